"""Memory for the weights a decode step streams, on 2 MiB pages: `empty` is `torch.empty` on transparent huge pages.

Why: a decode step reads every quantized weight from memory once (about 600 MB per token on the 1.2B benchmark
model). On 4 KiB pages that is about 150,000 pages per token, each a TLB miss and a page walk for the GEMV's loads and
prefetches. One thread's IQ4_XS GEMV from memory read at 25-29 GB/s on 4 KiB pages and at 31-33 GB/s on 2 MiB pages,
and the 1.2B default's one-thread decode step took 23.5 ms instead of 27.6-28.1 (AMD EPYC family 26 model 2,
docs/performance.md, fifteenth session). Where the bytes sit is not their layout: nothing stored changes.

How: on Linux, a tensor of at least `HUGE_PAGE` bytes is a view of its own private anonymous map (`mmap`), 2 MiB
aligned, whose whole 2 MiB pages are advised `MADV_HUGEPAGE` before anything touches them, so that the kernel backs
them with transparent huge pages as they are first written (THP "madvise" or "always"; under "never", or where no
huge page is free, they fault in as 4 KiB pages as before). The tail past the last whole 2 MiB page is not advised:
no page is made resident that `torch.empty` would not have. The map is unmapped when the tensor's storage is freed.
Smaller tensors, other platforms and other devices get `torch.empty`. Advising memory already written would need
`MADV_COLLAPSE`, a copy: it measured 1.3 ms per MiB here, 0.8-1.2 CPU s for the 1.2B's weights, against none when the
weights are written into such memory in the first place.

Cost: the kernel zeroes each huge page at its first write, where `torch.empty` often reuses heap memory that the
load's freed float temporaries left: the 7.4B benchmark model's load took 4-5 s more (about 2.7 CPU s of
`clear_page_erms`); no cost showed at the 1.2B (docs/performance.md, fifteenth session).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

__all__ = ["HUGE_PAGE", "empty"]

HUGE_PAGE = 1 << 21
"""Bytes of an x86-64 (and 4 KiB-page arm64) transparent huge page."""

_AVAILABLE = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str | None = None):
    """An uninitialized contiguous tensor of `shape` and `dtype` on `device` (default: the CPU), its whole 2 MiB
    pages on transparent huge pages where it is a CPU tensor of at least `HUGE_PAGE` bytes on Linux (module
    docstring); else `torch.empty`. The tensor owns its memory as `torch.empty`'s would (not resizable).

    Raises:
        OSError: the map cannot be made (out of memory, or the process's map count limit).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if not _AVAILABLE or nbytes < HUGE_PAGE or torch.device(device or "cpu").type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor  # a live export would keep the map from being closed
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    storage = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # no view chain: `_base` is None
