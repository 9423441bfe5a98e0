"""Input gradients through quantized layers (hfquant.ops.autograd): weights frozen, grad_x against the dequantized
float layer's, on every CPU kernel path, under torch.compile(fullgraph=True) and with activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hfquant.core.format import Method, StoredFormat
from hfquant.nn.experts import QuantExperts, quantize_experts_tensor
from hfquant.nn.linear import QuantLinear
from hfquant.ops import kernels
from hfquant.ops.kernels import Kernel

# (bits, group_size, symmetric, method, in_features, out_features)
FORMATS = [
    (8, 256, True, Method.RTN, 256, 64),  # int8pack_mm
    (8, 64, False, Method.RTN, 256, 48),  # dequant
    (4, 32, False, Method.RTN, 256, 192),  # int4pack_mm_cpu, three 64-row blocks
    (4, 64, True, Method.RTN, 256, 80),  # int4pack_mm_cpu, a 16-row tail block
    (4, 64, False, Method.SINQ, 256, 128),  # sinq: column scale
    (4, 128, False, Method.RTN, 256, 8),  # dequant
]
IDS = [f"int{b}-g{g}-{'sym' if s else 'asym'}-{m.value}-N{n}" for b, g, s, m, _, n in FORMATS]

# The quantized layer's grad_x and the float reference's multiply the same dequantized weight (both rounded to the
# activation dtype): in float32 only the summation order differs (relative error ~1e-6); in bfloat16 each side rounds
# its output to 8 bits of mantissa (relative error per element up to ~2**-8, 0.4%); the bound is on the max error
# relative to the largest reference element.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _layer(fmt, dtype):
    bits, group, symmetric, method, k, n = fmt
    generator = torch.Generator().manual_seed(k + n + bits)
    weight = torch.randn((n, k), generator=generator).to(dtype)
    bias = torch.randn((n,), generator=generator).to(dtype)
    layer = QuantLinear.from_float(weight, bias, StoredFormat(bits, group, symmetric, method))
    layer.prepare_kernel(dtype)
    return layer, layer.dequantize_to_float(dtype)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def _grads(module, x, grad_y, wrap=lambda m, x: m(x)):
    x = x.detach().clone().requires_grad_(True)
    y = wrap(module, x)
    y.backward(grad_y)
    return y.detach(), x.grad


@pytest.mark.parametrize("rows", [1, 7, 200], ids=lambda r: f"M{r}")  # one row (GEMV), aten, chunked prefill
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_input_gradient_matches_the_dequantized_float_layer(fmt, dtype, rows):
    layer, reference = _layer(fmt, dtype)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn((rows, fmt[4]), generator=generator).to(dtype)
    grad_y = torch.randn((rows, fmt[5]), generator=generator).to(dtype)
    y, grad_x = _grads(layer, x, grad_y)
    y_ref, grad_ref = _grads(reference, x, grad_y)
    assert grad_x.dtype == dtype and grad_x.shape == x.shape
    assert _relative_error(grad_x, grad_ref) < TOLERANCE[dtype], layer.kernel
    assert torch.equal(y, layer(x)), "forward with grad differs from the inference path"
    assert not any(t.grad is not None for t in layer.buffers())


def test_every_cpu_kernel_is_exercised():
    kinds = {_layer(fmt, torch.bfloat16)[0].kernel for fmt in FORMATS}
    expected = {Kernel.INT8PACK_MM, Kernel.DEQUANT}
    if kernels.kernel_works(Kernel.INT4PACK_MM_CPU, "cpu"):
        expected.add(Kernel.INT4PACK_MM_CPU)
    assert expected <= kinds


def test_backward_dequantizes_row_chunks(monkeypatch):
    """A chunk smaller than the weight: several 64-row steps give the same gradient as one."""
    from hfquant.ops import autograd

    layer, reference = _layer(FORMATS[2], torch.float32)
    x = torch.randn(9, 256)
    grad_y = torch.randn(9, 192)
    _, whole = _grads(layer, x, grad_y)
    monkeypatch.setattr(autograd, "_CHUNK_BYTES", 64 * 4 * 256)
    _, chunked = _grads(layer, x, grad_y)
    assert _relative_error(chunked, whole) < 1e-6


def test_no_grad_inputs_take_the_inference_path(monkeypatch):
    from hfquant.ops import autograd

    def refuse(*args, **kwargs):
        raise AssertionError("custom op used without grad")

    monkeypatch.setattr(autograd, "_quantized_matmul_op", refuse)
    layer, _ = _layer(FORMATS[2], torch.bfloat16)
    layer(torch.randn(3, 256, dtype=torch.bfloat16))
    with torch.no_grad():
        layer(torch.randn(3, 256, dtype=torch.bfloat16, requires_grad=True))


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[2]], ids=[IDS[0], IDS[2]])
def test_input_gradient_under_compile_fullgraph(fmt):
    layer, reference = _layer(fmt, torch.bfloat16)
    x = torch.randn((2, 5, fmt[4]), dtype=torch.bfloat16)
    grad_y = torch.randn((2, 5, fmt[5]), dtype=torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    _, grad_x = _grads(compiled, x, grad_y)
    _, grad_ref = _grads(reference, x, grad_y)
    assert _relative_error(grad_x, grad_ref) < TOLERANCE[torch.bfloat16]


def test_input_gradient_with_non_reentrant_checkpointing():
    layer, reference = _layer(FORMATS[3], torch.float32)
    x = torch.randn((4, 256))
    grad_y = torch.randn((4, 80))

    def wrapped(module, x):
        return checkpoint(lambda t: F.gelu(module(t)), x, use_reentrant=False)

    _, grad_x = _grads(layer, x, grad_y, wrapped)
    _, grad_ref = _grads(reference, x, grad_y, wrapped)
    assert _relative_error(grad_x, grad_ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)])
def test_experts_input_gradient(bits, symmetric):
    e, n, k = 3, 64, 128
    fmt = StoredFormat(bits, k if bits == 8 else 32, symmetric)
    source = nn.Module()
    source.act_fn = nn.SiLU()
    experts = QuantExperts(source, {"down_proj": (e, n, k)}, {"down_proj": fmt}, torch.float32, "cpu")
    weight = torch.randn((e, n, k), generator=torch.Generator().manual_seed(bits))
    for suffix, tensor in quantize_experts_tensor(weight, fmt).items():
        setattr(experts, "down_proj" + suffix.removeprefix("weight"), tensor)
    dense = experts.dequantize("down_proj")
    for expert in range(e):
        x = torch.randn((5, k), generator=torch.Generator().manual_seed(expert))
        grad_y = torch.randn((5, n), generator=torch.Generator().manual_seed(10 + expert))
        _, grad_x = _grads(lambda t, expert=expert: experts._project("down_proj", expert, t), x, grad_y)
        _, grad_ref = _grads(lambda t, expert=expert: t @ dense[expert].T, x, grad_y)
        assert _relative_error(grad_x, grad_ref) < TOLERANCE[torch.float32]
