"""`hfquant convert`: quantize a float safetensors checkpoint file to file, without building the float model.

    convert(src, dst, HfQuantConfig(bits=4), max_shard_size="5GB")

Only the model skeleton is built, on the meta device, exactly as `from_pretrained` builds it; the quantizer's own
`preprocess_model` swaps its Linear/Conv1D layers for `QuantLinear`s (`quantizer.plan_model` decides which), so both
paths agree on every layer. The skeleton's `state_dict()` then gives the name, dtype and shape of every output
tensor before any weight is read. Source tensors are read one at a time (`safe_open(...).get_tensor`), cast to the
load dtype, quantized with `linear.quantize_to_buffers` (Conv1D weights transposed first, as on load) and released;
an output shard is written with `safetensors.torch.save_file` as soon as its tensors are complete. Peak memory is
about one source tensor plus twice one output shard (`save_file` serializes the shard to bytes before writing).

The output equals `from_pretrained(src, quantization_config=config, dtype=dtype, device_map="cpu")` followed by
`save_pretrained(dst, max_shard_size=...)`: same tensor names (in the checkpoint's original naming), dtypes, shapes
and bytes, the same shards and index, the same `config.json`. Tokenizer, generation config and other small files
are copied as they are, and a model card is written as `README.md` (`hfquant.commands.cards`).

Everything is written into a temporary folder beside `dst`, with the sha256 sums of its weights, config and index
(`hfquant.sha256.json`, checked by `hfquant verify`), and renamed to `dst` in one atomic step at the end
(`hfquant.checkpoint.publish`); an interrupted or failed run leaves `dst` as it was.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from huggingface_hub import snapshot_download, split_torch_state_dict_into_shards
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.checksums import write_checksums
from hfquant.checkpoint.files import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHT_SUFFIXES,
    open_safetensors,
    read_tensor,
    stays_inside,
    tensor_files,
    write_index,
    write_shard,
)
from hfquant.checkpoint.model_type import mark_config_file
from hfquant.checkpoint.schema import is_hfquant_module
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.commands.cards import write_card
from hfquant.commands.verify import read_model_config
from hfquant.config import HfQuantConfig
from hfquant.core.dtypes import dtype_name, torch_dtype
from hfquant.integration.conversions import Output, QuantJob, plan_outputs
from hfquant.integration.counting import quantized_weight_count
from hfquant.integration.skeleton import build_skeleton

__all__ = [
    "ConvertResult",
    "convert",
    "resolve_source",
    "base_model_of",
    "copy_small_files",
    "shard_plan",
]

logger = logging.getLogger(__name__)

SKIPPED_FILES = {CONFIG_NAME, "README.md", INDEX_NAME, "pytorch_model.bin.index.json"}
"""Files of SRC that convert rewrites (config.json, the index, the card) instead of copying."""
MAX_COPIED_FILE_BYTES = 200 * 2**20
"""Larger non-weight files are not copied (logged): tokenizers and configs are far smaller."""
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py", "README.md"]
"""What `resolve_source` downloads for a Hub repo id: config, weights, tokenizer, generation config, card."""


class ConvertResult(NamedTuple):
    """What `convert` wrote: `dst`, the shard files, counts of quantized layers and float tensors, bytes, seconds."""

    dst: Path
    shards: list[str]
    quantized_layers: int
    float_tensors: int
    weight_bytes: int
    source_weight_bytes: int
    seconds: float


# -- source ------------------------------------------------------------------------------------------------------


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$|^[A-Za-z0-9][\w.-]*$")


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
            raise NotADirectoryError(
                f"SRC {str(src)!r} is a file; pass the folder that holds config.json and the weights"
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


# -- reading and quantizing --------------------------------------------------------------------------------------


_HANDLES: dict[str, Any] = {}
_QUANTIZER_STATE: dict[str, Any] = {}  # "model": meta skeleton, "op": the quantizer's conversion op


def _read(path: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors file (handles stay open in this process; `_close_handles` closes them)."""
    handle = _HANDLES.get(path)
    if handle is None:
        handle = _HANDLES[path] = open_safetensors(path)
    return read_tensor(handle, path, key)


def _close_handles() -> None:
    _HANDLES.clear()


def _use_quantizer(model, quantizer) -> None:
    _QUANTIZER_STATE.update(model=model, op=quantizer.get_quantize_ops())


def _run_job(job: QuantJob) -> dict[str, torch.Tensor]:
    """Quantize one source tensor with the quantizer's own on-load op; returns {model key: stored tensor}."""
    op = _QUANTIZER_STATE["op"]
    tensor = _read(job.path, job.source_key).to(torch_dtype(job.dtype))
    try:
        result = op.convert({job.model_key: tensor}, model=_QUANTIZER_STATE["model"])
        # the on-load op may record a refused tensor (NaN/Inf weights) instead of raising; it is raised here by name
        failure = getattr(op.hf_quantizer, "failed_tensors", {}).pop(job.model_key, None)
    except ValueError as error:
        failure = str(error)
    del tensor
    out_of_memory = getattr(op.hf_quantizer, "out_of_memory", [])
    if job.model_key in out_of_memory:  # recorded as a failure by the on-load op: raised as what it is
        out_of_memory.remove(job.model_key)
        raise MemoryError(f"while quantizing {job.source_key} of {Path(job.path).name}")
    if failure is not None:
        module = job.model_key.rpartition(".")[0]
        raise ValueError(
            f"cannot quantize {job.source_key} of {Path(job.path).name}: {failure} Repair the float checkpoint, or "
            f"keep the layer in float with modules_to_not_convert=[{module!r}] (--modules-to-not-convert {module})"
        )
    return result


