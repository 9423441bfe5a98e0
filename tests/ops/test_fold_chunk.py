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


@pytest.mark.parametrize("name", ["iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("importance_shape", ["none", "columns", "rows"])
@pytest.mark.parametrize("threads", [1, 2])
def test_iq4_quantize_fold_gives_the_chunked_bytes(name, dtype, importance_shape, threads):
    """`native.iq4_quantize_fold` (each search thread folds its own groups of blocks) gives the bytes of `fold_chunk`
    then `iq4_quantize`, with groups of 16 (super-)blocks that cross rows (K = 768 for IQ4_XS: 3 super-blocks a row;
    37 rows: a last partial group) and both scales."""
    k = 768 if name == "iq4_xs" else 96
    weight, row_scale, col_scale = _case(dtype, rows=37, k=k)
    weight[3] *= 40  # rows of very different sizes, so that a mixed-up row or column scale changes the bytes
    generator = torch.Generator().manual_seed(5)
    shapes = {"none": None, "columns": (k,), "rows": (37, k)}
    importance = (
        None if shapes[importance_shape] is None else torch.rand(shapes[importance_shape], generator=generator)
    )
    chunk = torch.empty(weight.shape)
    assert native.fold_chunk(weight, row_scale, col_scale, chunk)
    search = native.IQ4_SEARCHES["fast"]
    expected = native.iq4_quantize(name, chunk, importance, search, finite=True)
    out = torch.zeros_like(expected)
    assert native.iq4_quantize_fold(name, weight, row_scale, col_scale, importance, search, out, threads=threads)
    assert torch.equal(out, expected)
    unscaled = native.iq4_quantize(name, weight.float(), importance, search)
    assert not torch.equal(unscaled, expected)  # the scales were applied
    assert native.iq4_quantize_fold(name, weight, None, None, importance, search, out, threads=threads)
    assert torch.equal(out, unscaled)


def test_iq4_quantize_fold_flags_non_finite_and_refuses_bad_inputs():
    weight, row_scale, col_scale = _case(torch.float32, rows=20, k=256)
    search = native.IQ4_SEARCHES["fast"]
    out = torch.empty(20, 136, dtype=torch.uint8)
    weight[19, 255] = float("inf")  # the last element: the last group's last lane
    assert not native.iq4_quantize_fold("iq4_xs", weight, row_scale, col_scale, None, search, out)
    weight[19, 255] = 3e38
    row_scale[19] = 4.0  # finite, overflowing once scaled
    assert not native.iq4_quantize_fold("iq4_xs", weight, row_scale, None, None, search, out)
    assert native.iq4_quantize_fold("iq4_xs", weight[:19], row_scale[:19], None, None, search, out[:19])
    with pytest.raises(ValueError, match="multiple of 256"):
        native.iq4_quantize_fold("iq4_xs", weight[:, :128], None, None, None, search, out)
    with pytest.raises(ValueError, match="contiguous"):
        native.iq4_quantize_fold("iq4_xs", torch.zeros(20, 512)[:, ::2], None, None, None, search, out)
    with pytest.raises(ValueError, match="importance"):
        native.iq4_quantize_fold("iq4_xs", weight[:19], None, None, -torch.ones(256), search, out[:19])
