"""Round-to-nearest (RTN) weight quantization: scales, zero points, quantize, dequantize.

Pure tensor math, no modules and no transformers. A weight `w` of shape (out_features, in_features) is split
along its input dimension into groups of `group_size` columns; each (row, group) gets one `scale` and, when
asymmetric, one integer `zero_point`:

    q = clamp(round(w / scale) + zero_point, qmin, qmax)        (quantize)
    w_hat = (q - zero_point) * scale                             (dequantize)

Asymmetric (min/max affine, the zero of the float range kept exactly representable, as in Jacob et al. 2018,
"Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference", eq. 1-2):
    lo = min(min(w_g), 0), hi = max(max(w_g), 0), scale = (hi - lo) / (2**bits - 1), zero_point = round(-lo / scale),
    q in [0, 2**bits - 1].  Example at 4 bits: w_g = [-0.3, 0.0, 0.45] -> scale = 0.05, zero_point = 6,
    q = [0, 6, 15], w_hat = [-0.3, 0.0, 0.45].
Symmetric: scale = max|w_g| / (2**(bits-1) - 1), zero_point = 0, q in [-(2**(bits-1) - 1), 2**(bits-1) - 1].

Scales are stored in bfloat16 (the range of float32, half the bytes), rounded *up* to the next bfloat16 value so
that no weight is clamped: every element then satisfies |w - w_hat| <= scale / 2 (half a quantization step),
up to float32 rounding of the division. An all-zero group gets scale 1 and dequantizes to exact zeros.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "value_range",
    "SCALE_DTYPE",
    "QuantizedTensor",
    "effective_group_size",
    "qrange",
    "compute_scale_zero_point",
    "codes_for_groups",
    "dequantize_groups",
    "quantize_weight",
    "dequantize_weight",
]

SCALE_DTYPE = torch.bfloat16
"""dtype of stored scales."""

# Rows quantized at once: bounds the float32 working copy to about this many bytes whatever the layer size.
_CHUNK_BYTES = 4 * 2**20


class QuantizedTensor(NamedTuple):
    """Integer codes and their parameters for one weight of shape (N, K) = (out_features, in_features).

    q: (N, K) int8 when symmetric at 8 bits (values in [-127, 127]); uint8 otherwise (values in [0, 2**bits - 1];
        at 4 bits symmetric the code is the signed value + 8, in [1, 15]). Not yet nibble-packed.
    scale: (N, K // group_size) bfloat16, > 0.
    zero_point: (N, K // group_size) uint8 when asymmetric, else None (the implicit zero is 0 at 8 bits, 8 at 4).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None


def effective_group_size(in_features: int, group_size: int | None, bits: int) -> int | None:
    """Group size a layer with `in_features` inputs actually uses, or None if it must stay in float.

    Per-channel (`group_size=None`) gives `in_features` (one group per row). A group size that does not divide
    `in_features` is replaced by the largest power of two >= 32 that does (e.g. 128 asked, 576 inputs -> 64).
    4-bit codes are packed two per byte, so at 4 bits `in_features` must be even.
    """
    if in_features <= 0:
        return None
    if bits == 4 and in_features % 2:
        return None
    if group_size is None:
        return in_features
    if in_features % group_size == 0:
        return group_size
    largest = in_features & -in_features  # largest power of two dividing in_features
    return largest if largest >= 32 else None


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the integer values before storage: [-(2**(b-1)-1), 2**(b-1)-1] or [0, 2**b - 1]."""
    if symmetric:
        m = 2 ** (bits - 1) - 1
        return -m, m
    return 0, 2**bits - 1


def _round_up_to_scale_dtype(scale: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up so the stored scale never makes the range narrower."""
    rounded = scale.to(SCALE_DTYPE)
    low = rounded.float() < scale
    if low.any():
        rounded = torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)
    return rounded


def compute_scale_zero_point(
    groups: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point per group.

    Args:
        groups: (rows, n_groups, group_size), any float dtype (min/max are exact in it).
    Returns:
        scale: (rows, n_groups) bfloat16, strictly positive.
        zero_point: (rows, n_groups) float32 holding integers in [0, 2**bits - 1] when asymmetric, else None.
    Raises:
        ValueError: the weight holds NaN or Inf (no meaningful scale exists).
    """
    # amax and amin separately: torch.aminmax over a short inner dimension is much slower on CPU (torch 2.13;
    # docs/performance.md)
    low, high = groups.amin(dim=-1).float(), groups.amax(dim=-1).float()
    return _scale_zero_point_of_range(low, high, bits, symmetric)


def _scale_zero_point_of_range(
    low: torch.Tensor, high: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_scale_zero_point` for groups whose range is [low, high] (float32, (rows, n_groups))."""
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        scale = torch.maximum(low.abs(), high.abs()) / qmax
    else:
        low = low.clamp_(max=0)
        # hi/n - lo/n rather than (hi - lo)/n: the difference of two finite float32 values can overflow.
        scale = high.clamp_(min=0) / (qmax - qmin) - low / (qmax - qmin)
    if not torch.isfinite(scale).all():
        raise ValueError("cannot quantize a weight that contains NaN or Inf values")
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = _round_up_to_scale_dtype(scale)
    if symmetric:
        return scale, None
    zero_point = torch.round(-low / scale.float()).clamp_(qmin, qmax)
    return scale, zero_point


CLIPPING = ("minmax", "mse")
"""How a group's range is chosen: "minmax" (its min and max, nothing clipped) or "mse" (`search_scale_zero_point`)."""

MSE_RATIOS = tuple(1.0 - 0.02 * i for i in range(16))
"""Range shrink factors `search_scale_zero_point` tries: 1.0 (min/max) down to 0.70."""


def search_scale_zero_point(
    groups: torch.Tensor, bits: int, symmetric: bool, ratios: tuple[float, ...] = MSE_RATIOS
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point per group with an MSE-searched clipping range (`clipping="mse"`).

    For each factor r of `ratios` the range [r * min, r * max] (r * max|w| when symmetric) is quantized with
    round-to-nearest; each group keeps the factor whose dequantized values have the smallest squared error
    sum((w - w_hat)^2). This is the grid search over clipping ranges of llama.cpp's k-quant quantizers
    (`make_qkx2_quants`, ggml-quants.c) and of AWQ's clip search (Lin et al. 2023, arXiv 2306.00978, sec. 3.3,
    without calibration data: the weight error stands in for the output error). Factor 1.0 is min/max, so the error
    is never above RTN's. Cost: len(ratios) quantize-dequantize passes over the groups (16 by default).

    Args:
        groups: (rows, n_groups, group_size) float32.
    Returns:
        as `compute_scale_zero_point`.
    Raises:
        ValueError: the weight holds NaN or Inf.
    """
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    best_scale, best_zero, best_error = None, None, None
    for ratio in ratios:
        scale, zero_point = _scale_zero_point_of_range(low * ratio, high * ratio, bits, symmetric)
        codes = codes_for_groups(groups, scale, zero_point, bits, symmetric)
        values = _from_codes(codes, bits, symmetric).reshape(groups.shape)
        error = (dequantize_groups(values, scale, zero_point) - groups).square_().sum(dim=-1)
        if best_error is None:
            best_scale, best_zero, best_error = scale, zero_point, error
            continue
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        if zero_point is not None:
            best_zero = torch.where(better, zero_point, best_zero)
    return best_scale, best_zero


def codes_for_groups(
    groups: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int, symmetric: bool
) -> torch.Tensor:
    """Stored integer codes (see `QuantizedTensor`) of `groups` (rows, n_groups, gs), same shape.

    q = clamp(floor(w / scale + zero_point + 1/2), qmin, qmax): round half up, computed as one fused
    `addcdiv` on the float input (no float32 copy of a bf16 weight), then a truncating cast. The stored offset
    (+8 for 4-bit symmetric codes, +128 then reinterpretation for int8) is folded into the same addition.
    """
    if symmetric:
        offset = 8.5 if bits == 4 else 128.5  # codes v + 8 in [1, 15], or v + 128 in [1, 255] (int8 after xor)
        low, high = (1, 15) if bits == 4 else (1, 255)
        shift = torch.full_like(scale, offset, dtype=torch.float32)
    else:
        low, high = 0, 2**bits - 1
        shift = zero_point + 0.5
    q = torch.addcdiv(shift.unsqueeze(-1), groups, scale.float().unsqueeze(-1))
    codes = q.clamp_(low, high).to(torch.uint8)
    if symmetric and bits == 8:
        return (codes ^ 0x80).view(torch.int8)  # u - 128: values in [-127, 127]
    return codes


def dequantize_groups(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w_hat = (q - zero_point) * scale for q of shape (rows, n_groups, gs), computed in float32, cast to `dtype`."""
    values = q.to(torch.float32)
    if zero_point is not None:
        values -= zero_point.to(torch.float32).unsqueeze(-1)
    return (values * scale.float().unsqueeze(-1)).to(dtype)


def _from_codes(codes: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """Inverse of `_to_codes`: stored codes -> int32 values."""
    values = codes.to(torch.int32)
    if symmetric and bits == 4:
        values -= 8
    return values


def _rows_per_chunk(in_features: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(1, in_features)))


@torch.no_grad()
def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool, clipping: str = "minmax"
) -> QuantizedTensor:
    """RTN-quantize a 2-D float weight (N, K) row chunk by row chunk (bounded float32 working memory).

    Args:
        weight: (N, K) float tensor (any float dtype, any device).
        bits: 8 or 4.
        group_size: columns per group; must divide K (use `effective_group_size` first).
        symmetric: see module docstring.
        clipping: "minmax" (each group's range) or "mse" (`search_scale_zero_point`); the stored format is the same.
    Returns:
        `QuantizedTensor` on the weight's device.
    Raises:
        ValueError: weight not 2-D, group_size not dividing K, NaN/Inf in the weight, or an unknown `clipping`.
    """
    if clipping not in CLIPPING:
        raise ValueError(f"clipping={clipping!r} is not supported; allowed values are {list(CLIPPING)}")
    choose = compute_scale_zero_point if clipping == "minmax" else search_scale_zero_point
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    n_groups = k // group_size
    code_dtype = torch.int8 if (symmetric and bits == 8) else torch.uint8
    q_out = torch.empty((n, k), dtype=code_dtype, device=weight.device)
    scale_out = torch.empty((n, n_groups), dtype=SCALE_DTYPE, device=weight.device)
    zp_out = None if symmetric else torch.empty((n, n_groups), dtype=torch.uint8, device=weight.device)
    step = _rows_per_chunk(k)
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        groups = weight[rows].reshape(-1, n_groups, group_size)
        if not groups.is_floating_point():
            raise ValueError(f"expected a float weight, got {weight.dtype}")
        # one float32 copy of the chunk (exact): the reductions and addcdiv below then run vectorized, without
        # converting bf16/fp16 element by element in each of them
        groups = groups.float()
        scale, zero_point = choose(groups, bits, symmetric)
        q_out[rows] = codes_for_groups(groups, scale, zero_point, bits, symmetric).reshape(-1, k)
        scale_out[rows] = scale
        if zp_out is not None:
            zp_out[rows] = zero_point.to(torch.uint8)
    return QuantizedTensor(q_out, scale_out, zp_out)


@torch.no_grad()
def dequantize_weight(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    symmetric: bool,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float weight (N, K) in `dtype` from unpacked codes (N, K), scale (N, G) and zero point (N, G) or None."""
    n, k = codes.shape
    n_groups = scale.shape[1]
    values = _from_codes(codes, bits, symmetric).reshape(n, n_groups, k // n_groups)
    return dequantize_groups(values, scale, zero_point, dtype).reshape(n, k)


def value_range(x: torch.Tensor) -> tuple[float, float, bool]:
    """(min, max, all finite) of a float tensor in one pass (`torch.aminmax`: NaN and inf reach the min or max),
    about 30x cheaper than `torch.isfinite(x).all()`, which builds a bool tensor the size of x. Empty: (0, 0, True)."""
    if x.numel() == 0:
        return 0.0, 0.0, True
    low, high = (float(v) for v in torch.aminmax(x))
    return low, high, math.isfinite(low) and math.isfinite(high)
