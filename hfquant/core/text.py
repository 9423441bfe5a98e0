"""Showing text that comes from a file (tensor names, config strings, file and model names of a checkpoint, a GGUF or
a compressed-tensors file) on a terminal, in a log or in a model card without letting it act there.

A terminal acts on control characters: ESC starts sequences that retitle the window, clear the screen or move the
cursor over earlier lines; CR and BS overwrite; the C1 controls (U+0080-U+009F, CSI among them) do what ESC
sequences do on many terminals; bidirectional overrides (U+202A-U+202E, U+2066-U+2069) reorder what is shown, so a
name can read as another. `terminal_safe` shows each of them as an escape instead (`\\x1b`, `\\n`, `\\u202e`).
"""

from __future__ import annotations

import re

__all__ = ["terminal_safe"]

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: object) -> str:
    """`str(text)` with every control character, C1 control, bidirectional control and line separator shown as an
    escape (`\\n`, `\\r`, `\\t`, `\\xNN`, `\\uNNNN`); everything else (other non-ASCII text too) unchanged, so the result
    is one line that shows what it holds.

    Example: `terminal_safe("model.\\x1b]0;pwned\\x07layers")` -> `'model.\\\\x1b]0;pwned\\\\x07layers'` (printed:
    `model.\\x1b]0;pwned\\x07layers`).
    """
    return _UNSAFE.sub(_escape, str(text))
