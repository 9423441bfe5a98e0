"""`native.bf16_gemv` (csrc/bf16_cpu.c): one bfloat16 row times a bfloat16 weight, each output summed in float32 and
rounded once, against a float64 reference; its AVX2 body (CPUs without AVX512-BF16, or `HFQUANT_ISA=avx2`) in this
process or, where this process runs the AVX512-BF16 body, in a child. tests/ops/test_isa.py compares the two bodies;
tests/nn/test_float_linear.py the layer that calls them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_python

from hfquant.ops import gemv, native

pytestmark = pytest.mark.skipif("avx2" not in native.isa(), reason="needs hfquant's native library and AVX2 + FMA")

CASES = {
    "67x32": (67, 32, 1.0),
    "256x2048 heavy columns": (256, 2048, 1.0),
    "64x8192 large": (64, 8192, 1e30),
    "96x576 small": (96, 576, 1e-30),
}
"""(N, K, scale of x): a single step per row, the 1.2B's hidden size with a few heavy input columns (as a checkpoint
has), a long row, and magnitudes near both ends of the float32 range (no overflow or flush in the sums)."""


def _case(n: int, k: int, scale: float, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((n, k), generator=generator).to(torch.bfloat16)
    x = torch.randn((1, k), generator=generator) * scale
    x[:, :5] *= 50
    bias = (torch.randn(n, generator=generator) * scale).to(torch.bfloat16)
    return x.to(torch.bfloat16), weight, bias


def _within_one_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|y - exact| <= half a bfloat16 step of |exact| (2^-8 relative) + float32 summation error (K * 2^-24 *
    (sum |x w| + |b|)), output by output, against x @ weight.T + bias in float64; and y is not all zeros."""
    exact = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    error = (y.double() - exact).abs()
    bound = 2.0**-8 * exact.abs() + x.shape[-1] * 2.0**-24 * magnitude
    assert (error <= bound).all(), float((error - bound).max())
    assert y.abs().max() > 0


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_within_one_rounding_of_float64(case, with_bias):
    x, weight, bias = _case(*CASES[case])
    bias = bias if with_bias else None
    _within_one_rounding(native.bf16_gemv(x, weight, bias), x, weight, bias)


def test_the_avx2_body_within_one_rounding_of_float64_in_a_child():
    """Where this process runs the AVX512-BF16 body, `HFQUANT_ISA=avx2` runs the AVX2 body on the same cases."""
    if "avx512_bf16" not in native.isa():
        pytest.skip("this process runs the AVX2 body (test_within_one_rounding_of_float64)")
    here = Path(__file__).parent
    child = run_python(
        f"""
        import sys
        sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
        from test_bf16_gemv import CASES, _case, _within_one_rounding
        from hfquant.ops import native
        assert native.isa() == ("avx2",), native.isa()
        for case in CASES.values():
            x, weight, bias = _case(*case)
            _within_one_rounding(native.bf16_gemv(x, weight, bias), x, weight, bias)
        print("ok")
        """,
        HFQUANT_ISA="avx2",
    )
    assert child.returncode == 0 and child.stdout.split() == ["ok"], child.stderr[-3000:]


def test_nan_and_infinity_pass_through():
    x, weight, bias = _case(8, 64, 1.0)
    x[0, 7] = 1.0
    weight[2, 7] = float("inf")
    y = native.bf16_gemv(x, weight, bias)
    assert y[0, 2] == float("inf") and y[0, :2].isfinite().all() and y[0, 3:].isfinite().all()
    x[0, 3] = float("nan")
    assert native.bf16_gemv(x, weight, bias).isnan().all()  # x's NaN reaches every output


def test_refuses_k_not_a_multiple_of_32_and_a_cpu_without_avx2():
    x, weight, _ = _case(8, 48, 1.0)
    with pytest.raises(RuntimeError, match="K % 32 == 0"):
        native.bf16_gemv(x, weight)
    child = run_python(
        """
        import torch
        from hfquant.ops import gemv, native
        try:
            native.bf16_gemv(torch.ones((1, 32), dtype=torch.bfloat16), torch.ones((4, 32), dtype=torch.bfloat16))
        except RuntimeError as error:
            print("refused", gemv.native_bf16_works())
        """,
        HFQUANT_ISA="generic",
    )
    assert child.stdout.split() == ["refused", "False"], child.stderr[-3000:]


def test_the_agreement_check_passes_here():
    """`gemv.native_bf16_works`, which gates `plan_bf16_row`, accepts the body this CPU runs."""
    assert gemv.native_bf16_works()
