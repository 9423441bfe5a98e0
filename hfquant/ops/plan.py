"""A layer's kernel plan, decided once per layer and device: `plan_kernel` (quantized layers) and `plan_bf16_row`
(bfloat16 layers kept in float).

Everything that says which kernel multiplies a layer's activations is decided here, from what is known when the
layer is prepared, and carried as one immutable value (`kernels.KernelPlan`) that the layer stores:

- the GEMM kernel (`kernels.select_kernel`: the aten kernel that fits the format and passed its probe on the device,
  else `Kernel.DEQUANT`), and from how many rows its layers run the chunked dequantized GEMM (`kernels.plain_plan`);
- the one-row (decode) kernel, in eager and in compiled graphs: hfquant's GEMV where it works here (`hfquant.ops.gemv`)
  and was timed faster on the layer's shape on this CPU (`hfquant.ops.choice`, its disk cache and
  `HFQUANT_KERNEL_CHOICE`), in compiled graphs only where it beats aten by more than a custom op's call cost
  (`gemv.custom_op_overhead_s`, 0 where the dispatcher operators load); else aten's kernel;
- how the GEMV is called (`gemv.RowCall`: the dispatcher operator where `torch_ops.loaded()`, else ctypes in eager and
  the Python custom op in compiled graphs);
- the activation format: with `DecodeActivations.INT8`, the W4A8 GEMV for one row of a CPU int4 layer where it works
  (`gemv.native_int4_a8_works`, whole blocks, groups of a multiple of 32);
- whether the chunked GEMM of a CPU int4 layer dequantizes in C (`gemv.native_int4_works`, N % 64 == 0);
- for a block format (`StoredFormat.block`), the block GEMV (`RowKernel.BLOCK_GEMV`) for one bfloat16 row where it
  works for the type (`gemv.native_block_works`) and, on small shapes (`UNTIMED_BLOCK_WEIGHTS`), was timed faster
  than the torch dequantization path; with it, the weight's layout (`KernelPlan.block_rows`: rows interleaved by 8
  where that GEMV runs for the type, `block_layout.rows_for`).

The probes and timings behind these are cached per process behind their functions, so planning many layers of one
shape measures once.
"""

from __future__ import annotations

import dataclasses

import torch

from hfquant.core.format import StoredFormat
from hfquant.ops import block_layout, choice, gemv, kernels, torch_ops
from hfquant.ops.gemv import RowCall, RowKernel
from hfquant.ops.kernels import DecodeActivations, Kernel, KernelPlan

__all__ = ["plan_kernel", "plan_bf16_row"]


def plan_kernel(
    fmt: StoredFormat,
    in_features: int,
    out_features: int,
    device: torch.device | str,
    dtype: torch.dtype,
    activations: DecodeActivations | str = DecodeActivations.FLOAT,
) -> KernelPlan:
    """The plan of a layer of this stored format and shape on `device` (see the module docstring).

    Args:
        fmt: the stored format.
        in_features, out_features: K and N.
        device: where the layer's tensors are.
        dtype: the activation dtype the layer was prepared for (its int4 (scale, zero) pairs are built in it); the
            one-row kernels are timed for bfloat16 layers.
        activations: "float" or "int8" (`DecodeActivations`).
    Raises:
        ValueError: `activations` is not "float" or "int8"; a bad `HFQUANT_KERNEL_CHOICE`.
    """
    activations = DecodeActivations(activations)
    device = torch.device(device)
    kernel = kernels.select_kernel(fmt, in_features=in_features, out_features=out_features, device=device)
    plan = dataclasses.replace(
        kernels.plain_plan(kernel, fmt, in_features, out_features, device.type), activations=activations
    )
    if device.type != "cpu":
        return plan
    if fmt.block is not None:
        return _block_rows(plan, dtype)
    if kernel == Kernel.INT4PACK_MM_CPU:
        return _int4_rows(plan, dtype)
    if kernel == Kernel.INT8PACK_MM and dtype == torch.bfloat16:
        return _int8_rows(plan)
    return plan


def _int4_rows(plan: KernelPlan, dtype: torch.dtype) -> KernelPlan:
    """`plan` of a CPU int4 layer with its one-row kernels and its C dequantization for the chunked GEMM."""
    n, k, group_size, block = plan.out_features, plan.in_features, plan.group_size, plan.cpu_int4_block
    native_dequant = n % 64 == 0 and gemv.native_int4_works()  # the 64-row blocks of the AVX-512 layout
    plan = dataclasses.replace(plan, native_dequant=native_dequant)
    whole_blocks = block > 0 and n % block == 0 and group_size % 32 == 0
    if plan.activations is DecodeActivations.INT8 and whole_blocks and gemv.native_int4_a8_works():
        row = RowKernel.INT4_A8 if block == 64 else RowKernel.INT4_A8_AVX2
        return _with_row(plan, row, True)
    if native_dequant:
        row = RowKernel.INT4_GEMV
    elif block == 32 and whole_blocks and gemv.native_int4_avx2_works():
        row = RowKernel.INT4_GEMV_AVX2
    else:
        return plan
    if dtype != torch.bfloat16:  # not timed: a bfloat16 row of such a layer takes the GEMV
        return _with_row(plan, row, True)
    eager = choice.int4_row_uses_native(n, k, group_size)
    return _with_row(plan, row if eager else RowKernel.ATEN, eager and _wins_compiled(n, k, group_size))


