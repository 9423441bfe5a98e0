"""hfquant's stored codes re-blocked into GGUF blocks for llama.cpp (Llama-family models).

GGUF's quantized types work on blocks of 32 weights along a row, each with its own fp16 scale (ggml's block formats,
`ggml-common.h` in llama.cpp):

    Q8_0: block_q8_0 {half d; int8 qs[32]}            w = d * q
    Q4_0: block_q4_0 {half d; uint8 qs[16]}           w = d * (q - 8), q of element i in the low nibble of qs[i],
                                                      of element i + 16 in the high nibble
    Q4_1: block_q4_1 {half d; half m; uint8 qs[16]}   w = d * q + m, nibbles as Q4_0

hfquant's groups are 32..256 wide, so a group is 1..8 blocks sharing its scale: codes copy as they are.
- int8 per-channel symmetric -> Q8_0 (d = the channel's scale);
- int4 symmetric (implicit zero point 8) -> Q4_0 (d = scale);
- int4 asymmetric -> Q4_1 with d = scale and m = -scale * zero_point (w = (q - z) * s).

d is hfquant's bfloat16 scale written as fp16, which is exact only inside fp16's range and precision: a scale that
fp16 cannot hold is refused by name. m = -s * z rounds to fp16 and is inexact in some blocks: `reblock_int4` reports
how many and the largest weight error, and never hides it.

llama.cpp stores the rows of q_proj and k_proj permuted (its rotary embedding pairs dimensions i and i + d/2 of a head
differently from transformers): `llama_permutation` gives the row order, applied to codes and scales alike.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["reblock_int8", "reblock_int4", "llama_permutation", "Reblocked"]

BLOCK = 32


class Reblocked:
    """One tensor's GGUF bytes: `data` (N, blocks * block bytes) uint8, `kind` ("Q8_0" / "Q4_0" / "Q4_1"), and for
    Q4_1 the number of blocks whose m is inexact in fp16 and the largest weight error that makes."""

    def __init__(self, data: np.ndarray, kind: str, inexact_blocks: int = 0, max_error: float = 0.0):
        self.data, self.kind, self.inexact_blocks, self.max_error = data, kind, inexact_blocks, max_error


def _fp16_scales(scale: torch.Tensor, name: str) -> torch.Tensor:
    """`scale` (float) as float16, exactly, or ValueError naming the tensor."""
    wide = scale.float()
    half = wide.to(torch.float16)
    bad = half.float() != wide
    if bool(bad.any()):
        value = wide[bad][0].item()
        raise ValueError(
            f"{name}: the scale {value!r} has no exact fp16 value (GGUF blocks store fp16 scales); "
            "export it to compressed-tensors instead, or quantize that layer to keep it in float"
        )
    return half


def _per_block(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, G) per-group values -> (N, K / 32) per-block values (a group covers group_size / 32 blocks)."""
    return values.repeat_interleave(group_size // BLOCK, dim=1)


def reblock_int8(codes: torch.Tensor, scale: torch.Tensor, name: str) -> Reblocked:
    """Q8_0 blocks of an int8 per-channel layer.

    Args:
        codes: (N, K) int8, K a multiple of 32.
        scale: (N,) or (N, 1) float scales.
        name: the tensor, for error messages.
    Returns:
        `Reblocked` with (N, K / 32 * 34) bytes.
    Raises:
        ValueError: K is not a multiple of 32, or a scale has no exact fp16 value.
    """
    n, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"{name}: in_features={k} is not a multiple of {BLOCK}, the GGUF block")
    d = _fp16_scales(scale.reshape(n, 1), name).expand(n, k // BLOCK)
    out = np.empty((n, k // BLOCK, 2 + BLOCK), dtype=np.uint8)
    out[..., :2] = d.contiguous().numpy().view(np.uint8).reshape(n, k // BLOCK, 2)
    out[..., 2:] = codes.contiguous().numpy().view(np.uint8).reshape(n, k // BLOCK, BLOCK)
    return Reblocked(out.reshape(n, -1), "Q8_0")


def reblock_int4(
    codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int, name: str
) -> Reblocked:
    """Q4_0 (symmetric) or Q4_1 (asymmetric) blocks of an int4 group-wise layer.

    Args:
        codes: (N, K) uint8 codes in [0, 15].
        scale: (N, K / group_size) float scales.
        zero_point: (N, K / group_size) uint8 zero points, or None (symmetric: implicit 8).
        group_size: a multiple of 32 dividing K.
        name: the tensor, for error messages.
    Returns:
        `Reblocked` with (N, K / 32 * 18) bytes (Q4_0) or (N, K / 32 * 20) bytes (Q4_1).
    Raises:
        ValueError: group_size is not a multiple of 32, or a scale has no exact fp16 value.
    """
    n, k = codes.shape
    if group_size % BLOCK or k % group_size:
        raise ValueError(
            f"{name}: group_size={group_size} is not a multiple of {BLOCK}, the GGUF block; GGUF cannot "
            "hold this layer without requantizing it"
        )
    blocks = k // BLOCK
    d = _per_block(_fp16_scales(scale, name), group_size)
    q = codes.reshape(n, blocks, BLOCK).numpy()
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # element i low nibble, i + 16 high nibble
    parts = [d.contiguous().numpy().view(np.uint8).reshape(n, blocks, 2)]
    kind, inexact, max_error = "Q4_0", 0, 0.0
    if zero_point is not None:
        kind = "Q4_1"
        exact_m = -scale.double() * zero_point.double()
        m = exact_m.to(torch.float16)
        wrong = m.double() != exact_m
        inexact = int(_per_block(wrong, group_size).sum())
        max_error = float((m.double() - exact_m).abs().max()) if inexact else 0.0
        parts.append(_per_block(m, group_size).contiguous().numpy().view(np.uint8).reshape(n, blocks, 2))
    parts.append(packed)
    return Reblocked(np.concatenate(parts, axis=-1).reshape(n, -1), kind, inexact, max_error)


def llama_permutation(rows: int, heads: int) -> torch.Tensor:
    """The row order llama.cpp stores q_proj / k_proj in: within each head of `rows / heads` rows, rows [0, 2, 4, ...,
    1, 3, 5, ...] of the head's two halves interleaved as llama.cpp's convert script permutes them (the inverse of
    transformers' `_reverse_permute_weights` in its GGUF reader). Returns (rows,) int64 indices: stored = w[perm]."""
    head_dim = rows // heads
    index = torch.arange(rows).reshape(heads, 2, head_dim // 2).transpose(1, 2).reshape(rows)
    return index
