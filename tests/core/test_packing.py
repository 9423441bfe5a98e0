"""Tests of hfquant.core.packing: the plain 4-bit file layout and the CPU int4 kernel layout."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import packing
from hfquant.core.packing import cpu_int4_layout, from_cpu_int4_layout, pack_int4, to_cpu_int4_layout, unpack_int4

_ATEN_PACK = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
needs_cpu_int4_op = pytest.mark.skipif(_ATEN_PACK is None, reason="this PyTorch build has no CPU int4 pack op")


def _codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_nibble_order_docstring_example():
    packed = pack_int4(torch.tensor([[3, 10, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0xA3, 0x0F]]
    assert unpack_int4(packed).tolist() == [[3, 10, 15, 0]]


@pytest.mark.parametrize("shape", [(1, 2), (3, 34), (17, 576), (5, 2)])
def test_pack_matches_bytewise_definition_and_unpack_inverts_it(shape):
    codes = _codes(*shape, seed=shape[1])
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], shape[1] // 2)
    rows = codes.tolist()
    expected = [[row[2 * j] | (row[2 * j + 1] << 4) for j in range(len(row) // 2)] for row in rows]
    assert packed.tolist() == expected
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("shape", [(1, 1), (3, 17), (17, 288)])
def test_unpack_then_pack_gives_back_every_byte(shape):
    packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    codes = unpack_int4(packed)
    assert codes.shape == (shape[0], shape[1] * 2)
    assert int(codes.max()) <= 15
    assert torch.equal(pack_int4(codes), packed)


def test_pack_works_on_leading_batch_dimensions_and_non_contiguous_input():
    codes = _codes(2 * 3, 10).reshape(2, 3, 10)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)
    wide = _codes(4, 20, seed=2)
    view = wide[:, 4:14]  # non-contiguous columns
    assert torch.equal(pack_int4(view), pack_int4(view.contiguous()))


def test_pack_accepts_a_contiguous_row_with_an_odd_stride():
    """(1, K) from `.t().contiguous()` of (K, 1) is contiguous with strides (1, 1): the int16 fast path must not
    view it as is (torch refuses an odd stride), and the result equals the bytewise definition."""
    codes = torch.randint(0, 16, (6, 1), dtype=torch.uint8).t().contiguous()
    assert codes.is_contiguous() and codes.stride() == (1, 1)
    assert torch.equal(pack_int4(codes), codes[:, 0::2] | (codes[:, 1::2] << 4))


def test_pack_rejects_odd_columns_and_wrong_dtype():
    with pytest.raises(ValueError, match="even"):
        pack_int4(_codes(2, 5))
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(_codes(2, 4).to(torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        pack_int4(_codes(2, 4).to(torch.int8))


@needs_cpu_int4_op
def test_layout_probe_finds_a_known_layout():
    layout = cpu_int4_layout()
    assert layout is not None, "the aten op exists, so its layout must be one hfquant knows"
    assert layout.block_n in (16, 32, 64)


@needs_cpu_int4_op
@pytest.mark.parametrize("n", [16, 48, 64, 80, 176, 576])
@pytest.mark.parametrize("k", [64, 256])
def test_cpu_kernel_layout_matches_the_aten_op_and_inverts(n, k):
    codes = _codes(n, k, seed=n + k)
    reference = _ATEN_PACK(codes.to(torch.int32), 1)
    ours = to_cpu_int4_layout(codes)
    assert ours.dtype == torch.uint8 and ours.shape == (n, k // 2)
    assert reference.numel() == ours.numel()
    assert torch.equal(ours.reshape(-1), reference.reshape(-1).view(torch.uint8))
    assert torch.equal(from_cpu_int4_layout(reference.reshape(n, k // 2), n, k), codes)
    assert torch.equal(from_cpu_int4_layout(ours, n, k), codes)


@pytest.mark.parametrize(
    "layout", packing._CANDIDATES, ids=lambda layout: f"block{layout.block_n}_{layout.full_blocks_halves}"
)
@pytest.mark.parametrize("n", [16, 48, 176])
def test_every_candidate_layout_round_trips(layout, n):
    codes = _codes(n, 96, seed=n)
    assert torch.equal(layout.unpack(layout.pack(codes), n, 96), codes)


def test_unknown_layout_raises_runtime_error(monkeypatch):
    monkeypatch.setattr(packing, "cpu_int4_layout", lambda: None)
    with pytest.raises(RuntimeError, match="not available"):
        to_cpu_int4_layout(_codes(16, 64))
    with pytest.raises(RuntimeError, match="not available"):
        from_cpu_int4_layout(torch.zeros((16, 32), dtype=torch.uint8), 16, 64)
