"""Column scales of SINQ, Sinkhorn-normalized quantization (Müller et al. 2025, arXiv 2509.22944, Algorithm 1).

SINQ writes a weight as W ~ diag(r) Q diag(c): besides the usual scale of each (row, group), every input column k
gets a scale c[k]. Both vectors come from a Sinkhorn-Knopp-style balancing of the matrix: alternately divide every
column, then every row, by its standard deviation, so that no row or column is much wider than the others, and keep
the iterate whose *imbalance* (the largest standard deviation of a row or column over the smallest) is lowest. A
column with outliers gets a large c[k], so the rest of its groups' rows are not stretched to cover it.

hfquant stores the weight divided by the column scale with plain round-to-nearest (`hfquant.core.rtn`), and the
column scale beside it: RTN's min/max scale of each (row, group) already absorbs any per-row factor, so the row
scales r change nothing and are not kept. As in the paper, the balancing runs per tile of `group_size` columns
(every row of the tile), so a column's scale depends only on its own group of columns.

    c = column_scale(w, group_size)                       # (K,) float32, > 0, rounded to the stored bfloat16
    q = RTN(w / c)  ->  w_hat = dequantize(q) * c          # the layer computes x @ w_hat.T = (x * c) @ dequantize(q).T

Cost: `iterations` passes of two standard deviations over a bfloat16 copy of the weight (one tensor at a time). The
same balancing runs in C for the folds where hfquant's native library loads (`hfquant.ops.balance`,
`csrc/sinq_cpu.c`): one read of the weight per iteration, with float32 sums where these torch ops round each sum to
bfloat16; `scale_from_balance` turns either result into the column scale.
"""

from __future__ import annotations

import torch

from hfquant.core import rtn
from hfquant.core.scratch import Scratch

__all__ = ["ITERATIONS", "NonFiniteWeightError", "balance", "column_scale", "scale_from_balance"]

ITERATIONS = 4
"""Balancing iterations. The paper uses 16; on SmolLM2-135M at int4 group 64 and 128, 1 to 16 iterations gave
perplexities within 0.02 of each other (docs/performance.md); each iteration costs four batched matrix-vector
products over the weight."""
_STD_RANGE = (1e-3, 1e3)  # standard deviations are clamped to this range, relative to the tile's smallest one
_STATS_DTYPE = torch.bfloat16
_LOG_SCALE_LIMIT = 8.0  # |log c| stays below this, so w / c and x * c stay far from bfloat16 overflow


class NonFiniteWeightError(ValueError):
    """The weight holds NaN or Inf: no column scale exists."""


def column_scale(
    weight: torch.Tensor, group_size: int, iterations: int = ITERATIONS, scratch: Scratch | None = None
) -> torch.Tensor:
    """The SINQ column scale of a weight (N, K), balanced per tile of `group_size` columns.

    Args:
        weight: (N, K) float tensor, any float dtype; finite.
        group_size: columns per tile; divides K.
        iterations: balancing iterations; the iterate with the lowest imbalance is kept (0 gives all ones).
        scratch: where the two weight-sized bfloat16 temporaries go (`hfquant.core.scratch`), when computing many
            scales in a row; the result is the same with or without it.
    Returns:
        (K,) float32, every value > 0 and exactly representable in bfloat16 (`rtn.SCALE_DTYPE`), so that the stored
        scale and the one the codes were computed with are the same number. A tile whose rows or columns are
        constant (standard deviation 0) keeps scale 1 for those columns.
        A weight of one row has nothing to balance: all ones.
    Raises:
        ValueError: group_size does not divide K.
        NonFiniteWeightError (a ValueError): the weight holds NaN/Inf.
    """
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    if n < 2:
        return torch.ones(k)
    return scale_from_balance(balance(weight, group_size, iterations, scratch), group_size)


