"""HQ3_0: hfquant's own 3-bit format of 32-weight blocks (3.5 bits per weight), for rows 256 does not divide.

llama.cpp has no 3-bit type for rows of 384 or 576 weights (MiniLM, SmolLM2): its 3-bit types are 256-weight
super-blocks and its fallback for other rows is IQ4_NL (4.5 bits per weight). HQ3_0 is Q4_0 with one bit less: a
float16 scale and 32 codes of 3 bits. It is not a GGUF type: the GGUF and compressed-tensors exports refuse it by
name. Bytes of a block (14, little endian):

| bytes | field | holds |
| --- | --- | --- |
| 0-1 | d f16 | the block's scale |
| 2-9 | qs[8] | bits 0-1 of each code: code j's in bits 2 (j // 8), 2 (j // 8) + 1 of qs[j % 8] |
| 10-13 | qh[4] | bit 2 of each code: code j's is bit j of the little-endian uint32 |

Weight j of the block is d * (q[j] - 4), q[j] in [0, 7] (codes [5, 0, ...] with q[8] = 3 give qs[0] = 0b1101 = 0x0D,
qh bit 0 = 1).

The uniform grid -4..3 was measured against an MSE-optimal non-uniform grid of 8 values (Lloyd iterations on
SmolLM2's blocks: -127, -73, -41, -15, 9, 35, 65, 106): the non-uniform grid has 14% less weight error but a worse
SmolLM2 perplexity (3.56x bf16 against 2.75x with every 576-wide layer in the format), so the grid keeps a zero.

HQ3_NL has HQ3_0's bytes, but code q[j] stands for `NL_VALUES[q[j]]` (-127, -87, -56, -29, 0, 29, 58, 94: weighted
Lloyd iterations on the blocks the 3.5-bit budget quantizes, under the search's importance, with the zero kept):
weight j is d * NL_VALUES[q[j]]. With the 3.5-bit budget it gives SmolLM2 1.857x bf16 perplexity against HQ3_0's
1.913x and MiniLM cosine 0.9427 against 0.9325 (docs/performance.md); the values are int8, so the decode kernel looks
them up with a byte shuffle as IQ4_NL's does.

`quantize_hq3_0(weight, importance=None)` searches each block's scale (`legacy.fit_symmetric`: 2 x 31 candidates
around both ends of the grid, least-squares refit, float16 rounding in the loop), minimizing the error weighted by
`importance` (`blocks.quantize` without one: the type's data-free default, `importance.RULES["hq3_0"]`, which
favours the large weights); `reference_hq3_0` is the round-to-nearest baseline (the largest-magnitude weight maps
to code 0, as llama.cpp's Q4_0 reference does). The C search (`hfquant.ops.native.block_quantize("hq3_0", ...)`, which quantize-on-load takes when the library is built)
writes the same bytes about 100x faster (SmolLM2's 576 x 1536 matrices: 0.2 s against 23 s on 2 busy cores).
"""

from __future__ import annotations

import torch

from .legacy import (
    Grid,
    _safe_div,
    _signed_absmax,
    as_blocks,
    f16_bytes,
    f16_field,
    fit_symmetric,
    importance_blocks,
)

__all__ = [
    "QK",
    "TYPE_SIZE",
    "NL_VALUES",
    "dequantize_hq3_0",
    "quantize_hq3_0",
    "dequantize_hq3_nl",
    "quantize_hq3_nl",
    "reference_hq3_0",
    "pack_codes",
    "unpack_codes",
    "search_targets",
]

QK = 32
"""Weights per block."""
TYPE_SIZE = 14
"""Bytes per block: d (2), qs (8), qh (4)."""

NL_VALUES = (-127, -87, -56, -29, 0, 29, 58, 94)
"""HQ3_NL's grid: the value of each 3-bit code (the C kernels' `kvalues_hq3nl` / `HQ3_NL_GRID`)."""

_GRID = Grid(list(range(-4, 4)))
_NL_GRID = Grid(list(NL_VALUES))
_FACTORS = torch.linspace(0.7, 1.3, 31)
_LANES = torch.arange(4, dtype=torch.int32) * 2  # shift of code j's low bits in qs[j % 8]: 2 (j // 8)
_BIT = 1 << torch.arange(8, dtype=torch.int32)


