"""`native.bf16_f32_gemv` (csrc/bf16_cpu.c): bfloat16 weights times a float32 vector in float32, the BOS forward's
matrix-vector product (`hfquant.integration.bos_importance`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import run_python

from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="needs hfquant's native library")

TOLERANCE = 1e-6
"""Largest error against float64, relative to the largest |w| * |x| row sum: float32 sums of 2,000-odd exact
products (about 2^-24 per addition, far below this)."""


def _case(k: int = 2048 + 7) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, k, generator=generator).bfloat16()
    weight[:, :3] *= 100  # a few heavy columns, as a checkpoint has
    return weight, torch.randn(k, generator=generator)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 2048 + 7])
def test_matches_float64(k):
    weight, x = _case(k)
    got = native.bf16_f32_gemv(weight, x)
    reference = weight.double() @ x.double()
    scale = float((weight.double().abs() @ x.double().abs()).max())
    assert got.dtype == torch.float32 and got.shape == (64,)
    assert float((got.double() - reference).abs().max()) <= TOLERANCE * scale
    assert not torch.equal(native.bf16_f32_gemv(weight, x + 1e-3), got)  # the product reads x: the check can fail


def test_the_c_body_gives_the_avx512_bodys_floats():
    """`HFQUANT_ISA=avx2` (no AVX-512: the C body) in a child gives this process's floats bit for bit."""
    if "avx512" not in native.isa():
        pytest.skip("this process runs the C body already")
    here = Path(__file__).parent
    child = run_python(
        f"""
        import sys, torch
        sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
        from test_bf16_f32_gemv import _case
        from hfquant.ops import native
        print(native.bf16_f32_gemv(*_case()).double().tolist())
        """,
        HFQUANT_ISA="avx2",
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert eval(child.stdout) == native.bf16_f32_gemv(*_case()).double().tolist()


def test_refuses_other_dtypes_and_shapes_naming_them():
    weight, x = _case()
    with pytest.raises(ValueError, match="float32"):
        native.bf16_f32_gemv(weight.float(), x)
    with pytest.raises(ValueError, match=r"\(2054,\)"):
        native.bf16_f32_gemv(weight, x[:-1])
