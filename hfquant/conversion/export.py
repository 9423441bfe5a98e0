"""`hfquant export`: an hfquant checkpoint folder -> a checkpoint other engines read, file to file.

    export_checkpoint(src, dst, format="compressed-tensors")

The only format is compressed-tensors `pack-quantized` (`hfquant.checkpoint.compressed_tensors`: the tensor mapping,
bit-exact), which vLLM serves and transformers loads with the `compressed-tensors` package, without hfquant. The
layers' formats come from the safetensors headers and, for the width of asymmetric layers and which layers are
embeddings, the lm_head or GPT-2 `Conv1D`s, from the float model skeleton built on the meta device from config.json.
Source tensors are read one at a time through `safe_open`; an output shard is written as soon as its tensors are
made, so memory stays near one output shard plus one source layer. DST is written into a temporary folder beside it
and renamed in one step at the end (`hfquant.checkpoint.publish`): a failed or interrupted export leaves DST as it
was. Tokenizer, generation config and other small top-level files are copied; hfquant's own files (its model card,
`hfquant.sha256.json`, `hfquant_eval.json`) are not, since they describe the hfquant checkpoint.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant.checkpoint import compressed_tensors as ct
from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.copying import NOT_EXPORTED, copy_small_files
from hfquant.checkpoint.files import (
    CONFIG_NAME,
    TensorHeader,
    first_float_dtype,
    read_headers,
    require_inside,
    tensor_files,
    write_index,
    write_json,
)
from hfquant.checkpoint.model_config import read_quantization_config
from hfquant.checkpoint.schema import block_layers
from hfquant.checkpoint.sharding import shard_plan, write_shards
from hfquant.config import HfQuantConfig
from hfquant.core import blocks
from hfquant.core.dtypes import torch_dtype
from hfquant.integration.schema_check import check_checkpoint_schema
from hfquant.integration.skeleton import build_skeleton
from hfquant.nn.replace import output_embedding

__all__ = ["FORMATS", "ExportResult", "export_checkpoint", "check_dst"]

logger = logging.getLogger(__name__)

FORMATS = ("compressed-tensors", "gguf")
"""Formats `export_checkpoint` writes."""


class ExportResult(NamedTuple):
    """What `export_checkpoint` wrote: `dst`, shard files, layers written quantized / dequantized, groups, seconds."""

    dst: Path
    shards: list[str]
    quantized_layers: int
    dequantized_layers: int
    config_groups: int
    seconds: float


def check_dst(dst: Path, src: Path, overwrite: bool) -> None:
    """Refuse a DST that is SRC, inside it or contains it, is a file, lies under a file, or exists without
    `overwrite` (before any work).

    Raises:
        FileExistsError, NotADirectoryError, ValueError: naming DST (and SRC) and the fix.
    """
    folders.check_apart_from_source(dst, src, "the new checkpoint")
    folders.check_destination(dst, overwrite)


def _compute_dtype(qconfig: dict, config: dict, files) -> torch.dtype:
    """The dtype dequantized embeddings / lm_head are written in: the config's compute dtype, else config.json's."""
    for name in (qconfig.get("compute_dtype"), config.get("dtype"), config.get("torch_dtype")):
        if isinstance(name, str) and name != "auto":
            return torch_dtype(name)
    return first_float_dtype(files.values())


def _model_facts(folder: Path, layer_names) -> tuple[dict[str, int], set[str], list[str]]:
    """From the float skeleton: K of every Linear / Embedding weight, the layers to dequantize (embeddings and the
    output embedding), and every nn.Linear module name.

    Raises:
        ValueError: a quantized layer is a GPT-2 `Conv1D` (compressed-tensors quantizes nn.Linear only).
    """
    model, _, _ = build_skeleton(folder, "auto", None)
    output = output_embedding(model)
    in_features, dequantize, linears = {}, set(), []
    for name, module in model.named_modules():
        if isinstance(module, Conv1D) and name in layer_names:
            raise ValueError(
                f"{name} is a GPT-2 style Conv1D; compressed-tensors pack-quantized targets nn.Linear layers only, so "
                "it cannot be exported. Allowed: models whose quantized layers are nn.Linear (Llama, Mistral, Qwen2, ...)"
            )
        if isinstance(module, (nn.Linear, nn.Embedding)):
            in_features[name] = module.weight.shape[1]
        if isinstance(module, nn.Embedding) or (module is output and output is not None):
            dequantize.add(name)
        if isinstance(module, nn.Linear):
            linears.append(name)
    return in_features, dequantize, linears


def _read_source(folder: Path) -> tuple[dict, HfQuantConfig, dict[str, Path], dict[str, TensorHeader]]:
    """(config.json, its `HfQuantConfig`, tensor name -> shard, tensor name -> header) of the hfquant checkpoint
    `folder`, read from JSON and the safetensors headers only.

    Raises:
        ValueError: config.json is a link leaving `folder`, or not an hfquant checkpoint's (`read_quantization_config`),
            or the tensors do not match it (`check_checkpoint_schema`: the message a pre-quantized load gives).
        FileNotFoundError: no config.json or no safetensors.
    """
    require_inside(folder, folder / CONFIG_NAME)
    config, hfconfig = read_quantization_config(folder)
    check_checkpoint_schema(folder)  # config.json against every stored tensor, as from_pretrained checks it
    files = tensor_files(folder)
    headers = {}
    for path in dict.fromkeys(files.values()):
        headers.update(read_headers(path))
    return config, hfconfig, files, headers


def _refuse_block_formats(hfconfig: HfQuantConfig, headers: dict) -> None:
    """Refuse a checkpoint with layers in a block format (llama.cpp's types), which compressed-tensors cannot express.

    Raises:
        ValueError: naming the first such layer (one in hfquant's own formats if any), its format, how many there are
            and what to do instead.
    """
    # hfquant's own formats named first (a 3-bit budget's layers beside its q6_k / q8_0 lm_head): no GGUF either
    layers = sorted(block_layers(hfconfig, headers).items(), key=lambda item: blocks.LAYOUTS[item[1]].gguf)
    if layers:
        name, fmt = layers[0]
        gguf = all(blocks.LAYOUTS[f].gguf for _, f in layers)
        raise ValueError(
            f"{name} is stored in {'llama.cpp' if blocks.LAYOUTS[fmt].gguf else 'hfquant'}'s block format {fmt} "
            f"({len(layers)} layer(s) in block formats), which compressed-tensors cannot express (it holds uniform "
            "int4/int8 codes with per-group scales): "
            + ("export it with --format gguf, or " if gguf else "")
            + "convert with --format int for compressed-tensors and vLLM"
        )


def _export_plan(
    folder: Path, config: dict, hfconfig: HfQuantConfig, headers: dict, files: dict, engine: str = "vllm"
) -> tuple[list, dict, list]:
    """(the layers as compressed-tensors writes them, its `quantization_config`, the output tensors) of the hfquant
    checkpoint `folder` whose config.json is `config` and safetensors headers are `headers`, laid out for `engine`
    (`compressed_tensors.ENGINES`; for "vllm", fused sets stored in different formats are written in float).

    Raises:
        ValueError: a layer compressed-tensors cannot express (`_model_facts`, `compressed_tensors.plan_layers`).
    """
    _refuse_block_formats(hfconfig, headers)
    candidates = {k.removesuffix(".weight") for k in headers if k.endswith(".weight") and f"{k}_scale" in headers}
    in_features, dequantize, linears = _model_facts(folder, candidates)
    layers = ct.plan_layers(headers, in_features.get, lambda name: hfconfig.layer_settings(name)[0], dequantize)
    float_linears = [name for name in linears if name not in {la.name for la in layers if not la.dequantize}]
    if engine == "vllm":
        in_float = set(ct.vllm_float_layers(layers, float_linears))
        layers = [la._replace(dequantize=True) if la.name in in_float else la for la in layers]
    quantized = {layer.name for layer in layers if not layer.dequantize}
    qconfig = ct.quantization_config(layers, [name for name in linears if name not in quantized], engine)
    outputs = ct.plan_outputs(headers, layers, _compute_dtype(config["quantization_config"], config, files), engine)
    return layers, qconfig, outputs


def _write_folder(folder: Path, dst: Path, config: dict, outputs, split, files, overwrite: bool) -> None:
    """Write the exported shards (`outputs` in `split`), their index, `config` and the small files of `folder` into a
    temporary folder beside `dst`, then publish it as `dst` (replacing it when `overwrite`)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    with folders.temporary_folder(dst) as tmp:
        write_shards(outputs, split, files, tmp, ct.export_tensor)
        if split.is_sharded:
            write_index(tmp, split.tensor_to_filename, dict(split.metadata))
        write_json(tmp / CONFIG_NAME, config)
        copy_small_files(folder, tmp, skipped=NOT_EXPORTED)
        folders.give_umask_modes(tmp)
        folders.publish_folder(tmp, dst, overwrite)


def export_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    format: str = "compressed-tensors",
    *,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    engine: str = "vllm",
) -> ExportResult:
    """Write the hfquant checkpoint folder `src` as a compressed-tensors `pack-quantized` checkpoint folder `dst`.

    Every quantized Linear layer keeps its codes and scales bit for bit (`hfquant.checkpoint.compressed_tensors`:
    `P.weight_packed` int32 (N, K * bits / 32), `P.weight_scale` bfloat16 (N, K / g), `P.weight_zero_point` int32
    (N * bits / 32, K / g) when asymmetric, `P.weight_shape` int64 (2,)); config.json gets a compressed-tensors
    `quantization_config` with one config group per (bits, group size, symmetric) and the float Linear layers in
    `ignore`. Quantized embeddings and a quantized lm_head are written dequantized in the compute dtype, the
    float tensors as they are.

    Args:
        src: an hfquant checkpoint folder (from `hfquant convert` or `save_pretrained`).
        dst: the folder to write; must not exist unless `overwrite`.
        format: "compressed-tensors", or "gguf": then `dst` is one .gguf file and the result a
            `hfquant.conversion.export_gguf.GgufResult` (`export_gguf`; `max_shard_size` does not apply).
        max_shard_size: largest output shard, bytes or e.g. "500MB".
        overwrite: replace an existing `dst` (atomically, once the new one is complete).
        engine: the reader the files are laid out for (`compressed_tensors.ENGINES`; only asymmetric layers
            differ). "vllm" (default): zero points packed along N, as compressed-tensors' compressor writes them and
            vLLM reads them; fused q/k/v or gate/up sets stored in different formats are written in float (a
            warning names them). "transformers": zero points (N, G) int32 as transformers 5 with
            compressed-tensors 0.20 allocates them, so that it loads the export quantized; vLLM refuses that
            layout.

    Raises:
        ValueError: an unknown `format` or `engine`; `src` is not an hfquant checkpoint; a layer compressed-tensors cannot
            express (method "sinq", a GPT-2 Conv1D), named with what is allowed; a bad `max_shard_size`; config.json,
            the index or a shard is a link leaving `src`.
        FileExistsError: `dst` exists and `overwrite` is False (checked before any work).
        FileNotFoundError: `src` has no config.json or no safetensors.
        ImportError: format "gguf" without the gguf package (an optional dependency), with its pip command.
        OSError: a file could not be written; `dst` is left as it was.
    """
    start = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not an export format; allowed: {list(FORMATS)}")
    if engine not in ct.ENGINES:
        raise ValueError(f"engine={engine!r} is not an engine the export is laid out for; allowed: {list(ct.ENGINES)}")
    if format == "gguf":  # one file for llama.cpp (`hfquant.conversion.export_gguf`), not a folder
        from hfquant.conversion.export_gguf import export_gguf  # imports gguf, an optional dependency

        return export_gguf(src, dst, overwrite=overwrite)
    folder, dst = Path(src).expanduser(), Path(dst).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"SRC {folder} is not a folder; pass an hfquant checkpoint folder")
    check_dst(dst, folder, overwrite)
    shard_plan([], max_shard_size)
    config, hfconfig, files, headers = _read_source(folder)
    layers, qconfig, outputs = _export_plan(folder, config, hfconfig, headers, files, engine)
    quantized = {layer.name for layer in layers if not layer.dequantize}
    split = shard_plan(outputs, max_shard_size)

    _write_folder(folder, dst, dict(config, quantization_config=qconfig), outputs, split, files, overwrite)
    result = ExportResult(
        dst,
        list(split.filename_to_tensors),
        len(quantized),
        len(layers) - len(quantized),
        len(qconfig["config_groups"]),
        time.perf_counter() - start,
    )
    logger.info(
        "exported %s -> %s (%s): %d layers quantized, %d dequantized, %d config group(s) in %.1f s",
        src,
        dst,
        format,
        result.quantized_layers,
        result.dequantized_layers,
        result.config_groups,
        result.seconds,
    )
    return result