def search_targets(name: str = "hq3_0") -> torch.Tensor:
    """(62,) float32: where the search of `name` ("hq3_0" or "hq3_nl") lets a block's largest weight land, both ends
    of its grid times the factors (`legacy._symmetric_candidates`' order), as the C search (`native.block_quantize`)
    takes them."""
    grid = _NL_GRID if name == "hq3_nl" else _GRID
    return torch.cat([grid.low * _FACTORS, grid.high * _FACTORS])


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes in [0, 7] -> (..., 12) uint8: qs[8] (low 2 bits) then qh[4] (bit 2), as the table above."""
    c = codes.to(torch.int32)
    low = (c & 3).reshape(*c.shape[:-1], 4, 8)  # [..., j // 8, j % 8]
    qs = (low << _LANES.view(4, 1)).sum(-2)
    qh = ((c >> 2) & 1).reshape(*c.shape[:-1], 4, 8)
    qh = (qh * _BIT).sum(-1)
    return torch.cat([qs, qh], dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """(..., 12) uint8 -> (..., 32) int32 codes in [0, 7], the inverse of `pack_codes`."""
    qs, qh = packed[..., :8].to(torch.int32), packed[..., 8:].to(torch.int32)
    low = (qs.unsqueeze(-2) >> _LANES.view(4, 1)) & 3  # (..., 4, 8): code 8 i + l
    high = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1  # (..., 4, 8): code 8 i + b
    return (low | (high << 2)).reshape(*packed.shape[:-1], 32)


def _encode(d: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """d (rows, nb), codes (rows, nb, 32) in [0, 7] -> (rows, nb * 14) uint8."""
    return torch.cat([f16_bytes(d), pack_codes(codes)], dim=-1).reshape(d.shape[0], -1)


def dequantize_hq3_0(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 14) uint8 HQ3_0 blocks -> (rows, nb * 32) float32."""
    blocks = data.reshape(data.shape[0], -1, TYPE_SIZE)
    d = f16_field(blocks, 0).unsqueeze(-1)
    return (d * (unpack_codes(blocks[..., 2:]) - 4).float()).reshape(data.shape[0], -1)


def reference_hq3_0(weight: torch.Tensor) -> torch.Tensor:
    """Round to nearest: d = (largest-magnitude weight) / -4, q = clamp(round(x / d) + 4, 0, 7). (rows, K) float,
    K % 32 == 0 -> (rows, K // 32 * 14) uint8."""
    x = as_blocks(weight)
    d = _signed_absmax(x) / _GRID.low
    codes = _GRID.index(x * _safe_div(torch.ones_like(d), d).unsqueeze(-1))
    return _encode(d, codes)


def quantize_hq3_0(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """HQ3_0 blocks of `weight` (rows, K) float, K % 32 == 0, with the searched scale.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 14) uint8.
    Raises:
        ValueError: `importance` of another shape, negative or not finite.
    """
    return _search(weight, importance, _GRID)


def dequantize_hq3_nl(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 14) uint8 HQ3_NL blocks -> (rows, nb * 32) float32: d * NL_VALUES[q]."""
    blocks = data.reshape(data.shape[0], -1, TYPE_SIZE)
    d = f16_field(blocks, 0).unsqueeze(-1)
    return (d * _NL_GRID.value(unpack_codes(blocks[..., 2:]).long())).reshape(data.shape[0], -1)


def quantize_hq3_nl(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """HQ3_NL blocks of `weight` (rows, K) float, K % 32 == 0: `quantize_hq3_0`'s search on the grid `NL_VALUES`.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 14) uint8.
    Raises:
        ValueError: `importance` of another shape, negative or not finite.
    """
    return _search(weight, importance, _NL_GRID)


def _search(weight: torch.Tensor, importance: torch.Tensor | None, grid: Grid) -> torch.Tensor:
    """Both formats' blocks: each block's scale searched on `grid` (`legacy.fit_symmetric`, seeded with the
    largest-magnitude weight on the grid's low end), codes the grid's indices."""
    x, w = as_blocks(weight), importance_blocks(importance, weight)
    seed = _signed_absmax(x) / grid.low
    d, idx = fit_symmetric(x.reshape(-1, QK), w.reshape(-1, QK), grid, _FACTORS, seed.reshape(-1))
    return _encode(d.reshape(x.shape[:2]), idx.reshape(x.shape))
