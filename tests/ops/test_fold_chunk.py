"""`native.fold_chunk` (csrc/fold_chunk_cpu.c): a weight chunk widened to float32, rows times the fold's row scale,
columns divided by its column scale, in one pass: torch's values bit for bit, and its NaN / Inf flag."""

from __future__ import annotations

import pytest
import torch

from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="needs hfquant's native library")


def _case(dtype: torch.dtype, rows: int = 37, k: int = 203):
    generator = torch.Generator().manual_seed(2)
    weight = (torch.randn(rows, k, generator=generator) * 0.03).to(dtype)
    row_scale = torch.rand(rows, generator=generator) * 3 + 0.1
    col_scale = (torch.rand(k, generator=generator) * 3 + 0.1).bfloat16().float()
    return weight, row_scale, col_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scales", ["none", "rows", "columns", "both"])
def test_gives_torchs_floats_bit_for_bit(dtype, scales):
    weight, row_scale, col_scale = _case(dtype)
    row_scale = row_scale if scales in ("rows", "both") else None
    col_scale = col_scale if scales in ("columns", "both") else None
    expected = weight.float().clone()
    if row_scale is not None:
        expected.mul_(row_scale[:, None])
    if col_scale is not None:
        expected.div_(col_scale)
    out = torch.full(weight.shape, float("nan"))
    assert native.fold_chunk(weight, row_scale, col_scale, out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "overflow"])
def test_flags_nan_inf_and_overflow(bad):
    weight, row_scale, col_scale = _case(torch.float32)
    if bad == "overflow":
        weight[5, 7] = 3e38
        row_scale[5] = 4.0
    else:
        weight[5, 7] = bad
    assert not native.fold_chunk(weight, row_scale, None, torch.empty(weight.shape))
    assert native.fold_chunk(weight[6:], row_scale[6:], None, torch.empty(weight[6:].shape))  # the rest is finite


def test_refuses_other_layouts_naming_them():
    weight, row_scale, col_scale = _case(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 out"):
        native.fold_chunk(weight, None, None, torch.empty(weight.shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        native.fold_chunk(weight.t(), None, None, torch.empty(weight.t().shape))
