"""The native RTN quantizer (hfquant.ops.native.rtn_quantize, csrc/rtn_cpu.c) against the torch path it replaces on
the CPU (hfquant.core.rtn.quantize_weight, then packing.pack_int4): the same codes, scales and zero points, bit for
bit, on random weights of both input dtypes, every bit width and symmetry, and the groups where rounding is decided
by one ulp (ties, all-zero and constant groups, huge and tiny magnitudes)."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import packing, rtn
from hfquant.ops import gemv, native

pytestmark = pytest.mark.skipif(not gemv.native_int4_works(),
                                reason="native kernels unavailable here (no compiler or no AVX512-BF16)")

FORMATS = [(4, False), (4, True), (8, True), (8, False)]


def _reference(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    q = rtn.quantize_weight(weight, bits, group, symmetric)
    codes = packing.pack_int4(q.q) if bits == 4 else q.q
    return codes, q.scale, q.zero_point


def _assert_same(weight: torch.Tensor, bits: int, group: int, symmetric: bool) -> None:
    want = _reference(weight, bits, group, symmetric)
    got = native.rtn_quantize(weight, bits, group, symmetric)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0]), "codes differ"
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16)), "scales differ"
    if symmetric:
        assert got[2] is None and want[2] is None
    else:
        assert torch.equal(got[2], want[2]), "zero points differ"


@pytest.mark.parametrize("bits, symmetric", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, group", [(64, 64, 32), (96, 576, 64), (256, 2048, 128), (33, 1536, 1536)])
def test_random_weights_bit_for_bit(bits, symmetric, dtype, n, k, group):
    generator = torch.Generator().manual_seed(n * k + group)
    weight = (torch.randn((n, k), generator=generator) * 0.02).to(dtype)
    weight[0, :7] *= 40  # an outlier group
    _assert_same(weight, bits, group, symmetric)


@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_groups_decided_by_one_rounding(bits, symmetric):
    """Rows whose codes sit on exact ties (x / s + shift = m + 0.5), zero and constant groups, one-sided groups,
    huge and subnormal magnitudes: each decided by the order and kind of float32 operations."""
    group = 32
    levels = 15 if bits == 4 else 255
    steps = torch.arange(group, dtype=torch.float32)
    rows = [
        torch.zeros(group),
        torch.full((group,), 0.75),
        torch.full((group,), -3.0),
        steps / levels * 2.0 - 1.0,  # a ramp over the whole range: many exact ties
        (steps - 16.0) * 0.5,  # half steps
        steps * 1e-30,  # tiny: scales near the bottom of the float32 range
        steps * 1e37,  # huge: scales near the top of the bfloat16 range
        torch.where(steps % 2 == 0, 1.0, -1.0) * 0.1,
        torch.linspace(-0.3, 0.45, group),
    ]
    weight = torch.stack(rows)
    for dtype in (torch.float32, torch.bfloat16):
        _assert_same(weight.to(dtype), bits, group, symmetric)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_is_refused_like_the_torch_path(value):
    weight = torch.randn(64, 64).to(torch.bfloat16)
    weight[17, 3] = value
    with pytest.raises(ValueError, match="NaN or Inf"):
        rtn.quantize_weight(weight, 4, 32, False)
    with pytest.raises(ValueError, match="NaN or Inf"):
        native.rtn_quantize(weight, 4, 32, False)


def test_same_result_for_any_thread_count():
    weight = torch.randn(512, 1024).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.rtn_quantize(weight, 4, 128, False)
    finally:
        torch.set_num_threads(threads)
    many = native.rtn_quantize(weight, 4, 128, False)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def test_refuses_arguments_it_does_not_handle():
    with pytest.raises(RuntimeError, match="refused"):
        native.rtn_quantize(torch.randn(8, 96).to(torch.bfloat16), 4, 64, False)  # 64 does not divide 96
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        native.rtn_quantize(torch.randn(8, 64).half(), 4, 32, False)
