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


def _body(isa: tuple[str, ...]) -> str:
    """The body `hfquant_bf16_f32_gemv` runs under these instruction sets (csrc/bf16_cpu.c)."""
    return "avx512" if "avx512" in isa else "avx2" if "avx2" in isa else "c"


@pytest.mark.parametrize("setting, body", [("avx2", "avx2"), ("generic", "c")])
def test_every_body_gives_the_same_floats(setting, body):
    """`HFQUANT_ISA=avx2` (the AVX2 body where the CPU has it) and `generic` (the C body, its FMA clone on a CPU with
    FMA) in a child give this process's floats bit for bit: the same fused multiply-adds into the same 16 sums."""
    if _body(native.isa()) == body or (body == "avx2" and "avx2" not in native.isa()):
        pytest.skip(f"this process runs the {_body(native.isa())} body: nothing to compare with")
    here = Path(__file__).parent
    child = run_python(
        f"""
        import sys, torch
        sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
        from test_bf16_f32_gemv import _case
        from hfquant.ops import native
        print(native.isa())
        for k in (15, 16, 17, 2048 + 7):
            print(native.bf16_f32_gemv(*_case(k)).double().tolist())
        """,
        HFQUANT_ISA=setting,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    isa, *outputs = child.stdout.splitlines()
    assert _body(eval(isa)) == body
    for k, output in zip((15, 16, 17, 2048 + 7), outputs, strict=True):
        assert eval(output) == native.bf16_f32_gemv(*_case(k)).double().tolist(), k


def test_refuses_other_dtypes_and_shapes_naming_them():
    weight, x = _case()
    with pytest.raises(ValueError, match="float32"):
        native.bf16_f32_gemv(weight.float(), x)
    with pytest.raises(ValueError, match=r"\(2054,\)"):
        native.bf16_f32_gemv(weight, x[:-1])