def _int8_rows(plan: KernelPlan) -> KernelPlan:
    """`plan` of a CPU int8 layer (bfloat16 activations) with its one-row kernel."""
    n, k = plan.out_features, plan.in_features
    if k % 16 or not gemv.native_int8_works() or not choice.int8_row_uses_native(n, k):
        return plan
    return _with_row(plan, RowKernel.INT8_GEMV, _wins_compiled(n, k, None))


UNTIMED_BLOCK_WEIGHTS = 1 << 18
"""Block layers of at least this many weights (N * K) take the block GEMV without timing it: on every shape of that
size timed so far the torch path (the whole weight dequantized to float, then a product) was 1.5x to thousands of
times slower, and timing it took about 5 s per shape of a 1.2B model on 2 cores (most of `from_gguf`'s time)."""


def block_gemv_max_rows(n: int, k: int) -> int:
    """The most bfloat16 activation rows (a short prompt's prefill) an N x K block layer runs as one block GEMV per row,
    each row quantized to int8 blocks as in decode, rather than dequantizing its whole weight for a float product:
    64 from 2**21 weights, 24 below. The dequantization's cost per weight is about the same at every size, the GEMV's
    about twice as high on small layers. Measured with one thread on AMD EPYC Zen 3 (docs/performance.md, "Few-row
    prefill of block formats"): the 1.2B benchmark model's 4-bit default (layers of 4-16M weights) at 8 / 32 / 63
    tokens 0.46 / 1.69 / 3.09 s against 3.00 / 3.50 / 4.57; SmolLM2-135M (0.3-1.8M) at 8 / 24 / 32 tokens
    0.16 / 0.27 / 0.45 s against 0.39 / 0.34 / 0.33."""
    return 64 if n * k >= 1 << 21 else 24


def _block_rows(plan: KernelPlan, dtype: torch.dtype) -> KernelPlan:
    """`plan` of a CPU layer in a block format with the block GEMV for one bfloat16 row, and for each row of calls of
    up to `block_gemv_max_rows` rows, where it works for the type here (`gemv.native_block_works`) and, on a
    layer of fewer than `UNTIMED_BLOCK_WEIGHTS` weights, was timed faster than the torch dequantization path on the
    shape (one row timed: the few-row calls follow it). With the block GEMV the weight takes the R8 layout where that
    GEMV runs for the type here (`block_layout.rows_for`)."""
    name, n, k = plan.block, plan.out_features, plan.in_features
    if dtype != torch.bfloat16 or not gemv.native_block_works(name):
        return plan
    rows = block_layout.rows_for(name, n)
    few_rows = dataclasses.replace(plan, gemv_max_rows=block_gemv_max_rows(n, k), block_rows=rows)
    if n * k >= UNTIMED_BLOCK_WEIGHTS:
        return _with_row(few_rows, RowKernel.BLOCK_GEMV, True)
    if not choice.block_row_uses_native(name, n, k):
        return plan
    timings = choice.block_row_timings(name, n, k)
    in_graphs = timings is None or timings[0] + gemv.custom_op_overhead_s() < timings[1]
    return _with_row(few_rows, RowKernel.BLOCK_GEMV, in_graphs)


def _with_row(plan: KernelPlan, row: RowKernel, in_graphs: bool) -> KernelPlan:
    """`plan` whose one row runs `row` in eager, and in compiled graphs where `in_graphs`, called the cheapest way."""
    if row is RowKernel.ATEN:
        return plan
    operators = torch_ops.loaded()
    return dataclasses.replace(
        plan,
        row=row,
        row_call=RowCall.OPERATOR if operators else RowCall.CTYPES,
        compiled_row=row if in_graphs else RowKernel.ATEN,
        compiled_row_call=RowCall.OPERATOR if operators else RowCall.CUSTOM_OP,
    )


def _wins_compiled(n: int, k: int, group_size: int | None) -> bool:
    """Whether the GEMV, timed (GEMV s, aten s) in eager, stays faster when a compiled graph calls it as a custom op.
    Without timings (a forced choice) the eager choice stands."""
    timings = choice.row_timings(n, k, group_size)
    if timings is None:
        return True
    native_s, aten_s = timings
    return native_s + gemv.custom_op_overhead_s() < aten_s


def plan_bf16_row(weight: torch.Tensor) -> RowKernel:
    """The kernel of one bfloat16 row of a layer kept in float with this (N, K) weight (`FloatLinear.row_kernel`):
    `RowKernel.BF16_GEMV` where hfquant's bf16 GEMV works here (`gemv.native_bf16_works`, K % 32 == 0) and was timed
    faster on the shape on this CPU (`choice.bf16_row_uses_native`), else `RowKernel.ATEN`. Only bfloat16 CPU weights
    are timed."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return RowKernel.ATEN
    n, k = weight.shape
    if k % 32 or not gemv.native_bf16_works() or not choice.bf16_row_uses_native(n, k):
        return RowKernel.ATEN
    return RowKernel.BF16_GEMV
