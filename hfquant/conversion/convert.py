"""`hfquant convert`: quantize a float safetensors checkpoint file to file, without building the float model.

    convert(src, dst, HfQuantConfig(bits=4), max_shard_size="5GB")

Only the model skeleton is built, on the meta device, exactly as `from_pretrained` builds it; the quantizer's own
`preprocess_model` swaps its Linear/Conv1D layers for `QuantLinear`s (`quantizer.plan_model` decides which), so both
paths agree on every layer. The skeleton's `state_dict()` then gives the name, dtype and shape of every output
tensor before any weight is read. Source tensors are read one at a time (`safe_open(...).get_tensor`), cast to the
load dtype, quantized with `linear.quantize_to_buffers` (Conv1D weights transposed first, as on load) and released
(`hfquant.conversion.jobs`, in this process or in worker processes); an output shard is written with `safetensors.torch.save_file` as soon as its tensors are complete. Peak memory is
about one source tensor plus twice one output shard (`save_file` serializes the shard to bytes before writing).

The output equals `from_pretrained(src, quantization_config=config, dtype=dtype, device_map="cpu")` followed by
`save_pretrained(dst, max_shard_size=...)`: same tensor names (in the checkpoint's original naming), dtypes, shapes
and bytes, the same shards and index, the same `config.json`. Tokenizer, generation config and other small files
are copied as they are (`hfquant.checkpoint.copying`). No model card is written: `before_publish` lets the caller add
files to the finished folder before it is published (`hfquant convert` writes the card there, `hfquant.publishing`).

Everything is written into a temporary folder beside `dst`, with the sha256 sums of its weights, config and index
(`hfquant.sha256.json`, checked by `hfquant verify`), and renamed to `dst` in one atomic step at the end
(`hfquant.checkpoint.publish`); an interrupted or failed run leaves `dst` as it was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from transformers.utils import logging as hf_logging

from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.checksums import write_checksums
from hfquant.checkpoint.copying import copy_small_files
from hfquant.checkpoint.files import CONFIG_NAME, tensor_files, write_index
from hfquant.checkpoint.model_config import read_model_config
from hfquant.checkpoint.model_type import mark_config_file
from hfquant.checkpoint.schema import is_hfquant_module
from hfquant.checkpoint.sharding import shard_plan
from hfquant.checkpoint.source import resolve_source
from hfquant.config import QUANT_METHOD, HfQuantConfig
from hfquant.conversion import jobs
from hfquant.core.dtypes import dtype_name
from hfquant.integration.conversions import Output, model_key_map, plan_outputs
from hfquant.integration.counting import quantized_weight_count
from hfquant.integration.schema_check import check_checkpoint_schema
from hfquant.integration.skeleton import build_skeleton

__all__ = ["ConvertResult", "convert"]

logger = logging.getLogger(__name__)


class ConvertResult(NamedTuple):
    """What `convert` wrote: `dst`, the shard files, counts of quantized layers and float tensors, bytes, seconds."""

    dst: Path
    shards: list[str]
    quantized_layers: int
    float_tensors: int
    weight_bytes: int
    source_weight_bytes: int
    seconds: float


@contextmanager
def _transformers_progress_bars(enabled: bool) -> Iterator[None]:
    """transformers' tqdm switch set to `enabled` for the block, then restored."""
    before = hf_logging.is_progress_bar_enabled()
    if before and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if before and not enabled:
            hf_logging.enable_progress_bar()


def _save_config(model, folder: Path) -> None:
    """config.json as `save_pretrained` of a model hfquant loaded writes it: the model's dtype (of its first float
    parameter) and class stamped, `quantization_config` included, `model_type` "hfquant" (`mark_config_file`)."""
    config = model.config
    config.dtype = dtype_name(model.dtype)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    mark_config_file(folder)


