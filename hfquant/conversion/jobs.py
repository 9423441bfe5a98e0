"""Quantizing a conversion's source tensors and writing its shards: one `QuantJob` per source tensor, run by the
quantizer's own on-load op, in this process or in spawned worker processes (`workers` > 0), results consumed in
shard order.

A process keeps its open safetensors handles and its meta skeleton with the quantizer's op for the whole conversion,
in a `JobRunner`: the caller's, or the one a worker process makes when it starts.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from hfquant.checkpoint.files import open_safetensors, read_tensor, write_shard
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.config import HfQuantConfig
from hfquant.core.dtypes import torch_dtype
from hfquant.integration.conversions import Output, QuantJob
from hfquant.integration.skeleton import build_skeleton

__all__ = ["JobRunner", "write_weights"]


class JobRunner:
    """One process's side of a conversion: the meta skeleton and the quantizer's own on-load op that quantize its
    jobs, and the safetensors handles it reads through (kept open until `close`)."""

    def __init__(self, model, quantizer):
        self.model = model
        self.op = quantizer.get_quantize_ops()
        self.handles: dict[str, Any] = {}

    def read(self, path: str, key: str) -> torch.Tensor:
        """One tensor of a safetensors file (its handle stays open until `close`)."""
        handle = self.handles.get(path)
        if handle is None:
            handle = self.handles[path] = open_safetensors(path)
        return read_tensor(handle, path, key)

    def close(self) -> None:
        """Close the safetensors handles."""
        self.handles.clear()

    def run(self, job: QuantJob) -> dict[str, torch.Tensor]:
        """Quantize one source tensor with the quantizer's own on-load op; returns {model key: stored tensor}.

        Raises:
            MemoryError: the op ran out of memory on it.
            ValueError: the op refused it (NaN/Inf weights), naming the tensor, the file and the fix.
        """
        op = self.op
        tensor = self.read(job.path, job.source_key).to(torch_dtype(job.dtype))
        try:
            result = op.convert({job.model_key: tensor}, model=self.model)
            # the on-load op may record a refused tensor (NaN/Inf weights) instead of raising; it is raised here by name
            failure = op.hf_quantizer.report.failed.pop(job.model_key, None)
        except ValueError as error:
            failure = str(error)
        del tensor
        out_of_memory = op.hf_quantizer.report.out_of_memory
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


_WORKER: JobRunner | None = None
"""A worker process's runner, set once by `_init_worker` when the process starts (None in the main process)."""


def _init_worker(folder: str, dtype: str, config: dict, folds: dict) -> None:
    """Worker process: one torch thread (N processes share the cores), and its own meta skeleton and quantizer (with
    the config the main process resolved and its folds, so the checkpoint is not read again to plan them)."""
    global _WORKER
    torch.set_num_threads(1)
    model, _, quantizer = build_skeleton(Path(folder), dtype, HfQuantConfig.from_dict(config), folds=folds)
    _WORKER = JobRunner(model, quantizer)


def _run_in_worker(job: QuantJob) -> dict[str, torch.Tensor]:
    return _WORKER.run(job)


def _job_results(
    runner: JobRunner, jobs: list[QuantJob], workers: int, worker_args: tuple
) -> Iterator[dict[str, torch.Tensor]]:
    """Results of `jobs` in order: run by `runner`, or with `workers` > 0 by that many processes started with
    `worker_args` (`_init_worker`), at most 2 per worker ahead."""
    if workers <= 0:
        for job in jobs:
            yield runner.run(job)
        return
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch has started its thread pools
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=worker_args) as pool:
        pending: deque = deque()
        queued = iter(jobs)
        for job in queued:
            pending.append(pool.submit(_run_in_worker, job))
            if len(pending) >= 2 * workers:
                break
        while pending:
            result = pending.popleft().result()
            next_job = next(queued, None)
            if next_job is not None:
                pending.append(pool.submit(_run_in_worker, next_job))
            yield result


def write_weights(
    runner: JobRunner, outputs: list[Output], split, folder: Path, workers: int, worker_args: tuple, progress: bool
) -> int:
    """Read (through `runner`), quantize and write every shard of `split` into `folder`; returns the bytes of tensor
    data written.

    A job's results are kept until all its tensors are written (a layer's buffers may straddle two shards).
    """
    by_name = {out.name: out for out in outputs}
    order = [by_name[name] for names in split.filename_to_tensors.values() for name in names]
    jobs = list(dict.fromkeys(out.job for out in order if out.job is not None))
    remaining = {job: 0 for job in jobs}
    for out in order:
        if out.job is not None:
            remaining[out.job] += 1
    results = _job_results(runner, jobs, workers, worker_args)
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
                    tensor = runner.read(out.path, out.source_key).to(out.dtype)
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
            # an OSError leaves DST untouched: the shard is in a temporary folder
            write_shard(folder / filename, tensors)
            del tensors
    finally:
        results.close()
    return written
