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

import json
import logging
import os
import re
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch

from hfquant.checkpoint import publish as folders
from hfquant.config import HfQuantConfig
from hfquant.commands.verify import write_checksums

__all__ = [
    "ConvertResult", "convert", "resolve_source", "load_skeleton", "checkpoint_tensor_files", "open_safetensors",
]

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".pb", ".tflite")
"""Files never copied from SRC: weights, which are rewritten."""
SKIPPED_FILES = {"config.json", "README.md", SAFE_WEIGHTS_INDEX_NAME, "pytorch_model.bin.index.json"}
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
            raise NotADirectoryError(f"SRC {str(src)!r} is a file; pass the folder that holds config.json and the weights")
        return path
    text = str(src)
    if not _REPO_ID.match(text) or text.startswith((".", "/", "~")):
        raise FileNotFoundError(f"SRC {text!r} is not a folder; pass a local checkpoint folder or a Hub repo id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        folder = snapshot_download(text, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except RepositoryNotFoundError:
        raise OSError(
            f"SRC {text!r} is not a local folder and the Hub has no model repo {text!r} you can read; check the name, "
            "or log in (hf auth login / HF_TOKEN) for a private or gated repo"
        ) from None
    except RevisionNotFoundError:
        raise OSError(f"the Hub repo {text!r} has no revision {revision!r}; pass an existing branch, tag or commit") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, HfHubHTTPError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(
            f"SRC {text!r} is not a local folder, so it was taken as a Hub repo id, but the Hub could not be reached "
            f"({reason}). Download it where the Hub is reachable (hf download {text} --local-dir DIR) and pass DIR."
        ) from None
    return Path(folder)


def open_safetensors(path: str | os.PathLike):
    """`safe_open(path)`; a damaged or truncated file raises a ValueError naming it instead of SafetensorError."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as error:
        raise ValueError(
            f"{path} is damaged or not a safetensors file ({error}); download or save the checkpoint again"
        ) from None


def checkpoint_tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from `model.safetensors.index.json` or the single `model.safetensors`.

    Raises:
        FileNotFoundError: no safetensors checkpoint in `folder` (the message says what was found instead).
    """
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) {missing} that are not in {folder}")
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SAFE_WEIGHTS_NAME
    if single.is_file():
        with open_safetensors(single) as handle:
            return {name: single for name in handle.keys()}
    others = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    hint = f" (found {others}; convert reads safetensors only: load it with from_pretrained and save_pretrained it)" if others else ""
    raise FileNotFoundError(f"{folder} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}{hint}")


def _source_dtype(files: dict[str, Path]) -> torch.dtype:
    """dtype of the first floating tensor of the checkpoint (what `dtype="auto"` picks when config.json has none)."""
    for path in dict.fromkeys(files.values()):
        with open_safetensors(path) as handle:
            for name in handle.keys():
                dtype = _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype())
                if dtype is not None and dtype.is_floating_point:
                    return dtype
    return torch.float32


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


# -- skeleton ----------------------------------------------------------------------------------------------------