def _init_worker(folder: str, dtype: str, config: dict, folds: dict) -> None:
    """Worker process: one torch thread (N processes share the cores), and its own meta skeleton and quantizer (with
    the config the main process resolved and its folds, so the checkpoint is not read again to plan them)."""
    torch.set_num_threads(1)
    model, _, quantizer = build_skeleton(Path(folder), dtype, HfQuantConfig.from_dict(config), folds=folds)
    _use_quantizer(model, quantizer)


def _job_results(jobs: list[QuantJob], workers: int, worker_args: tuple) -> Iterator[dict[str, torch.Tensor]]:
    """Results of `jobs` in order; with `workers` > 0, computed by that many processes, at most 2 per worker ahead."""
    if workers <= 0:
        for job in jobs:
            yield _run_job(job)
        return
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch has started its thread pools
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=worker_args) as pool:
        pending: deque = deque()
        queued = iter(jobs)
        for job in queued:
            pending.append(pool.submit(_run_job, job))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().result()
            next_job = next(queued, None)
            if next_job is not None:
                pending.append(pool.submit(_run_job, next_job))
            yield result


# -- writing -----------------------------------------------------------------------------------------------------


def shard_plan(outputs: list, max_shard_size: int | str):
    """`huggingface_hub.split_torch_state_dict_into_shards` on meta tensors of the outputs (anything with `name`,
    `shape` and `dtype`), as save_pretrained shards; also used by export and import.

    Raises:
        ValueError: `max_shard_size` is not a size.
    """

    meta = {out.name: torch.empty(out.shape, dtype=out.dtype, device="meta") for out in outputs}
    try:
        return split_torch_state_dict_into_shards(
            meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
        )
    except ValueError:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size; use bytes or e.g. 500MB, 5GB") from None


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


def _write_weights(
    outputs: list[Output], split, folder: Path, workers: int, worker_args: tuple, progress: bool
) -> int:
    """Read, quantize and write every shard of `split`; returns the bytes of tensor data written.

    A job's results are kept until all its tensors are written (a layer's buffers may straddle two shards).
    """
    by_name = {out.name: out for out in outputs}
    order = [by_name[name] for names in split.filename_to_tensors.values() for name in names]
    jobs = list(dict.fromkeys(out.job for out in order if out.job is not None))
    remaining = {job: 0 for job in jobs}
    for out in order:
        if out.job is not None:
            remaining[out.job] += 1
    results = _job_results(jobs, workers, worker_args)
    ready: dict[QuantJob, dict[str, torch.Tensor]] = {}
    next_job = 0
    written = 0
    try:
        shards = tqdm(split.filename_to_tensors.items(), desc="shards", unit="shard", disable=not progress)
        for filename, names in shards:
            tensors: dict[str, torch.Tensor] = {}
            for name in tqdm(names, desc=filename, unit="tensor", leave=False, disable=not progress):
                out = by_name[name]
                if out.job is None:
                    tensor = _read(out.path, out.source_key).to(out.dtype)
                    release_checkpoint_pages()
                else:
                    while out.job not in ready:
                        ready[jobs[next_job]] = next(results)
                        next_job += 1
                    tensor = ready[out.job][out.model_key]
                    remaining[out.job] -= 1
                    if remaining[out.job] == 0:
                        del ready[out.job]
                if tuple(tensor.shape) != out.shape or tensor.dtype != out.dtype:
                    raise RuntimeError(
                        f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, the skeleton has {out.shape} {out.dtype}"
                    )
                tensors[name] = tensor.contiguous()
                written += tensor.numel() * tensor.element_size()
            write_shard(
                folder / filename, tensors
            )  # an OSError leaves DST untouched: the shard is in a temporary folder
            del tensors
    finally:
        results.close()
    return written


def copy_small_files(src: Path, dst: Path, skipped: set[str] = SKIPPED_FILES) -> list[str]:
    """Copy SRC's top-level non-weight files (tokenizer, generation config, chat template, ...) except hidden ones and
    `skipped`, never through a link leaving SRC nor above `MAX_COPIED_FILE_BYTES` (both logged); returns their names."""
    copied = []
    for path in sorted(src.iterdir()):
        name = path.name
        if name.startswith(".") or name in skipped or name.endswith(WEIGHT_SUFFIXES):
            continue
        if not stays_inside(src, path):
            logger.warning(
                "not copying %s: it is a link to %s, outside SRC (links that leave it are never followed)",
                path,
                path.resolve(),
            )
            continue
        if path.is_dir():
            logger.info("not copying folder %s (convert copies the top-level files only)", path)
            continue
        if path.stat().st_size > MAX_COPIED_FILE_BYTES:
            logger.warning(
                "not copying %s: %d bytes is more than a tokenizer or config file", path, path.stat().st_size
            )
            continue
        shutil.copyfile(path, dst / name)
        copied.append(name)
    return copied


