"""hfquant's own int4 CPU kernels (hfquant.ops.native, csrc/int4_cpu.c): the single-row GEMV against a float64 reference
and the aten kernel, thread-count independence, dispatch from QuantLinear, the prefill dequantization, and the
fallbacks when they cannot be used (building and trusting the library: test_native_build.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import record_row_kernels, run_python

from hfquant import QuantLinear
from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.ops import gemv, kernels, native
from hfquant.ops.gemv import RowKernel
from hfquant.ops.kernels import Kernel

needs_native = pytest.mark.skipif(
    not gemv.native_int4_works(), reason="native int4 GEMV unavailable here (no compiler or no AVX512-BF16)"
)


def _layer(n: int, k: int, group: int, symmetric: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 4, group, symmetric)
    runtime = kernels.prepare_weight("int4pack_mm_cpu", q.q, k)
    sz = kernels.scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    return q, runtime, sz, x


def _exact_and_magnitude(q, sz, x, group):
    """float64 x @ w.T for the kernel's own formula w = (q - 8) * scale + zero with its bfloat16 (scale, zero) pairs
    `sz`, and |x| @ (|q * scale| + |zero - 8 scale|).T: the size of the terms the kernel sums (its scale and offset
    terms cancel where the weights are centred, so its rounding scales with them, not with the result)."""
    scale = sz[..., 0].double().t().repeat_interleave(group, dim=1)  # (N, K)
    offset = sz[..., 1].double().t().repeat_interleave(group, dim=1) - 8.0 * scale
    codes = q.q.double()
    exact = x.double() @ (codes * scale + offset).t()
    magnitude = x.double().abs() @ ((codes * scale).abs() + offset.abs()).t()
    return exact, magnitude


@needs_native
@pytest.mark.parametrize("n, k, group", [(64, 64, 32), (192, 576, 64), (4096, 2048, 128), (128, 8192, 256)])
@pytest.mark.parametrize("symmetric", [False, True])
def test_matches_float64_reference_and_aten(n, k, group, symmetric):
    q, runtime, sz, x = _layer(n, k, group, symmetric)
    y = native.int4_gemv(x, runtime, sz, group)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    exact, magnitude = _exact_and_magnitude(q, sz, x, group)
    # the scale and zero are bfloat16 in both paths (exact in float64 here); the kernel sums in float32 and rounds
    # once to bfloat16: half a bfloat16 step (2^-8 relative) plus float32 summation error (<= 2^-16 of the terms)
    bound = 2.0**-8 * exact.abs() + 2.0**-16 * magnitude
    assert bool(((y.double() - exact).abs() <= bound).all())
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, runtime, group, sz)
    assert bool(((y.double() - aten.double()).abs() <= 2 * bound).all())


@needs_native
def test_wrong_nibble_order_would_be_caught():
    """The error bound above is tight enough to notice codes read from the wrong rows."""
    q, runtime, sz, x = _layer(128, 256, 64, False)
    swapped = (runtime >> 4) | ((runtime & 0x0F) << 4)
    y = native.int4_gemv(x, swapped, sz, 64)
    exact, magnitude = _exact_and_magnitude(q, sz, x, 64)
    assert not bool(((y.double() - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-16 * magnitude).all())


@needs_native
def test_same_result_for_any_thread_count():
    q, runtime, sz, x = _layer(1024, 1024, 128, False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.int4_gemv(x, runtime, sz, 128)
        torch.set_num_threads(max(2, threads))
        many = native.int4_gemv(x, runtime, sz, 128)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_native
def test_activation_at_odd_address():
    q, runtime, sz, x = _layer(128, 256, 64, False)
    storage = torch.empty(257, dtype=torch.bfloat16)
    storage[1:] = x[0]
    odd = storage[1:]
    assert odd.data_ptr() % 4
    assert torch.equal(native.int4_gemv(odd, runtime, sz, 64), native.int4_gemv(x, runtime, sz, 64))


@needs_native
def test_refuses_shapes_it_does_not_handle():
    _, runtime, sz, x = _layer(80, 256, 64, False)
    with pytest.raises(RuntimeError, match="N=80"):
        native.int4_gemv(x, runtime, sz, 64)


@needs_native
@pytest.mark.parametrize("n", [4096, 80])
def test_quant_linear_single_row_dispatch(n, monkeypatch):
    """One bfloat16 row of a 64-row-aligned layer goes through the native GEMV (where chosen: forced here), anything
    else through aten."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    calls = record_row_kernels(monkeypatch)
    layer = QuantLinear.from_float(torch.randn(n, 512), None, StoredFormat(4, 128, False))
    layer.prepare_kernel(torch.bfloat16)
    x = torch.randn((3, 512), dtype=torch.bfloat16)
    rows = torch.cat([layer(x[i : i + 1]) for i in range(3)])
    together = layer(x)
    assert calls == ([RowKernel.INT4_GEMV] * 3 if n % 64 == 0 else [])
    aten = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.weight, 128, layer.scale_zero)
    # both sum the same products in float32 in different orders and round once to bfloat16
    tolerance = dict(rtol=2**-7, atol=2**-12 * aten.abs().max().item())
    assert torch.allclose(rows.float(), aten.float(), **tolerance)
    assert torch.allclose(together.float(), aten.float(), **tolerance)


