"""hfquant's GEMVs as PyTorch dispatcher operators (hfquant.ops.torch_ops, csrc/torch_ops.cpp): the same bits as the
ctypes calls, named refusals, a compiled graph that calls them without a graph break, the ctypes fallback without a
C++ compiler, and a planted library in the cache that is never loaded."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import run_python

from hfquant import QuantLinear
from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.ops import gemv, native, native_build, torch_ops
from hfquant.ops.gemv import RowCall, RowKernel

needs_operators = pytest.mark.skipif(
    not (gemv.native_int4_works() and torch_ops.loaded()),
    reason="hfquant's GEMV operators unavailable here (no AVX512-BF16, or no C/C++ compiler)",
)
needs_int8_operators = pytest.mark.skipif(
    not (gemv.native_int8_works() and torch_ops.loaded()),
    reason="hfquant's int8 GEMV operator unavailable here (no AVX2 or AVX512-BF16, or no C/C++ compiler)",
)


def _int4(n: int, k: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 4, group, False)
    weight = packing.to_cpu_int4_layout(q.q)
    scale_zero = packing.scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16)
    return torch.randn((1, k), generator=generator).to(torch.bfloat16), weight, scale_zero


@needs_operators
@pytest.mark.parametrize("n, k, group", [(64, 64, 32), (192, 576, 64), (1536, 576, 64), (576, 1536, 128)])
def test_int4_operator_gives_the_ctypes_bits(n, k, group):
    x, weight, scale_zero = _int4(n, k, group)
    y = torch.ops.hfquant_cpu.int4_gemv(x, weight, scale_zero, group)
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, native.int4_gemv(x, weight, scale_zero, group))


@needs_int8_operators
@pytest.mark.parametrize("n, k", [(96, 256), (576, 1536), (192, 48)])
def test_int8_operator_gives_the_ctypes_bits(n, k):
    generator = torch.Generator().manual_seed(1)
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 8, k, True)
    scale = q.scale.reshape(-1).to(torch.bfloat16).contiguous()
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    y = torch.ops.hfquant_cpu.int8_gemv(x, q.q.contiguous(), scale)
    assert torch.equal(y, native.int8_gemv(x, q.q.contiguous(), scale))


@needs_int8_operators
@pytest.mark.parametrize("n, k", [(97, 576), (21, 4096), (3, 8256), (98, 8256), (99, 16384)])
def test_int8_gemv_writes_every_row_at_one_and_two_threads(n, k):
    """The 4-row loop (K > 8192; K >= 4096 in the AVX2 body) and the remaining rows share one OpenMP region (csrc/int8_cpu.c): every output is
    written, with the same bits at one and two threads, within the output's bfloat16 rounding and the activations'
    int16 rounding (at most max|x| / 65534 per element) of the float64 product."""
    generator = torch.Generator().manual_seed(n)
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 8, k, True)
    codes, scale = q.q.contiguous(), q.scale.reshape(-1).to(torch.bfloat16).contiguous()
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs.append(torch.ops.hfquant_cpu.int8_gemv(x, codes, scale))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])
    reference = (x.double() @ codes.double().T) * scale.double()
    activation_error = codes.double().abs().sum(1) * scale.double() * x.double().abs().max() / 65534
    bound = reference.abs() * 2.0**-8 + activation_error
    assert ((outputs[0].double() - reference).abs() <= bound).all()


@needs_operators
def test_operators_name_what_they_refuse():
    x, weight, scale_zero = _int4(128, 256, 64)
    with pytest.raises(RuntimeError, match="x must be a contiguous bfloat16 CPU tensor, got Float"):
        torch.ops.hfquant_cpu.int4_gemv(x.float(), weight, scale_zero, 64)
    with pytest.raises(RuntimeError, match=r"x must hold one row of 256 inputs, got shape \[2, 256\]"):
        torch.ops.hfquant_cpu.int4_gemv(x.repeat(2, 1), weight, scale_zero, 64)
    with pytest.raises(RuntimeError, match="does not fit N=128, K=256, group_size=32"):
        torch.ops.hfquant_cpu.int4_gemv(x, weight, scale_zero, 32)
    with pytest.raises(RuntimeError, match="refused N=96, K=256, group_size=64"):  # N not a multiple of 64
        torch.ops.hfquant_cpu.int4_gemv(x, weight[:96].contiguous(), scale_zero[:, :96].contiguous(), 64)
    with pytest.raises(RuntimeError, match="scale must hold N=8 values, got shape \\[3\\]"):
        torch.ops.hfquant_cpu.int8_gemv(
            torch.zeros((1, 32)).bfloat16(), torch.zeros((8, 32), dtype=torch.int8), torch.ones(3).bfloat16()
        )
    with pytest.raises(RuntimeError, match="refused N=8, K=40"):
        torch.ops.hfquant_cpu.int8_gemv(
            torch.zeros((1, 40)).bfloat16(), torch.zeros((8, 40), dtype=torch.int8), torch.ones(8).bfloat16()
        )


@pytest.mark.parametrize("bits", [pytest.param(4, marks=needs_operators), pytest.param(8, marks=needs_int8_operators)])
def test_a_compiled_graph_calls_the_operator_without_a_graph_break(bits):
    """fullgraph=True fails on any break; the graph dynamo hands the backend names the C++ operator (not the Python
    custom op), and the compiled row equals the eager one bit for bit."""
    weight = torch.randn((192, 576), generator=torch.Generator().manual_seed(2))
    layer = QuantLinear.from_float(weight, None, StoredFormat(bits, 64 if bits == 4 else 576, bits == 8))
    layer.prepare_kernel(torch.bfloat16)
    x = torch.randn((1, 576), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    row = RowKernel.INT4_GEMV if bits == 4 else RowKernel.INT8_GEMV
    operator = RowCall.OPERATOR
    layer.plan = dataclasses.replace(
        layer.plan, row=row, row_call=operator, compiled_row=row, compiled_row_call=operator
    )
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    eager = layer(x)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    assert f"hfquant_cpu.int{bits}_gemv" in targets, targets
    assert not any(target.startswith("hfquant.") for target in targets)
    assert torch.equal(compiled, eager)


@needs_operators
def test_without_a_cpp_compiler_the_gemv_goes_through_ctypes_and_the_python_custom_op():
    code = """
    import torch
    from hfquant.ops import gemv, native, native_build, torch_ops
    assert gemv.native_int4_works() and not torch_ops.loaded()
    x = torch.randn((1, 64)).to(torch.bfloat16)
    weight = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    scale = torch.ones(64).to(torch.bfloat16)
    assert torch.equal(torch_ops.int8_gemv(x, weight, scale), native.int8_gemv(x, weight, scale))
    # compiled graphs fall back to the Python custom op, without a graph break
    from hfquant import QuantLinear
    from hfquant.core.format import StoredFormat
    layer = QuantLinear.from_float(torch.randn((192, 576)), None, StoredFormat(4, 64, False))
    layer.prepare_kernel(torch.bfloat16)
    from hfquant.ops.gemv import RowCall, RowKernel
    assert layer.plan.row is layer.plan.compiled_row is RowKernel.INT4_GEMV
    assert (layer.plan.row_call, layer.plan.compiled_row_call) == (RowCall.CTYPES, RowCall.CUSTOM_OP)
    targets = []
    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward
    row = torch.randn((1, 576)).to(torch.bfloat16)
    assert torch.equal(torch.compile(layer, backend=backend, fullgraph=True)(row), layer(row))
    assert any(target.startswith("hfquant.int4_gemv") for target in targets), targets
    print("ctypes ok")
    """
    result = run_python(code, CXX="/nonexistent/c++", HFQUANT_KERNEL_CHOICE="native")  # the GEMV, without timing
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ctypes ok" in result.stdout


PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen(SENTINEL, "w"); if (f) fclose(f); }
"""


