"""SINQ's column scales (`hfquant.core.sinq`) on the fastest path at hand, for the fold pre-pass of
`fold_column_scales` (`hfquant.integration.folding`): the Sinkhorn balancing in C (`csrc/sinq_cpu.c` through
`hfquant.ops.native.sinq_balance`) where hfquant's native library loads and the weights are on the CPU, else the torch
ops of `hfquant.core.sinq` / `hfquant.core.folding`. (Stored column scales, `method="sinq"` without a fold, keep
torch's steps and the bytes they had: `hfquant.nn.linear.quantize_to_buffers`.)

The C balancing reads the weights once per iteration (each read gives the row statistics of one step and the column
statistics of the next) and sums in float32; torch's batched products read them about twenty times, after a stacked
and a transposed copy, and round every sum to bfloat16. Both run
the same steps, so their scales agree up to those roundings (about one bfloat16 step on a few columns;
tests/ops/test_sinq_balance.py), not bit for bit. Measured: docs/performance.md ("The 4-bit default's load:
the fold pre-pass at memory speed").
"""

from __future__ import annotations

import torch

from hfquant.core import folding, sinq
from hfquant.core.scratch import Scratch
from hfquant.ops import native

__all__ = ["column_scale", "native_balance_available"]


def native_balance_available() -> bool:
    """Whether the C balancing can run here (the native library built and loaded on this x86-64 CPU)."""
    return native.built_library() is not None


def column_scale(
    weights: list[torch.Tensor],
    group_size: int,
    row_scales: list[torch.Tensor | None] | None = None,
    iterations: int = sinq.ITERATIONS,
    scratch: Scratch | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """The SINQ column scale (K,) float32 shared by the matrices `weights` (N_i, K) stacked along their rows, each
    row of matrix i first multiplied by `row_scales[i]` when given: `hfquant.core.folding.column_scale_of`'s result
    (`hfquant.core.sinq.column_scale` for one matrix without row scales), computed in C where it can be.

    Args:
        weights: the matrices (N_i, K), any float dtype, one width.
        group_size: columns per Sinkhorn tile, dividing K.
        row_scales: per matrix, None or (N_i,) float factors of its rows.
        iterations: balancing iterations (`hfquant.core.sinq.ITERATIONS`).
        scratch: the torch path's reusable buffers (`hfquant.core.scratch`); the C path needs none.
        threads: the C path's OpenMP threads (`hfquant.ops.native.sinq_balance`), None for OpenMP's default.
    Returns:
        (K,) float32, > 0, exactly representable in bfloat16; all ones for fewer than 2 rows in all.
    Raises:
        ValueError: the widths differ or group_size does not divide K.
        sinq.NonFiniteWeightError (a ValueError): a weight holds NaN/Inf.
    """
    widths = {w.shape[1] for w in weights}
    if len(widths) != 1:
        raise ValueError(f"matrices reading one input must have the same width; got widths {sorted(widths)}")
    k = widths.pop()
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={k}")
    if sum(w.shape[0] for w in weights) < 2:
        return torch.ones(k)
    if all(w.device.type == "cpu" for w in weights) and native_balance_available():
        try:
            inv_col = native.sinq_balance(weights, group_size, iterations, row_scales, threads)
        except ValueError as error:
            if "NaN or Inf" in str(error):
                raise sinq.NonFiniteWeightError(str(error)) from None
            raise
        return sinq.scale_from_balance(inv_col, group_size)
    return folding.column_scale_of(weights, group_size, row_scales, scratch=scratch, iterations=iterations)
