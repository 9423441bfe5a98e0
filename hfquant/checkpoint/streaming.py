"""Keeping memory bounded while the checkpoint streams in: drop already-read checkpoint pages from the process.

transformers reads safetensors shards through memory maps. Every page of a shard that was read stays mapped,
and counted in the process's resident set, until the shard is closed at the end of loading; for a model that is
quantized on load that would put the whole float checkpoint in RSS. After each weight is quantized,
`release_checkpoint_pages()` asks the kernel to reclaim the resident pages of every mapped `.safetensors` file
with `madvise(MADV_PAGEOUT)` (Linux >= 5.4). It only ever reclaims clean file pages (a page the process wrote
to is anonymous memory and is left alone), so no data can be lost; a page that is read again is faulted back in
from the file. Elsewhere it does nothing. Pages that another process maps too (the same checkpoint loaded by two
processes at once) are shared and are not reclaimed: the peak-RSS bound holds for one loader at a time.
Why not the cheaper `MADV_DONTNEED` (0.35-0.44 of a 1.2B load's 4.8 CPU s go to `MADV_PAGEOUT`'s eviction from the
page cache): safetensors maps its shards writable and private (`rw-p`), and every shard mapped in the process is
advised, including those of a model loaded earlier whose float parameters still point into its map; a page written
there (copy-on-write: a fine-tuned parameter) would silently revert to the file's bytes under `MADV_DONTNEED`.

The weights quantized on load are released sooner and cheaper: `PageReleaser.consume` unmaps the whole pages of each
one that transformers read as a view of this load's map, right after it was quantized, with `MADV_DONTNEED` on its
own pages only (pages that no parameter keeps and that this load never wrote), then drops those file bytes from the
page cache (`POSIX_FADV_DONTNEED`, which leaves pages mapped elsewhere alone). The periodic `MADV_PAGEOUT` stays as
the bound for the rest (copies, pages shared with a kept tensor): on the 1.2B benchmark model it then found almost
nothing left to evict (0.06-0.09 CPU s a load instead of 0.36), and unlike it `MADV_DONTNEED` also takes out pages
that another process maps too (docs/performance.md, sixteenth session).

Each call reads `/proc/self/maps` and advises every mapped shard whole, so its cost grows with the checkpoint, not with
the weight just read: once per weight it cost 0.68 s of a 3.2 s load of a 2.35 GB checkpoint (docs/performance.md).
`PageReleaser` calls it once per `every` bytes read instead (1/32 of the checkpoint, 16-256 MiB): the pages it lets
stay resident between two calls are at most `every` bytes more than before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = [
    "PageReleaser",
    "release_checkpoint_pages",
    "release_range",
    "release_pages_within",
    "populate_range",
    "mapped_checkpoint_ranges",
    "spare_mapping",
    "trim_heap",
]

logger = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
_MADV_POPULATE_READ = 22
_MAPS = "/proc/self/maps"


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    function = libc.madvise
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


def mapped_checkpoint_ranges(suffix: str = ".safetensors") -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's memory maps of files whose name ends with `suffix` (Linux only)."""
    return [(start, end, path) for start, end, _, path in _file_maps(suffix)]


