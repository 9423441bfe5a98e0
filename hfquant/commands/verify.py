"""Checking a quantized checkpoint against its config without loading a weight: `hfquant verify PATH`.

Only JSON and safetensors headers are read, never pickle and never code from the checkpoint:

1. `config.json` (at most 16 MiB of JSON): `quantization_config` must be an hfquant config, parsed by
   `HfQuantConfig.from_dict` (its fields are an allowlist; an unknown field or format version is a problem).
2. `model.safetensors.index.json` when present: every shard it names exists and is a plain file name in the folder,
   every tensor it maps is in that shard, every tensor of a shard is in the index, no tensor is in two shards.
3. Every shard's header: the 8-byte little-endian length, then at most `MAX_HEADER_BYTES` of JSON, parsed against
   an allowlist (`dtype`, `shape`, `data_offsets` per tensor; `__metadata__` of strings); dtypes must be known,
   offsets contiguous and sized for the shape, and the file exactly as long as the header says (a truncated or
   padded shard is a problem).
4. The schema: the model skeleton is built on the meta device from `config.json` (a transformers class only, with
   `trust_remote_code=False`) and hfquant's quantizer swaps its layers exactly as a reload does. Every tensor of an
   hfquant module (`QuantLinear` weight, weight_scale, weight_zero_point; the docs/format.md table) must be in the
   files with exactly the dtype and shape the config gives; every other tensor must have the model's shape. A model
   tensor absent from the files (and not tied to one that is present), or a file tensor the model does not have,
   is a problem.
5. Checksums, when recorded: `SUMS_NAME` (`hfquant.sha256.json`) maps file names to sha256 hex digests; each listed
   file is hashed and compared. `write_checksums(folder)` records config.json, the index and every shard.

`check_checkpoint_files(model, files)` runs 3 and 4 for an already prepared skeleton; the quantizer calls it with
`loading=True` for pre-quantized loads (only hfquant tensors are compared there: a float tensor of another shape is
transformers' own business, for example with `ignore_mismatched_sizes=True`), so a quantized tensor of the wrong
shape or dtype fails the load with a `ValueError` instead of being re-initialized or loaded as garbage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterable, NamedTuple

__all__ = [
    "MAX_HEADER_BYTES",
    "SUMS_NAME",
    "TensorHeader",
    "VerifyResult",
    "read_header",
    "read_json",
    "read_index",
    "read_quantization_config",
    "check_checkpoint_files",
    "verify",
    "write_checksums",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SUMS_NAME = "hfquant.sha256.json"
"""Checksum manifest: {"algorithm": "sha256", "files": {file name: 64 hex digits}}, written by `write_checksums`."""

MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header accepted (the safetensors library's own limit)."""
MAX_JSON_BYTES = 64 * 2**20
"""Largest config.json / index / checksum file read."""

# safetensors dtype code -> (torch dtype name, bytes per element). Anything else in a header is a problem.
SAFETENSORS_DTYPES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2), "I16": ("int16", 2),
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "U32": ("uint32", 4), "I32": ("int32", 4), "F32": ("float32", 4),
    "U64": ("uint64", 8), "I64": ("int64", 8), "F64": ("float64", 8), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1), "F8_E8M0": ("float8_e8m0fnu", 1),
}
_TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}
_INDEX_FIELDS = {"metadata", "weight_map"}
_SUMS_FIELDS = {"algorithm", "files"}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 2**20


class TensorHeader(NamedTuple):
    """One tensor as a safetensors header describes it: dtype code ("BF16"), shape, and the file holding it."""

    dtype: str
    shape: tuple[int, ...]
    file: str

    def describe(self) -> str:
        return f"{SAFETENSORS_DTYPES.get(self.dtype, (self.dtype,))[0]} {_shape_text(self.shape)}"


class VerifyResult(NamedTuple):
    """What `verify` found: `problems` (empty when the checkpoint is sound), counts, and notes (checks not run)."""

    problems: list[str]
    tensors: int
    files: int
    checksums: int
    notes: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def _shape_text(shape: Iterable[int]) -> str:
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


def _loads(text: str | bytes) -> Any:
    """json.loads without NaN/Infinity and without duplicate keys; raises ValueError."""
    return json.loads(text, object_pairs_hook=_pairs_without_duplicates, parse_constant=_reject_constant)


