"""Reusable scratch buffers for passes that make one large temporary per weight.

A fresh CPU tensor above glibc's mmap threshold (at most 32 MiB) is a new mapping: the first write to each of its pages
faults, and the kernel zeroes the page: a copy into a fresh weight-sized tensor costs several times a product that
reads the same bytes (docs/performance.md, "SINQ column scales"). A pass over every weight of a model (the fold pre-pass, `hfquant.integration.folding`) that writes into
the same buffers instead pays those faults once.

    scratch = Scratch()
    tiles = scratch.take("tiles", (groups, rows, group_size), torch.bfloat16)   # a view, reused by the next take
    ...
    scratch.clear()                                                              # or let it go out of scope
"""

from __future__ import annotations

import math

import torch

__all__ = ["Scratch"]


class Scratch:
    """Named flat CPU buffers, grown on demand. `take(name, ...)` returns a view of the buffer `name`: the previous view
    of that name must no longer be needed. Memory held: the largest request per name, until `clear()`."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor of `shape` and `dtype` that shares memory with earlier takes of
        `name` (and this dtype)."""
        numel = math.prod(shape)
        key = (name, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop(key, None)  # free the smaller one first: peak memory is the new size, not both
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device="cpu")
        return buffer[:numel].view(shape)

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()
