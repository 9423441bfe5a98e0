"""HQ3_R, hfquant's own 3-bit rows of 16-weight sub-blocks with 6-bit log scales under a float16 per row
(hfquant.core.blocks.hq3r): the byte layout of its docstring, the row header in the layout table, the search's
choice among the codable scales, and the error against the float weights."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.core.blocks import hq3, hq3r, importance

GRID = torch.tensor(hq3.NL_VALUES, dtype=torch.float32)


def test_layout_counts_the_row_header():
    fmt = blocks.layout("hq3_r")
    assert (fmt.block_size, fmt.type_size, fmt.row_header, fmt.gguf) == (64, 27, 2, False)
    assert fmt.row_bytes(576) == 2 + 9 * 27
    assert fmt.in_features_of(fmt.row_bytes(576)) == 576
    assert fmt.row_bits_per_weight(576) == pytest.approx(3.375 + 16 / 576)
    with pytest.raises(ValueError, match="multiple of 64"):
        fmt.row_bytes(96)
    with pytest.raises(ValueError, match="2 header byte"):
        fmt.in_features_of(30)
    with pytest.raises(ValueError, match="row header"):
        blocks.dequantize("hq3_r", torch.zeros(1, 27, dtype=torch.uint8))


def test_bytes_decode_as_the_docstring_states():
    """One row of 64 weights built field by field: D, four 6-bit fields (e | s << 5), then two HQ3_0 code groups."""
    top = torch.tensor([0.5])
    fields = torch.tensor([[[0, 8, 32 + 3, 31]]])  # D, D/2, -D 2^(-3/8), D 2^(-31/8)
    codes = torch.arange(64).remainder(8).reshape(1, 1, 2, 32)
    data = hq3r.encode(top, fields, codes)
    assert data.shape == (1, 29)
    assert data[0, :2].clone().view(torch.float16).item() == 0.5
    packed = 0 | (8 << 6) | (35 << 12) | (31 << 18)
    assert data[0, 2:5].tolist() == [packed & 255, (packed >> 8) & 255, packed >> 16]
    assert torch.equal(data[0, 5:17], hq3.pack_codes(codes[0, 0, 0]))
    scale = torch.tensor([0.5, 0.25, -0.5 * 2 ** (-3 / 8), 0.5 * 2 ** (-31 / 8)])
    expected = (scale.repeat_interleave(16) * GRID[codes.reshape(-1)]).reshape(1, 64)
    torch.testing.assert_close(blocks.dequantize("hq3_r", data), expected, rtol=1e-6, atol=0)


def _codable_errors(x: torch.Tensor, w: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """(n, 16) sub-blocks, (n,) D -> (n, 64) weighted squared error of every codable scale with its nearest codes."""
    scales = torch.cat([top.unsqueeze(-1) * hq3r.LEVELS, -top.unsqueeze(-1) * hq3r.LEVELS], -1).double()
    u = x.double().unsqueeze(1) / torch.where(scales == 0, 1.0, scales).unsqueeze(-1)
    nearest = GRID.double()[(u.unsqueeze(-1) - GRID.double()).abs().argmin(-1)]
    return (w.double().unsqueeze(1) * (x.double().unsqueeze(1) - scales.unsqueeze(-1) * nearest) ** 2).sum(-1)


@pytest.mark.parametrize("rule", ["default", "uniform"])
def test_sub_blocks_take_the_best_codable_scale_but_rarely_miss_it(rule):
    """Given the row's D, the search tries 12 of the 64 scales a field can code (both signs, 6 levels around its
    searched scale): the exhaustive best (float64 reference) is at most rarely better, and then barely."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(24, 384, generator=generator) * torch.exp(torch.randn(24, 384, generator=generator))
    weights = importance.default_importance("hq3_r", weight) if rule == "default" else torch.ones_like(weight)
    data = blocks.quantize("hq3_r", weight, weights)
    top = data[:, :2].flatten().clone().view(torch.float16).float().reshape(-1)
    restored = blocks.dequantize("hq3_r", data)
    x, w = weight.reshape(-1, 16), weights.reshape(-1, 16)
    got = (w.double() * (x.double() - restored.reshape(-1, 16).double()) ** 2).sum(-1)
    best = _codable_errors(x, w, top.repeat_interleave(384 // 16)).amin(-1)
    assert (got >= best * (1 - 1e-5)).all()  # nothing codable beats the exhaustive minimum: the reference is right
    missed = got > best * (1 + 1e-5) + 1e-12
    assert missed.float().mean() < 0.05, missed.float().mean()  # measured 0.2-3% (log-normal rows, both rules)
    assert got.sum() <= best.sum() * 1.005  # measured at most 0.18% more in all


def test_row_scale_is_the_largest_sub_block_scale_in_float16():
    """D bounds every sub-block's scale and one sub-block uses it or a scale within 1/8 octave of D (e = 0 or 1)."""
    weight = torch.randn(5, 256, generator=torch.Generator().manual_seed(9))
    data = blocks.quantize("hq3_r", weight)
    top = data[:, :2].flatten().clone().view(torch.float16).float()
    body = data[:, 2:].reshape(5, -1, 27)[..., :3].to(torch.int64)
    packed = body[..., 0] | (body[..., 1] << 8) | (body[..., 2] << 16)
    e = torch.stack([(packed >> (6 * i)) & 31 for i in range(4)], -1).reshape(5, -1)
    assert (top > 0).all()
    assert (e.amin(-1) <= 2).all()


def test_error_against_the_float_weights_is_bounded_and_below_hq3_nl():
    """Every weight within its sub-block's grid range lies within half the widest grid gap (18 of 127) of its value
    times the scale; on Gaussian rows HQ3_R's error is below HQ3_NL's, at fewer bytes (3.4 against 3.5 bits)."""
    weight = torch.randn(32, 576, generator=torch.Generator().manual_seed(11)) * 0.02
    ones = torch.ones(576)
    data = blocks.quantize("hq3_r", weight, ones)
    restored = blocks.dequantize("hq3_r", data)
    body = data[:, 2:].reshape(32, -1, 27)[..., :3].to(torch.int64)
    packed = body[..., 0] | (body[..., 1] << 8) | (body[..., 2] << 16)
    fields = torch.stack([(packed >> (6 * i)) & 63 for i in range(4)], -1).reshape(32, -1)
    top = data[:, :2].flatten().clone().view(torch.float16).float().unsqueeze(-1)
    scale = (top * hq3r.LEVELS[fields & 31]).repeat_interleave(16, dim=1)  # (32, 576) magnitudes
    inside = weight.abs() <= 94 * scale
    assert ((weight - restored).abs()[inside] <= 18.0001 * scale[inside]).all()
    error = ((weight - restored) ** 2).sum() / (weight**2).sum()
    nl = ((weight - blocks.dequantize("hq3_nl", blocks.quantize("hq3_nl", weight, ones))) ** 2).sum() / (
        weight**2
    ).sum()
    assert error < 0.9 * nl, (error, nl)
    assert data.numel() * 8 / weight.numel() < blocks.layout("hq3_nl").bits_per_weight


@pytest.mark.parametrize("edge", ["zeros", "one spike", "huge", "tiny"])
def test_edge_rows_round_trip_finitely(edge):
    weight = {
        "zeros": torch.zeros(2, 64),
        "one spike": torch.zeros(2, 64).index_fill_(1, torch.tensor([17]), 2.0),
        "huge": torch.randn(2, 64, generator=torch.Generator().manual_seed(1)) * 3e4,
        "tiny": torch.randn(2, 64, generator=torch.Generator().manual_seed(1)) * 1e-6,
    }[edge]
    restored = blocks.dequantize("hq3_r", blocks.quantize("hq3_r", weight))
    assert torch.isfinite(restored).all()
    if edge == "tiny":  # scales of 1e-8 are below float16's range (as every float16-scaled block format's)
        assert (restored.abs() <= weight.abs().max()).all()
        return
    assert ((restored - weight).norm() <= 0.25 * weight.norm()).item()
    if edge == "zeros":
        assert torch.equal(restored, weight)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="multiple of 64"):
        blocks.quantize("hq3_r", torch.zeros(2, 96))
    with pytest.raises(ValueError, match="importance"):
        hq3r.quantize_hq3_r(torch.zeros(2, 64), -torch.ones(64))
