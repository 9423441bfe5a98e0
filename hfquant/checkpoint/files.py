"""Reading checkpoint folders: the file names, strict JSON, the shard index, and safetensors through `safe_open` only.

A checkpoint folder is untrusted input. Nothing here runs code or unpickles: JSON is parsed without NaN/Infinity and
without repeated keys, under a size limit; a shard name from the index must be a plain file name inside the folder
(no `/`, `..` or absolute path); safetensors headers and tensors are read by the safetensors library, which checks
that the header is JSON, every dtype known, the offsets contiguous and sized for their shapes, and the file exactly
as long as the header says. Its errors come out as `ValueError`s naming the file and the fix.

`SAFETENSORS_DTYPES` is the one table between safetensors dtype codes ("BF16") and torch dtypes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from hfquant.checkpoint.model_type import unmark
from hfquant.core.dtypes import dtype_name, torch_dtype

__all__ = [
    "CONFIG_NAME",
    "INDEX_NAME",
    "SINGLE_NAME",
    "EVAL_FILE",
    "WEIGHT_SUFFIXES",
    "MAX_JSON_BYTES",
    "SAFETENSORS_DTYPES",
    "TensorHeader",
    "read_json",
    "is_plain_file_name",
    "read_index",
    "tensor_files",
    "open_safetensors",
    "read_headers",
    "read_tensor",
    "first_float_dtype",
    "write_shard",
    "write_index",
    "stays_inside",
    "require_inside",
    "CHECKPOINT_ID_KEY",
    "PLACEHOLDER_METADATA",
    "stamp_checkpoint_ids",
    "read_checkpoint_id",
    "checkpoint_ids",
    "mixed_checkpoint_problem",
    "read_config",
    "write_json",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
EVAL_FILE = "hfquant_eval.json"
"""What `hfquant eval` writes into a checkpoint folder (`hfquant.evaluation.evaluate`'s results); the card shows them."""
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".gguf",
    ".onnx",
    ".pb",
    ".tflite",
)
"""Weight files of any framework; hfquant reads only the safetensors ones."""
MAX_JSON_BYTES = 64 * 2**20
"""Largest config.json / index / manifest read, in bytes."""

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in {
        "BOOL": "bool",
        "U8": "uint8",
        "I8": "int8",
        "U16": "uint16",
        "I16": "int16",
        "F16": "float16",
        "BF16": "bfloat16",
        "U32": "uint32",
        "I32": "int32",
        "F32": "float32",
        "U64": "uint64",
        "I64": "int64",
        "F64": "float64",
        "C64": "complex64",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }.items()
    if hasattr(torch, name)
}
"""safetensors dtype code -> torch dtype (codes this torch has no dtype for are left out)."""
_INDEX_FIELDS = {"metadata", "weight_map"}
CHECKPOINT_ID_KEY = "hfquant_checkpoint_id"
"""Metadata key of the id every safetensors shard of one save carries (`write_shard`, `write_index`): shards of two
saves in one folder are told apart (`mixed_checkpoint_problem`)."""
_ID_PLACEHOLDER = "0" * 32
"""The id `write_shard` writes, replaced in place by `write_index` once every shard is written (same length, so the
header keeps its size); a single-file checkpoint keeps it (it cannot mix saves)."""
PLACEHOLDER_METADATA = {CHECKPOINT_ID_KEY: _ID_PLACEHOLDER}
"""Shard metadata a writer gives every shard of one save; `stamp_checkpoint_ids` (or `write_index`) replaces the
placeholder by the id of the whole save once all shards are written."""
_DAMAGED = "the file is damaged (an interrupted copy or download, or an edit): copy or download it again"