@needs_native
def test_compiled_single_row_uses_the_same_kernel():
    layer = QuantLinear.from_float(torch.randn(256, 512), None, StoredFormat(4, 128, False))
    layer.prepare_kernel(torch.bfloat16)
    x = torch.randn((1, 1, 512), dtype=torch.bfloat16)
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, fullgraph=True, dynamic=False)(x)
    assert torch.equal(compiled, eager)


FALLBACK = """
    import logging, torch
    logging.basicConfig(level=logging.INFO)
    from hfquant import QuantLinear
    from hfquant.ops import kernels, native
    from hfquant.ops.gemv import RowKernel
    from hfquant.core.format import StoredFormat
    layer = QuantLinear.from_float(torch.randn(128, 256), None, StoredFormat(4, 64, False))
    layer.prepare_kernel(torch.bfloat16)
    x = torch.randn((1, 256), dtype=torch.bfloat16)
    assert native.int4_cpu_library() is None and layer.plan.row is layer.plan.compiled_row is RowKernel.ATEN
    assert not layer.plan.native_dequant
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.weight, 64, layer.scale_zero)
    assert torch.equal(layer(x), expected)
    print("fallback ok")
"""


def test_switched_off_by_environment():
    result = run_python(FALLBACK, HFQUANT_NATIVE="0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallback ok" in result.stdout and "HFQUANT_NATIVE=0" in result.stderr


def test_failed_build_falls_back_to_aten(tmp_path):
    result = run_python(FALLBACK, CC="false", HFQUANT_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallback ok" in result.stdout and "build failed" in result.stderr
    assert not list(tmp_path.rglob("*.so"))  # no half-written library left behind


def test_missing_compiler_falls_back_to_aten(tmp_path):
    result = run_python(FALLBACK, CC=str(tmp_path / "no-such-cc"), HFQUANT_CACHE=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallback ok" in result.stdout and "no C compiler" in result.stderr


@needs_native
@pytest.mark.parametrize("start, stop", [(0, 192), (64, 128), (128, 192)])
def test_dequantize_t_gives_the_kernel_formula_transposed(start, stop):
    q, runtime, sz, _ = _layer(192, 256, 64, False)
    out = torch.empty((256, stop - start), dtype=torch.bfloat16)
    native.int4_dequantize_t(runtime, sz, 64, start, stop, out)
    scale = sz[..., 0].float().t().repeat_interleave(64, dim=1)
    zero = sz[..., 1].float().t().repeat_interleave(64, dim=1)
    expected = ((q.q.float() - 8) * scale + zero)[start:stop].t()
    # computed in float32 as q * scale + (zero - 8 scale) and rounded once: at most one bfloat16 step away
    assert bool(((out.float() - expected).abs() <= 2.0**-7 * expected.abs() + 1e-30).all())
    assert (out.float() != expected.to(torch.bfloat16).float()).float().mean().item() < 0.01


@needs_native
@pytest.mark.parametrize("start, stop", [(32, 128), (0, 0), (0, 256), (128, 64)])
def test_dequantize_t_refuses_bad_channel_ranges(start, stop):
    _, runtime, sz, _ = _layer(192, 256, 64, False)
    out = torch.empty((256, max(stop - start, 1)), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        native.int4_dequantize_t(runtime, sz, 64, start, stop, out)


@needs_native
def test_prefill_gemm_with_native_dequantization_matches_torch_ops(monkeypatch):
    """The chunked prefill GEMM gives the same products whether its int4 chunks come from C or from torch ops."""
    n, k = 2048 + 64, 512
    monkeypatch.setattr(kernels, "_GEMM_CHUNK_BYTES", 2 * 1024 * 512)  # 1024-row chunks: 1024, 1024, then 64
    q, runtime, sz, _ = _layer(n, k, 128, False)
    x = torch.randn((200, k), dtype=torch.bfloat16)
    calls = []
    real = native.int4_dequantize_t
    monkeypatch.setattr(native, "int4_dequantize_t", lambda *a: calls.append(a[3:5]) or real(*a))
    plan = kernels.plain_plan(Kernel.INT4PACK_MM_CPU, StoredFormat(4, 128, False), k, n, "cpu")
    tensors = kernels.LayerTensors(runtime, q.scale, None, sz)
    with_c = kernels._dequantized_gemm(dataclasses.replace(plan, native_dequant=True), tensors, x)
    assert calls == [(0, 1024), (1024, 2048), (2048, 2112)]
    with_torch = kernels._dequantized_gemm(dataclasses.replace(plan, native_dequant=False), tensors, x)
    assert len(calls) == 3 and with_c.shape == (200, n)
    # weights differ by at most one bfloat16 rounding (the offset is rounded first in the torch path)
    assert torch.allclose(with_c.float(), with_torch.float(), rtol=2**-6, atol=2**-6 * with_torch.abs().max().item())


@needs_native
# K / 2 a multiple of 16 goes through the 16 x 16 byte transposes alone; 40 and 600 leave 4 stored bytes to the byte
# loop
@pytest.mark.parametrize("n, k", [(64, 32), (128, 576), (192, 2048), (64, 40), (128, 600)])
def test_native_repacking_equals_the_torch_path_both_ways(n, k):
    """hfquant_int4_to_cpu_layout / _from_cpu_layout: one pass each way, byte for byte what the torch ops give."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + k))
    stored = packing.pack_int4(codes)
    runtime = native.int4_repack(stored, to_cpu_layout=True)
    assert torch.equal(runtime, packing.to_cpu_int4_layout(codes))
    assert torch.equal(native.int4_repack(runtime, to_cpu_layout=False), stored)
    with pytest.raises(RuntimeError, match="N % 64"):
        native.int4_repack(stored[:32], to_cpu_layout=True)
    # in place (out is the weight): the same bytes in the same memory, rows of a larger tensor included
    rows = torch.cat([stored, stored.flip(0)])
    top = rows[:n]
    assert native.int4_repack(top, to_cpu_layout=True, out=top) is top
    assert torch.equal(top, runtime) and torch.equal(rows[n:], stored.flip(0))
    with pytest.raises(RuntimeError, match="apart from the weight"):  # overlapping, not the same rows
        native.int4_repack(rows[32 : n + 32], to_cpu_layout=True, out=rows[:n])


@needs_native
def test_a_prepared_int4_layer_saves_the_bytes_it_was_given():
    weight = torch.randn((128, 256), generator=torch.Generator().manual_seed(3))
    layer = QuantLinear.from_float(weight, None, StoredFormat(4, 64, False))
    stored = layer.weight.clone()
    assert layer.prepare_kernel(torch.bfloat16) == kernels.Kernel.INT4PACK_MM_CPU
    assert not torch.equal(layer.weight, stored)  # the kernel layout
    assert torch.equal(layer.stored_weight(), stored) and torch.equal(layer.state_dict()["weight"], stored)
