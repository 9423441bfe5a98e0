"""HQ3_R: hfquant's own 3-bit format of 16-weight sub-blocks with 6-bit log scales under one float16 scale per row.

HQ3_NL (`hq3.py`) spends 16 of its 112 bits per 32 weights on a float16 scale. HQ3_R scales every 16 weights, as
llama.cpp's Q3_K does, but codes each sub-block's scale in 6 bits relative to one float16 per row instead of per
256-weight super-block (so rows of 384 or 576 weights, which 256 does not divide, take it): 64 weights are 24 bytes
of codes and 3 bytes of scales, 3.375 bits per weight, plus a 2-byte row header (16 / K bits per weight: 3.403 at
K = 576). The codes stand for HQ3_NL's grid `hq3.NL_VALUES` (chosen over the uniform grid -4..3 on SmolLM2 and
MiniLM with the 3.5-bit budget: docs/performance.md). It is not a GGUF type: the exports refuse it by name.

A row of K weights (K % 64 == 0) is 2 + K / 64 * 27 bytes, little endian:

| bytes | field | holds |
| --- | --- | --- |
| 0-1 | D f16 | the row's scale: the largest magnitude of its sub-block scales |
| then per block of 64 weights, 27 bytes: | | |
| 0-2 | sc[3] | four 6-bit fields, sub-block i's (weights 16 i .. 16 i + 15) in bits 6 i .. 6 i + 5 of the little-endian 24-bit value; field = e \\| (s << 5) |
| 3-14 | codes of weights 0-31 | HQ3_0's 12 bytes (qs[8], qh[4]: `hq3.pack_codes`) |
| 15-26 | codes of weights 32-63 | the same |

Weight j of sub-block i is `(-1)^s * (D * LEVELS[e]) * NL_VALUES[q[j]]`, `LEVELS[e] = 2^(-e / 8)` in float32 (e in
[0, 31]: 1/8-octave steps down to 0.068 D); the product D * LEVELS[e] rounds to float32 first.

`quantize_hq3_r(weight, importance=None)`: per sub-block, the weighted search of a scale (62 candidates where the
largest-magnitude weight lands at 0.7-1.3 of either end of the grid, each the least-squares scale of its nearest
codes; the least weighted error kept, in float32 without rounding); D = the row's largest |scale| rounded to float16;
then per sub-block the codable scales of both signs at the 6 levels around that scale (e0 - 3 .. e0 + 2, e0 the first
level at most its magnitude) with their nearest codes, the least weighted error kept (the first on ties: + before -,
e ascending; an exhaustive search of all 64 finds a better one for 0.2-3% of sub-blocks and at most 0.2% less total
weighted error: tests/core/test_blocks_hq3r.py). Sums accumulate in float64 and round once to float32 (`legacy._sum`),
so the C search (`hfquant.ops.native.block_quantize("hq3_r", ...)`) writes the same bytes.
"""

from __future__ import annotations

import torch

from .hq3 import _FACTORS, _NL_GRID, pack_codes, unpack_codes
from .legacy import _safe_div, _signed_absmax, _sum, f16_bytes, importance_blocks

__all__ = ["QK", "SUB", "TYPE_SIZE", "ROW_HEADER", "LEVELS", "search_targets", "quantize_hq3_r", "dequantize_hq3_r"]

QK = 64
"""Weights per block."""
SUB = 16
"""Weights per sub-block (one 6-bit scale)."""
TYPE_SIZE = 27
"""Bytes per block: sc (3), two HQ3_0 code groups (12 each)."""
ROW_HEADER = 2
"""Bytes before a row's blocks: its float16 scale D."""
LEVELS = torch.exp2(-torch.arange(32, dtype=torch.float32) / 8)
"""(32,) float32: the magnitude of a sub-block scale relative to D for each 5-bit e (the C codec takes these values)."""

_GRID = _NL_GRID
_ROUNDS = 3
_CHUNK = 4096


def search_targets() -> torch.Tensor:
    """(62,) float32: where a sub-block's largest weight lands on the grid in the first search (both ends times
    `_FACTORS`)."""
    return torch.cat([_GRID.low * _FACTORS, _GRID.high * _FACTORS])


