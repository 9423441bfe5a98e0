"""`machine.gemm_dtype`: float GEMMs of bfloat16 operands run in float32 on a CPU without oneDNN's bfloat16 GEMM, in
the quantized layers' prefill, the LoRA backward and the float layers, and give the bfloat16 path's values."""

from __future__ import annotations

import pytest
import torch

from hfquant import QuantLinear
from hfquant.core.format import StoredFormat
from hfquant.nn.float_linear import FloatLinear
from hfquant.ops import machine

FORMATS = [StoredFormat(8, 512, True), StoredFormat(4, 64, False), StoredFormat(4, 256, True, block="iq4_xs")]


@pytest.fixture(params=[True, False], ids=["bf16-gemm", "no-bf16-gemm"])
def bf16_gemm(request, monkeypatch):
    """Both answers of oneDNN's bfloat16 query, whatever this CPU says; yields whether bfloat16 GEMMs are native."""
    monkeypatch.setitem(machine._HALF_GEMM, torch.bfloat16, request.param)
    return request.param


def test_the_rule(bf16_gemm):
    assert machine.gemm_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if bf16_gemm else torch.float32)
    assert machine.gemm_dtype(torch.float32, "cpu") == torch.float32
    assert machine.gemm_dtype(torch.bfloat16, "meta") == torch.bfloat16  # only the CPU's GEMMs are concerned


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.block or f"int{f.bits}")
def test_prefill_gemm_is_within_its_roundings_of_float64(bf16_gemm, fmt, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    layer = QuantLinear.from_float(torch.randn(384, 512, generator=generator), None, fmt)
    layer.prepare_kernel()
    x = torch.randn(160, 512, generator=generator).to(torch.bfloat16)  # >= GEMM_MIN_ROWS: the chunked GEMM
    seen = set()
    real = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b, **kw: seen.add((a.dtype, b.dtype)) or real(a, b, **kw))
    y = layer(x)
    gemm = torch.bfloat16 if bf16_gemm else torch.float32
    assert seen == {(gemm, gemm)}
    assert y.dtype == torch.bfloat16 and y.shape == (160, 384)
    weight = layer.dequantize(torch.float64)
    reference = x.double() @ weight.T
    # each dequantized weight rounded to bfloat16 (relative 2^-9), the float32 sums, the result rounded to bfloat16
    # once (int8: twice, the channel scale applied after)
    bound = 2.0**-9 * (x.double().abs() @ weight.abs().T) + 2.0**-7 * reference.abs() + 1e-6
    assert bool(((y.double() - reference).abs() <= bound).all())


def test_float_linear_rows_take_float32_without_a_bf16_gemm(bf16_gemm, monkeypatch):
    generator = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(256, 96).to(torch.bfloat16)
    layer.__class__ = FloatLinear
    x = torch.randn(7, 256, generator=generator).to(torch.bfloat16)
    seen = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, w, b=None: seen.append(a.dtype) or real(a, w, b))
    y = layer(x)
    assert seen == [torch.bfloat16 if bf16_gemm else torch.float32] and y.dtype == torch.bfloat16
    reference = x.double() @ layer.weight.double().T + layer.bias.double()
    assert bool(((y.double() - reference).abs() <= 2.0**-7 * reference.abs() + 1e-6).all())
