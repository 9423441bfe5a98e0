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

Cost: `iterations` passes of two standard deviations over a float32 copy of the weight (one tensor at a time).
"""

from __future__ import annotations

import torch

from hfquant.core import rtn

__all__ = ["ITERATIONS", "column_scale"]

ITERATIONS = 16
"""Balancing iterations (the paper's default order)."""
_STD_RANGE = (1e-3, 1e3)  # standard deviations are clamped to this range, relative to the tile's smallest one
_LOG_SCALE_LIMIT = 8.0  # |log c| stays below this, so w / c and x * c stay far from bfloat16 overflow


def _imbalance(tiles: torch.Tensor) -> torch.Tensor:
    """(G,) largest over smallest standard deviation of the rows and columns of each (G, N, g) tile."""
    stds = torch.cat((tiles.std(dim=1), tiles.std(dim=2)), dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return stds.amax(dim=1) / stds.amin(dim=1)


def column_scale(weight: torch.Tensor, group_size: int, iterations: int = ITERATIONS) -> torch.Tensor:
    """The SINQ column scale of a weight (N, K), balanced per tile of `group_size` columns.

    Args:
        weight: (N, K) float tensor, any float dtype; finite.
        group_size: columns per tile; divides K.
        iterations: balancing iterations; the iterate with the lowest imbalance is kept (0 gives all ones).
    Returns:
        (K,) float32, every value > 0 and exactly representable in bfloat16 (`rtn.SCALE_DTYPE`), so that the stored
        scale and the one the codes were computed with are the same number. A tile whose rows or columns are
        constant (standard deviation 0) keeps scale 1 for those columns.
        A weight of one row has nothing to balance: all ones.
    Raises:
        ValueError: group_size does not divide K, or the weight holds NaN/Inf.
    """
    n, k = weight.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    if n < 2:
        return torch.ones(k)
    tiles = weight.detach().float().reshape(n, k // group_size, group_size).transpose(0, 1)  # (G, N, g)
    if not torch.isfinite(tiles).all():
        raise ValueError("the weight holds NaN or Inf values; SINQ cannot balance it")
    log_col = torch.zeros(tiles.shape[0], 1, group_size)
    log_row = torch.zeros(tiles.shape[0], n, 1)
    best_col = log_col.clone()
    best = _imbalance(tiles)
    for _ in range(iterations):
        current = tiles * torch.exp(-log_col - log_row)
        col_std = current.std(dim=1, keepdim=True)
        floor = col_std.amin(dim=2, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        log_col = log_col + torch.log((col_std / floor).clamp(*_STD_RANGE)) * (col_std > 0)
        current = tiles * torch.exp(-log_col - log_row)
        row_std = current.std(dim=2, keepdim=True)
        floor = row_std.amin(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        log_row = log_row + torch.log((row_std / floor).clamp(*_STD_RANGE)) * (row_std > 0)
        score = _imbalance(tiles * torch.exp(-log_col - log_row))
        better = score < best
        best = torch.where(better, score, best)
        best_col = torch.where(better[:, None, None], log_col, best_col)
    # centre each tile's log scale on 0 (its mean factor is absorbed by the group scales anyway), then bound it
    best_col = (best_col - best_col.mean(dim=2, keepdim=True)).clamp(-_LOG_SCALE_LIMIT, _LOG_SCALE_LIMIT)
    return torch.exp(best_col).reshape(k).to(rtn.SCALE_DTYPE).float()