def _error(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-blocks x, w (..., 16) and scales d (...): the nearest grid values q (..., 16) and sum w (x - d q)^2."""
    q = _GRID.nearest(x * _safe_div(torch.ones_like(d), d).unsqueeze(-1))
    diff = x - d.unsqueeze(-1) * q
    return q, _sum(w * (diff * diff))


def _continuous(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(n, 16) sub-blocks -> (n,) float32 searched scales (not rounded): per target, the nearest codes and the
    least-squares scale for them; the one of largest gain (sum w q x)^2 / sum w q^2 (least error) kept, the first on
    ties."""
    d = _signed_absmax(x).unsqueeze(-1) / search_targets()  # (n, T)
    xs, ws = x.unsqueeze(1), w.unsqueeze(1)
    q = _GRID.nearest(xs * _safe_div(torch.ones_like(d), d).unsqueeze(-1))
    wq = ws * q
    sqx, sqq = _sum(wq * xs), _sum(wq * q)
    gain = _safe_div(sqx * sqx, sqq)
    best = gain.argmax(-1, keepdim=True)
    return torch.gather(_safe_div(sqx, sqq), -1, best).squeeze(-1)


_WINDOW = torch.arange(-3, 3)
"""Levels tried around the searched scale: e0 - 3 .. e0 + 2, e0 the first level at most its magnitude."""


def _scale_fields(
    x: torch.Tensor, w: torch.Tensor, top: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 16) sub-blocks, (n,) row scale D, (n,) searched scales -> (n,) 6-bit fields and (n, 16) code indices of the
    best codable scale among both signs of the levels in `_WINDOW` around |d| (the first on ties: + before -, e
    ascending)."""
    magnitude = top.unsqueeze(-1) * LEVELS  # (n, 32)
    e0 = (magnitude > d.abs().unsqueeze(-1)).sum(-1, keepdim=True)  # levels decrease: the first at most |d|
    e = e0 + _WINDOW  # (n, 6)
    valid = (e >= 0) & (e <= 31)
    e = e.clamp(0, 31)
    chosen = torch.gather(magnitude, -1, e)
    scales = torch.cat([chosen, -chosen], -1)  # (n, 12): sign-major order
    _, err = _error(x.unsqueeze(1), w.unsqueeze(1), scales)
    err = torch.where(torch.cat([valid, valid], -1), err, torch.full_like(err, float("inf")))
    pick = err.argmin(-1, keepdim=True)
    s = torch.gather(scales, -1, pick).squeeze(-1)
    field = torch.gather(torch.cat([e, e + 32], -1), -1, pick).squeeze(-1)
    codes = _GRID.index(x * _safe_div(torch.ones_like(s), s).unsqueeze(-1))
    return field, codes


def _half(value: torch.Tensor) -> torch.Tensor:
    return value.clamp(-65504.0, 65504.0).half().float()


def quantize_hq3_r(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """HQ3_R rows of `weight` (rows, K) float, K % 64 == 0 (the search in the module docstring).

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, 2 + K // 64 * 27) uint8.
    Raises:
        ValueError: K not a multiple of 64, or `importance` of another shape, negative or not finite.
    """
    if weight.dim() != 2 or weight.shape[1] % QK:
        raise ValueError(f"hq3_r quantizes (rows, K) weights with K a multiple of {QK}; got {tuple(weight.shape)}")
    x = weight.detach().to(torch.float32)
    rows, k = x.shape
    xs, ws = x.reshape(-1, SUB), importance_blocks(importance, x, SUB).reshape(-1, SUB)
    d = torch.cat([_continuous(xs[i : i + _CHUNK], ws[i : i + _CHUNK]) for i in range(0, max(len(xs), 1), _CHUNK)])
    top = _half(d.reshape(rows, -1).abs().amax(-1) if k else torch.zeros(rows))  # (rows,)
    tops = top.repeat_interleave(k // SUB)
    parts = [
        _scale_fields(xs[i : i + _CHUNK], ws[i : i + _CHUNK], tops[i : i + _CHUNK], d[i : i + _CHUNK])
        for i in range(0, len(xs), _CHUNK)
    ]
    field = torch.cat([p[0] for p in parts]).reshape(rows, -1, 4)
    codes = torch.cat([p[1] for p in parts]).reshape(rows, -1, 2, 32)
    return encode(top, field, codes)


def encode(top: torch.Tensor, field: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """D (rows,), fields (rows, nb, 4) in [0, 63], codes (rows, nb, 2, 32) in [0, 7] -> (rows, 2 + nb * 27) uint8."""
    f = field.to(torch.int64)
    packed = f[..., 0] | (f[..., 1] << 6) | (f[..., 2] << 12) | (f[..., 3] << 18)
    sc = torch.stack([(packed >> (8 * b)) & 255 for b in range(3)], -1).to(torch.uint8)
    body = torch.cat([sc, pack_codes(codes).flatten(-2)], -1).reshape(top.shape[0], -1)
    return torch.cat([f16_bytes(top), body], -1)


def dequantize_hq3_r(data: torch.Tensor) -> torch.Tensor:
    """(rows, 2 + nb * 27) uint8 HQ3_R rows -> (rows, nb * 64) float32."""
    rows = data.shape[0]
    top = data[:, :ROW_HEADER].flatten().clone().view(torch.float16).float()  # a fresh buffer: even strides
    blocks = data[:, ROW_HEADER:].reshape(rows, -1, TYPE_SIZE)
    sc = blocks[..., :3].to(torch.int64)
    packed = sc[..., 0] | (sc[..., 1] << 8) | (sc[..., 2] << 16)
    field = torch.stack([(packed >> (6 * i)) & 63 for i in range(4)], -1)  # (rows, nb, 4)
    scale = top.view(rows, 1, 1) * LEVELS[field & 31]
    scale = torch.where(field >= 32, -scale, scale)
    codes = unpack_codes(blocks[..., 3:].reshape(rows, -1, 2, 12)).reshape(rows, -1, 4, SUB)
    return (scale.unsqueeze(-1) * _GRID.value(codes.long())).reshape(rows, -1)
