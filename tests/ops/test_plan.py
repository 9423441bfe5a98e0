"""A layer's kernel plan (hfquant.ops.plan): decided once, an immutable value on the layer, and nothing in hfquant/ops
decided through module state written at run time."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import hfquant.ops
from hfquant import QuantLinear
from hfquant.core.format import StoredFormat
from hfquant.ops import gemv, kernels, plan
from hfquant.ops.gemv import RowCall, RowKernel
from hfquant.ops.kernels import NO_GEMM, DecodeActivations, Kernel, KernelPlan

INT4 = StoredFormat(4, 64, False)
INT8 = StoredFormat(8, 256, True)


def test_a_plan_is_a_frozen_hashable_value_that_its_key_gives_back():
    layer_plan = kernels.plain_plan(Kernel.INT8PACK_MM, INT8, 256, 96, "cpu")
    assert layer_plan.gemm_min_rows == kernels.GEMM_MIN_ROWS[Kernel.INT8PACK_MM] and layer_plan.row is RowKernel.ATEN
    with pytest.raises(dataclasses.FrozenInstanceError):
        layer_plan.row = RowKernel.INT8_GEMV
    other = dataclasses.replace(layer_plan, row=RowKernel.INT8_GEMV)
    assert len({layer_plan, other, dataclasses.replace(other)}) == 2
    decoded = KernelPlan.from_key(other.key)
    assert decoded == other and decoded.row is RowKernel.INT8_GEMV and decoded.kernel is Kernel.INT8PACK_MM
    assert kernels.plain_plan(Kernel.DEQUANT, INT8, 256, 96, "cpu").gemm_min_rows == NO_GEMM
    assert kernels.plain_plan(Kernel.INT8PACK_MM, INT8, 256, 96, "cuda").gemm_min_rows == NO_GEMM


@pytest.mark.parametrize("mode", ["aten", "native"])
def test_plan_kernel_takes_the_forced_choice_for_the_one_row_kernels(monkeypatch, mode):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", mode)
    int4 = plan.plan_kernel(INT4, 256, 128, "cpu", torch.bfloat16)
    int8 = plan.plan_kernel(INT8, 256, 96, "cpu", torch.bfloat16)
    assert int4.kernel == kernels.select_kernel(INT4, in_features=256, out_features=128, device="cpu")
    int4_native = int4.kernel is Kernel.INT4PACK_MM_CPU and mode == "native"
    if int4_native and gemv.native_int4_works():
        expected_row = RowKernel.INT4_GEMV  # AVX-512's 64-row blocks
    elif int4_native and int4.cpu_int4_block == 32 and gemv.native_int4_avx2_works():
        expected_row = RowKernel.INT4_GEMV_AVX2  # AVX2's 32-row blocks
    else:
        expected_row = RowKernel.ATEN
    assert int4.row is int4.compiled_row is expected_row
    assert int4.native_dequant is (int4.kernel is Kernel.INT4PACK_MM_CPU and gemv.native_int4_works())
    int8_row = mode == "native" and int8.kernel is Kernel.INT8PACK_MM and gemv.native_int8_works()
    assert int8.row is int8.compiled_row is (RowKernel.INT8_GEMV if int8_row else RowKernel.ATEN)
    if int8_row:  # the cheapest call at hand
        from hfquant.ops import torch_ops

        expected = (RowCall.OPERATOR,) * 2 if torch_ops.loaded() else (RowCall.CTYPES, RowCall.CUSTOM_OP)
        assert (int8.row_call, int8.compiled_row_call) == expected
    # float16 int8 layers keep aten's kernel for every row; another device has no one-row kernel
    assert plan.plan_kernel(INT8, 256, 96, "cpu", torch.float16).row is RowKernel.ATEN
    assert plan.plan_kernel(INT8, 256, 96, "meta", torch.bfloat16) == kernels.plain_plan(
        Kernel.DEQUANT, INT8, 256, 96, "meta"
    )


def test_int8_decode_activations_plan_the_w4a8_gemv_where_it_works(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "aten")
    layer_plan = plan.plan_kernel(INT4, 256, 128, "cpu", torch.bfloat16, "int8")
    assert layer_plan.activations == "int8"
    if layer_plan.kernel is Kernel.INT4PACK_MM_CPU and kernels.int8_decode_activations_available():
        w4a8 = RowKernel.INT4_A8 if layer_plan.cpu_int4_block == 64 else RowKernel.INT4_A8_AVX2
        assert layer_plan.row is layer_plan.compiled_row is w4a8
    monkeypatch.setattr(gemv, "native_int4_a8_works", lambda: False)
    assert not kernels.int8_decode_activations_available()
    assert plan.plan_kernel(INT4, 256, 128, "cpu", torch.bfloat16, "int8").row is RowKernel.ATEN
    with pytest.raises(
        ValueError, match=r"decode_activations='int4' is not supported; use one of \['float', 'int8'\]"
    ):
        plan.plan_kernel(INT4, 256, 128, "cpu", torch.bfloat16, "int4")


def test_a_layer_keeps_its_decode_activations_through_prepare_and_load_and_replans_when_they_change(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    weight = torch.randn((128, 256), generator=torch.Generator().manual_seed(0))
    layer = QuantLinear.from_float(weight, None, INT4)
    assert layer.kernel is Kernel.DEQUANT and layer.decode_activations == "float"
    layer.decode_activations = "int8"  # before the kernel is prepared: remembered
    assert layer.plan.activations is DecodeActivations.INT8 and layer.kernel is Kernel.DEQUANT
    state = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    layer.prepare_kernel(torch.bfloat16)
    assert layer.decode_activations == "int8" and layer.kernel is layer.plan.kernel
    int8_plan = layer.plan
    layer.decode_activations = "float"
    assert layer.plan == dataclasses.replace(int8_plan, activations="float", **_rows(layer.plan))
    assert layer.plan == plan.plan_kernel(INT4, 256, 128, "cpu", torch.bfloat16)
    layer.decode_activations = DecodeActivations.INT8
    assert layer.plan == int8_plan
    for name, tensor in layer.state_dict().items():  # the stored layout, bit for bit
        assert torch.equal(tensor, state[name]), name
    layer.load_state_dict(state)
    assert layer.kernel is Kernel.DEQUANT and layer.decode_activations == "int8"
    with pytest.raises(ValueError, match="decode_activations='fp8'"):
        layer.decode_activations = "fp8"


def _rows(layer_plan: KernelPlan) -> dict:
    names = ("row", "row_call", "compiled_row", "compiled_row_call")
    return {name: getattr(layer_plan, name) for name in names}


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def test_no_module_state_is_written_after_import_in_hfquant_ops():
    """Decisions are values on the layers or per-process caches behind one function: no `global` statement and no
    module-level container changed by a function anywhere in hfquant/ops."""
    writes = []
    for path in sorted(Path(hfquant.ops.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        module_names = _module_names(tree)
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Global):
                    writes.append(f"{path.name}:{node.lineno} global {', '.join(node.names)}")
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets:
                    if isinstance(target, ast.Subscript) and getattr(target.value, "id", None) in module_names:
                        writes.append(f"{path.name}:{node.lineno} {target.value.id}[...] =")
                mutators = ("update", "setdefault", "pop", "clear", "append", "add", "__setitem__")
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in mutators
                    and getattr(node.func.value, "id", None) in module_names
                ):
                    writes.append(f"{path.name}:{node.lineno} {node.func.value.id}.{node.func.attr}(...)")
    assert writes == []