def _save_config(model, folder: Path) -> None:
    """config.json as `save_pretrained` of a model hfquant loaded writes it: the model's dtype (of its first float
    parameter) and class stamped, `quantization_config` included, `model_type` "hfquant" (`mark_config_file`)."""
    config = model.config
    config.dtype = dtype_name(model.dtype)
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    mark_config_file(folder)


# -- the command -------------------------------------------------------------------------------------------------


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
    base_model: str | None = None,
    progress: bool = True,
    card: bool = True,
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
        base_model: Hub repo id of the float model for the card's `base_model`; default: `src` when it is a repo
            id, else the repo id found in a Hub cache path, else none.
        progress: show tqdm bars per shard and per tensor.
        card: write the model card as README.md.

    Returns:
        A `ConvertResult`.

    Raises:
        FileExistsError: `dst` exists and `overwrite` is False (checked before any work).
        FileNotFoundError / OSError: `src` is missing, has no safetensors, or is an unreachable repo id.
        ValueError / TypeError: a bad option (the message names the value and the fix).
    """
    start = time.perf_counter()
    dst = Path(dst).expanduser()
    folders.check_destination(dst, overwrite)
    if workers < 0:
        raise ValueError(f"workers={workers} must be >= 0 (0: quantize in this process)")
    shard_plan([], max_shard_size)  # parses max_shard_size: a bad value fails before any work
    config.validate()
    folder = resolve_source(src, revision)
    if dst.resolve() == folder.resolve():
        raise ValueError(f"DST {dst} is SRC; write the quantized checkpoint to another folder")
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} has no config.json; SRC must be a transformers checkpoint folder")
    existing = read_model_config(folder).get("quantization_config")  # a malformed config.json: one ValueError
    if existing is not None:
        raise ValueError(
            f"{folder} is already quantized (quant_method {existing.get('quant_method')!r}); convert needs the float "
            "checkpoint it was made from"
        )
    files = tensor_files(folder)

    with _transformers_progress_bars(progress):  # the fold's pre-pass over the blocks has its own bar
        model, load_dtype, quantizer = build_skeleton(folder, dtype, config)
    _use_quantizer(model, quantizer)
    outputs, missing = plan_outputs(model, quantizer, load_dtype, files)
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
    split = shard_plan(outputs, max_shard_size)

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with folders.temporary_folder(dst) as tmp:  # deleted at the end: unfinished, or the version replaced
            resolved = quantizer.quantization_config  # with the mixed-precision and fold entries it wrote
            worker_args = (str(folder), dtype_name(load_dtype), resolved.to_dict(), quantizer.folds)
            written = _write_weights(outputs, split, tmp, workers, worker_args, progress)
            if split.is_sharded:
                # as save_pretrained of a loaded model writes it: quantized weights counted (integration.counting)
                total = model.num_parameters() + quantized_weight_count(model)
                metadata = {"total_parameters": total, **split.metadata}
                write_index(tmp, split.tensor_to_filename, metadata)
            _save_config(model, tmp)
            copy_small_files(folder, tmp)
            if card:
                write_card(
                    tmp,
                    base_model=base_model if base_model is not None else base_model_of(src, folder),
                    base_card=folder / "README.md",
                    name=dst.name,
                )
            write_checksums(tmp)
            folders.publish_folder(tmp, dst, overwrite)
    finally:
        _close_handles()
        _QUANTIZER_STATE.clear()
    # a quantized tensor's job also makes its scales; a job making one tensor only rescales it (a fold's norm or bias)
    quantized_jobs = {out.job for out in outputs if out.job is not None and out.model_key != out.job.model_key}
    source_bytes = sum(p.stat().st_size for p in set(files.values()))
    result = ConvertResult(
        dst,
        list(split.filename_to_tensors),
        len(quantized_jobs),
        sum(out.job not in quantized_jobs for out in outputs),
        written,
        source_bytes,
        time.perf_counter() - start,
    )
    logger.info("converted %s -> %s: %d layers quantized in %.1f s", src, dst, result.quantized_layers, result.seconds)
    return result


_HUB_CACHE_PATH = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[0-9a-f]+/?$")


def base_model_of(src: str | os.PathLike, folder: Path) -> str | None:
    """The Hub repo id of the float model, when `src` is one or `folder` is a Hub cache snapshot; else None."""
    text = str(src)
    if not Path(text).expanduser().exists() and _REPO_ID.match(text) and "/" in text:
        return text
    match = _HUB_CACHE_PATH.search(folder.resolve().as_posix())
    return f"{match.group(1)}/{match.group(2)}" if match else None
