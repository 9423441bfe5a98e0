"""Output shards of a checkpoint written file to file: which tensor goes in which shard (as `save_pretrained` splits
them), and writing the shards of a plan from tensors made one at a time out of a source checkpoint's files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from hfquant.checkpoint.files import open_safetensors, read_tensor, write_shard
from hfquant.checkpoint.streaming import release_checkpoint_pages

__all__ = ["shard_plan", "write_shards"]


def shard_plan(outputs: list, max_shard_size: int | str):
    """`huggingface_hub.split_torch_state_dict_into_shards` on meta tensors of the outputs (anything with `name`,
    `shape` and `dtype`), as save_pretrained shards; `shard_plan([], size)` only checks the size.

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


def write_shards(
    outputs: list, split, files: dict[str, Path], folder: Path, make: Callable[[Any, Callable], torch.Tensor]
) -> None:
    """Write every shard of `split` (a `shard_plan`) into `folder`, each tensor made by `make(output, read)`,
    `read(name)` reading a source tensor of `files` (name -> shard path) through `safe_open`, one at a time (the pages
    read are given back). `outputs` are the planned tensors (anything with `name`)."""
    handles: dict[Path, Any] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = open_safetensors(path)
        tensor = read_tensor(handles[path], path, name)
        release_checkpoint_pages()
        return tensor

    by_name = {out.name: out for out in outputs}
    try:
        for filename, names in split.filename_to_tensors.items():
            write_shard(folder / filename, {name: make(by_name[name], read) for name in names})
    finally:
        handles.clear()
