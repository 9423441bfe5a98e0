"""Weights on transparent huge pages (hfquant.core.huge_pages.empty): the tensor is what `torch.empty` gives, its
memory 2 MiB aligned and advised, and unmapped with the tensor."""

from __future__ import annotations

import copy
import gc
import io
import sys
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
