"""sha256 sums of a checkpoint's files: `hfquant.sha256.json`, written when a folder is finished, checked by verify.

Manifest: {"algorithm": "sha256", "files": {file name: 64 lowercase hex digits}}; file names are plain names inside
the folder (config.json, the index, every .safetensors shard).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from hfquant.checkpoint.files import CONFIG_NAME, INDEX_NAME, is_plain_file_name, read_json, write_json

__all__ = ["SUMS_NAME", "write_checksums", "checksum_problems"]

SUMS_NAME = "hfquant.sha256.json"
"""The checksum manifest's file name."""
_FIELDS = {"algorithm", "files"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 2**20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: str | os.PathLike) -> Path:
    """Record the sha256 of config.json, the index and every .safetensors file of `folder` in `SUMS_NAME`.

    Call it last, on the finished folder (before it is renamed into place). Returns the manifest's path.
    """
    folder = Path(folder)
    names = [n for n in (CONFIG_NAME, INDEX_NAME) if (folder / n).is_file()]
    names += sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    manifest = {"algorithm": "sha256", "files": {name: _sha256(folder / name) for name in names}}
    target = folder / SUMS_NAME
    partial = folder / f".{SUMS_NAME}.partial"
    write_json(partial, manifest)
    os.replace(partial, target)
    return target


def checksum_problems(folder: str | os.PathLike) -> tuple[list[str], int]:
    """(problems, files whose sum matched) for the manifest of `folder`; ([], 0) when there is none."""
    folder = Path(folder)
    path = folder / SUMS_NAME
    if not path.is_file():
        return [], 0
    try:
        manifest = read_json(path)
    except ValueError as error:
        return [str(error)], 0
    fix = "the file changed after it was written (damaged or edited copy): copy it again"
    if (
        not isinstance(manifest, dict)
        or set(manifest) != _FIELDS
        or manifest["algorithm"] != "sha256"
        or not isinstance(manifest["files"], dict)
    ):
        return [
            f'{SUMS_NAME} must be {{"algorithm": "sha256", "files": {{name: sha256 hex}}}}; restore it or delete it'
        ], 0
    problems = []
    checked = 0
    for name, digest in sorted(manifest["files"].items()):
        if not is_plain_file_name(name) or not isinstance(digest, str) or not _HEX64.match(digest):
            problems.append(f"{SUMS_NAME} has an invalid entry {name!r}: {digest!r}; restore it or delete it")
            continue
        if not (folder / name).is_file():
            problems.append(f"{name} has a recorded sha256 in {SUMS_NAME} but is missing; copy it again")
            continue
        checked += 1
        actual = _sha256(folder / name)
        if actual != digest:
            problems.append(f"{name} has sha256 {actual}, {SUMS_NAME} records {digest}; {fix}")
    return problems, checked
