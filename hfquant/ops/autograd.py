"""Gradients w.r.t. the input through a quantized matmul, weights frozen (LoRA / QLoRA-style fine-tuning).

`quantized_matmul_trainable` is `kernels.quantized_matmul` wrapped in one custom op (`hfquant::quantized_matmul`)
with an explicit autograd rule: the forward runs the same kernel as inference; the backward saves only the stored
tensors (codes, scales, zero points: no float copy of the weight) and computes grad_x = grad_y @ w_hat one row chunk
of w_hat at a time (`hfquant::quantized_matmul_backward`), so the transient float weight stays under about
`_CHUNK_BYTES`. Both ops have fake implementations, so `torch.compile(fullgraph=True)` traces them as single nodes.
"""

from __future__ import annotations

import torch

from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.ops import kernels
from hfquant.ops.kernels import Kernel

__all__ = ["quantized_matmul_trainable", "dequantized_rows"]

# Float bytes of the weight rows dequantized per backward step.
_CHUNK_BYTES = 4 * 2**20
# The CPU int4 layout is blocked by 64 output rows: chunks start on a block boundary.
_ROW_ALIGN = 64


def dequantized_rows(
    kernel: Kernel,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
    out_features: int,
    in_features: int,
    start: int,
    stop: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows [start, stop) of the dequantized weight, (stop - start, in_features) in `dtype`.

    `weight` is the runtime weight of `kernel` (the stored layout except for the int4 kernels); `start` must be a
    multiple of 64 for `Kernel.INT4PACK_MM_CPU`. Raises ValueError for `Kernel.INT4PACK_MM_CUDA` row slices other
    than the whole weight (that layout is restored whole).
    """
    rows = slice(start, stop)
    if kernel == Kernel.INT4PACK_MM_CPU:
        codes = packing.from_cpu_int4_layout(weight[rows], stop - start, in_features)
    elif kernel == Kernel.INT4PACK_MM_CUDA:
        if (start, stop) != (0, out_features):
            raise ValueError("the CUDA int4 layout is restored whole: pass start=0, stop=out_features")
        codes = kernels.restore_codes(kernel, weight, out_features, in_features)
    elif bits == 4:
        codes = packing.unpack_int4(weight[rows])
    else:
        codes = weight[rows]
    zp = None if zero_point is None else zero_point[rows]
    return rtn.dequantize_weight(codes, scale[rows], zp, bits, symmetric, dtype)


@torch.library.custom_op("hfquant::quantized_matmul", mutates_args=())
def _quantized_matmul_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scale_zero: torch.Tensor | None,
    kernel: str,
    bits: int,
    group_size: int,
    symmetric: bool,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    fmt = StoredFormat(bits, group_size, symmetric)
    y = kernels.quantized_matmul(
        Kernel(kernel),
        x,
        weight,
        scale,
        zero_point,
        scale_zero,
        fmt,
        in_features=in_features,
        out_features=out_features,
    )
    return y.clone() if y.data_ptr() == x.data_ptr() else y


@_quantized_matmul_op.register_fake
def _(x, weight, scale, zero_point, scale_zero, kernel, bits, group_size, symmetric, in_features, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("hfquant::quantized_matmul_backward", mutates_args=())
def _quantized_matmul_backward_op(
    grad: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    kernel: str,
    bits: int,
    symmetric: bool,
    in_features: int,
    out_features: int,
) -> torch.Tensor:
    kernel = Kernel(kernel)
    grad2d = grad.reshape(-1, out_features)
    grad_x = torch.zeros((grad2d.shape[0], in_features), dtype=torch.float32, device=grad.device)
    if kernel == Kernel.INT4PACK_MM_CUDA:
        step = out_features
    else:
        step = max(1, _CHUNK_BYTES // (4 * in_features))
        step = max(_ROW_ALIGN, step // _ROW_ALIGN * _ROW_ALIGN)
    for start in range(0, out_features, step):
        stop = min(out_features, start + step)
        w = dequantized_rows(
            kernel, weight, scale, zero_point, bits, symmetric, out_features, in_features, start, stop, grad.dtype
        )
        grad_x.add_(torch.mm(grad2d[:, start:stop], w))
    return grad_x.to(grad.dtype).reshape(*grad.shape[:-1], in_features)


@_quantized_matmul_backward_op.register_fake
def _(grad, weight, scale, zero_point, kernel, bits, symmetric, in_features, out_features):
    return grad.new_empty((*grad.shape[:-1], in_features))


def _setup_context(ctx, inputs, output):
    x, weight, scale, zero_point, _scale_zero, kernel, bits, _group, symmetric, in_features, out_features = inputs
    ctx.save_for_backward(weight, scale, zero_point)
    ctx.args = (kernel, bits, symmetric, in_features, out_features)


def _backward(ctx, grad):
    weight, scale, zero_point = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = _quantized_matmul_backward_op(grad.contiguous(), weight, scale, zero_point, *ctx.args)
    return grad_x, None, None, None, None, None, None, None, None, None, None


_quantized_matmul_op.register_autograd(_backward, setup_context=_setup_context)


def quantized_matmul_trainable(
    kernel: Kernel,
    x: torch.Tensor,
    runtime_weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scale_zero: torch.Tensor | None,
    fmt: StoredFormat,
    *,
    in_features: int,
    out_features: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """`kernels.quantized_matmul` (x (..., K) float -> (..., N) in x's dtype) that also gives grad_x.

    When `x` requires grad (and grad mode is on), the product goes through the `hfquant::quantized_matmul` custom op
    and its autograd rule; otherwise it is exactly `kernels.quantized_matmul` (the inference path, unchanged). The
    stored tensors never get a gradient (they are integer codes and frozen scales). Arguments as for
    `kernels.quantized_matmul` (`int8_activations` applies to the inference path only).
    """
    if not (x.requires_grad and torch.is_grad_enabled()):
        return kernels.quantized_matmul(
            kernel,
            x,
            runtime_weight,
            scale,
            zero_point,
            scale_zero,
            fmt,
            in_features=in_features,
            out_features=out_features,
            int8_activations=int8_activations,
        )
    return _quantized_matmul_op(
        x,
        runtime_weight,
        scale,
        zero_point,
        scale_zero,
        Kernel(kernel).value,
        fmt.bits,
        fmt.group_size,
        fmt.symmetric,
        in_features,
        out_features,
    )
