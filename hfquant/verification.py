"""Checking a quantized checkpoint against its config without loading a weight: `hfquant verify PATH`.

Only JSON and safetensors headers are read, never pickle and never code from the checkpoint
(`hfquant.checkpoint.files` reads them):

1. `config.json`: `quantization_config` must be an hfquant config, parsed by `HfQuantConfig.from_dict` (its fields
   are an allowlist; an unknown field or format version is a problem).
2. `model.safetensors.index.json` when present: every shard it names exists and is a plain file name in the folder,
   every tensor it maps is in that shard, every tensor of a shard is in the index, no tensor is in two shards.
3. Every shard's header, read with `safe_open`: the safetensors library refuses a truncated or padded file, a
   header that is not JSON, unknown dtypes and offsets that do not tile the data.
4. The schema and the values (`hfquant.integration.schema_check`, the check a pre-quantized load, `inspect`, `export`
   and `convert` make too): the base model type must be that of the `architectures` class; the model skeleton is
   built on the meta device from `config.json` (a transformers class only, `trust_remote_code=False`; a model that
   cannot be built is a problem, one with custom code a note) and hfquant's quantizer swaps its layers exactly as a
   reload does. Every stored tensor of an hfquant module must be in the files with exactly the dtype and shape the
   config gives; every other tensor must have the model's shape; a model tensor absent from the files (and not tied to
   one that is present), or a file tensor the model does not have (a SINQ column scale under a config saying RTN), is
   a problem. Every stored scale must be finite and > 0, every zero point within the codes of its bit width (these
   small tensors are read; the codes are not).
5. Checksums, when recorded (`hfquant.checkpoint.checksums`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from hfquant.checkpoint.checksums import SUMS_NAME, checksum_problems
from hfquant.checkpoint.files import (
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_NAME,
    WEIGHT_SUFFIXES,
    TensorHeader,
    checkpoint_ids,
    mixed_checkpoint_problem,
    open_safetensors,
    read_headers,
    read_index,
    read_tensor,
    require_inside,
)
from hfquant.checkpoint.model_config import read_quantization_config
from hfquant.checkpoint.schema import is_hfquant_module, value_problem
from hfquant.integration.schema_check import checkpoint_schema

__all__ = ["VerifyResult", "verify"]


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


def _shard_names(folder: Path, problems: list[str]) -> tuple[list[str], dict[str, str] | None]:
    """(shard file names to read, the index's weight_map or None); problems of the index appended."""
    if (folder / INDEX_NAME).is_file():
        try:
            weight_map = read_index(folder)
        except ValueError as error:
            problems.append(str(error))
            return [], None
        shards = sorted(set(weight_map.values()))
        for name in sorted(p.name for p in folder.glob("*.safetensors") if p.name not in shards):
            problems.append(
                f"{name} is not named in {INDEX_NAME}, so from_pretrained ignores it: delete it, or restore the index "
                "that names it"
            )
        return shards, weight_map
    if (folder / SINGLE_NAME).is_file():
        return [SINGLE_NAME], None
    others = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    hint = f" (found {others}, which hfquant never reads: only safetensors are loaded)" if others else ""
    problems.append(f"{folder} has no {SINGLE_NAME} or {INDEX_NAME}{hint}; copy the complete checkpoint")
    return [], None


def _checkpoint_headers(folder: Path, problems: list[str]) -> tuple[dict[str, TensorHeader], list[str]]:
    """Headers of the checkpoint's tensors (name -> header) and the shard names read; problems appended."""
    shards, weight_map = _shard_names(folder, problems)
    tensors: dict[str, TensorHeader] = {}
    read: list[str] = []
    for shard in shards:
        path = folder / shard
        try:
            require_inside(folder, path)
        except ValueError as error:
            problems.append(str(error))
            continue
        if not path.is_file():
            problems.append(
                f"{shard} is named in {INDEX_NAME} but missing from {folder}; copy the complete checkpoint again"
            )
            continue
        try:
            found = read_headers(path)
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
    for key, shard in sorted((weight_map or {}).items()):
        if shard in read and (key not in tensors or tensors[key].file != shard):
            where = f"is in {tensors[key].file}" if key in tensors else "is in no shard"
            problems.append(
                f"{INDEX_NAME} maps {key} to {shard}, which has no tensor {key!r} (it {where}); the index and the "
                "shards are from different saves: copy the complete checkpoint again"
            )
    return tensors, read


def _value_problems(
    folder: Path, model, tensors: dict[str, TensorHeader], key_map: dict[str, str | None]
) -> list[str]:
    """`value_problem` of every stored scale and zero point of an hfquant module, read from the files."""
    wanted: dict[str, list[tuple[str, int]]] = {}  # shard -> [(file key, bits)]
    for file_key, header in tensors.items():
        model_key = key_map.get(file_key)
        if model_key is None or not model_key.endswith(("scale", "zero_point")):
            continue
        module = model.get_submodule(model_key.rpartition(".")[0])
        if is_hfquant_module(module) and hasattr(module, "bits"):
            wanted.setdefault(header.file, []).append((file_key, module.bits))
    problems = []
    for shard, keys in sorted(wanted.items()):
        path = folder / shard
        try:
            with open_safetensors(path) as handle:
                for key, bits in keys:
                    problem = value_problem(key, read_tensor(handle, path, key), bits)
                    if problem is not None:
                        problems.append(f"{problem} (in {shard})")
        except ValueError as error:
            problems.append(str(error))
    return problems


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
    quant_config = config = None
    if not (folder / CONFIG_NAME).is_file():
        problems.append(f"{folder} has no {CONFIG_NAME}; copy the complete checkpoint")
    else:
        try:
            config, quant_config = read_quantization_config(folder)
        except (ValueError, TypeError) as error:
            text = str(error)
            problems.append(
                text if text.startswith((CONFIG_NAME, str(folder / CONFIG_NAME))) else f"{CONFIG_NAME}: {text}"
            )
    tensors, shards = _checkpoint_headers(folder, problems)
    try:
        mixed = mixed_checkpoint_problem(checkpoint_ids(folder / shard for shard in shards))
    except ValueError:  # an unreadable shard is reported by the header check
        mixed = None
    if mixed is not None:
        problems.append(mixed)
    compared = 0
    if quant_config is not None and tensors:
        # the check a pre-quantized from_pretrained, inspect, export and convert make too (hfquant.integration.schema_check)
        schema = checkpoint_schema(folder, tensors, quant_config, config)
        problems += schema.problems
        compared = schema.compared
        notes += [schema.note] if schema.note else []
        if schema.model is not None:
            problems += _value_problems(folder, schema.model, tensors, schema.key_map)
    sums, checksummed = checksum_problems(folder)
    problems += sums
    if not (folder / SUMS_NAME).is_file():
        notes.append(f"no {SUMS_NAME}: file contents not checked against recorded sha256 sums")
    return VerifyResult(problems, compared, len(shards), checksummed, notes)