def _source_folder(src, dst: Path, config: HfQuantConfig, revision: str | None) -> Path:
    """The float checkpoint folder of `src` (downloaded when a repo id), checked to be one `convert` can read.

    Raises:
        FileNotFoundError / OSError: as `resolve_source`, or no config.json.
        ValueError: `dst` is SRC, inside it or contains it, config.json malformed or naming an unknown model type, SRC
            already quantized (an hfquant SRC whose tensors do not match its config.json is named as such first, with
            `check_checkpoint_schema`'s message), or the config refuses its values.
    """
    config.validate()
    folder = resolve_source(src, revision)
    folders.check_apart_from_source(dst, folder, "the quantized checkpoint")
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} has no config.json; SRC must be a transformers checkpoint folder")
    existing = read_model_config(folder).get("quantization_config")  # a malformed config.json: one ValueError
    if existing is not None and existing.get("quant_method") == QUANT_METHOD:
        check_checkpoint_schema(folder)  # a mismatch is named as from_pretrained and verify name it
    if existing is not None:
        raise ValueError(
            f"{folder} is already quantized (quant_method {existing.get('quant_method')!r}); convert needs the float "
            "checkpoint it was made from"
        )
    return folder


def _check_destination(src, dst: Path, overwrite: bool) -> None:
    """`dst` checked before any work: apart from a local `src` first (else "exists, pass --overwrite" would lead a
    user whose DST contains SRC into deleting it), then `check_destination`; a Hub SRC is checked once downloaded.

    Raises:
        ValueError, FileExistsError, NotADirectoryError: naming the paths and the fix.
    """
    if Path(src).expanduser().is_dir():
        folders.check_apart_from_source(dst, src, "the quantized checkpoint")
    folders.check_destination(dst, overwrite)


def _check_sources_are_float(folder: Path, model, quantizer, files: dict[str, Path]) -> None:
    """Refuse a source tensor that lands on a tensor quantization makes (a `weight_scale`, `weight_zero_point` or
    SINQ `weight_col_scale`): SRC is a quantized checkpoint whose config.json lost its `quantization_config`, and its
    scales would be stored beside codes computed from its codes.

    Raises:
        ValueError: naming the tensor and the fix.
    """
    for file_key, model_key in model_key_map(model, files, quantizer).items():
        if model_key is None:
            continue
        module_name, _, attribute = model_key.rpartition(".")
        module = model.get_submodule(module_name)
        if not is_hfquant_module(module) or attribute not in module._buffers:
            continue
        if quantizer.param_needs_quantization(model, model_key):
            continue
        raise ValueError(
            f"{folder}: {file_key} is a stored tensor of a quantized layer ({attribute}) but config.json has no "
            "quantization_config: SRC is a quantized checkpoint whose config.json lost it; restore its config.json "
            "(hfquant verify checks it), or convert the float checkpoint it was made from"
        )


def _check_missing(folder: Path, model, missing: list[str]) -> None:
    """Refuse a quantized layer with no source weight; log other model tensors the files do not have.

    Raises:
        ValueError: naming the layer and the fix.
    """
    unquantizable = [
        key
        for key in missing
        if key.endswith(("weight", "weight_scale")) and is_hfquant_module(model.get_submodule(key.rpartition(".")[0]))
    ]
    if unquantizable:
        raise ValueError(
            f"{folder} has no tensor for {unquantizable[0].rpartition('.')[0]}.weight, so there is nothing to quantize "
            "into that layer (from_pretrained would refuse it too); use the complete float checkpoint, or keep it in "
            f"float with --modules-to-not-convert {unquantizable[0].rpartition('.')[0]}"
        )
    if missing:
        logger.warning(
            "%s has no tensor for %d model tensor(s) (%s%s); from_pretrained would initialize them, convert leaves "
            "them out as the source does",
            folder,
            len(missing),
            ", ".join(missing[:5]),
            ", ..." if len(missing) > 5 else "",
        )


def _write_folder(tmp: Path, folder: Path, model, quantizer, outputs: list[Output], split, options: dict) -> int:
    """Write the shards, the index, config.json and the small files of SRC into `tmp`, then `before_publish`'s files
    and the sums; returns the bytes of tensor data written."""
    resolved = quantizer.quantization_config  # with the mixed-precision and fold entries it wrote
    worker_args = (str(folder), dtype_name(options["load_dtype"]), resolved.to_dict(), quantizer.plan.folds)
    written = jobs.write_weights(
        options["runner"], outputs, split, tmp, options["workers"], worker_args, options["progress"]
    )
    if split.is_sharded:
        # as save_pretrained of a loaded model writes it: quantized weights counted (integration.counting)
        total = model.num_parameters() + quantized_weight_count(model)
        metadata = {"total_parameters": total, **split.metadata}
        write_index(tmp, split.tensor_to_filename, metadata)
    _save_config(model, tmp)
    copy_small_files(folder, tmp)
    if options["before_publish"] is not None:
        options["before_publish"](tmp, folder)
    write_checksums(tmp)
    return written


