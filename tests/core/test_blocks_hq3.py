"""HQ3_0 and HQ3_NL, hfquant's own 3-bit formats of 32-weight blocks (hfquant.core.blocks.hq3): the byte layout
docs/format.md states, the dequantizers' formulas, and a searched scale never worse than round-to-nearest."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.core.blocks import hq3, importance


@pytest.mark.parametrize("name", ["hq3_0", "hq3_nl"])
def test_layout_is_3_5_bits_per_weight_and_not_a_gguf_type(name):
    fmt = blocks.layout(name)
    assert (fmt.block_size, fmt.type_size, fmt.bits, fmt.gguf) == (32, 14, 3, False)
    assert fmt.bits_per_weight == 3.5
    assert all(other.gguf for name, other in blocks.LAYOUTS.items() if not name.startswith("hq3"))


def test_codes_pack_as_documented():
    codes = torch.zeros(32, dtype=torch.int64)
    codes[0], codes[8], codes[31] = 5, 3, 7  # 0b101, 0b011, 0b111
    packed = hq3.pack_codes(codes)
    # qs[0]: code 0's low bits (01) in bits 0-1, code 8's (11) in bits 2-3; qs[7]: code 31's (11) in bits 6-7
    assert packed[0] == 0b1101 and packed[7] == 0b11 << 6
    # qh: bit 2 of code 0 is bit 0, of code 31 bit 31 (byte 3, bit 7); code 8 has none
    assert packed[8:].tolist() == [0b1, 0, 0, 0b1000_0000]
    generator = torch.Generator().manual_seed(0)
    many = torch.randint(0, 8, (17, 32), generator=generator)
    assert torch.equal(hq3.unpack_codes(hq3.pack_codes(many)), many.to(torch.int32))


def test_dequantize_is_d_times_code_minus_4():
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 8, (3, 2, 32), generator=generator)
    d = torch.tensor([[0.5, -0.25], [2.0, 0.0], [1e-3, 7.0]], dtype=torch.float16)
    data = torch.cat([d.view(torch.uint8).reshape(3, 2, 2), hq3.pack_codes(codes)], dim=-1).reshape(3, -1)
    expected = (d.float().unsqueeze(-1) * (codes - 4).float()).reshape(3, 64)
    assert torch.equal(blocks.dequantize("hq3_0", data), expected)


def _block_errors(weight, data, importance):
    restored = blocks.dequantize("hq3_0", data)
    return (importance * (weight - restored) ** 2).reshape(weight.shape[0], -1, 32).sum(-1)


@pytest.mark.parametrize("rule", ["uniform", "default"])
def test_searched_scale_is_never_worse_than_round_to_nearest_per_block(rule):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 256, generator=generator) * torch.rand(64, 1, generator=generator)
    weight[0, :32] = 0.0  # an all-zero block stays exactly zero
    # the search minimizes the error weighted by the importance it is given: the type's default (rms_abs_square) or 1
    weights = importance.default_importance("hq3_0", weight) if rule == "default" else torch.ones_like(weight)
    searched = _block_errors(weight, blocks.quantize("hq3_0", weight, weights), weights)
    reference = _block_errors(weight, hq3.reference_hq3_0(weight), weights)
    assert bool((searched <= reference * (1 + 1e-6) + 1e-12).all())
    assert searched.sum() < 0.9 * reference.sum()
    assert searched[0, 0] == 0


def test_importance_moves_the_error_to_unimportant_weights():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(128, 64, generator=generator)
    importance = torch.ones(64)
    importance[::4] = 100.0
    plain = blocks.dequantize("hq3_0", blocks.quantize("hq3_0", weight, torch.ones(64)))
    weighted = blocks.dequantize("hq3_0", blocks.quantize("hq3_0", weight, importance))
    important = importance > 1
    error = lambda restored, mask: float(((weight - restored)[:, mask] ** 2).mean())  # noqa: E731
    assert error(weighted, important) < error(plain, important)
    assert error(weighted, ~important) > error(plain, ~important)


def test_gaussian_weights_come_back_within_a_fifth_of_their_rms():
    """3-bit codes on 8 levels with a searched scale per 32 weights: the relative RMS error of normal weights is about
    0.17 (a Lloyd-Max quantizer of 8 levels for a whole normal distribution: 0.19); the bound is 0.2."""
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(5))
    restored = blocks.dequantize("hq3_0", blocks.quantize("hq3_0", weight))
    assert float((weight - restored).pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()) < 0.2


def test_hq3_nl_dequantizes_to_d_times_its_grid_value():
    generator = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 8, (2, 3, 32), generator=generator)
    d = torch.tensor([[0.5, -0.25, 3e-3], [2.0, 0.0, -7.0]], dtype=torch.float16)
    data = torch.cat([d.view(torch.uint8).reshape(2, 3, 2), hq3.pack_codes(codes)], dim=-1).reshape(2, -1)
    grid = torch.tensor(hq3.NL_VALUES, dtype=torch.float32)
    assert torch.equal(blocks.dequantize("hq3_nl", data), (d.float().unsqueeze(-1) * grid[codes]).reshape(2, 96))
    assert hq3.NL_VALUES[4] == 0 and list(hq3.NL_VALUES) == sorted(hq3.NL_VALUES)  # an exact zero, sorted codes


@pytest.mark.parametrize("rule", ["uniform", "default"])
def test_hq3_nl_search_is_never_worse_than_its_seed_per_block(rule):
    """The seed maps each block's largest-magnitude weight to the grid's -127 (its nearest codes for the float16 d)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(32, 256, generator=generator) * torch.rand(32, 1, generator=generator)
    weight[1, 32:64] = 0.0  # an all-zero block stays exactly zero
    weights = importance.default_importance("hq3_nl", weight) if rule == "default" else torch.ones_like(weight)
    restored = blocks.dequantize("hq3_nl", blocks.quantize("hq3_nl", weight, weights))
    x = weight.reshape(32, -1, 32)
    peak = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
    d = (peak / hq3.NL_VALUES[0]).half().float()
    grid = torch.tensor(hq3.NL_VALUES, dtype=torch.float32)
    u = torch.where(d != 0, x / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(x))
    seed = (d * grid[torch.bucketize(u, (grid[1:] + grid[:-1]) / 2, right=True)]).reshape(weight.shape)
    errors = lambda r: (weights * (weight - r) ** 2).reshape(32, -1, 32).sum(-1)  # noqa: E731
    assert bool((errors(restored) <= errors(seed) * (1 + 1e-6) + 1e-12).all())
    assert errors(restored).sum() < 0.95 * errors(seed).sum()
    assert bool((restored[1, 32:64] == 0).all())


def test_hq3_nl_is_closer_than_hq3_0_on_gaussian_weights():
    """The grid is denser near zero than HQ3_0's (steps of 29-39 against 127 / 4 = 31.75 in the same units at the
    ends), which fits bell-shaped blocks: less weight error at the same bytes (about 7% on N(0, 1) rows)."""
    weight = torch.randn(128, 512, generator=torch.Generator().manual_seed(8))
    error = {
        name: float((weight - blocks.dequantize(name, blocks.quantize(name, weight))).pow(2).sum())
        for name in ("hq3_0", "hq3_nl")
    }
    assert error["hq3_nl"] < 0.97 * error["hq3_0"]
