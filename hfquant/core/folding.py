"""SINQ column scales folded into the model: a plain uniform int4 checkpoint with most of SINQ's accuracy.

SINQ (`hfquant.core.sinq`, arXiv 2509.22944) quantizes W / c and keeps the column scale c (K,) beside the codes: the
layer computes (x * c) @ dequantize(q).T, a vector no other engine reads. When the layer's input x is made by a
linear producer, c can move into that producer instead, an exact identity of the float model (the same identity
SmoothQuant, arXiv 2211.10438, and AWQ, arXiv 2306.00978, use to move scales into preceding layers):

- a norm feeding the layer (RMSNorm: y = normalize(x) * g):  g' = g * c,  W' = W / c  (every consumer of y shares c:
  q/k/v share `input_layernorm`, gate/up share `post_attention_layernorm`; c comes from the consumers stacked);
- a projection whose rows feed the layer one to one:  P' = diag(c) P (and its bias),  W' = W / c.  `o_proj`'s input is
  the attention output, per head a mix of `v_proj`'s rows; `down_proj`'s is `act(gate) * up`, linear in `up_proj`'s
  rows. With grouped-query attention the query heads that read one key/value head share that head's rows, so their
  column scales are replaced by the geometric mean over the group (`share_across_heads`).

After the fold every matrix is quantized with plain RTN (`hfquant.core.rtn`): min/max RTN absorbs any per-row factor,
so SINQ's row scales change nothing and the column scales are all of its gain. A folded norm weight is rounded to its
own dtype (bfloat16); its consumers are divided by the rounded ratio g' / g (`fold_into_norm`), so the float model
stays the same function up to float32 rounding. Measured on SmolLM2-135M and the rule of `hfquant.core.allocation`:
docs/performance.md.

Everything here is tensor math on one decoder block at a time; which modules form a block is the integration layer's
business (`hfquant.integration.folding`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hfquant.core import sinq
from hfquant.core.scratch import Scratch

__all__ = ["Transform", "apply", "column_scale_of", "fold_into_norm", "share_across_heads", "tile_size"]


class Transform(NamedTuple):
    """What the fold does to one module's tensors (float32 vectors, every value > 0).

    row_scale: (N,) or None: row n of the weight, and bias[n], are multiplied by row_scale[n]; for a norm, its weight
        (and bias) of shape (N,) are multiplied elementwise.
    col_scale: (K,) or None: column k of the weight is divided by col_scale[k] (the bias is untouched).
    importance: (K,) float32 >= 0 or None: not a change of the tensors but the weight of each column of the folded
        weight in a block format's search (`HfQuantConfig.importance`, `hfquant.integration.bos_importance`); None:
        the type's data-free rule.
    """

    row_scale: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    importance: torch.Tensor | None = None

    def merged(self, other: Transform) -> Transform:
        """This transform with the vectors `other` sets (a module gets its row and column scales from two folds)."""
        return Transform(
            other.row_scale if other.row_scale is not None else self.row_scale,
            other.col_scale if other.col_scale is not None else self.col_scale,
            other.importance if other.importance is not None else self.importance,
        )


def apply(tensor: torch.Tensor, transform: Transform, transposed: bool = False) -> torch.Tensor:
    """`tensor` (a weight (N, K), or a bias / norm weight (N,)) with `transform` applied, in float32.

    Args:
        tensor: any float dtype. A 2-D tensor stored (K, N) (GPT-2 `Conv1D`) needs `transposed=True`.
        transform: the module's `Transform`; its vectors match N and K.
    Returns:
        float32 tensor of `tensor`'s shape.
    Raises:
        ValueError: a vector's length does not match the tensor.
    """
    out = tensor.float()
    if transposed:
        out = out.t()
    rows = out.shape[0]
    if transform.row_scale is not None:
        if transform.row_scale.shape != (rows,):
            raise ValueError(
                f"row scale of {tuple(transform.row_scale.shape)} does not fit a tensor of {tuple(tensor.shape)}"
            )
        out = out * (transform.row_scale[:, None] if out.dim() == 2 else transform.row_scale)
    if transform.col_scale is not None and out.dim() == 2:
        if transform.col_scale.shape != (out.shape[1],):
            raise ValueError(
                f"column scale of {tuple(transform.col_scale.shape)} does not fit a weight of {tuple(tensor.shape)}"
            )
        out = out / transform.col_scale
    return out.t() if transposed else out


def tile_size(in_features: int, group_sizes: list[int | None]) -> int:
    """Columns per Sinkhorn tile for a column scale shared by layers of these (effective) group sizes: the smallest
    one (None, per-channel, counts as `in_features`)."""
    return min((g or in_features) for g in group_sizes) if group_sizes else in_features


def column_scale_of(
    weights: list[torch.Tensor],
    group_size: int,
    row_scales: list[torch.Tensor | None] | None = None,
    scratch: Scratch | None = None,
    iterations: int = sinq.ITERATIONS,
) -> torch.Tensor:
    """The SINQ column scale (K,) float32 shared by matrices that read the same input: `sinq.column_scale` of the
    matrices (N_i, K) stacked along their rows, balanced per tile of `group_size` columns.

    Args:
        weights: the matrices (N_i, K), any float dtype.
        group_size: columns per Sinkhorn tile.
        row_scales: per matrix, None or (N_i,) factors its rows are multiplied by first (a row scale another fold puts
            on it), in bfloat16: only the statistics read these values.
        scratch: reusable buffers for the stacked copy and the statistics' temporaries (`hfquant.core.scratch`).
        iterations: balancing iterations (`sinq.ITERATIONS`).
    Raises:
        ValueError: the widths differ, group_size does not divide K, or a weight holds NaN/Inf.
    """
    widths = {w.shape[1] for w in weights}
    if len(widths) != 1:
        raise ValueError(f"matrices reading one input must have the same width; got widths {sorted(widths)}")
    row_scales = row_scales or [None] * len(weights)
    if len(weights) == 1 and row_scales[0] is None:
        return sinq.column_scale(weights[0], group_size, iterations, scratch=scratch)
    shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
    stacked = (
        torch.empty(shape, dtype=torch.bfloat16) if scratch is None else scratch.take("stacked", shape, torch.bfloat16)
    )
    start = 0
    for weight, rows in zip(weights, row_scales, strict=False):
        part = stacked[start : start + weight.shape[0]]
        part.copy_(weight)
        if rows is not None:
            part.mul_(rows.to(torch.bfloat16)[:, None])
        start += weight.shape[0]
    return sinq.column_scale(stacked, group_size, iterations, scratch=scratch)


def fold_into_norm(norm_weight: torch.Tensor, col_scale: torch.Tensor) -> tuple[Transform, torch.Tensor]:
    """Fold a column scale into the norm that makes the consumers' input.

    Args:
        norm_weight: (K,) the norm's weight g in its stored dtype (the rounding target).
        col_scale: (K,) float32 > 0, the consumers' column scale c.
    Returns:
        (the norm's `Transform`, the consumers' effective column scale (K,) float32). The norm's new weight
        g' = round(g * c) to g's dtype; consumers divide by g' / g, so that g' / (g' / g) = g exactly in float; where
        g is 0 (the column is never read) or g' underflows, c itself is used.
    """
    g = norm_weight.float()
    rounded = (g * col_scale).to(norm_weight.dtype).float()
    usable = (g != 0) & (rounded != 0) & torch.isfinite(rounded)
    effective = torch.where(usable, rounded / torch.where(usable, g, torch.ones_like(g)), col_scale)
    return Transform(row_scale=effective), effective


def share_across_heads(
    col_scale: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column scale of `o_proj` made foldable into `v_proj` under grouped-query attention.

    Query head h reads key/value head h // (num_heads // num_kv_heads) (transformers' `repeat_kv`), so the heads of a
    group must share one scale per head dimension: the geometric mean over the group.

    Args:
        col_scale: (num_heads * head_dim,) float32, `o_proj`'s column scale, head-major.
    Returns:
        (v_proj's row scale (num_kv_heads * head_dim,), o_proj's column scale expanded back (num_heads * head_dim,)).
    Raises:
        ValueError: num_heads is not a multiple of num_kv_heads, or the width is not a multiple of num_heads.
    """
    width = col_scale.shape[0]
    if num_kv_heads <= 0 or num_heads % num_kv_heads or width % num_heads:
        raise ValueError(
            f"cannot share a column scale of width {width} across {num_heads} query and {num_kv_heads} key/value heads"
        )
    head_dim, repeats = width // num_heads, num_heads // num_kv_heads
    grouped = col_scale.float().log().reshape(num_kv_heads, repeats, head_dim).mean(dim=1).exp()  # (kv, d)
    return grouped.reshape(-1), grouped[:, None, :].expand(num_kv_heads, repeats, head_dim).reshape(-1)
