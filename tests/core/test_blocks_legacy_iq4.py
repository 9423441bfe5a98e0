"""Tests of hfquant.core.blocks.legacy (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and hfquant.core.blocks.iq4 (IQ4_NL, IQ4_XS).

gguf-py (`gguf.quants`) is the reference for the bytes: its dequantizers for all seven types, and its quantizers
for the five legacy types, which implement llama.cpp's data-free reference rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfquant.core import blocks
from hfquant.core.blocks import iq4, legacy

gguf_quants = pytest.importorskip("gguf.quants")

LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
IQ4 = ["iq4_nl", "iq4_xs"]
MODULE = {**dict.fromkeys(LEGACY, legacy), **dict.fromkeys(IQ4, iq4)}
# Bytes of float16 fields at the start of a block: d (and m for the affine types).
F16_FIELDS = {"q4_0": 1, "q4_1": 2, "q5_0": 1, "q5_1": 2, "q8_0": 1, "iq4_nl": 1, "iq4_xs": 1}
# Relative MSE of llama.cpp's data-free recipe on N(0, 1) rows of 768 (shared/notes/llamacpp-yardstick.md for Q8_0,
# Q4_0, IQ4_NL, IQ4_XS; the reference_* functions for the others): the default quantizer must stay below it, and
# below MARGIN x the reference's error on the same rows (measured ratios 0.80-0.93).
LLAMA_CPP_REL_MSE = {
    "q8_0": 3.0e-5,
    "q4_0": 7.4e-3,
    "q4_1": 6.1e-3,
    "q5_0": 1.8e-3,
    "q5_1": 1.43e-3,
    "iq4_nl": 5.8e-3,
    "iq4_xs": 5.9e-3,
}
MARGIN = 0.95


def _random_blocks(name: str, rows: int, nblocks: int, seed: int) -> torch.Tensor:
    """Random bytes of `nblocks` blocks per row with finite float16 scales (and minimums)."""
    fmt = blocks.layout(name)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, nblocks, fmt.type_size), dtype=torch.uint8, generator=gen)
    fields = torch.randn(rows, nblocks, F16_FIELDS[name], generator=gen) * 0.05
    data[..., : 2 * F16_FIELDS[name]] = fields.to(torch.float16).view(torch.uint8).reshape(rows, nblocks, -1)
    return data.reshape(rows, -1)


def _weight(rows: int, k: int, seed: int) -> torch.Tensor:
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = torch.linspace(-1, 1, 32)  # ties at the ends: +1 and -1 have the same magnitude
    return w


def _gguf_type(name: str):
    return gguf_quants.GGMLQuantizationType[name.upper()]


@pytest.mark.parametrize("name", LEGACY + IQ4)
def test_dequantize_is_bit_exact_with_gguf_py(name):
    nblocks = 3 if blocks.layout(name).block_size == 256 else 7
    data = _random_blocks(name, 5, nblocks, seed=len(name))
    ours = blocks.dequantize(name, data)
    expected = gguf_quants.dequantize(data.numpy(), _gguf_type(name))
    assert ours.dtype == torch.float32 and ours.shape == expected.shape
    assert np.array_equal(ours.numpy().view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("name", LEGACY)
def test_reference_quantizer_writes_gguf_py_bytes(name):
    w = _weight(6, 256, seed=3)
    expected = gguf_quants.quantize(w.numpy(), _gguf_type(name))
    ours = getattr(legacy, f"reference_{name}")(w)
    assert ours.dtype == torch.uint8
    assert np.array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("name", LEGACY + IQ4)
def test_search_beats_llama_cpp_recipe_on_gaussian_rows(name):
    w = _weight(16, 768, seed=7)
    data = blocks.quantize(name, w, torch.ones(768))  # the search alone, on the plain squared error
    fmt = blocks.layout(name)
    assert data.dtype == torch.uint8 and data.shape == (16, fmt.row_bytes(768))
    err = ((blocks.dequantize(name, data) - w) ** 2).sum() / (w**2).sum()
    reference = getattr(MODULE[name], f"reference_{name}")(w)
    ref_err = ((blocks.dequantize(name, reference) - w) ** 2).sum() / (w**2).sum()
    assert err < MARGIN * ref_err
    assert err < LLAMA_CPP_REL_MSE[name]


@pytest.mark.parametrize("name", LEGACY)
def test_searched_legacy_block_never_worse_than_reference_block(name):
    w = _weight(8, 512, seed=11) * torch.rand(8, 512, generator=torch.Generator().manual_seed(1)) ** 3
    ours = blocks.dequantize(name, blocks.quantize(name, w, torch.ones(512)))
    reference = blocks.dequantize(name, getattr(legacy, f"reference_{name}")(w))
    per_block = ((ours - w) ** 2).reshape(-1, 32).sum(-1)
    ref_per_block = ((reference - w) ** 2).reshape(-1, 32).sum(-1)
    assert bool((per_block <= ref_per_block * (1 + 1e-5) + 1e-12).all())


@pytest.mark.parametrize("name", LEGACY + IQ4)
def test_zero_rows_stay_zero(name):
    w = torch.zeros(2, 256)
    assert torch.equal(blocks.dequantize(name, blocks.quantize(name, w)), w)


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "iq4_nl", "iq4_xs"])
def test_importance_lowers_the_error_where_it_is_large(name):
    w = _weight(8, 512, seed=5)
    importance = torch.ones(512)
    importance[::4] = 100.0
    plain = blocks.dequantize(name, blocks.quantize(name, w, torch.ones(512)))
    weighted = blocks.dequantize(name, blocks.quantize(name, w, importance))
    assert ((weighted - w)[:, ::4] ** 2).sum() < 0.8 * ((plain - w)[:, ::4] ** 2).sum()
    per_row = blocks.quantize(name, w, importance.expand(8, 512).clone())
    assert torch.equal(per_row, blocks.quantize(name, w, importance))


def test_importance_of_the_wrong_shape_or_sign_is_refused():
    w = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"\(64,\) or \(2, 64\)"):
        legacy.quantize_q4_0(w, torch.ones(32))
    with pytest.raises(ValueError, match=">= 0"):
        iq4.quantize_iq4_nl(w, -torch.ones(64))
    with pytest.raises(ValueError, match="finite"):
        legacy.quantize_q4_0(w, torch.full((64,), float("nan")))


def test_iq4_xs_block_scale_packing_docstring_example():
    # ls = 45 = 0b101101 for block 1: high nibble of scales_l[0] = 0xD, bits 2-3 of scales_h = 0b10.
    levels = torch.zeros(1, 1, 8, dtype=torch.int32) - 32
    levels[0, 0, 1] = 45 - 32
    data = iq4._encode_xs(torch.ones(1, 1), levels, torch.zeros(1, 1, 8, 32, dtype=torch.int64))
    assert data[0, 4] >> 4 == 0xD
    assert (int(data[0, 2]) | int(data[0, 3]) << 8) >> 2 & 3 == 0b10
    assert iq4._block_scales(data.reshape(1, 1, 136))[0, 0, 1] == 45


def test_nibble_and_high_bit_order_docstring_example():
    codes = torch.zeros(1, 32, dtype=torch.uint8)
    codes[0, 0], codes[0, 1], codes[0, 16], codes[0, 17] = 3, 10, 5, 0x13
    assert legacy.pack_nibbles(codes & 0x0F)[0, :2].tolist() == [0x53, 0x3A]
    assert legacy.pack_high_bits(codes)[0].tolist() == [0, 0, 0b10, 0]
    assert torch.equal(legacy.unpack_high_bits(legacy.pack_high_bits(codes)), codes & 0x10)


@pytest.mark.parametrize("name", ["q4_0", "iq4_xs", "q4_k", "q6_k", "hq3_0"])
def test_dequantize_traces_in_a_fullgraph_compile(name):
    """A block-format embedding (what a GGUF import keeps) decodes its rows inside a compiled decode step: the codec
    lookup must not call anything dynamo refuses (it imported the family module by name, and every compiled GGUF
    decode failed)."""
    torch._dynamo.reset()
    data = blocks.quantize(name, torch.randn((4, 256), generator=torch.Generator().manual_seed(3)))
    compiled = torch.compile(lambda d: blocks.dequantize(name, d), fullgraph=True, backend="eager")
    assert torch.equal(compiled(data), blocks.dequantize(name, data))
