"""Gradients w.r.t. the input through a quantized matmul, weights frozen (LoRA / QLoRA-style fine-tuning).

`quantized_matmul_trainable` is `kernels.quantized_matmul` wrapped in one custom op (`hfquant::quantized_matmul`)
with an explicit autograd rule: the forward runs the same kernel as inference; the backward saves only the stored
tensors (codes, scales, zero points: no float copy of the weight) and computes grad_x = grad_y @ w_hat one row chunk
of w_hat at a time (`hfquant::quantized_matmul_backward`), so the transient float weight stays under about
`_CHUNK_BYTES`. Both ops have fake implementations, so `torch.compile(fullgraph=True)` traces them as single nodes.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from hfquant.core import blocks, packing, rtn
from hfquant.ops import block_layout, kernels, machine
from hfquant.ops.kernels import Kernel, KernelPlan, LayerTensors

__all__ = ["quantized_matmul_trainable", "dequantized_rows"]

# Float bytes of the weight rows dequantized per backward step.
_CHUNK_BYTES = 4 * 2**20
# The CPU int4 layout is blocked by 64 output rows: chunks start on a block boundary.
_ROW_ALIGN = 64


def dequantized_rows(
    plan: KernelPlan, tensors: LayerTensors, start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows [start, stop) of the dequantized weight, (stop - start, in_features) in `dtype`.

    `tensors.weight` is the runtime weight of `plan.kernel` (the stored layout except for the int4 kernels); `start`
    must be a multiple of 64 for `Kernel.INT4PACK_MM_CPU`. Reads the stored scales and zero points of `tensors`.

    Raises:
        ValueError: `Kernel.INT4PACK_MM_CUDA` row slices other than the whole weight (that layout is restored whole).
    """
    rows = slice(start, stop)
    weight, kernel = tensors.weight, plan.kernel
    if plan.block:
        stored = block_layout.storage_rows(weight, plan.in_features, plan.block, plan.block_rows, start, stop)
        return blocks.dequantize(plan.block, stored).to(dtype)
    if kernel == Kernel.INT4PACK_MM_CPU:
        codes = packing.from_cpu_int4_layout(weight[rows], stop - start, plan.in_features)
    elif kernel == Kernel.INT4PACK_MM_CUDA:
        if (start, stop) != (0, plan.out_features):
            raise ValueError("the CUDA int4 layout is restored whole: pass start=0, stop=out_features")
        codes = kernels.restore_codes(kernel, weight, plan.out_features, plan.in_features)
    elif plan.bits == 4:
        codes = packing.unpack_int4(weight[rows])
    else:
        codes = weight[rows]
    zp = None if tensors.zero_point is None else tensors.zero_point[rows]
    return rtn.dequantize_weight(codes, tensors.scale[rows], zp, plan.bits, plan.symmetric, dtype)


@torch.library.custom_op("hfquant::quantized_matmul", mutates_args=())
def _quantized_matmul_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    zero_point: torch.Tensor | None,
    scale_zero: torch.Tensor | None,
    plan: str,
) -> torch.Tensor:
    """`kernels.quantized_matmul` with the plan passed as its `KernelPlan.key` (custom ops take plain values)."""
    tensors = LayerTensors(weight, scale, zero_point, scale_zero)
    y = kernels.quantized_matmul(KernelPlan.from_key(plan), tensors, x)
    return y.clone() if y.data_ptr() == x.data_ptr() else y


@_quantized_matmul_op.register_fake
def _(x, weight, scale, zero_point, scale_zero, plan):
    return x.new_empty((*x.shape[:-1], KernelPlan.from_key(plan).out_features))


@torch.library.custom_op("hfquant::quantized_matmul_backward", mutates_args=())
def _quantized_matmul_backward_op(
    grad: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None, plan: str
) -> torch.Tensor:
    """grad_x (..., K) = grad (..., N) @ w_hat, one chunk of w_hat's rows at a time (`dequantized_rows`)."""
    plan = KernelPlan.from_key(plan)
    tensors = LayerTensors(weight, scale, zero_point)
    in_features, out_features = plan.in_features, plan.out_features
    grad2d = grad.reshape(-1, out_features)
    grad_x = torch.zeros((grad2d.shape[0], in_features), dtype=torch.float32, device=grad.device)
    if plan.kernel == Kernel.INT4PACK_MM_CUDA:
        step = out_features
    else:
        step = max(1, _CHUNK_BYTES // (4 * in_features))
        step = max(_ROW_ALIGN, step // _ROW_ALIGN * _ROW_ALIGN)
    gemm_dtype = machine.gemm_dtype(grad.dtype, grad.device)  # float32 where the CPU has no bfloat16 GEMM
    for start in range(0, out_features, step):
        stop = min(out_features, start + step)
        w = dequantized_rows(plan, tensors, start, stop, grad.dtype)
        grad_x.add_(torch.mm(grad2d[:, start:stop].to(gemm_dtype), w.to(gemm_dtype)))
    return grad_x.to(grad.dtype).reshape(*grad.shape[:-1], in_features)


@_quantized_matmul_backward_op.register_fake
def _(grad, weight, scale, zero_point, plan):
    return grad.new_empty((*grad.shape[:-1], KernelPlan.from_key(plan).in_features))


def _setup_context(ctx, inputs, output):
    x, weight, scale, zero_point, _scale_zero, plan = inputs
    ctx.save_for_backward(weight, scale, zero_point)
    ctx.plan = plan


def _backward(ctx, grad):
    weight, scale, zero_point = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = _quantized_matmul_backward_op(grad.contiguous(), weight, scale, zero_point, ctx.plan)
    return grad_x, None, None, None, None, None


_quantized_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def quantized_matmul_trainable(plan: KernelPlan, tensors: LayerTensors, x: torch.Tensor) -> torch.Tensor:
    """`kernels.quantized_matmul` (x (..., K) float -> (..., N) in x's dtype) that also gives grad_x.

    When `x` requires grad (and grad mode is on), the product goes through the `hfquant::quantized_matmul` custom op
    and its autograd rule (`tensors.zero_point` must then be the stored zero points, not None, for an asymmetric
    layer); otherwise it is exactly `kernels.quantized_matmul` (the inference path, unchanged). The stored tensors
    never get a gradient (they are integer codes and frozen scales).
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return kernels.quantized_matmul(plan, tensors, x)
    return _quantized_matmul_op(x, *tensors, _float_product_plan(plan).key)


@functools.lru_cache(maxsize=1024)
def _float_product_plan(plan: KernelPlan) -> KernelPlan:
    """`plan` without the few-row block GEMV (`gemv_max_rows` 1): under autograd a few rows take the float product,
    whose gradient the backward's rule is. Cached: a training step asks once per layer call, and a new plan builds
    its JSON `key`."""
    return plan if plan.gemv_max_rows <= 1 else dataclasses.replace(plan, gemv_max_rows=1)