FAKE_COMPILER = """#!/bin/sh
# answers --version (the cache folders' names hash it); any build command is recorded, then fails
if [ "$1" = "--version" ]; then echo "fake-compiler 1"; exit 0; fi
echo "$@" >> "MARKER"
exit 1
"""


@needs_operators
def test_a_library_planted_in_the_cache_is_never_loaded(tmp_path):
    """A torch_ops.so that others may write over (folder mode 0777), even with a matching hash record, is built
    again instead of loaded: its constructor never runs.

    The compilers are stand-ins that record the build command and fail: what is checked is that the planted file is
    not loaded and that a build of torch_ops.so starts in its place (the real build, into a fresh cache, is the
    first use of every clean CI run; compiling the C++ operators here again took 45 s). The trusted C library
    `torch_ops.loaded()` needs first is this process's, copied into the fresh cache with its hash record."""
    cache, marker = tmp_path / "cache", tmp_path / "MARKER"
    sentinel = tmp_path / "SENTINEL"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED.replace("SENTINEL", f'"{sentinel}"'))
    fake = tmp_path / "fake-cc"
    fake.write_text(FAKE_COMPILER.replace("MARKER", str(marker)))
    fake.chmod(0o755)
    env = {"HFQUANT_CACHE": str(cache), "CC": str(fake), "CXX": str(fake)}
    where = (
        "from hfquant.ops import native_build; "
        f"print(native_build.c_library_folder({str(fake)!r})); "
        f"print(native_build.torch_ops_folder({str(fake)!r}, {str(fake)!r}))"
    )
    c_folder, folder = (Path(line) for line in run_python(where, **env).stdout.strip().splitlines()[-2:])
    c_library = native_build.build_c_library(native_build.c_compiler())  # this process's, trusted
    c_folder.mkdir(parents=True)
    for name in (c_library.name, c_library.name + ".sha256"):
        shutil.copy2(c_library.with_name(name), c_folder / name)
    folder.mkdir(parents=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "torch_ops.so"), str(source)], check=True)
    (folder / "torch_ops.so.sha256").write_text(hashlib.sha256((folder / "torch_ops.so").read_bytes()).hexdigest())
    folder.chmod(0o777)
    code = """
    from hfquant.ops import native, torch_ops
    assert native.built_library() is not None  # the copied C library, trusted: no build
    print("loaded", torch_ops.loaded())
    """
    result = run_python(code, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded False" in result.stdout  # the stand-in compiler failed the build that replaced the planted file
    assert not sentinel.exists(), "the planted library's constructor ran"
    # the build that started is torch_ops.so's (its C objects first, `-c`), not the C library's (taken from the cache)
    commands = marker.read_text().splitlines() if marker.is_file() else []
    assert commands and " -c " in f" {commands[0]} ", commands
    assert not any("int4_cpu.so" in command for command in commands), commands


@needs_operators
def test_a_compiled_int4_layer_guards_no_zero_points():
    """The int4 kernel reads (scale, zero) pairs from `scale_zero`: the stored zero points are not read, so the
    compiled graph does not check them at every call (7 guards per layer: SmolLM2's decode graph went from 13285 to
    11320 guards)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    layer = QuantLinear.from_float(torch.randn((192, 576)), None, StoredFormat(4, 64, False))
    layer.prepare_kernel(torch.bfloat16)
    assert layer.weight_zero_point is not None

    def call(module, x):
        return module(x)

    torch._dynamo.reset()
    torch.compile(call, backend="eager", fullgraph=True)(layer, torch.randn((1, 576)).to(torch.bfloat16))
    (entry,) = _debug_get_cache_entry_list(call.__code__)
    guards = str(entry.guard_manager)
    torch._dynamo.reset()
    assert "scale_zero" in guards and "weight_zero_point" not in guards
