"""Where hfquant keeps what it builds on a machine (the native kernels, the example model)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The root cache folder: `$HFQUANT_CACHE` when set and non-empty, else `~/.cache/hfquant`. Not created here."""
    env = os.environ.get("HFQUANT_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hfquant"
