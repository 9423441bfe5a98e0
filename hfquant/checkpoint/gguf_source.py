"""Where a GGUF file comes from: a local file, a folder holding it, or a Hub repo (huggingface_hub's download).

Kept apart from `gguf_import` so that what `from_pretrained` runs never imports huggingface_hub.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

__all__ = ["resolve_gguf"]


def resolve_gguf(src: str | os.PathLike, gguf_file: str | None = None) -> Path:
    """The local GGUF file of `src`: a file itself; `gguf_file` inside a folder `src`; else `gguf_file` downloaded
    from the Hub repo `src` (huggingface_hub's cache).

    Raises:
        FileNotFoundError: a folder without `gguf_file`, or a repo id without `gguf_file`.
        OSError: the Hub could not give the file.
    """
    path = Path(src).expanduser()
    if path.is_file():
        return path
    if gguf_file is None and str(src).endswith(".gguf"):
        raise FileNotFoundError(f"{str(src)!r} does not exist; pass a GGUF file")
    if gguf_file is None:
        raise FileNotFoundError(
            f"{str(src)!r} is not a GGUF file; pass the file, or a folder or Hub repo id with gguf_file='name.gguf'"
        )
    if path.is_dir():
        found = path / gguf_file
        if not found.is_file():
            raise FileNotFoundError(f"{found} does not exist")
        return found
    try:
        return Path(hf_hub_download(str(src), gguf_file))
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(f"could not get {gguf_file!r} from the Hub repo {str(src)!r}: {reason}") from None
