"""hfquant.checkpoint.streaming.PageReleaser: the pages of a streamed checkpoint are released once per share of it
read (not once per tensor: each release advises every mapped shard whole), and always at the end."""

from __future__ import annotations

import os

import pytest

from hfquant.checkpoint import streaming
from hfquant.checkpoint.streaming import PageReleaser

MIB = 2**20


@pytest.fixture()
def calls(monkeypatch):
    made = {"release": 0, "trim": 0}

    def release():
        made["release"] += 1
        return 1

    def trim():
        made["trim"] += 1

    monkeypatch.setattr(streaming, "release_checkpoint_pages", release)
    monkeypatch.setattr(streaming, "trim_heap", trim)
    return made


@pytest.mark.parametrize(
    "total, every",
    [(0, 16 * MIB), (270 * 10**6, 16 * MIB), (2_350_000_000, 2_350_000_000 // 32), (16 * 10**9, 256 * MIB)],
)
def test_share_of_the_checkpoint_within_16_and_256_mib(total, every):
    assert PageReleaser.for_checkpoint(total).every_bytes == every


def test_releases_once_per_share_and_trims_the_heap_in_between(calls):
    releaser = PageReleaser(100)
    advised = [releaser.read(30) for _ in range(10)]  # 300 bytes: releases after the 4th, 8th tensor
    assert calls["release"] == 2 and advised == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert calls["trim"] == 8  # every other tensor still gives back its freed heap memory
    assert releaser.flush() == 1 and calls["release"] == 3 and releaser.pending == 0


def test_views_of_the_checkpoint_skip_the_heap_trim(calls):
    releaser = PageReleaser(100)
    advised = [releaser.read(30, copied=i % 2 == 0) for i in range(6)]  # released after the 4th tensor
    assert advised == [0, 0, 0, 1, 0, 0] and calls["release"] == 1
    assert calls["trim"] == 3  # the 1st, 3rd and 5th tensors were copies; the views freed no heap memory


def test_one_tensor_larger_than_the_share_is_released_at_once(calls):
    releaser = PageReleaser(100)
    releaser.read(1000)
    assert calls["release"] == 1 and releaser.pending == 0


def test_background_releases_run_beside_the_load_one_at_a_time(monkeypatch):
    import threading

    started, finish = [], threading.Event()

    def release():
        started.append(threading.current_thread().name)
        if len(started) == 1:
            assert finish.wait(10)  # the first release is still running when the next share is read
        return 1

    monkeypatch.setattr(streaming, "release_checkpoint_pages", release)
    monkeypatch.setattr(streaming, "trim_heap", lambda: None)
    releaser = PageReleaser(100, background=True)
    assert releaser.read(100) == 0  # submitted, not waited for
    assert releaser.pending == 0
    waiter = threading.Thread(target=releaser.read, args=(100,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and len(started) == 1  # the second release waits for the first: one share in flight
    finish.set()
    waiter.join(10)
    assert releaser.flush() == 1
    assert len(started) == 3 and started[0] != threading.current_thread().name
    assert started[2] == threading.current_thread().name  # the last release, at the end of loading, is the caller's


def _resident_kib(start: int) -> int:
    """Rss of this process's map starting at `start` (/proc/self/smaps)."""
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no map starts at {start:#x}")


def test_populate_range_maps_a_tensor_in_and_release_range_takes_it_out(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    from hfquant.checkpoint.files import open_safetensors, read_tensor

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(512, 1024, dtype=torch.bfloat16), "b": torch.ones(512, 1024)}, str(path))
    handle = open_safetensors(path)
    tensor = read_tensor(handle, path, "b")  # 2 MiB, not touched
    mapping = streaming.spare_mapping(tensor.data_ptr())
    if mapping is None:
        pytest.skip("no checkpoint maps in /proc/self/maps here")
    try:
        before = _resident_kib(mapping[0])
        if not streaming.populate_range(tensor.data_ptr(), tensor.nbytes, mapping):
            pytest.skip("MADV_POPULATE_READ needs Linux >= 5.14")
        assert _resident_kib(mapping[0]) - before >= 2048  # the whole tensor, without reading it
        assert streaming.release_range(tensor.data_ptr(), tensor.nbytes, mapping)
        assert _resident_kib(mapping[0]) < before + 2048
    finally:
        streaming.spare_mapping(mapping[0], spared=False)


def _file_tensors(tmp_path, torch):
    """A checkpoint whose tensor "b" (2 MiB + 6 bytes) shares its first and last pages with its neighbours, read
    through its map: (handle, {name: tensor}, the map's (start, end))."""
    from safetensors.torch import save_file

    from hfquant.checkpoint.files import open_safetensors, read_tensor

    path = tmp_path / "w.safetensors"
    tensors = {"a": torch.ones(1001, dtype=torch.uint8), "b": torch.full((2 * MIB + 6,), 2, dtype=torch.uint8)}
    tensors["c"] = torch.full((999,), 3, dtype=torch.uint8)
    save_file(tensors, str(path))
    with open(path, "rb+") as written:
        os.fsync(written.fileno())  # clean pages, as a checkpoint's are: the kernel drops no dirty page from its cache
    handle = open_safetensors(path)
    read = {name: read_tensor(handle, path, name) for name in tensors}
    mapping = next(((s, e) for s, e, p in streaming.mapped_checkpoint_ranges() if p == str(path)), None)
    if mapping is None:
        pytest.skip("no checkpoint maps in /proc/self/maps here")
    if not streaming.populate_range(mapping[0], mapping[1] - mapping[0], mapping):
        pytest.skip("MADV_POPULATE_READ needs Linux >= 5.14")
    return handle, read, mapping


def test_consume_unmaps_only_the_whole_pages_inside_the_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    handle, read, mapping = _file_tensors(tmp_path, torch)
    b = read["b"]
    page = 4096
    inside = ((b.data_ptr() + b.nbytes) // page - -(-b.data_ptr() // page)) * page
    before = _resident_kib(mapping[0])
    releaser = PageReleaser(MIB)
    assert releaser.consume(b.data_ptr(), b.nbytes) == inside == releaser.consumed_bytes
    assert before - _resident_kib(mapping[0]) == inside // 1024  # the pages shared with "a" and "c" stay mapped
    assert torch.all(b == 2) and torch.all(read["a"] == 1) and torch.all(read["c"] == 3)  # read back from the file
    del handle


def test_consume_leaves_spared_maps_and_memory_outside_checkpoint_maps(tmp_path):
    torch = pytest.importorskip("torch")
    handle, read, mapping = _file_tensors(tmp_path, torch)
    releaser = PageReleaser(MIB)
    anonymous = torch.full((4 * MIB,), 7, dtype=torch.uint8)  # MADV_DONTNEED would zero it
    assert releaser.consume(anonymous.data_ptr(), anonymous.nbytes) == 0 and torch.all(anonymous == 7)
    streaming.spare_mapping(mapping[0])
    try:
        before = _resident_kib(mapping[0])
        assert releaser.consume(read["b"].data_ptr(), read["b"].nbytes) == 0
        assert _resident_kib(mapping[0]) == before
    finally:
        streaming.spare_mapping(mapping[0], spared=False)
    del handle


def _cached_pages(path, offset: int, nbytes: int) -> int:
    """Pages of the file's bytes [offset, offset + nbytes) in the page cache (`mincore` on a fresh map of them)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    page = mmap.PAGESIZE
    start, end = offset // page * page, -(-(offset + nbytes) // page) * page
    vector = (ctypes.c_ubyte * ((end - start) // page))()
    with open(path, "rb") as file:
        address = libc.mmap(None, end - start, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), start)
    try:
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(end - start), vector) == 0
    finally:
        libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(end - start))
    return sum(byte & 1 for byte in vector)


def _file_system(path) -> str:
    """The type of the file system holding `path` (/proc/mounts' longest mount point above it)."""
    path, best = str(os.path.realpath(path)), ("", "")
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            point, kind = line.split()[1:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


@pytest.mark.parametrize("drop_cached", [True, False])
def test_consume_drops_the_tensors_bytes_from_the_page_cache_unless_asked_to_keep_them(tmp_path, drop_cached):
    torch = pytest.importorskip("torch")
    handle, read, mapping = _file_tensors(tmp_path, torch)
    b = read["b"]
    offset = b.data_ptr() - mapping[0]  # safetensors maps the whole file from its start
    path = tmp_path / "w.safetensors"
    pages = -(-b.nbytes // 4096)
    assert _cached_pages(path, offset, b.nbytes) >= pages  # populated: read in
    if drop_cached and _file_system(path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory file system keeps its pages")
    assert PageReleaser(MIB, drop_cached=drop_cached).consume(b.data_ptr(), b.nbytes) > 0
    left = _cached_pages(path, offset, b.nbytes)
    if drop_cached:
        assert left <= 2  # at most the pages shared with "a" and "c", which stay mapped
    else:
        assert left >= pages
    assert torch.all(b == 2)  # read back from the file
    del handle