def read_json(path: str | os.PathLike, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file of at most `limit` bytes.

    Raises:
        FileNotFoundError: no such file.
        ValueError: larger than `limit`, not UTF-8, not JSON, or a key repeated; the message names the file.
    """
    path = Path(path)
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path.name} is {size} bytes, more than the {limit} a JSON file of a checkpoint may have")
    try:
        return _loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path.name} is not valid JSON ({error}); restore it from the original checkpoint") from None


# -- safetensors headers ------------------------------------------------------------------------------------------


def read_header(path: str | os.PathLike) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """Tensors and `__metadata__` of a safetensors file, from its header only (no tensor data is read).

    The header is checked as the safetensors format defines it: an 8-byte little-endian length N (at most
    `MAX_HEADER_BYTES`), N bytes of UTF-8 JSON whose entries have exactly `dtype`, `shape` and `data_offsets`, known
    dtypes, offsets that tile the data section from 0 without gaps or overlaps, each sized for its shape, and a file
    exactly 8 + N + data bytes long.

    Raises:
        ValueError: the file is truncated, padded or its header is corrupt; the message names the file, what is wrong
            and the fix.
    """
    path = Path(path)
    name = str(path)
    fix = "the file is damaged (an interrupted copy or download?): copy or download it again"
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{name} is {size} bytes, too short for a safetensors file (8-byte header length); {fix}")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise ValueError(
                f"{name} declares a {length}-byte header, more than the {MAX_HEADER_BYTES} allowed; it is not a "
                f"safetensors file or {fix}"
            )
        if 8 + length > size:
            raise ValueError(f"{name} is truncated: its header needs {8 + length} bytes, the file has {size}; {fix}")
        raw = handle.read(length)
    try:
        header = _loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{name} has a corrupt safetensors header ({error}); {fix}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name} has a corrupt safetensors header (a JSON {type(header).__name__}, not an object); {fix}")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{name} has a corrupt safetensors header (__metadata__ must map strings to strings); {fix}")
    tensors: dict[str, TensorHeader] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        where = f"{name} has a corrupt safetensors header: tensor {key!r}"
        if not isinstance(entry, dict) or set(entry) != _TENSOR_FIELDS:
            raise ValueError(f"{where} must have exactly the fields {sorted(_TENSOR_FIELDS)}; {fix}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{where} has dtype {dtype!r}, not one of {sorted(SAFETENSORS_DTYPES)}; {fix}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where} has shape {shape!r}, not a list of non-negative integers; {fix}")
        if (
            not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{where} has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end; {fix}")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * SAFETENSORS_DTYPES[dtype][1]:
            raise ValueError(
                f"{where} has {offsets[1] - offsets[0]} bytes for {numel} {dtype} elements of shape "
                f"{_shape_text(shape)}; {fix}"
            )
        tensors[key] = TensorHeader(dtype, tuple(shape), path.name)
        spans.append((offsets[0], offsets[1], key))
    end = 0
    for begin, stop, key in sorted(spans):
        if begin != end:
            raise ValueError(
                f"{name} has a corrupt safetensors header: tensor {key!r} starts at byte {begin} of the data, "
                f"expected {end} (gap or overlap); {fix}"
            )
        end = stop
    expected = 8 + length + end
    if size < expected:
        raise ValueError(f"{name} is truncated: its header describes {expected} bytes, the file has {size}; {fix}")
    if size > expected:
        raise ValueError(
            f"{name} has {size - expected} bytes after the tensor data its header describes ({expected} bytes); {fix}"
        )
    return tensors, metadata


# -- checkpoint files ---------------------------------------------------------------------------------------------


def _plain_file_name(value: Any) -> bool:
    return (
        isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
        and "\x00" not in value
    )


def read_index(folder: str | os.PathLike) -> dict[str, str]:
    """`weight_map` of `model.safetensors.index.json`: tensor name -> shard file name (a plain name in the folder).

    Raises:
        ValueError: not JSON, unknown top-level fields, or a weight_map that is not {tensor: plain file name}.
    """
    path = Path(folder) / INDEX_NAME
    index = read_json(path)
    if not isinstance(index, dict) or "weight_map" not in index or not set(index) <= _INDEX_FIELDS:
        found = sorted(index) if isinstance(index, dict) else type(index).__name__
        raise ValueError(
            f"{INDEX_NAME} must be an object with the fields {sorted(_INDEX_FIELDS)} (weight_map required); found "
            f"{found}. Restore it from the original checkpoint"
        )
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(f"{INDEX_NAME}: weight_map must map tensor names to shard file names; restore the index")
    for tensor, file in weight_map.items():
        if not _plain_file_name(file):
            raise ValueError(
                f"{INDEX_NAME} maps {tensor!r} to {file!r}, which is not a file name inside the checkpoint folder; "
                "the index may only name shards beside it: restore the index"
            )
    return weight_map


def read_quantization_config(folder: str | os.PathLike):
    """(config.json as a dict, its `HfQuantConfig`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: config.json is not JSON, has no `quantization_config`, or one of another method, or one
            `HfQuantConfig` refuses (unknown field, unknown format version, bad value); the message says which.
        TypeError: a field has the wrong type (from `HfQuantConfig`).
    """
    from hfquant.config import QUANT_METHOD, HfQuantConfig

    folder = Path(folder)
    config = read_json(folder / CONFIG_NAME)
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_NAME} must hold a JSON object; restore it from the original checkpoint")
    quant = config.get("quantization_config")
    if quant is None:
        raise ValueError(
            f"{CONFIG_NAME} has no quantization_config: {folder} is not a quantized checkpoint; quantize it with "
            "hfquant convert SRC DST"
        )
    if not isinstance(quant, dict):
        raise ValueError(f"{CONFIG_NAME}: quantization_config must be a JSON object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(
            f"{CONFIG_NAME}: quantization_config has quant_method={method!r}, not {QUANT_METHOD!r}; this checkpoint "
            "was quantized by another method: load it with the library for that method, not hfquant"
        )
    return config, HfQuantConfig.from_dict(dict(quant))


def _checkpoint_headers(folder: Path, problems: list[str]) -> tuple[dict[str, TensorHeader], list[str]]:
    """Headers of the checkpoint's tensors (name -> header) and the shard names read; index problems appended."""
    shards: list[str]
    weight_map: dict[str, str] | None = None
    if (folder / INDEX_NAME).is_file():
        try:
            weight_map = read_index(folder)
        except ValueError as error:
            problems.append(str(error))
            return {}, []
        shards = sorted(set(weight_map.values()))
        stray = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in shards)
        for name in stray:
            problems.append(
                f"{name} is not named in {INDEX_NAME}, so from_pretrained ignores it: delete it, or restore the index "
                "that names it"
            )
    elif (folder / SINGLE_NAME).is_file():
        shards = [SINGLE_NAME]
    else:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        hint = f" (found {others}, which hfquant never reads: only safetensors are loaded)" if others else ""
        problems.append(f"{folder} has no {SINGLE_NAME} or {INDEX_NAME}{hint}; copy the complete checkpoint")
        return {}, []
    tensors: dict[str, TensorHeader] = {}
    read: list[str] = []
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            problems.append(
                f"{shard} is named in {INDEX_NAME} but missing from {folder}; copy the complete checkpoint again"
            )
            continue
        try:
            found, _ = read_header(path)
        except ValueError as error:
            problems.append(str(error))
            continue
        read.append(shard)
        for key, header in found.items():
            if key in tensors:
                problems.append(f"{key} is stored twice, in {tensors[key].file} and {shard}; remove one copy")
                continue
            tensors[key] = header
            if weight_map is not None and key not in weight_map:
                problems.append(
                    f"{key} is in {shard} but not in {INDEX_NAME}; the index and the shards are from different "
                    "saves: copy the complete checkpoint again"
                )
    if weight_map is not None:
        for key, shard in sorted(weight_map.items()):
            if shard in read and (key not in tensors or tensors[key].file != shard):
                where = f"is in {tensors[key].file}" if key in tensors else "is in no shard"
                problems.append(
                    f"{INDEX_NAME} maps {key} to {shard}, which has no tensor {key!r} (it {where}); the index and the "
                    "shards are from different saves: copy the complete checkpoint again"
                )
    return tensors, read


# -- the schema ---------------------------------------------------------------------------------------------------


def _is_hfquant_module(module) -> bool:
    return type(module).__module__.split(".")[0] == "hfquant"


def _layer_text(module) -> str:
    """"4-bit QuantLinear (group size 32, asymmetric)": what a stored tensor's dtype and shape follow from."""
    details = []
    if getattr(module, "group_size", None) is not None:
        details.append(f"group size {module.group_size}")
    if isinstance(getattr(module, "symmetric", None), bool):
        details.append("symmetric" if module.symmetric else "asymmetric")
    bits = getattr(module, "bits", None)
    text = f"{bits}-bit {type(module).__name__}" if bits is not None else type(module).__name__
    return text + (f" ({', '.join(details)})" if details else "")


class _Expected(NamedTuple):
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    exact: bool  # an hfquant stored tensor: dtype must match exactly
    layer: str  # "4-bit QuantLinear (group size 32, asymmetric)" for hfquant tensors


def _expected_tensors(model) -> tuple[dict[str, _Expected], dict[str, set[str]]]:
    """Every tensor `model.state_dict()` holds, and for each name the names sharing its tensor (tied weights)."""
    from torch import nn

    expected: dict[str, _Expected] = {}
    state = model.state_dict()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        hfquant = _is_hfquant_module(module)
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = prefix + name
            if key not in state:
                continue
            exact = hfquant and not isinstance(tensor, nn.Parameter)
            expected[key] = _Expected(
                str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), exact, _layer_text(module) if exact else ""
            )
    aliases: dict[int, set[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        aliases.setdefault(id(tensor), set()).add(name)
    tied: dict[str, set[str]] = {}
    for names in aliases.values():
        for name in names:
            tied[name] = names - {name}
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.setdefault(target, set()).add(source)
    return expected, tied


def _model_key_map(model, file_keys: Iterable[str], quantizer=None) -> dict[str, str | None]:
    """File tensor name -> model state_dict name as the loader renames it (None when a weight converter fuses it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    conversions = get_model_conversion_mapping(model, None, quantizer)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = model.base_model_prefix
    meta_state = model.state_dict()
    mapping: dict[str, str | None] = {}
    for key in sorted(file_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        mapping[key] = renamed if pattern is None else None
    return mapping


def _ignored(model, key: str, attribute: str) -> bool:
    patterns = getattr(model, attribute, None) or []
    return any(re.search(pattern, key) for pattern in patterns)


def _schema_problems(model, tensors: dict[str, TensorHeader], quantizer, loading: bool) -> tuple[list[str], int]:
    """Compare the file tensors to the model skeleton; returns (problems, tensors compared)."""
    expected, tied = _expected_tensors(model)
    mapping = _model_key_map(model, tensors, quantizer)
    problems: list[str] = []
    present: set[str] = set()
    fused = False
    compared = 0
    fix = (
        "the file does not match quantization_config in config.json: it was written by another tool or version, or "
        "config.json was edited; quantize the float checkpoint again (hfquant convert) or restore config.json"
    )
    for file_key, header in tensors.items():
        model_key = mapping[file_key]
        if model_key is None:  # fused by a transformers weight converter: no per-tensor shape to compare
            fused = True
            continue
        want = expected.get(model_key)
        if want is None:
            if not loading and not _ignored(model, file_key, "_keys_to_ignore_on_load_unexpected"):
                problems.append(
                    f"{file_key} (in {header.file}) is not a tensor of {type(model).__name__}; from_pretrained ignores "
                    "it: the files are from another model or config.json was changed"
                )
            continue
        present.add(model_key)
        if loading and not want.exact:
            continue
        compared += 1
        found_dtype = SAFETENSORS_DTYPES[header.dtype][0]
        if want.exact:
            if found_dtype != want.dtype or header.shape != want.shape:
                problems.append(
                    f"{file_key} in {header.file} is {header.describe()}, expected {want.dtype} "
                    f"{_shape_text(want.shape)} for a {want.layer}; {fix}"
                )
        elif header.shape != want.shape:
            problems.append(
                f"{file_key} in {header.file} has shape {_shape_text(header.shape)}, expected "
                f"{_shape_text(want.shape)} for {type(model).__name__} as config.json describes it; {fix}"
            )
    if fused:
        return problems, compared  # names of fused tensors cannot be matched one to one: missing ones not judged
    for model_key, want in expected.items():
        if model_key in present or (loading and not want.exact):
            continue
        if any(alias in present for alias in tied.get(model_key, ())):
            continue
        module_name, _, _ = model_key.rpartition(".")
        if any(alias in present for alias in tied.get(f"{module_name}.weight", ())):
            continue
        if model_key in getattr(model, "all_tied_weights_keys", {}) or _ignored(
            model, model_key, "_keys_to_ignore_on_load_missing"
        ):
            continue
        what = f"{want.dtype} {_shape_text(want.shape)}" + (f" of a {want.layer}" if want.exact else "")
        problems.append(
            f"{model_key} ({what}) is missing from the checkpoint files; it would be left uninitialized: copy the "
            "complete checkpoint again, or quantize the float checkpoint again"
        )
    return problems, compared


def check_checkpoint_files(model, files: Iterable[str | os.PathLike], quantizer=None, loading: bool = True) -> int:
    """Compare the headers of `files` with the prepared (meta) skeleton `model`; returns the tensors compared.

    With `loading=True` (what the quantizer runs on a pre-quantized `from_pretrained`), only the tensors of hfquant
    modules are compared (name present, exact dtype, exact shape); otherwise every tensor's shape is too, and file
    tensors the model lacks are problems.

    Raises:
        ValueError: listing every problem, each naming the tensor and file, the expected and found dtype and shape,
            and the fix.
    """
    tensors: dict[str, TensorHeader] = {}
    problems: list[str] = []
    for file in files:
        path = Path(file)
        if path.suffix != ".safetensors":
            raise ValueError(f"{path.name} is not a safetensors file; hfquant checkpoints are stored as safetensors only")
        found, _ = read_header(path)
        for key, header in found.items():
            tensors.setdefault(key, header)
    schema, compared = _schema_problems(model, tensors, quantizer, loading)
    problems += schema
    if problems:
        raise ValueError(_problem_text(problems))
    return compared


def _problem_text(problems: list[str], limit: int = 20) -> str:
    lines = problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"the hfquant checkpoint does not match its config ({count}):\n  " + "\n  ".join(lines)


# -- the model skeleton -------------------------------------------------------------------------------------------


def _skeleton(folder: Path, config_dict: dict, quant_config):
    """(meta model prepared like a pre-quantized reload, quantizer), or (None, reason) when it cannot be built safely."""
    import torch
    import transformers
    from transformers import AutoConfig

    from hfquant.integration.quantizer import HfQuantQuantizer

    architectures = config_dict.get("architectures") or []
    cls = next((getattr(transformers, name, None) for name in architectures if getattr(transformers, name, None)), None)
    if cls is None:
        names = architectures or ["(none)"]
        return None, (
            f"schema not checked: architecture {names[0]} in config.json is not a transformers class, and hfquant never "
            "runs code from a checkpoint (trust_remote_code stays off)"
        )
    try:
        model_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as error:
        return None, f"schema not checked: transformers cannot read config.json ({error})"
    dtype = getattr(model_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    with torch.device("meta"):
        model = cls._from_config(model_config, dtype=dtype)
    quantizer = HfQuantQuantizer(quant_config, pre_quantized=True)
    quantizer.validate_environment()
    quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"})
    return model, quantizer


# -- checksums ----------------------------------------------------------------------------------------------------


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
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(partial, target)
    return target


def _checksum_problems(folder: Path) -> tuple[list[str], int]:
    path = folder / SUMS_NAME
    if not path.is_file():
        return [], 0
    try:
        manifest = read_json(path)
    except ValueError as error:
        return [str(error)], 0
    fix = "the file changed after it was written (damaged or edited copy): copy it again"
    if (
        not isinstance(manifest, dict) or set(manifest) != _SUMS_FIELDS or manifest["algorithm"] != "sha256"
        or not isinstance(manifest["files"], dict)
    ):
        return [f'{SUMS_NAME} must be {{"algorithm": "sha256", "files": {{name: sha256 hex}}}}; restore it or delete it'], 0
    problems = []
    checked = 0
    for name, digest in sorted(manifest["files"].items()):
        if not _plain_file_name(name) or not isinstance(digest, str) or not _HEX64.match(digest):
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


# -- everything ---------------------------------------------------------------------------------------------------


def verify(path: str | os.PathLike) -> VerifyResult:
    """Check the quantized checkpoint folder `path` (see the module docstring); nothing is loaded or executed.

    Returns:
        A `VerifyResult`; `problems` lists every problem found, each naming the file or tensor and the fix.
    Raises:
        FileNotFoundError: `path` does not exist.
        NotADirectoryError: `path` is a file.
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"{folder} does not exist; pass the folder of a quantized checkpoint")
    if not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file; pass the folder that holds config.json and the safetensors")
    problems: list[str] = []
    notes: list[str] = []
    config_dict, quant_config = None, None
    if not (folder / CONFIG_NAME).is_file():
        problems.append(f"{folder} has no {CONFIG_NAME}; copy the complete checkpoint")
    else:
        try:
            config_dict, quant_config = read_quantization_config(folder)
        except (ValueError, TypeError) as error:
            problems.append(f"{CONFIG_NAME}: {error}" if not str(error).startswith(CONFIG_NAME) else str(error))
    tensors, shards = _checkpoint_headers(folder, problems)
    compared = 0
    if quant_config is not None and tensors:
        model, quantizer = _skeleton(folder, config_dict, quant_config)
        if model is None:
            notes.append(quantizer)
        else:
            schema, compared = _schema_problems(model, tensors, quantizer, loading=False)
            problems += schema
    sums, checksummed = _checksum_problems(folder)
    problems += sums
    if not (folder / SUMS_NAME).is_file():
        notes.append(f"no {SUMS_NAME}: file contents not checked against recorded sha256 sums")
    return VerifyResult(problems, compared, len(shards), checksummed, notes)
