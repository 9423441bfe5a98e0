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
`clear_page_erms`); no cost showed at the 1.2B (docs/performance.md, fifteenth session). Under a hypervisor that
takes back the guest's free memory (a virtio balloon reporting free pages) a huge page is mostly fresh to the host
too: its first write measured 1.3 GB/s here, against 5 GB/s for 4 KiB pages (recycled by the guest) and 40 GB/s for a
huge page freed a moment before.

`Spares` takes that first write off the load's critical path: while a quantize-on-load runs, a thread of low priority
(nice 19) makes and writes spare maps of the sizes `empty` was asked for more than once (a model's blocks repeat the
same shapes), at most `budget` bytes of them, and first of all one map of each size the load names up front (`first`:
the stored weights of an lm_head or an embedding, each a size of its own, made while the pre-load hook folds the first
block on the other core); `empty` hands out a spare of the size asked for, already resident. The load closes it at
its end, freeing the spares left.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import math
import mmap
import os
import queue
import sys
import threading

import torch

__all__ = ["HUGE_PAGE", "Spares", "empty"]

logger = logging.getLogger(__name__)

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
    spares = _spares
    region, offset = (spares is not None and spares.take(nbytes)) or _huge_map(nbytes)
    storage = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
    return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # no view chain: `_base` is None


def _huge_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous map of `nbytes` + `HUGE_PAGE` and the offset of its first 2 MiB boundary, the whole 2 MiB
    pages of the `nbytes` from there advised `MADV_HUGEPAGE`; nothing touched."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(anchor)
    del anchor  # a live export would keep the map from being closed
    offset = -address % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    return region, offset


_spares: Spares | None = None
"""The `Spares` `empty` takes maps from (one quantize-on-load at a time), or None."""


class Spares:
    """Maps for `empty` made resident ahead of their use by a thread of its own, at nice 19 (it runs when the load's
    threads leave a core idle): the kernel's first-write zeroing of their pages (module docstring) off the load's path.

    A size `empty` asks for a second time (a model's blocks repeat their shapes) gets one spare, made again each time
    it is taken; the spares and those being made stay within `budget` bytes (resident: counted in the peak RSS).
    `empty` takes spares only from the `Spares` that `start` made current; `close` stops the thread and frees the
    spares left. Each spare is written whole once (`memset` from C, without the GIL, faulting its pages in under the
    map's own lock: no `mmap_lock` held for long, unlike `MADV_POPULATE_WRITE`).

    Args:
        budget: bytes of spares, made or being made, at most (the `first` maps aside).
    """

    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self.taken = 0
        """Maps `empty` took from the spares."""
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)
        self._first: collections.Counter[int] = collections.Counter()  # `first` maps not taken yet, by size
        self._ready: dict[int, list[tuple[mmap.mmap, int]]] = collections.defaultdict(list)
        self._asked: collections.Counter[int] = collections.Counter()
        self._making: set[int] = set()
        self._held = 0
        self._requests: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @classmethod
    def start(cls, budget: int, first: tuple[int, ...] = ()) -> Spares | None:
        """A `Spares` of `budget` bytes that `empty` takes from until it is closed; None where huge pages are not
        used (other platforms) or for a budget under one huge page. One is current at a time: one left current (a
        load that failed before closing it) is closed first.

        `first`: sizes in bytes the load will ask `empty` for once each (its own output, so outside the budget): one
        map of each is made before anything else, in this order, and `take` waits for it (sizes under `HUGE_PAGE`
        are left out: `empty` does not map them)."""
        global _spares
        if _spares is not None:
            _spares.close()
        if not _AVAILABLE or budget < HUGE_PAGE:
            return None
        _spares = cls(budget)
        for nbytes in first:
            if nbytes >= HUGE_PAGE:
                _spares._request(nbytes, first=True)
        return _spares

    def _request(self, nbytes: int, first: bool = False) -> None:
        """Queue one map of `nbytes` for the thread (started on the first request); `first`: a `first` map, outside
        the budget. Called with the lock held, or before the thread runs."""
        self._making.add(nbytes)
        if first:
            self._first[nbytes] += 1
        else:
            self._held += nbytes
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hfquant-spares", daemon=True)
            self._thread.start()
        self._requests.put(nbytes)

    def take(self, nbytes: int) -> tuple[mmap.mmap, int] | None:
        """A resident spare map of `nbytes` (as `_huge_map` gives) or None; asks the thread for the next one."""
        with self._lock:
            self._asked[nbytes] += 1
            first = self._first[nbytes] > 0
            if first:  # named up front: being made, or made; the load's own write would be no sooner
                self._first[nbytes] -= 1
                self._made.wait_for(lambda: self._closed or self._ready.get(nbytes))
            ready = self._ready.get(nbytes)
            spare = ready.pop() if ready else None
            if spare is not None:
                self.taken += 1
                if not first:
                    self._held -= nbytes
            ask = not self._closed and self._asked[nbytes] > 1 and nbytes not in self._making
            ask = ask and not self._ready.get(nbytes) and self._held + nbytes <= self.budget
            if ask:
                self._request(nbytes)
        return spare

    def close(self) -> None:
        """Stop making spares (after the one being made) and free those left; `empty` maps its own again."""
        global _spares
        with self._lock:
            self._closed = True
            if _spares is self:
                _spares = None
            left = [region for maps in self._ready.values() for region, _ in maps]
            self._ready.clear()
            self._held = 0
            self._made.notify_all()  # a `take` waiting for a `first` map maps its own
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join()
        for region in left:
            region.close()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            logger.debug("hfquant spares: the thread keeps its priority")
        while (nbytes := self._requests.get()) is not None:
            region, offset = _huge_map(nbytes)
            anchor = ctypes.c_char.from_buffer(region)
            ctypes.memset(ctypes.addressof(anchor) + offset, 0, nbytes)  # the kernel zeroes each page it faults in
            del anchor
            with self._lock:
                self._making.discard(nbytes)
                if self._closed:
                    region.close()
                else:
                    self._ready[nbytes].append((region, offset))
                self._made.notify_all()
