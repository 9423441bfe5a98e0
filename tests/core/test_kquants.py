"""Tests of hfquant.core.blocks.kquants: llama.cpp's Q2_K..Q6_K super-blocks, byte for byte as gguf-py reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hfquant.core import blocks
from hfquant.core.blocks import kquants

gguf = pytest.importorskip("gguf")

K_TYPES = ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"]
# Byte offsets of the float16 fields (d, dmin) of each block struct in ggml-common.h.
HALF_FIELDS = {"q2_k": [80, 82], "q3_k": [108], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def _random_blocks(name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes of whole blocks whose float16 fields are finite (random bytes would hold NaN and inf)."""
    fmt = blocks.layout(name)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, blocks_per_row * fmt.type_size), dtype=np.uint8)
    view = data.reshape(-1, fmt.type_size)
    for offset in HALF_FIELDS[name]:
        half = (rng.standard_normal(view.shape[0]) * 10.0 ** rng.integers(-4, 3, view.shape[0])).astype(np.float16)
        view[:, offset : offset + 2] = half.reshape(-1, 1).view(np.uint8)
    return data


def _normal(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", K_TYPES)
def test_layout_sizes_match_gguf(name):
    fmt = blocks.layout(name)
    block_size, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)]
    assert (fmt.block_size, fmt.type_size) == (block_size, type_size) == (kquants.QK_K, fmt.type_size)


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3)])
def test_dequantize_is_bit_exact_against_gguf_py(name, shape):
    data = _random_blocks(name, *shape, seed=shape[0] * 7 + shape[1])
    expected = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(blocks.layout(name).ggml_type))
    ours = blocks.dequantize(name, torch.from_numpy(data))
    assert ours.dtype == torch.float32 and tuple(ours.shape) == (shape[0], shape[1] * kquants.QK_K)
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), expected.reshape(ours.shape).view(np.uint32))


@pytest.mark.parametrize("name", K_TYPES)
def test_dequantize_of_no_rows_keeps_the_width(name):
    data = torch.zeros(0, 2 * blocks.layout(name).type_size, dtype=torch.uint8)
    assert tuple(blocks.dequantize(name, data).shape) == (0, 2 * kquants.QK_K)


@pytest.mark.parametrize("name", K_TYPES)
def test_fields_to_bytes_gives_back_every_byte(name):
    fmt = blocks.layout(name)
    data = torch.from_numpy(_random_blocks(name, 40, 1, seed=3)).reshape(-1, fmt.type_size)
    fields = getattr(kquants, f"_fields_{name}")(data)
    assert torch.equal(getattr(kquants, f"_bytes_{name}")(*fields), data)


def test_q4_k_scale_packing_worked_example():
    # Block 5's scale 0b101101 = 45: low nibble 13 in byte 9 bits 0-3, top bits 0b10 in byte 1 bits 6-7.
    sc = torch.tensor([[1, 2, 3, 4, 5, 45, 7, 8]])
    m = torch.zeros_like(sc)
    packed = kquants._pack_scales_k4(sc, m)
    assert packed[0, 9].item() == 13 and packed[0, 1].item() == (2 | (0b10 << 6))
    back_sc, back_m = kquants._unpack_scales_k4(packed)
    assert back_sc.tolist() == sc.tolist() and back_m.tolist() == m.tolist()