class TensorHeader(NamedTuple):
    """One tensor as a safetensors header describes it: torch dtype, shape, and the name of the file holding it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """'bfloat16 (64, 4)'."""
        return f"{dtype_name(self.dtype)} {shape_text(self.shape)}"


def shape_text(shape: Iterable[int]) -> str:
    """(64, 4) -> '(64, 4)'; (32,) -> '(32)'."""
    return "(" + ", ".join(str(d) for d in shape) + ")"


# -- JSON, strictly ----------------------------------------------------------------------------------------------


def _pairs_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_json(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file of at most `limit` bytes, refusing NaN/Infinity and repeated keys.

    Raises:
        FileNotFoundError: no such file.
        ValueError: larger than `limit`, not UTF-8, not JSON, or a key repeated; the message names the file.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path.name} is {size} bytes, more than the {limit} a JSON file of a checkpoint may have")
    try:
        text = path.read_bytes().decode("utf-8")
        return json.loads(text, object_pairs_hook=_pairs_without_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); restore it from the original checkpoint") from None


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    """`config.json` of a checkpoint folder, with the fields read before any model is built checked: a JSON object,
    `architectures` a list of class names, `quantization_config` (where present) an object, `dtype` / `torch_dtype` a
    torch dtype name or "auto". A config marked with
    `model_type` "hfquant" comes back with its base model type (`hfquant.checkpoint.model_type.unmark`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: as `read_json`, or one of the above fields malformed, naming the file, the value and the fix (where
            transformers raises an AttributeError or a TypeError with a traceback).
    """
    path = Path(folder) / CONFIG_NAME
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} must hold a JSON object, not a {type(config).__name__}; restore it from the original checkpoint"
        )
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(name, str) and name for name in architectures)
    ):
        raise ValueError(
            f"{path}: architectures={architectures!r} is not a list of class names such as "
            '["LlamaForCausalLM"]; restore it from the original checkpoint'
        )
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ValueError(
            f"{path}: quantization_config must be a JSON object, got {type(quant).__name__} {quant!r:.40}; restore "
            "config.json from the original checkpoint (a float checkpoint has no quantization_config)"
        )
    for field in ("dtype", "torch_dtype"):
        value = config.get(field)
        if value is None or value == "auto":
            continue
        try:
            if not isinstance(value, str) or not torch_dtype(value).is_floating_point:
                raise ValueError(value)
        except ValueError:
            raise ValueError(
                f'{path}: {field}={value!r} is not a float torch dtype; write one of "bfloat16", '
                '"float16", "float32" (the dtype of the checkpoint\'s weights), or remove the field'
            ) from None
    return unmark(config, path)


# -- the index ---------------------------------------------------------------------------------------------------


def is_plain_file_name(value: Any) -> bool:
    """Whether `value` names a file directly inside a folder: a non-empty string without '/', '\\', NUL, '.' or '..'."""
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and "/" not in value
        and "\\" not in value
        and "\x00" not in value
    )


def stays_inside(folder: str | os.PathLike, path: str | os.PathLike) -> bool:
    """Whether `path`, every symlink resolved, stays inside the checkpoint `folder` (resolved too).

    The files of a Hugging Face Hub cache snapshot (`.../models--org--name/snapshots/<revision>/`) are links into the
    repository's own `blobs/`: for such a folder the repository's cache folder is the boundary. hfquant never reads,
    copies, uploads or writes through a link that leaves it.
    """
    root = Path(folder).resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        root = root.parent.parent
    return Path(path).resolve().is_relative_to(root)


def require_inside(folder: str | os.PathLike, path: str | os.PathLike) -> None:
    """Raise unless `path` stays inside `folder` (`stays_inside`).

    Raises:
        ValueError: naming the file, its link target and the fix.
    """
    folder, path = Path(folder), Path(path)
    if not stays_inside(folder, path):
        raise ValueError(
            f"{path.name} in {folder} is a link to {path.resolve()}, outside the checkpoint folder; hfquant never reads "
            "through a link that leaves it: copy the file into the folder"
        )


def read_index(folder: str | os.PathLike) -> dict[str, str]:
    """`weight_map` of `model.safetensors.index.json`: tensor name -> shard file name (a plain name in the folder).

    Raises:
        ValueError: not JSON, unknown top-level fields, or a weight_map that is not {tensor: plain file name}; a
            `../` or absolute path is refused here, for every reader.
    """
    path = Path(folder) / INDEX_NAME
    index = read_json(path)
    if not isinstance(index, dict) or "weight_map" not in index or not set(index) <= _INDEX_FIELDS:
        found = sorted(index) if isinstance(index, dict) else type(index).__name__
        raise ValueError(
            f"{path} must be an object with the fields {sorted(_INDEX_FIELDS)} (weight_map required); found "
            f"{found}. Restore it from the original checkpoint"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path}: weight_map must map tensor names to shard file names; restore the index")
    for tensor, file in weight_map.items():
        if not is_plain_file_name(file):
            raise ValueError(
                f"{INDEX_NAME} maps {tensor!r} to {file!r}, which is not a file name inside the checkpoint folder; "
                "the index may only name shards beside it: restore the index"
            )
    return weight_map


def tensor_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> safetensors file, from `model.safetensors.index.json` or the single `model.safetensors`.

    Raises:
        FileNotFoundError: no safetensors checkpoint in `folder` (the message says what was found instead), or the
            index names a shard that is missing.
        ValueError: the index is malformed or names a path outside the folder (`read_index`), or a shard or the index
            is a link leaving the folder (`stays_inside`).
    """
    folder = Path(folder)
    if (folder / INDEX_NAME).is_file():
        require_inside(folder, folder / INDEX_NAME)
        weight_map = read_index(folder)
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{folder / INDEX_NAME} names shard(s) {missing} that are not in {folder}")
        for file in sorted(set(weight_map.values())):
            require_inside(folder, folder / file)
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_NAME
    if single.is_file():
        require_inside(folder, single)
        return {name: single for name in read_headers(single)}
    others = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    hint = (
        f" (found {others}; hfquant reads safetensors only: load it with from_pretrained and save_pretrained it)"
        if others
        else ""
    )
    raise FileNotFoundError(f"{folder} has no {SINGLE_NAME} or {INDEX_NAME}{hint}")


# -- safetensors -------------------------------------------------------------------------------------------------


def open_safetensors(path: str | os.PathLike):
    """`safetensors.safe_open(path, framework="pt")`.

    Raises:
        ValueError: the file is truncated, padded, or its header is corrupt (as safetensors judges it), naming the
            file and the fix.
    """

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise ValueError(f"{path} is not a readable safetensors file ({error}); {_DAMAGED}") from None


def read_headers(path: str | os.PathLike) -> dict[str, TensorHeader]:
    """Name -> `TensorHeader` of every tensor of one safetensors file, from its header only (no tensor data read).

    Raises:
        ValueError: as `open_safetensors`, or a dtype this torch does not know, naming the tensor.
    """
    path = Path(path)
    tensors = {}
    with open_safetensors(path) as handle:
        for name in handle.keys():
            piece = handle.get_slice(name)
            code = piece.get_dtype()
            if code not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {code!r}, which hfquant cannot read")
            tensors[name] = TensorHeader(SAFETENSORS_DTYPES[code], tuple(piece.get_shape()), path.name)
    return tensors


def read_tensor(handle, path: str | os.PathLike, name: str) -> torch.Tensor:
    """Tensor `name` from an open `safe_open` handle of `path`.

    Raises:
        ValueError: the tensor cannot be read (missing, or its bytes damaged), naming it, the file and the fix.
    """

    try:
        return handle.get_tensor(name)
    except SafetensorError as error:
        raise ValueError(f"cannot read {name} from {path} ({error}); {_DAMAGED}") from None


def first_float_dtype(files: Iterable[str | os.PathLike]) -> torch.dtype:
    """dtype of the first floating tensor of the files (what `dtype="auto"` picks when config.json names none);
    float32 when there is none."""
    for path in dict.fromkeys(str(f) for f in files):
        for header in read_headers(path).values():
            if header.dtype.is_floating_point:
                return header.dtype
    return torch.float32


def read_checkpoint_id(path: str | os.PathLike) -> str | None:
    """The `CHECKPOINT_ID_KEY` entry of a safetensors file's metadata (None when absent: an older file, or one another
    writer made).

    Raises:
        ValueError: as `open_safetensors`.
    """
    with open_safetensors(path) as handle:
        value = (handle.metadata() or {}).get(CHECKPOINT_ID_KEY)
    return value if isinstance(value, str) and value != _ID_PLACEHOLDER else None


def checkpoint_ids(files: Iterable[str | os.PathLike]) -> dict[str, str | None]:
    """File path -> its checkpoint id (`read_checkpoint_id`) for the safetensors `files` (others left out)."""
    return {str(f): read_checkpoint_id(f) for f in dict.fromkeys(str(f) for f in files) if f.endswith(".safetensors")}


def mixed_checkpoint_problem(ids: dict[str, str | None]) -> str | None:
    """Whether the shards of one checkpoint (`checkpoint_ids`) come from one save: every shard `write_shard` wrote
    carries the same checkpoint id. Returns the problem (naming the odd shard and the fix) or None; shards without an
    id (older checkpoints, or other writers) are not compared.

    A reader racing `convert --overwrite` (or a folder changed between reading the index and the shards) would
    otherwise load the tensors of two versions without any error."""
    first: tuple[str, str] | None = None  # (id, file)
    for file, value in ids.items():
        if value is None:
            continue
        if first is None:
            first = (value, file)
        elif value != first[0]:
            return (
                f"the checkpoint changed while loading ({Path(file).name} belongs to another save than "
                f"{Path(first[1]).name}, in {Path(file).parent}; a convert --overwrite or a copy replaced files "
                "meanwhile); retry, and if it persists the folder mixes two checkpoints: copy or convert it again"
            )
    return None


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.digest()


def _rewrite_metadata(path: Path, metadata: dict[str, str]) -> bool:
    """Write `metadata` (keys sorted) over the `__metadata__` of the safetensors file `path` in place, when it is the
    header's first entry and the new text has the same length (so no offset moves); returns whether it did.

    safetensors writes metadata keys in hash-map order, which changes from one process to the next: sorting them keeps
    a convert reproducible byte for byte."""
    with open(path, "r+b") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = handle.read(min(size, 2**20))
        start = b'{"__metadata__":'
        end = header.find(b"}", len(start))
        if not header.startswith(start) or end < 0:
            return False
        new = json.dumps(dict(sorted(metadata.items())), separators=(",", ":")).encode()
        if len(new) != end + 1 - len(start):
            return False
        handle.seek(8 + len(start))
        handle.write(new)
    return True


def _stamp_checkpoint_id(folder: Path, names: list[str]) -> None:
    """Replace the placeholder id of the shards `names` in `folder` (written by `write_shard`) by one id derived from
    all their bytes: the same content gives the same id (a convert is reproducible byte for byte), two different saves
    different ids. Shards without the placeholder are left alone."""
    names = [name for name in names if _has_placeholder(folder / name)]
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0" + _file_sha256(folder / name))
    value = digest.hexdigest()[: len(_ID_PLACEHOLDER)]
    for name in names:
        _rewrite_metadata(folder / name, {"format": "pt", CHECKPOINT_ID_KEY: value})


def stamp_checkpoint_ids(folder: str | os.PathLike) -> None:
    """Give the safetensors files of `folder` that carry the placeholder id (`PLACEHOLDER_METADATA`, as
    `save_pretrained` writes them for a model hfquant loaded) the id of the whole save (`_stamp_checkpoint_id`); a
    single-file checkpoint (no index) keeps the placeholder, as `write_index` leaves it. Either way the metadata keys
    are written sorted (safetensors writes them in hash-map order, which changes per process)."""
    folder = Path(folder)
    names = [p.name for p in sorted(folder.glob("*.safetensors")) if p.is_file() and not p.is_symlink()]
    names = [name for name in names if _has_placeholder(folder / name)]
    for name in names:  # keys sorted first, as `write_shard` does: the same save gives the same bytes
        _rewrite_metadata(folder / name, {"format": "pt", **PLACEHOLDER_METADATA})
    if (folder / INDEX_NAME).is_file():
        _stamp_checkpoint_id(folder, names)


def _has_placeholder(path: Path) -> bool:
    with open_safetensors(path) as handle:
        metadata = handle.metadata() or {}
    return metadata == {"format": "pt", CHECKPOINT_ID_KEY: _ID_PLACEHOLDER}


# -- writing -----------------------------------------------------------------------------------------------------


def write_shard(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` (contiguous) as one safetensors file with transformers' `{"format": "pt"}` metadata and a
    placeholder checkpoint id (`CHECKPOINT_ID_KEY`), which `write_index` replaces by the id of the whole save.

    Raises:
        OSError: the file could not be written (a full disk, say), naming it.
    """
    metadata = {"format": "pt", CHECKPOINT_ID_KEY: _ID_PLACEHOLDER}
    try:
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
        _rewrite_metadata(Path(path), metadata)
    except SafetensorError as error:
        raise OSError(f"writing the shard {Path(path).name} failed ({error}); free some space and run again") from None


def write_json(path: str | os.PathLike, value: Any) -> None:
    """Write `value` to `path` as transformers writes its JSON files: indent 2, keys sorted, a final newline, UTF-8.

    Raises:
        OSError: the file could not be written.
        TypeError: `value` holds something JSON cannot represent.
    """
    Path(path).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_index(folder: str | os.PathLike, weight_map: dict[str, str], metadata: dict[str, Any]) -> Path:
    """Write `model.safetensors.index.json` ({"metadata", "weight_map"}, keys sorted) into `folder`; returns its path.
    Call it once every shard is written: it stamps them with the checkpoint id of this save (`CHECKPOINT_ID_KEY`)."""
    path = Path(folder) / INDEX_NAME
    _stamp_checkpoint_id(Path(folder), sorted(set(weight_map.values())))
    index = {"metadata": metadata, "weight_map": weight_map}
    write_json(path, index)
    return path
