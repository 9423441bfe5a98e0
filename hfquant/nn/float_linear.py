"""`FloatLinear`: the `nn.Linear` layers hfquant leaves in float (lm_head, `modules_to_not_convert`, layers without a
group size), with a one-row product that reads a bfloat16 weight at memory speed on CPU.

Why: with bfloat16 on an AVX-512 CPU, PyTorch (2.13) sends `F.linear` to oneDNN, whose matrix-vector product for a
single activation row reads the weight well below the memory bandwidth, where ATen's own bf16 GEMV reads it at about
memory speed (timings: docs/performance.md, "Float layers"). At batch 1 decode the float lm_head is the largest
weight an int4 model reads per token, so this is where its time goes. With `torch.backends.mkldnn` disabled for the
call, the same `F.linear` takes ATen's GEMV (`cpublas` bf16 gemv, float32 accumulation): as accurate, but it sums in
another order, so an output may differ from oneDNN's by one bfloat16 rounding step (8 of 49152 outputs in a SmolLM2
lm_head test, both equally far from a float64 reference). From 2 rows on oneDNN's GEMM is as fast or faster, so only
single rows take this path; where hfquant's own bf16 GEMV (`csrc/bf16_cpu.c`: AVX512-BF16 dot products, or AVX2 + FMA
on the weights widened to float32 on CPUs without them, where ATen's one-row bfloat16 GEMV reads about 9 GB/s on a Zen
3 core against hfquant's 14-19: docs/performance.md, seventeenth session) was timed
faster for a layer's shape on this CPU (`hfquant.ops.plan.plan_bf16_row`, when `use_float_linear` runs; the layer
keeps the decision as `row_kernel`), it serves them instead. float16 and float32 gain nothing (oneDNN float16 and MKL float32 already run at memory
speed) and keep the default path.

The switch is the process-wide `torch.backends.mkldnn.enabled` flag, set for the duration of one call and restored
(also when the call raises). Another thread multiplying matrices at that moment also skips oneDNN: the same results
up to summation order, at that path's speed. Where the user disabled oneDNN, nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hfquant.ops import machine, native, plan
from hfquant.ops.gemv import RowKernel

__all__ = [
    "FloatLinear",
    "one_row_linear",
    "takes_one_row_path",
    "plain_linear",
    "use_float_linear",
    "restore_nn_linear",
]


def takes_one_row_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `one_row_linear` (ATen's GEMV instead of oneDNN) serves x @ weight.T: one activation row on CPU,
    bfloat16 activation and weight, and oneDNN enabled (else the default path is that GEMV already)."""
    return (
        x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.numel() == x.shape[-1]
        and torch.backends.mkldnn.enabled
    )


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, native_gemv: bool) -> torch.Tensor:
    """hfquant's bf16 GEMV where the layer's plan says so (`native_gemv`) and the tensors suit it, else ATen's."""
    if (
        native_gemv
        and x.is_contiguous()
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
    ):
        return native.bf16_gemv(x, weight, bias)
    return _linear_without_onednn(x, weight, bias)


def _linear_without_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        return torch.nn.functional.linear(x, weight, bias)
    finally:
        torch.backends.mkldnn.enabled = enabled


@torch.library.custom_op("hfquant::one_row_linear", mutates_args=())
def _one_row_linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, native_gemv: bool
) -> torch.Tensor:
    return _one_row(x, weight, bias, native_gemv)


@_one_row_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, native_gemv: bool) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def one_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    row_kernel: RowKernel = RowKernel.ATEN,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed by ATen's GEMV instead of oneDNN, or by hfquant's bf16 GEMV with
    `row_kernel` `RowKernel.BF16_GEMV` (a layer's `plan_bf16_row`; where x, weight and bias are contiguous).

    Args:
        x: (..., in_features) with one row in all (x.numel() == in_features), bfloat16, CPU.
        weight: (out_features, in_features) bfloat16, CPU.
        bias: (out_features,) or None.
        row_kernel: `RowKernel.ATEN` or `RowKernel.BF16_GEMV`.
    Returns:
        (..., out_features) bfloat16, the dot products accumulated in float32 and rounded once (oneDNN sums in
        another order: an output may differ from `F.linear`'s by one bfloat16 rounding step).

    Under `torch.compile` it is the custom op `hfquant::one_row_linear` (inductor cannot see the flag); in eager the
    flag is switched directly, which costs less than the custom op's dispatch (docs/performance.md). Meant for
    inference: under torch.compile with gradients required, call `F.linear` instead (the op has no backward).
    """
    native_gemv = row_kernel is RowKernel.BF16_GEMV
    if torch.compiler.is_compiling():
        return _one_row_linear_op(x, weight, bias, native_gemv)
    return _one_row(x, weight, bias, native_gemv)


class FloatLinear(nn.Linear):
    """An `nn.Linear` hfquant kept in float: same parameters and state dict as `nn.Linear`, and the same results up
    to float32 summation order, but a single bfloat16 row on CPU runs `one_row_linear`, and more rows multiply in
    float32 where the CPU has no bfloat16 GEMM (`machine.gemm_dtype`).

    hfquant turns the plain `nn.Linear` layers of a model it quantized into this class after loading
    (`use_float_linear`, which plans `row_kernel`) and back on `model.dequantize()` (`restore_nn_linear`).
    """

    row_kernel: RowKernel = RowKernel.ATEN
    """The kernel of one bfloat16 row (`plan.plan_bf16_row`): ATen's GEMV, or hfquant's bf16 GEMV."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_one_row_path(x, self.weight) and not (
            torch.compiler.is_compiling()
            and torch.is_grad_enabled()
            and (x.requires_grad or self.weight.requires_grad)
        ):
            return one_row_linear(x, self.weight, self.bias, self.row_kernel)
        gemm_dtype = machine.gemm_dtype(self.weight.dtype, self.weight.device)
        if gemm_dtype != self.weight.dtype and x.dtype == self.weight.dtype:  # no bfloat16 GEMM on this CPU
            bias = None if self.bias is None else self.bias.to(gemm_dtype)
            return F.linear(x.to(gemm_dtype), self.weight.to(gemm_dtype), bias).to(x.dtype)
        return super().forward(x)


def plain_linear(module: nn.Module) -> bool:
    """Whether `module` may become a `FloatLinear`: its type exactly `nn.Linear` (a subclass has its own forward) and
    its weight a plain tensor (a tensor subclass is another library's quantized weight, e.g. torchao's
    `Int4OpaqueTensor`, whose forward is that library's and which may not convert to float32)."""
    return type(module) is nn.Linear and type(module.weight) in (torch.Tensor, nn.Parameter)


def use_float_linear(model: nn.Module) -> int:
    """Make every `plain_linear` module of `model` a `FloatLinear` (class swap in place, as
    `torch.nn.utils.parametrize` does: parameters, ties and hooks stay), with the kernel of its single rows planned
    (`row_kernel`, `plan.plan_bf16_row`: timed per shape for bfloat16 CPU weights). Returns the number of layers
    changed."""
    changed = 0
    for module in model.modules():
        if plain_linear(module):
            module.__class__ = FloatLinear
            changed += 1
            module.row_kernel = plan.plan_bf16_row(module.weight)
    return changed


def restore_nn_linear(model: nn.Module) -> int:
    """Inverse of `use_float_linear`: every `FloatLinear` of `model` becomes an `nn.Linear` again. Returns the count."""
    changed = 0
    for module in model.modules():
        if type(module) is FloatLinear:
            module.__class__ = nn.Linear
            module.__dict__.pop("row_kernel", None)
            changed += 1
    return changed
