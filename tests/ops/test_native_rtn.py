"""The native RTN quantizer (hfquant.ops.native.rtn_quantize, csrc/rtn_cpu.c) against the torch path it replaces on
the CPU (hfquant.core.rtn.quantize_weight, then packing.pack_int4): the same codes, scales and zero points, bit for
bit, on random weights of both input dtypes, every bit width and symmetry, and the groups where rounding is decided
by one ulp (ties, all-zero and constant groups, huge and tiny magnitudes)."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import packing, rtn
from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="native kernels unavailable here (no compiler)")

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
# groups of a multiple of 16 run the AVX-512 row pass where the CPU has it (576 / 64: 9 groups, a partial vector of
# group scales), else the AVX2 one; 24 and 40 the AVX2 row pass; 20 and 12 the generic loops
@pytest.mark.parametrize(
    "n, k, group",
    [
        (64, 64, 32),
        (96, 576, 64),
        (256, 2048, 128),
        (33, 1536, 1536),
        (40, 120, 24),
        (17, 80, 40),
        (9, 60, 20),
        (5, 36, 12),
    ],
)
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
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=False))


def test_refuses_arguments_it_does_not_handle():
    with pytest.raises(RuntimeError, match="refused"):
        native.rtn_quantize(torch.randn(8, 96).to(torch.bfloat16), 4, 64, False)  # 64 does not divide 96
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        native.rtn_quantize(torch.randn(8, 64).half(), 4, 32, False)


@pytest.mark.parametrize("bits, symmetric", FORMATS)
def test_out_rows_of_a_larger_buffer_get_the_same_bytes(bits, symmetric):
    """`out=` writes into row slices of a layer's buffers (what quantize_to_buffers passes) the bytes of a plain call,
    and leaves the other rows alone."""
    weight = torch.randn((96, 256), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = native.rtn_quantize(weight[32:64], bits, 64, symmetric)
    codes = torch.full((96, 128 if bits == 4 else 256), 7, dtype=want[0].dtype)
    scale = torch.zeros((96, 4), dtype=torch.bfloat16)
    zero_point = None if symmetric else torch.full((96, 4), 9, dtype=torch.uint8)
    got = native.rtn_quantize(
        weight[32:64], bits, 64, symmetric, out=(codes[32:64], scale[32:64], None if symmetric else zero_point[32:64])
    )
    assert got[0].data_ptr() == codes[32:64].data_ptr()
    assert torch.equal(codes[32:64], want[0]) and bool((codes[:32] == 7).all()) and bool((codes[64:] == 7).all())
    assert torch.equal(scale[32:64].view(torch.int16), want[1].view(torch.int16)) and not scale[64:].any()
    if not symmetric:
        assert torch.equal(zero_point[32:64], want[2]) and bool((zero_point[:32] == 9).all())


def test_out_of_the_wrong_shape_dtype_or_layout_is_refused_by_name():
    weight = torch.randn((64, 128)).to(torch.bfloat16)
    scale = torch.empty((64, 2), dtype=torch.bfloat16)
    with pytest.raises(
        RuntimeError, match=r"out codes must be a contiguous CPU torch.uint8 tensor of shape \(64, 64\)"
    ):
        native.rtn_quantize(weight, 4, 64, True, out=(torch.empty((64, 128), dtype=torch.uint8), scale, None))
    with pytest.raises(RuntimeError, match="out scale .* not contiguous"):
        native.rtn_quantize(
            weight,
            4,
            64,
            True,
            out=(torch.empty((64, 64), dtype=torch.uint8), torch.empty((2, 64), dtype=torch.bfloat16).t(), None),
        )
    with pytest.raises(RuntimeError, match="out zero_point must be a contiguous"):
        native.rtn_quantize(weight, 4, 64, False, out=(torch.empty((64, 64), dtype=torch.uint8), scale, None))


@pytest.mark.parametrize("bits, symmetric", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, cols", [(True, True), (True, False), (False, True)], ids=["both", "rows", "cols"])
def test_fold_factors_in_the_pass_give_the_bytes_of_the_scaled_copy(bits, symmetric, dtype, rows, cols):
    """`row_scale` / `col_scale` (a fold's factors, applied in the C pass) quantize the float32 copy
    `weight.float() * row_scale[:, None] / col_scale` bit for bit: the bytes `quantize_to_buffers` stored before it
    passed the factors to the kernel."""
    generator = torch.Generator().manual_seed(bits + 2 * rows + cols)
    weight = (torch.randn(96, 512, generator=generator) * 0.05).to(dtype)
    row_scale = torch.rand(96, generator=generator) * 4 + 0.25 if rows else None
    col_scale = (torch.rand(512, generator=generator) * 4 + 0.25).to(torch.bfloat16).float() if cols else None
    scaled = weight.float()
    if row_scale is not None:
        scaled = scaled * row_scale[:, None]
    if col_scale is not None:
        scaled = scaled / col_scale
    want = native.rtn_quantize(scaled, bits, 64, symmetric)
    got = native.rtn_quantize(weight, bits, 64, symmetric, row_scale=row_scale, col_scale=col_scale)
    assert torch.equal(got[0], want[0]), "codes differ"
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16)), "scales differ"
    assert (got[2] is None) == symmetric and (symmetric or torch.equal(got[2], want[2])), "zero points differ"


def test_fold_factors_of_the_wrong_shape_are_refused_by_name():
    weight = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="col_scale must be a float32 CPU tensor of shape \\(64,\\)"):
        native.rtn_quantize(weight, 4, 32, False, col_scale=torch.ones(32))
    with pytest.raises(RuntimeError, match="row_scale"):
        native.rtn_quantize(weight, 4, 32, False, row_scale=torch.ones(8, dtype=torch.float64))
