"""Weights on transparent huge pages (hfquant.core.huge_pages.empty): the tensor is what `torch.empty` gives, its
memory 2 MiB aligned and advised, and unmapped with the tensor."""

from __future__ import annotations

import copy
import gc
import io
import sys
import threading
from pathlib import Path

import pytest
import torch

from hfquant.core import huge_pages
from hfquant.core.huge_pages import HUGE_PAGE

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are advised on Linux only")


def _thp_setting() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text[text.index("[") + 1 : text.index("]")]


def _anon_huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line in smaps_rollup")


def _mapped(address: int) -> bool:
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


@linux
def test_large_cpu_tensor_is_aligned_plain_and_unmapped_with_its_storage():
    tensor = huge_pages.empty((3, HUGE_PAGE // 2 + 7), dtype=torch.float32)
    assert tensor.shape == (3, HUGE_PAGE // 2 + 7) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor._base is None and tensor.storage_offset() == 0
    assert tensor.data_ptr() % HUGE_PAGE == 0
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32).view(tensor.shape))
    assert torch.equal(tensor[2, -3:], torch.arange(tensor.numel() - 3, tensor.numel(), dtype=torch.float32))
    address = tensor.data_ptr()
    rows = tensor.split([1, 2])  # views keep the map alive
    del tensor
    gc.collect()
    assert _mapped(address) and rows[1][1, -1].item() == rows[1].numel() * 3 // 2 - 1
    del rows
    gc.collect()
    assert not _mapped(address)


@linux
@pytest.mark.skipif(_thp_setting() == "never", reason="transparent huge pages are off")
def test_written_whole_pages_are_huge_pages():
    before = _anon_huge_kib()
    tensor = huge_pages.empty((4 * HUGE_PAGE + 100,), dtype=torch.uint8)
    tensor.fill_(1)
    # the kernel may fall back to 4 KiB pages where no huge page is free: most of the four must be huge here
    assert _anon_huge_kib() - before >= 3 * HUGE_PAGE // 1024
    del tensor


def test_small_or_non_cpu_tensors_are_torch_empty():
    small = huge_pages.empty((HUGE_PAGE // 4 - 1,), dtype=torch.int32)
    assert small.shape == (HUGE_PAGE // 4 - 1,) and small.dtype == torch.int32
    meta = huge_pages.empty((4 * HUGE_PAGE,), dtype=torch.uint8, device="meta")
    assert meta.device.type == "meta" and meta.shape == (4 * HUGE_PAGE,)


@linux
def test_copies_and_saves_like_any_tensor():
    tensor = huge_pages.empty((HUGE_PAGE + 3,), dtype=torch.uint8)
    tensor.copy_(torch.randint(0, 256, tensor.shape, dtype=torch.uint8))
    buffer = io.BytesIO()
    torch.save({"w": tensor}, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["w"], tensor)
    assert torch.equal(copy.deepcopy(tensor), tensor)


def _wait_ready(spares, nbytes: int) -> bool:
    """Whether a spare of `nbytes` is ready within 10 s (the thread runs at nice 19)."""
    import time

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with spares._lock:
            if spares._ready.get(nbytes):
                return True
        time.sleep(0.01)
    return False


@linux
def test_a_size_asked_twice_gets_a_resident_spare_that_empty_hands_out():
    nbytes = HUGE_PAGE + 3 * 4096 + 5
    spares = huge_pages.Spares.start(4 * HUGE_PAGE)
    try:
        first = huge_pages.empty((nbytes,), dtype=torch.uint8)
        assert spares.taken == 0 and not spares._making  # asked once: no spare yet
        second = huge_pages.empty((nbytes,), dtype=torch.uint8)
        assert spares.taken == 0 and _wait_ready(spares, nbytes)
        (region, offset) = spares._ready[nbytes][0]
        third = huge_pages.empty((nbytes,), dtype=torch.uint8)
        assert spares.taken == 1 and third.data_ptr() % HUGE_PAGE == 0 and third.untyped_storage().nbytes() == nbytes
        assert torch.all(third == 0)  # written whole by the thread, before it was handed out
        third.fill_(9)
        assert torch.all(third == 9) and torch.all(torch.frombuffer(region, dtype=torch.uint8)[offset:][:nbytes] == 9)
        assert _wait_ready(spares, nbytes)  # taken: made again
        del first, second, third, region
    finally:
        spares.close()
    assert huge_pages._spares is None and spares._ready == {} and spares._held == 0


@linux
def test_spares_stay_within_their_budget_and_are_freed_when_closed():
    small, large = HUGE_PAGE, 3 * HUGE_PAGE
    spares = huge_pages.Spares.start(2 * HUGE_PAGE)
    try:
        held = [huge_pages.empty((n,), dtype=torch.uint8) for n in (large, large, small, small)]
        assert _wait_ready(spares, small)
        assert large not in spares._ready and large not in spares._making  # over the budget: never made
        address = ctypes_address(spares._ready[small][0])
    finally:
        spares.close()
    assert not _mapped(address)  # the spare left is unmapped
    after = huge_pages.empty((small,), dtype=torch.uint8)
    assert spares.taken == 0 and after.data_ptr() % HUGE_PAGE == 0
    del held


def ctypes_address(spare) -> int:
    import ctypes

    region, offset = spare
    anchor = ctypes.c_char.from_buffer(region)
    try:
        return ctypes.addressof(anchor) + offset
    finally:
        del anchor


@linux
def test_starting_spares_closes_the_ones_a_failed_load_left():
    left = huge_pages.Spares.start(4 * HUGE_PAGE)
    current = huge_pages.Spares.start(4 * HUGE_PAGE)
    try:
        assert left._closed and huge_pages._spares is current and not current._closed
    finally:
        current.close()
    assert huge_pages.Spares.start(HUGE_PAGE - 1) is None and huge_pages._spares is None


@linux
def test_a_size_named_first_is_made_at_once_outside_the_budget_and_handed_out_on_its_first_ask(monkeypatch):
    """`Spares.start(budget, first=...)`: the one-off sizes a load names up front (an lm_head's stored weight) are made
    before anything is asked, beyond the budget, and the first `empty` of that size waits for its map and takes it."""
    large, tiny = 3 * HUGE_PAGE + 4096, HUGE_PAGE - 1
    made = threading.Event()
    run = huge_pages.Spares._run

    def slow_run(self):  # the map is not ready when `empty` asks: `take` must wait for it
        made.wait(5)
        run(self)

    monkeypatch.setattr(huge_pages.Spares, "_run", slow_run)
    spares = huge_pages.Spares.start(HUGE_PAGE, first=(large, tiny))
    try:
        assert spares._making == {large} and spares._held == 0  # a size under a huge page is not mapped by `empty`
        threading.Timer(0.2, made.set).start()
        weight = huge_pages.empty((large,), dtype=torch.uint8)
        assert spares.taken == 1 and weight.data_ptr() % HUGE_PAGE == 0 and torch.all(weight == 0)
        assert spares._held == 0 and not spares._ready.get(large) and large not in spares._making  # not made again
        again = huge_pages.empty((large,), dtype=torch.uint8)
        assert spares.taken == 1  # a second ask of it is an ordinary one (over the budget here: no spare)
        del weight, again
    finally:
        spares.close()


@linux
def test_a_take_waiting_for_a_first_map_returns_when_the_spares_close(monkeypatch):
    monkeypatch.setattr(huge_pages.Spares, "_run", lambda self: None)  # never makes the map
    spares = huge_pages.Spares.start(HUGE_PAGE, first=(2 * HUGE_PAGE,))
    threading.Timer(0.2, spares.close).start()
    assert spares.take(2 * HUGE_PAGE) is None
