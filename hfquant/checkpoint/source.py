"""Where a checkpoint comes from: a local folder, or a Hub repo id downloaded with huggingface_hub.

`resolve_source(src)` gives the local folder to read (convert's and eval's SRC); `base_model_of(src, folder)` the Hub
repo id of the model, when `src` is one or the folder is a Hub cache snapshot (for a model card's `base_model`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

__all__ = ["HUB_ALLOW_PATTERNS", "resolve_source", "base_model_of"]

HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "README.md"]
"""What `resolve_source` downloads for a Hub repo id: config, weights, tokenizer, generation config, card."""

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$|^[A-Za-z0-9][\w.-]*$")
_HUB_CACHE_PATH = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[0-9a-f]+/?$")


def resolve_source(src: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of `src`: `src` itself when it exists, else the Hub snapshot of repo id `src`.

    Raises:
        NotADirectoryError: `src` is a file.
        FileNotFoundError: `src` is neither a folder nor something shaped like a repo id ("org/name").
        OSError: `src` is a repo id but the Hub could not be reached, or has no such repo or revision.
    """
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            hint = "; for a GGUF file, make one with hfquant convert FILE.gguf DST" if path.suffix == ".gguf" else ""
            raise NotADirectoryError(
                f"SRC {str(src)!r} is a file; pass the folder that holds config.json and the weights{hint}"
            )
        return path
    text = str(src)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"SRC {text!r} is not a folder; pass a local checkpoint folder or a Hub repo id (org/name)"
        )
    try:
        folder = snapshot_download(text, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except RepositoryNotFoundError:
        raise OSError(
            f"SRC {text!r} is not a local folder and the Hub has no model repo {text!r} you can read; check the name, "
            "or log in (hf auth login / HF_TOKEN) for a private or gated repo"
        ) from None
    except RevisionNotFoundError:
        raise OSError(
            f"the Hub repo {text!r} has no revision {revision!r}; pass an existing branch, tag or commit"
        ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(
            f"SRC {text!r} is not a local folder, so it was taken as a Hub repo id, but the Hub could not be reached "
            f"({reason}). Download it where the Hub is reachable (hf download {text} --local-dir DIR) and pass DIR."
        ) from None
    return Path(folder)


def base_model_of(src: str | os.PathLike, folder: Path) -> str | None:
    """The Hub repo id of the float model, when `src` is one or `folder` is a Hub cache snapshot; else None."""
    text = str(src)
    if not Path(text).expanduser().exists() and _REPO_ID.match(text) and "/" in text:
        return text
    match = _HUB_CACHE_PATH.search(folder.resolve().as_posix())
    return f"{match.group(1)}/{match.group(2)}" if match else None