def balance(
    weight: torch.Tensor,
    group_size: int,
    iterations: int = ITERATIONS,
    scratch: Scratch | None = None,
    stats_dtype: torch.dtype = _STATS_DTYPE,
) -> torch.Tensor:
    """The Sinkhorn balancing of `column_scale` in torch ops: the inverse column factors (K,) float32 of the kept
    iterate, per tile of `group_size` columns (`scale_from_balance` makes the column scale of them).

    Args:
        weight: (N, K) float tensor, N >= 2; group_size divides K (the caller checks).
        stats_dtype: the dtype the statistics' products read and return (bfloat16; float64 gives a reference for the
            C balancing of `hfquant.ops.balance`).
    Raises:
        NonFiniteWeightError: the weight holds NaN/Inf.
    """
    n, k = weight.shape
    # The statistics are computed in bfloat16 (the weights' own precision in a bf16 checkpoint; the products sum in
    # float32), which halves the bytes each pass reads; the quantization itself uses the weight as given.
    shape = (k // group_size, n, group_size)
    source = weight.detach().to(stats_dtype).reshape(n, k // group_size, group_size).transpose(0, 1)
    if scratch is None:
        tiles = source.contiguous()
        squares = tiles * tiles  # (G, N, g)
    else:
        tiles = scratch.take("sinq.tiles", shape, stats_dtype).copy_(source)
        squares = torch.mul(tiles, tiles, out=scratch.take("sinq.squares", shape, stats_dtype))

    def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _bmm(a, b, stats_dtype)

    # The current iterate is tiles * inv_row * inv_col. The sums of a row (column) are the sums of tiles and of
    # squares weighted by the other side's factors: batched matrix-vector products, no weight-sized temporary.
    inv_col = torch.ones(tiles.shape[0], group_size, 1)  # (G, g, 1)
    inv_row = torch.ones(tiles.shape[0], 1, n)  # (G, 1, N)
    row_sum = bmm(tiles, inv_col)
    if not torch.isfinite(row_sum).all():  # a NaN or Inf anywhere makes its row's sum one too
        raise NonFiniteWeightError("the weight holds NaN or Inf values; SINQ cannot balance it")
    row_std = _std(row_sum, bmm(squares, inv_col * inv_col), group_size)  # (G, N, 1)
    best_inv_col, best = inv_col, None
    for step in range(iterations + 1):
        col_sum, col_squares = bmm(inv_row, tiles), bmm(inv_row * inv_row, squares)  # (G, 1, g)
        col_std = _std(col_sum, col_squares, n).transpose(1, 2) * inv_col  # (G, g, 1), of the current iterate
        score = _imbalance(col_std, row_std)
        if best is None:
            best = score
        else:
            better = score < best
            best = torch.where(better, score, best)
            best_inv_col = torch.where(better[:, None, None], inv_col, best_inv_col)
        if step == iterations:
            break
        inv_col = inv_col / _relative(col_std)
        row_sum, row_squares = bmm(tiles, inv_col), bmm(squares, inv_col * inv_col)  # (G, N, 1)
        row_std = _std(row_sum, row_squares, group_size) * inv_row.transpose(1, 2)
        factor = _relative(row_std)
        inv_row, row_std = inv_row / factor.transpose(1, 2), row_std / factor
    return best_inv_col.reshape(k).float()


def scale_from_balance(inv_col: torch.Tensor, group_size: int) -> torch.Tensor:
    """The column scale (K,) float32 of `column_scale` from the balancing's inverse column factors `inv_col` (K,):
    1 / inv_col with each tile's log scale centred on 0 (its mean factor is absorbed by the group scales anyway) and
    bounded by `_LOG_SCALE_LIMIT`, rounded to bfloat16."""
    k = inv_col.shape[0]
    log_col = -torch.log(inv_col.float().reshape(k // group_size, group_size, 1))
    log_col = (log_col - log_col.mean(dim=1, keepdim=True)).clamp(-_LOG_SCALE_LIMIT, _LOG_SCALE_LIMIT)
    return torch.exp(log_col).reshape(k).to(rtn.SCALE_DTYPE).float()


def _bmm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = _STATS_DTYPE) -> torch.Tensor:
    """Batched product of a statistics operand and float factors, in `dtype`, returned as float32 (float64 for a
    float64 `dtype`, whose statistics then stay in float64)."""
    return torch.bmm(a.to(dtype), b.to(dtype)).to(torch.promote_types(dtype, torch.float32))


def _std(total: torch.Tensor, squares: torch.Tensor, count: int) -> torch.Tensor:
    """Sample standard deviation from the sum and the sum of squares of `count` values (float32)."""
    return ((squares - total * total / count).clamp_min(0) / max(count - 1, 1)).sqrt()


def _relative(std: torch.Tensor) -> torch.Tensor:
    """(G, M, 1) standard deviations over the smallest of their tile, clamped to `_STD_RANGE`; 1 where a row or column
    is constant (its standard deviation is 0: nothing to scale)."""
    floor = std.masked_fill(std <= 0, float("inf")).amin(dim=1, keepdim=True)
    ratio = (std / floor).clamp(*_STD_RANGE)
    return torch.where(std > 0, ratio, torch.ones_like(ratio))


def _imbalance(col_std: torch.Tensor, row_std: torch.Tensor) -> torch.Tensor:
    """(G,) largest over smallest non-zero standard deviation of the columns (G, g, 1) and rows (G, N, 1) of each
    tile."""
    stds = torch.cat((col_std, row_std), dim=1)[..., 0]
    tiny = torch.finfo(torch.float32).tiny
    return stds.amax(dim=1) / stds.masked_fill(stds <= 0, float("inf")).amin(dim=1).clamp_min(tiny)
