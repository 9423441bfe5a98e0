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


# Relative MSE of llama.cpp's own data-free quantizer on N(0, 1) rows (docs/performance.md, measured with
# benchmarks/ggml_reference.py): hfquant's quantizers must stay under it with 5% to spare for the sample.
LLAMA_REL_MSE = {"q2_k": 8.9e-2, "q3_k": 2.3e-2, "q4_k": 5.1e-3, "q5_k": 1.3e-3, "q6_k": 3.1e-4}


def _rel_mse(approx: torch.Tensor, exact: torch.Tensor, importance: torch.Tensor | None = None) -> float:
    weight = torch.ones_like(exact) if importance is None else importance.expand_as(exact)
    return ((weight * (approx - exact) ** 2).sum() / (weight * exact**2).sum()).item()


UNIFORM = torch.ones(768)
"""Every weight alike: the search's own error, apart from the data-free default weighting (`blocks.importance`)."""


@pytest.fixture(scope="module")
def normal_rows() -> torch.Tensor:
    return _normal(24, 768, seed=5)


@pytest.mark.parametrize("name", K_TYPES)
def test_quantize_beats_llama_cpp_recipe_on_normal_rows(name, normal_rows):
    data = blocks.quantize(name, normal_rows, UNIFORM)  # the search alone, on the plain squared error
    fmt = blocks.layout(name)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (24, 3 * fmt.type_size)
    ours = _rel_mse(blocks.dequantize(name, data), normal_rows)
    llama = _rel_mse(blocks.dequantize(name, kquants.llama_reference(name, normal_rows)), normal_rows)
    assert ours < llama, (ours, llama)
    assert ours < LLAMA_REL_MSE[name] * 1.05
    # the recipe re-expressed is llama.cpp's: within 5% of its measured error
    assert abs(llama / LLAMA_REL_MSE[name] - 1) < 0.05


@pytest.mark.parametrize("name", K_TYPES)
def test_importance_lowers_the_error_where_it_is_high(name, normal_rows):
    importance = torch.ones(768)
    importance[::8] = 20.0
    plain = blocks.dequantize(name, blocks.quantize(name, normal_rows, UNIFORM))
    weighted = blocks.dequantize(name, blocks.quantize(name, normal_rows, importance))
    assert _rel_mse(weighted, normal_rows, importance) < _rel_mse(plain, normal_rows, importance)


@pytest.mark.parametrize("name", K_TYPES)
def test_requantizing_dequantized_weights_moves_them_far_less_than_quantizing(name):
    # Not byte-stable: a dequantized super-block has several byte spellings (d * sc can trade factors) and the search
    # is not guaranteed to land on the grid it came from; the values move by a small fraction of the first error.
    weight = _normal(8, 512, seed=9)
    first = blocks.dequantize(name, blocks.quantize(name, weight))
    second = blocks.dequantize(name, blocks.quantize(name, first))
    assert _rel_mse(second, first) < 0.05 * _rel_mse(first, weight)


@pytest.mark.parametrize("name", K_TYPES)
def test_zero_constant_and_wide_rows(name):
    weight = torch.zeros(4, 512)
    weight[1] = 0.25
    weight[2] = -3.0
    weight[3, 256:] = torch.linspace(-1000.0, 1000.0, 256)
    out = blocks.dequantize(name, blocks.quantize(name, weight))
    assert torch.equal(out[0], weight[0])
    assert torch.isfinite(out).all()
    for row in (1, 2, 3):
        assert _rel_mse(out[row], weight[row]) < LLAMA_REL_MSE[name] * 2


@pytest.mark.parametrize("name", K_TYPES)
def test_quantize_refuses_bad_inputs(name):
    with pytest.raises(ValueError, match="multiple of 256"):
        blocks.quantize(name, torch.ones(2, 384))
    with pytest.raises(ValueError, match="NaN or inf"):
        blocks.quantize(name, torch.full((1, 256), float("nan")))
    with pytest.raises(ValueError, match="importance must be"):
        blocks.quantize(name, torch.ones(2, 256), torch.ones(128))
    with pytest.raises(ValueError, match="importance must be"):
        blocks.quantize(name, torch.ones(2, 256), -torch.ones(256))
    with pytest.raises(ValueError, match="importance must be"):
        blocks.quantize(name, torch.ones(2, 256), torch.full((256,), float("inf")))


def _ggml():
    from benchmarks import ggml_reference

    return ggml_reference.load()


needs_ggml = pytest.mark.skipif(
    _ggml() is None,
    reason="llama.cpp's libggml-base.so is not installed (CI has no llama-cpp-python wheel; "
    "`python scripts/engines.py --engines llama.cpp` builds and installs it)",
)


@pytest.mark.slow
@needs_ggml
@pytest.mark.parametrize("name", K_TYPES)
def test_llama_cpp_bytes_dequantize_to_its_to_float_and_ours_are_closer(name, normal_rows):
    ggml = _ggml()
    theirs = ggml.quantize(name, normal_rows)
    assert theirs.shape[1] == ggml.row_size(name, 768) == blocks.layout(name).row_bytes(768)
    assert torch.equal(blocks.dequantize(name, theirs), ggml.dequantize(name, theirs))
    ours = blocks.quantize(name, normal_rows, UNIFORM)
    assert torch.equal(blocks.dequantize(name, ours), ggml.dequantize(name, ours))
    llama = _rel_mse(ggml.dequantize(name, theirs), normal_rows)
    assert _rel_mse(blocks.dequantize(name, ours), normal_rows) < llama
    recipe = kquants.llama_reference(name, normal_rows)
    type_size = blocks.layout(name).type_size
    same = (recipe.reshape(-1, type_size) == theirs.reshape(-1, type_size)).all(dim=1).float().mean().item()
    assert same > 0.8  # float32 summation order tips some near-ties of the scale searches
    assert abs(_rel_mse(blocks.dequantize(name, recipe), normal_rows) / llama - 1) < 0.01