def _result(dst: Path, split, outputs: list, written: int, source_bytes: int, seconds: float) -> ConvertResult:
    """The `ConvertResult` of a finished conversion: layers quantized and tensors kept in float counted from the
    planned outputs."""
    # a quantized tensor's job makes integer codes (a block format's bytes) or scales beside them; a job making one
    # float tensor only rescales it (a fold's norm or bias)
    quantized_jobs = {
        out.job
        for out in outputs
        if out.job is not None and (out.model_key != out.job.model_key or not out.dtype.is_floating_point)
    }
    float_tensors = sum(out.job not in quantized_jobs for out in outputs)
    shards = list(split.filename_to_tensors)
    return ConvertResult(dst, shards, len(quantized_jobs), float_tensors, written, source_bytes, seconds)


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    config: HfQuantConfig,
    *,
    max_shard_size: int | str = "2GB",
    dtype: str | torch.dtype = "auto",
    workers: int = 0,
    overwrite: bool = False,
    revision: str | None = None,
    progress: bool = True,
    before_publish: Callable[[Path, Path], object] | None = None,
) -> ConvertResult:
    """Quantize the safetensors checkpoint `src` into the folder `dst`, one tensor at a time.

    Args:
        src: a local checkpoint folder (config.json + model.safetensors or shards and their index), or a Hub repo
            id, downloaded with huggingface_hub (`revision` picks a branch, tag or commit).
        dst: output folder; must not exist unless `overwrite`.
        config: what to quantize and how.
        max_shard_size: largest output shard, bytes or a string such as "500MB" (as `save_pretrained`).
        dtype: load dtype, as `from_pretrained(dtype=...)`: "auto" (config.json's dtype, else the checkpoint's),
            "bfloat16", "float16" or "float32". Float tensors are stored in it; weights are cast to it before
            quantizing, as on load.
        workers: 0 quantizes in this process; N > 0 uses N spawned processes (one torch thread each).
        progress: show tqdm bars per shard and per tensor.
        before_publish: called as `before_publish(folder, src_folder)` with the finished temporary folder and the
            local source folder, before the sums are written and the folder is renamed to `dst`: what it writes is
            published in the same atomic step (`hfquant convert` writes the model card there).

    Returns:
        A `ConvertResult`.

    Raises:
        FileExistsError: `dst` exists and `overwrite` is False (checked before any work).
        FileNotFoundError / OSError: `src` is missing, has no safetensors, or is an unreachable repo id.
        ValueError / TypeError: a bad option, or `dst` is `src`, inside it or contains it (naming them and the fix).
    """
    start = time.perf_counter()
    dst = Path(dst).expanduser()
    _check_destination(src, dst, overwrite)
    if workers < 0:
        raise ValueError(f"workers={workers} must be >= 0 (0: quantize in this process)")
    shard_plan([], max_shard_size)  # parses max_shard_size: a bad value fails before any work
    folder = _source_folder(src, dst, config, revision)
    files = tensor_files(folder)

    with _transformers_progress_bars(progress):  # the fold's pre-pass over the blocks has its own bar
        model, load_dtype, quantizer = build_skeleton(folder, dtype, config)
    _check_sources_are_float(folder, model, quantizer, files)
    runner = jobs.JobRunner(model, quantizer)
    outputs, missing = plan_outputs(model, quantizer, load_dtype, files)
    _check_missing(folder, model, missing)
    split = shard_plan(outputs, max_shard_size)

    dst.parent.mkdir(parents=True, exist_ok=True)
    options = dict(
        runner=runner, load_dtype=load_dtype, workers=workers, progress=progress, before_publish=before_publish
    )
    try:
        with folders.temporary_folder(dst) as tmp:  # deleted at the end: unfinished, or the version replaced
            written = _write_folder(tmp, folder, model, quantizer, outputs, split, options)
            folders.give_umask_modes(tmp)
            folders.publish_folder(tmp, dst, overwrite)
    finally:
        runner.close()
    source_bytes = sum(p.stat().st_size for p in set(files.values()))
    result = _result(dst, split, outputs, written, source_bytes, time.perf_counter() - start)
    logger.info("converted %s -> %s: %d layers quantized in %.1f s", src, dst, result.quantized_layers, result.seconds)
    return result