def _file_maps(suffix: str = ".safetensors") -> list[tuple[int, int, int, str]]:
    """(start, end, file offset, path) of this process's maps of files whose name ends with `suffix`."""
    ranges = []
    try:
        with open(_MAPS, encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n").endswith(suffix):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end, int(fields[2], 16), fields[5].rstrip("\n")))
    except OSError:
        return []
    return ranges


_warned = False
_spared: set[int] = set()
"""Start addresses of the maps `release_checkpoint_pages` leaves alone unless `keep_cached` (`spare_mapping`)."""


def spare_mapping(address: int, spared: bool = True) -> tuple[int, int] | None:
    """Keep the checkpoint map holding `address` out of `release_checkpoint_pages`'s `MADV_PAGEOUT` (`spared`), or
    give it back (False): a reader that reads ahead of the streaming load through its own map (`FoldStream`'s worker
    thread) would otherwise have its pages dropped from the page cache mid-read, and read them from the disk again.
    Its owner unmaps them itself (`keep_cached=True`). Returns the map's (start, end) addresses, None when no
    checkpoint map holds `address` (a copy: nothing to spare)."""
    for start, end, _ in mapped_checkpoint_ranges():
        if start <= address < end:
            (_spared.add if spared else _spared.discard)(start)
            return start, end
    return None


def release_checkpoint_pages(keep_cached: bool = False) -> int:
    """Reclaim the resident pages of every mapped `.safetensors` file; returns the number of bytes advised.

    Safe to call at any time: data stays readable, it is re-read from the file when touched again.

    Args:
        keep_cached: unmap the pages from this process only (`MADV_DONTNEED`): they leave its resident set but stay in
            the kernel's page cache, for a pass that reads the checkpoint again soon. Every shard map of the process
            is advised, spared ones included: only for a process whose maps hold no written page (see above), so
            the library itself never asks it (`FoldStream` releases its own ranges with `release_range`).
    """
    global _warned
    madvise = _madvise()
    if madvise is None:
        return 0
    advised = 0
    advice = _MADV_DONTNEED if keep_cached else _MADV_PAGEOUT
    for start, end, path in mapped_checkpoint_ranges():
        if not keep_cached and start in _spared:
            continue
        if madvise(start, end - start, advice) == 0:
            advised += end - start
        elif not _warned:
            _warned = True
            logger.info("madvise(%d) refused for %s (errno %d)", advice, path, ctypes.get_errno())
    trim_heap()
    return advised


def release_range(address: int, nbytes: int, mapping: tuple[int, int]) -> bool:
    """Unmap the pages of `nbytes` at `address` (a tensor read through the checkpoint map `mapping`, its (start, end)
    addresses from `mapped_checkpoint_ranges` or `spare_mapping`) from this process, keeping them in the page cache
    (`MADV_DONTNEED`): `release_checkpoint_pages(keep_cached=True)` for one tensor, without reading `/proc/self/maps`
    or walking every shard. The range is widened to whole pages within `mapping` only: never call it on memory outside
    a read-only file map (on anonymous memory `MADV_DONTNEED` zeroes the pages). Returns whether the kernel accepted it
    (False off Linux or for an empty range)."""
    return _advise_range(address, nbytes, mapping, _MADV_DONTNEED)


def populate_range(address: int, nbytes: int, mapping: tuple[int, int]) -> bool:
    """Map the pages of `nbytes` at `address` (a tensor of the checkpoint map `mapping`, as for `release_range`) into
    this process in one call (`MADV_POPULATE_READ`, Linux >= 5.14), before a pass that reads them all: one fault per
    page range touched costs about as much as the pass itself (the fold worker's Sinkhorn over a 1.2B block: 20-30 ms
    of faults, 6-20 ms populated; docs/performance.md). Pages already mapped are left as they are, nothing is read
    that the pass would not read. Returns whether the kernel accepted it (False off Linux, on an older kernel or for an
    empty range: the pass then faults the pages in itself)."""
    return _advise_range(address, nbytes, mapping, _MADV_POPULATE_READ)


def release_pages_within(address: int, nbytes: int, mapping: tuple[int, int]) -> int:
    """`release_range` narrowed to the whole pages inside the `nbytes` at `address` (and inside `mapping`): a page
    that the range shares with a neighbouring tensor stays mapped (that tensor may be a parameter still read, or
    written). Returns the bytes unmapped (0 off Linux, when no whole page lies inside, or when the kernel refused)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = max(mapping[0], -(-address // page) * page)
    end = min(mapping[1], (address + nbytes) // page * page)
    if end <= start or not _advise_range(start, end - start, mapping, _MADV_DONTNEED):
        return 0
    return end - start


def _advise_range(address: int, nbytes: int, mapping: tuple[int, int], advice: int) -> bool:
    """`madvise(advice)` on the pages of `nbytes` at `address`, widened to whole pages within `mapping` only; whether
    the kernel accepted it (False off Linux or for an empty range)."""
    madvise = _madvise()
    page = os.sysconf("SC_PAGE_SIZE")
    start = max(mapping[0], address // page * page)
    end = min(mapping[1], -(-(address + nbytes) // page) * page)
    if madvise is None or end <= start:
        return False
    return madvise(start, end - start, advice) == 0


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc `malloc_trim(0)`); a no-op elsewhere. About 1 ms."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None. Freed float tensors leave holes in the heap that glibc keeps resident; trimming
    returns them, so the float copy of one weight does not stay in RSS after it was quantized."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_size_t,)
    function.restype = ctypes.c_int
    return function


class PageReleaser:
    """`release_checkpoint_pages` once per `every_bytes` of checkpoint data read, instead of once per tensor.

    Usage: `releaser.read(tensor.nbytes)` after each tensor is consumed; `releaser.flush()` at the end of loading.

    Args:
        every_bytes: bytes read between two releases; `for_checkpoint` derives it from the checkpoint's size.
        background: run each release but the last (`flush`) on a thread of its own, beside the load (a release is
            mostly the kernel's reclaim of the pages, 10-20 ms of system time on the main thread per 1/32 of a 2.35 GB
            checkpoint); `read` first waits for the one before, so at most one share more stays resident.
        drop_cached: `consume` also drops the consumed bytes from the page cache (`POSIX_FADV_DONTNEED`; pages that
            another map still maps are kept by the kernel). Their pages go back to the free lists at once, still
            backed by the host, where the load's next allocations (quantized weights, float temporaries) take them:
            kept cached, those allocations took memory the VM's balloon had given back (page reporting) and paid the
            host's faults; the 7.4B benchmark model's load took 35-36 CPU s dropping, 41-43 keeping (the page cache
            then spared only a second load of the same checkpoint its reads; docs/performance.md, sixteenth session).
    """

    MIN_BYTES = 16 * 2**20
    MAX_BYTES = 256 * 2**20

    def __init__(self, every_bytes: int = MIN_BYTES, background: bool = False, drop_cached: bool = True) -> None:
        self.every_bytes = max(1, int(every_bytes))
        self.pending = 0
        self.background = background
        self.consumed_bytes = 0
        """Bytes unmapped by `consume` (whole pages of consumed tensors) since this releaser was made."""
        self._executor: ThreadPoolExecutor | None = None
        self._running: Future | None = None
        self._maps: list[tuple[int, int, int, str]] = []
        self.drop_cached = drop_cached
        self._files: dict[str, int] = {}

    @classmethod
    def for_checkpoint(cls, total_bytes: int, background: bool = False) -> PageReleaser:
        """One release per 1/32 of a checkpoint of `total_bytes`, within [MIN_BYTES, MAX_BYTES] (16-256 MiB)."""
        return cls(min(cls.MAX_BYTES, max(cls.MIN_BYTES, total_bytes // 32)), background)

    @classmethod
    def for_files(cls, files, background: bool = False) -> PageReleaser:
        """`for_checkpoint` of the summed sizes of `files` (paths; missing ones count 0)."""
        return cls.for_checkpoint(sum(os.path.getsize(f) for f in files if os.path.isfile(f)), background)

    def read(self, nbytes: int, copied: bool = True) -> int:
        """Count `nbytes` read; release the pages when `every_bytes` have accumulated, else only return freed heap
        memory (`trim_heap`, about 0.4 ms: the float copy of the weight just quantized must not stay resident) when
        the tensor was `copied` (a tensor of its own, e.g. cast to the load's dtype); a view of the checkpoint's map
        (or of a tensor still held elsewhere) freed no heap memory. Returns the bytes advised (0 when the release runs
        in the background)."""
        self.pending += max(0, int(nbytes))
        if self.pending < self.every_bytes:
            if copied:
                trim_heap()
            return 0
        if not self.background:
            return self.flush()
        self.pending = 0
        self._wait()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hfquant-pages")
        self._running = self._executor.submit(release_checkpoint_pages)
        return 0

    def consume(self, address: int, nbytes: int) -> int:
        """Unmap now (`release_pages_within`: `MADV_DONTNEED`; then out of the page cache too when `drop_cached`) the
        whole pages of the `nbytes` at `address` when they lie in a mapped checkpoint file not spared
        (`spare_mapping`); the periodic `MADV_PAGEOUT` then finds them gone and has only what no `consume` covered to
        evict (a page shared with a kept tensor, a tensor copied on its way in). Only for a tensor of this load that
        was read, is not written, and that nothing keeps (a weight quantized on load, none of its stored tensors a
        view of it): its pages are read back from the file if touched again. Returns the bytes unmapped (0: not a
        checkpoint map).

        Cost: the checkpoint's maps are read from `/proc/self/maps` when `address` is in none known yet (once per
        shard mapped), then the call is one `madvise` of the tensor's own pages (0.3 ms per 10 MB resident here: 2 GB,
        about 0.06 CPU s, per 1.2B load) and one `posix_fadvise`, against `MADV_PAGEOUT`'s page walk and eviction
        (0.35-0.44 CPU s of a 1.2B load; docs/performance.md)."""
        found = self._mapping(address)
        if found is None or found[0] in _spared:
            return 0
        released = release_pages_within(address, nbytes, found[:2])
        self.consumed_bytes += released
        if released and self.drop_cached:
            self._drop_cached(found, address, nbytes)
        return released

    def _mapping(self, address: int) -> tuple[int, int, int, str] | None:
        """(start, end, offset, path) of the checkpoint map holding `address` (the maps known, else read again)."""
        for maps in (self._maps, None):
            if maps is None:
                maps = self._maps = _file_maps()
            found = next((found for found in maps if found[0] <= address < found[1]), None)
            if found is not None:
                return found
        return None

    def _drop_cached(self, found: tuple[int, int, int, str], address: int, nbytes: int) -> None:
        """`POSIX_FADV_DONTNEED` of the file bytes under `nbytes` at `address` in the map `found`: their page cache
        pages, now mapped nowhere (or skipped by the kernel), go back to the free lists."""
        start, _, offset, path = found
        descriptor = self._files.get(path)
        try:
            if descriptor is None:
                descriptor = self._files[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(descriptor, offset + address - start, nbytes, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            self.drop_cached = False

    def flush(self) -> int:
        """Release now (`release_checkpoint_pages`, after a background release still running) and start counting
        again. Returns the bytes advised."""
        self.pending = 0
        self._maps = []  # the shards are closed after the load: an address may then hold other memory
        for descriptor in self._files.values():
            os.close(descriptor)
        self._files.clear()
        self._wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return release_checkpoint_pages()

    def _wait(self) -> None:
        if self._running is not None:
            running, self._running = self._running, None
            running.result()