def _model_class(model_config):
    import transformers

    architectures = getattr(model_config, "architectures", None) or []
    for name in architectures:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if architectures:
        raise ValueError(
            f"architecture {architectures[0]!r} of config.json is not a transformers class; hfquant does not run "
            "custom (remote) code. Quantize such a model on load with from_pretrained(..., trust_remote_code=True, "
            "quantization_config=HfQuantConfig(...)) and save_pretrained it"
        )
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return AutoModelForCausalLM if type(model_config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel


def resolve_dtype(dtype: str | torch.dtype, model_config, files: dict[str, Path] | None) -> torch.dtype:
    """The load dtype: "auto" is config.json's `dtype`, else the checkpoint's first float dtype (as transformers does)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        configured = getattr(model_config, "dtype", None)
        if configured is not None:
            return configured if isinstance(configured, torch.dtype) else getattr(torch, str(configured).removeprefix("torch."))
        return _source_dtype(files) if files else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating dtype; use auto, bfloat16, float16 or float32")
    return value


def load_skeleton(folder: Path, dtype: str | torch.dtype = "auto", quantization_config: HfQuantConfig | None = None):
    """(model on the meta device, load dtype, quantizer or None) for the checkpoint in `folder`; no weight is read.

    The model is built like `from_pretrained` builds it: its architecture class from config.json, in the load dtype
    (`dtype`, resolved as transformers does, then passed through the quantizer's `update_dtype`). With a
    `quantization_config`, hfquant's quantizer runs its `preprocess_model` on it: the planned layers become meta
    `QuantLinear`s and `config.quantization_config` is set, exactly as in quantize-on-load.
    """
    from transformers import AutoConfig

    from hfquant.integration.quantizer import HfQuantQuantizer

    model_config = AutoConfig.from_pretrained(folder)
    try:
        files = checkpoint_tensor_files(folder)
    except FileNotFoundError:
        files = None
    load_dtype = resolve_dtype(dtype, model_config, files)
    quantizer = None
    if quantization_config is not None:
        quantizer = HfQuantQuantizer(quantization_config, pre_quantized=False)
        quantizer.validate_environment()
        load_dtype = quantizer.update_dtype(load_dtype)
    cls = _model_class(model_config)
    with torch.device("meta"):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(model_config, dtype=load_dtype)
        else:
            model = cls._from_config(model_config, dtype=load_dtype)
    if quantizer is not None:
        # from_pretrained runs preprocess_model inside its init context, where torch's default dtype is the load dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(load_dtype)
        try:
            with torch.device("meta"):
                quantizer.preprocess_model(model=model, dtype=load_dtype, device_map={"": "cpu"})
        finally:
            torch.set_default_dtype(default)
        model.config.quantization_config = quantizer.quantization_config
    return model, load_dtype, quantizer


# -- which source tensor makes which output tensor ---------------------------------------------------------------


class _QuantJob(NamedTuple):
    """One source tensor to quantize: read `source_key` from `path`, cast to `dtype`, hand it to the quantizer as
    model tensor `model_key`; the quantizer returns the stored tensors (for a `QuantLinear` weight: weight,
    weight_scale[, weight_zero_point])."""

    path: str
    source_key: str
    model_key: str
    dtype: str


class _Output(NamedTuple):
    """One output tensor: its name in the file, its model key, and its origin (a float source tensor or a job)."""

    name: str
    model_key: str
    path: str
    source_key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    job: _QuantJob | None


def _tied_targets(model, state_dict_names: list[str]) -> set[str]:
    """Names that `save_pretrained` drops as tied duplicates (`remove_tied_weights_from_state_dict`, by identity)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if name in state_dict_names:
            groups.setdefault(id(tensor), []).append(name)
    patterns = []
    for module_name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{module_name}.{key}" if module_name else key for key in tied]
    dropped = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        found = 0
        for name in sorted(names):
            if any(re.search(pattern, name) for pattern in patterns):
                found += 1
                if found < len(names):
                    dropped.add(name)
    return dropped


def _plan_outputs(model, quantizer, load_dtype: torch.dtype, files: dict[str, Path]) -> tuple[list[_Output], list[str]]:
    """Every output tensor in `save_pretrained`'s order, and the model tensors that no source tensor provides.

    Source keys are mapped to model keys with transformers' own renaming (`get_model_conversion_mapping`,
    `rename_source_key`, base-model prefix added or removed) and cast like `from_pretrained` casts them; a tensor
    for which the quantizer's `param_needs_quantization` is true becomes a job, which makes that model tensor and
    its module's other stored tensors that have no source (for a `QuantLinear`: weight_scale, weight_zero_point).
    Output names are the model keys mapped back with the reverse of the renamings used, as `save_pretrained` does.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
        build_glob_alternation,
        dot_natural_key,
        rename_source_key,
    )

    meta_state = model.state_dict()
    conversions = get_model_conversion_mapping(model, None, quantizer)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = model.base_model_prefix

    source_of: dict[str, str] = {}  # model key -> source key
    converted: set[str] = set()  # model keys made by a WeightConverter (fused or split tensors)
    for key in sorted(files, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        if renamed not in meta_state:
            logger.info("source tensor %s is not used by %s (from_pretrained ignores it too)", key, type(model).__name__)
            continue
        if pattern is not None:
            converted.add(renamed)
        source_of.setdefault(renamed, key)

    dtype_plan = model._get_dtype_plan(load_dtype) if hasattr(model, "_get_dtype_plan") else {}
    if dtype_plan:
        dtype_alternation, dtype_group, _ = build_glob_alternation(list(dtype_plan))

    def planned_dtype(model_key: str) -> torch.dtype | None:
        if dtype_plan and (match := dtype_alternation.search(model_key)) is not None:
            return dtype_plan[dtype_group[match.lastgroup]]
        return None

    jobs: dict[str, _QuantJob] = {}  # model key of every tensor a job makes -> job
    for model_key, source_key in source_of.items():
        if quantizer is None or not quantizer.param_needs_quantization(model, model_key):
            continue
        if model_key in converted:
            raise ValueError(
                f"{type(model).__name__} tensor {model_key} is built by a transformers weight conversion (fused or "
                "split tensors), which hfquant convert does not run; quantize this model on load instead: "
                "from_pretrained(SRC, quantization_config=HfQuantConfig(...)).save_pretrained(DST)"
            )
        job_dtype = planned_dtype(model_key) or load_dtype
        job = _QuantJob(str(files[source_key]), source_key, model_key, str(job_dtype).removeprefix("torch."))
        module = model_key.rpartition(".")[0]
        jobs[model_key] = job
        for key in meta_state:
            if key.rpartition(".")[0] == module and key not in source_of:
                jobs[key] = job

    used = [c for c in conversions if c.was_used()][::-1]
    reverse_renamings = [c.reverse_transform() for c in used if isinstance(c, WeightRenaming)]
    reverse_converters = [c.reverse_transform() for c in used if isinstance(c, WeightConverter)]

    def saved_name(model_key: str) -> str:
        name, pattern = apply_converters(model_key, reverse_converters)
        return name if pattern is not None else apply_renamings(model_key, reverse_renamings)

    names = sorted(meta_state, key=dot_natural_key)  # save_pretrained's order (revert_weight_conversion sorts)
    dropped = _tied_targets(model, names) | set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    outputs, missing = [], []
    for model_key in names:
        if model_key in dropped:
            continue
        meta = meta_state[model_key]
        job = jobs.get(model_key)
        if job is not None:
            name = saved_name(model_key)
            outputs.append(_Output(name, model_key, job.path, job.source_key, meta.dtype, tuple(meta.shape), job))
            continue
        source_key = source_of.get(model_key)
        if source_key is None:
            missing.append(model_key)
            continue
        name = source_key if model_key in converted else saved_name(model_key)
        target = planned_dtype(model_key) or meta.dtype
        outputs.append(_Output(name, model_key, str(files[source_key]), source_key, target, tuple(meta.shape), None))
    return outputs, missing


# -- reading and quantizing --------------------------------------------------------------------------------------


_HANDLES: dict[str, Any] = {}
_QUANTIZER_STATE: dict[str, Any] = {}  # "model": meta skeleton, "op": the quantizer's conversion op


def _read(path: str, key: str) -> torch.Tensor:
    """One tensor of a safetensors file (handles stay open in this process; `_close_handles` closes them)."""
    from safetensors import SafetensorError

    handle = _HANDLES.get(path)
    if handle is None:
        handle = _HANDLES[path] = open_safetensors(path)
    try:
        return handle.get_tensor(key)
    except SafetensorError as error:
        raise ValueError(f"cannot read {key} from {path} ({error}); the file is damaged, download or save it again") from None


def _close_handles() -> None:
    _HANDLES.clear()


def _use_quantizer(model, quantizer) -> None:
    _QUANTIZER_STATE.update(model=model, op=quantizer.get_quantize_ops())


def _run_job(job: _QuantJob) -> dict[str, torch.Tensor]:
    """Quantize one source tensor with the quantizer's own on-load op; returns {model key: stored tensor}."""
    op = _QUANTIZER_STATE["op"]
    tensor = _read(job.path, job.source_key).to(getattr(torch, job.dtype))
    try:
        result = op.convert({job.model_key: tensor}, model=_QUANTIZER_STATE["model"])
        # the on-load op may record a refused tensor (NaN/Inf weights) instead of raising; it is raised here by name
        failure = getattr(op.hf_quantizer, "failed_tensors", {}).pop(job.model_key, None)
    except ValueError as error:
        failure = str(error)
    del tensor
    if failure is not None:
        module = job.model_key.rpartition(".")[0]
        raise ValueError(
            f"cannot quantize {job.source_key} of {Path(job.path).name}: {failure} Repair the float checkpoint, or "
            f"keep the layer in float with modules_to_not_convert=[{module!r}] (--modules-to-not-convert {module})"
        )
    return result


def _init_worker(folder: str, dtype: str, config: dict) -> None:
    """Worker process: one torch thread (N processes share the cores), and its own meta skeleton and quantizer."""
    torch.set_num_threads(1)
    model, _, quantizer = load_skeleton(Path(folder), getattr(torch, dtype), HfQuantConfig.from_dict(config))
    _use_quantizer(model, quantizer)


def _job_results(jobs: list[_QuantJob], workers: int, worker_args: tuple) -> Iterator[dict[str, torch.Tensor]]:
    """Results of `jobs` in order; with `workers` > 0, computed by that many processes, at most 2 per worker ahead."""
    if workers <= 0:
        for job in jobs:
            yield _run_job(job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

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


def _shard_plan(outputs: list[_Output], max_shard_size: int | str):
    """`huggingface_hub.split_torch_state_dict_into_shards` on meta tensors of the outputs (as save_pretrained)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {out.name: torch.empty(out.shape, dtype=out.dtype, device="meta") for out in outputs}
    try:
        return split_torch_state_dict_into_shards(
            meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
        )
    except ValueError:
        raise ValueError(f"max_shard_size {max_shard_size!r} is not a size; use bytes or e.g. 500MB, 5GB") from None


def _write_weights(outputs: list[_Output], split, folder: Path, workers: int, worker_args: tuple, progress: bool) -> int:
    """Read, quantize and write every shard of `split`; returns the bytes of tensor data written.

    A job's results are kept until all its tensors are written (a layer's buffers may straddle two shards).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from hfquant.checkpoint.streaming import release_checkpoint_pages

    by_name = {out.name: out for out in outputs}
    order = [by_name[name] for names in split.filename_to_tensors.values() for name in names]
    jobs = list(dict.fromkeys(out.job for out in order if out.job is not None))
    remaining = {job: 0 for job in jobs}
    for out in order:
        if out.job is not None:
            remaining[out.job] += 1
    results = _job_results(jobs, workers, worker_args)
    ready: dict[_QuantJob, dict[str, torch.Tensor]] = {}
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
            try:
                save_file(tensors, str(folder / filename), metadata={"format": "pt"})
            except SafetensorError as error:
                raise OSError(f"writing the shard {filename} failed ({error}); DST was not touched, free some space "
                              "and run again") from None
            del tensors
    finally:
        results.close()
    return written


def _copy_small_files(src: Path, dst: Path) -> list[str]:
    """Copy SRC's top-level non-weight files (tokenizer, generation config, chat template, ...); returns their names."""
    copied = []
    for path in sorted(src.iterdir()):
        name = path.name
        if name.startswith(".") or name in SKIPPED_FILES or name.endswith(WEIGHT_SUFFIXES):
            continue
        if path.is_dir():
            logger.info("not copying folder %s (convert copies the top-level files only)", path)
            continue
        if path.stat().st_size > MAX_COPIED_FILE_BYTES:
            logger.warning("not copying %s: %d bytes is more than a tokenizer or config file", path, path.stat().st_size)
            continue
        shutil.copyfile(path, dst / name)
        copied.append(name)
    return copied


def _save_config(model, folder: Path) -> None:
    """config.json as `save_pretrained` writes it: the model's dtype (of its first float parameter) and class stamped,
    `quantization_config` included."""
    config = model.config
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)


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
    if dst.is_file():
        raise FileExistsError(f"DST {dst} is a file, not a checkpoint folder; pass the path of a folder to write")
    parent = next((p for p in dst.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise NotADirectoryError(f"{parent} is a file, so DST {dst} cannot be created under it; pass a folder path")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise FileExistsError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it")
    if workers < 0:
        raise ValueError(f"workers={workers} must be >= 0 (0: quantize in this process)")
    _shard_plan([], max_shard_size)  # parses max_shard_size: a bad value fails before any work
    config.validate()
    folder = resolve_source(src, revision)
    if dst.resolve() == folder.resolve():
        raise ValueError(f"DST {dst} is SRC; write the quantized checkpoint to another folder")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; SRC must be a transformers checkpoint folder")
    existing = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("quantization_config")
    if existing is not None:
        raise ValueError(
            f"{folder} is already quantized (quant_method {existing.get('quant_method')!r}); convert needs the float "
            "checkpoint it was made from"
        )
    files = checkpoint_tensor_files(folder)

    model, load_dtype, quantizer = load_skeleton(folder, dtype, config)
    _use_quantizer(model, quantizer)
    outputs, missing = _plan_outputs(model, quantizer, load_dtype, files)
    if missing:
        logger.warning(
            "%s has no tensor for %d model tensor(s) (%s%s); from_pretrained would initialize them, convert leaves "
            "them out as the source does", folder, len(missing), ", ".join(missing[:5]), ", ..." if len(missing) > 5 else "",
        )
    split = _shard_plan(outputs, max_shard_size)

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with folders.temporary_folder(dst) as tmp:  # deleted at the end: unfinished, or the version replaced
            worker_args = (str(folder), str(load_dtype).removeprefix("torch."), config.to_dict())
            written = _write_weights(outputs, split, tmp, workers, worker_args, progress)
            if split.is_sharded:
                index = {
                    "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
                    "weight_map": split.tensor_to_filename,
                }
                (tmp / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            _save_config(model, tmp)
            _copy_small_files(folder, tmp)
            if card:
                from hfquant.commands.cards import write_card

                write_card(
                    tmp,
                    base_model=base_model if base_model is not None else _base_model_of(src, folder),
                    base_card=folder / "README.md",
                    name=dst.name,
                )
            write_checksums(tmp)
            folders.publish_folder(tmp, dst, overwrite)
    finally:
        _close_handles()
        _QUANTIZER_STATE.clear()
    quantized = len({out.job for out in outputs if out.job is not None})
    source_bytes = sum(p.stat().st_size for p in set(files.values()))
    result = ConvertResult(
        dst, list(split.filename_to_tensors), quantized, sum(out.job is None for out in outputs), written, source_bytes,
        time.perf_counter() - start,
    )
    logger.info("converted %s -> %s: %d layers quantized in %.1f s", src, dst, quantized, result.seconds)
    return result


_HUB_CACHE_PATH = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[0-9a-f]+/?$")


def _base_model_of(src: str | os.PathLike, folder: Path) -> str | None:
    """The Hub repo id of the float model, when `src` is one or `folder` is a Hub cache snapshot; else None."""
    text = str(src)
    if not Path(text).expanduser().exists() and _REPO_ID.match(text) and "/" in text:
        return text
    match = _HUB_CACHE_PATH.search(folder.resolve().as_posix())
    return f"{match.group(1)}/{match.group(2)}" if match else None
