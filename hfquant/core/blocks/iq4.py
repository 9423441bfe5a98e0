"""llama.cpp's 4-bit non-uniform formats: IQ4_NL (32-weight blocks) and IQ4_XS (256-weight super-blocks).

A code q in [0, 15] stands for `KVALUES[q]` (llama.cpp's `kvalues_iq4nl`), a grid denser near zero. Bytes are
llama.cpp's `block_iq4_nl` / `block_iq4_xs` (ggml-common.h), little endian:

| type | bytes | fields | weight j of block b |
| --- | ---: | --- | --- |
| IQ4_NL | 18 | d f16, qs[16] | d * KVALUES[q[j]] |
| IQ4_XS | 136 | d f16, scales_h u16, scales_l[4], qs[128] | d * (ls[b] - 32) * KVALUES[q[b, j]] |

Codes of a 32-weight block are nibble-packed as in Q4_0 (weight j < 16 low nibble of byte j, j >= 16 high nibble of
byte j - 16); IQ4_XS's block b takes qs[16 b : 16 b + 16]. Its 6-bit block scale ls[b] in [0, 63] is the nibble
b % 2 of scales_l[b // 2] (low first) plus bits 2b, 2b + 1 of scales_h as bits 4-5 (ls = 45 = 0b101101, b = 1:
high nibble of scales_l[0] = 0xD, bits 2-3 of scales_h = 0b10).

Two quantizers per type, as in `legacy`:
- `reference_<name>(weight)`: llama.cpp's data-free recipe (`quantize_iq4_nl` / `quantize_iq4_xs` without an
  imatrix): per block, 15 scales that map the largest weight to -127 + t for t in [-7, 7], each with its nearest
  codes and least-squares scale under weights x^2; IQ4_XS then rounds each block scale to a multiple of
  d = -(largest block scale) / 32 and picks codes again;
- `quantize_<name>(weight, importance=None)`, the default: both ends of the grid and a wider scan (`fit_symmetric`),
  float16 rounding in the loop, the (importance-)weighted error of the stored block minimized; for IQ4_XS also a
  scan of the super-block scale d, and for each block the best of three neighbouring 6-bit scales with codes chosen
  again, then d refit by least squares.

Where the native library builds, quantize-on-load and `hfquant.ops.native.block_quantize` take the C search of
hfquant/ops/csrc/iq4_search_cpu.c instead (`native.IQ4_SEARCHES`, "thorough" by default): the same candidates as
`quantize_<name>` but its bytes differ (float16 rounding and refit order; squared errors equal to 4 digits), unless
`HfQuantConfig(iq4_search="exhaustive")` (`SEARCHES`: this search, ported to C bit for bit).
"""

from __future__ import annotations

import torch

from .legacy import (
    Grid,
    _safe_div,
    _signed_absmax,
    _sum,
    as_blocks,
    f16_bytes,
    f16_field,
    fit_symmetric,
    importance_blocks,
    pack_nibbles,
    unpack_nibbles,
)

__all__ = [
    "KVALUES",
    "dequantize_iq4_nl",
    "dequantize_iq4_xs",
    "quantize_iq4_nl",
    "quantize_iq4_xs",
    "reference_iq4_nl",
    "reference_iq4_xs",
]

KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
"""The 16 values of a code (llama.cpp's `kvalues_iq4nl`)."""

SEARCHES = ("thorough", "fast", "lean", "exact", "exhaustive")
"""The IQ4_NL / IQ4_XS searches a quantization may use (`HfQuantConfig(iq4_search=...)`, `hfquant.ops.native`'s
`block_quantize`): "exhaustive" is this module's (`quantize_iq4_nl` / `quantize_iq4_xs`, ported to C), the others
are `hfquant.ops.native.IQ4_SEARCHES`' candidates in C. The first is `native.block_quantize`'s when none is named;
a quantization config's default is `HfQuantConfig`'s `iq4_search` field's."""

QK_K = 256
_GRID = Grid(list(KVALUES))
_KV = _GRID.values
_FACTORS = torch.linspace(0.8, 1.2, 21)
# Super-block scale candidates: the largest block scale lands on 6-bit level -32 or +31, divided by these.
_SUPER_FACTORS = torch.tensor([1.0, 0.985, 0.97, 0.955, 0.94])
_SUPER_BLOCKS = 512


# ---------------------------------------------------------------------------------------------------------------------
# dequantize


def dequantize_iq4_nl(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 18) uint8 IQ4_NL blocks -> (rows, nb * 32) float32."""
    blocks = data.reshape(data.shape[0], -1, 18)
    d = f16_field(blocks, 0).unsqueeze(-1)
    return (d * _KV[unpack_nibbles(blocks[..., 2:]).long()]).reshape(data.shape[0], -1)


def _block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """IQ4_XS (..., 136) uint8 -> the 6-bit block scales ls (..., 8) int32 in [0, 63]."""
    high = blocks[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # (..., 1)
    low = unpack_nibbles_pairs(blocks[..., 4:8])
    shifts = 2 * torch.arange(8, dtype=torch.int32)
    return low | (((high >> shifts) & 3) << 4)


def unpack_nibbles_pairs(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2n) int32: low nibble of byte i at 2i, high nibble at 2i + 1."""
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return pairs.reshape(*packed.shape[:-1], -1).to(torch.int32)


def dequantize_iq4_xs(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 136) uint8 IQ4_XS super-blocks -> (rows, nb * 256) float32."""
    blocks = data.reshape(data.shape[0], -1, 136)
    d = f16_field(blocks, 0).unsqueeze(-1)
    dl = (d * (_block_scales(blocks) - 32).float()).unsqueeze(-1)  # (rows, nb, 8, 1)
    codes = unpack_nibbles(blocks[..., 8:].reshape(*blocks.shape[:2], 8, 16)).long()
    return (dl * _KV[codes]).reshape(data.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------------
# encode


def _encode_nl(d: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """d (rows, nb), codes (rows, nb, 32) -> (rows, nb * 18) uint8."""
    return torch.cat([f16_bytes(d), pack_nibbles(codes)], dim=-1).reshape(d.shape[0], -1)


def _encode_xs(d: torch.Tensor, levels: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """d (rows, nb), levels (rows, nb, 8) int in [-32, 31], codes (rows, nb, 8, 32) -> (rows, nb * 136) uint8."""
    ls = (levels + 32).to(torch.int32)
    high = (((ls >> 4) & 3) << (2 * torch.arange(8, dtype=torch.int32))).sum(-1)
    scales_h = torch.stack([high & 0xFF, high >> 8], dim=-1)
    low = ls & 0x0F
    scales_l = low[..., 0::2] | (low[..., 1::2] << 4)
    qs = pack_nibbles(codes).reshape(*codes.shape[:2], 128)
    fields = [f16_bytes(d), scales_h.to(torch.uint8), scales_l.to(torch.uint8), qs]
    return torch.cat(fields, dim=-1).reshape(d.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp's recipe


def _reference_block_scales(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's float scale of each block (n, 32) under weights x^2 (its data-free `ntry = 7` scan)."""
    w = x * x
    peak = _signed_absmax(x)
    zero = x.abs().amax(-1) < 1e-15

    def gain(inverse):
        q = _GRID.value(_GRID.index(x * inverse.unsqueeze(-1)))
        sqx, sqq = (w * q * x).sum(-1), (w * q * q).sum(-1)
        return sqx, sqq

    sqx, sqq = gain(_safe_div(torch.ones_like(peak), peak / -_GRID.low))
    d = _safe_div(sqx, sqq)
    best = d * sqx
    for t in range(-7, 8):
        sqx, sqq = gain(_safe_div(torch.full_like(peak, t + _GRID.low), peak))
        better = (sqq > 0) & (sqx * sqx > best * sqq)
        d = torch.where(better, _safe_div(sqx, sqq), d)
        best = torch.where(better, d * sqx, best)
    return torch.where(zero, torch.zeros_like(d), d)


def reference_iq4_nl(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's IQ4_NL (`quantize_iq4_nl`, no imatrix). (rows, K) float -> (rows, K // 32 * 18) uint8."""
    x = as_blocks(weight)
    d = _reference_block_scales(x.reshape(-1, 32)).reshape(x.shape[:2])
    codes = _GRID.index(x * _safe_div(torch.ones_like(d), d).unsqueeze(-1))
    return _encode_nl(d, codes)


def reference_iq4_xs(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's IQ4_XS (`quantize_iq4_xs`, no imatrix). (rows, K) float -> (rows, K // 256 * 136) uint8."""
    x = as_blocks(weight, QK_K).reshape(weight.shape[0], -1, 8, 32)
    scales = _reference_block_scales(x.reshape(-1, 32)).reshape(x.shape[:3])
    d = -_signed_absmax(scales) / 32
    levels = torch.round(scales * _safe_div(torch.ones_like(d), d).unsqueeze(-1)).clamp(-32, 31)
    dl = d.unsqueeze(-1) * levels
    codes = _GRID.index(x * _safe_div(torch.ones_like(dl), dl).unsqueeze(-1))
    return _encode_xs(d, levels, codes)


# ---------------------------------------------------------------------------------------------------------------------
# the search


def quantize_iq4_nl(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """IQ4_NL blocks of `weight` (rows, K) float, K % 32 == 0, with the searched scale.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 18) uint8.
    """
    x, w = as_blocks(weight), importance_blocks(importance, weight)
    seed = _signed_absmax(x) / _GRID.low
    d, idx = fit_symmetric(x.reshape(-1, 32), w.reshape(-1, 32), _GRID, _FACTORS, seed.reshape(-1))
    return _encode_nl(d.reshape(x.shape[:2]), idx.reshape(x.shape))


def _fp16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).to(torch.float32)


def _best_levels(x, w, d, scales):
    """For super-block scales d (n, C) and blocks x (n, 8, 32): per block the best of the 6-bit levels nearest to
    scales / d (and its two neighbours) with codes chosen again. Returns levels (n, C, 8), codes (n, C, 8, 32) and the
    super-block's weighted error (n, C)."""
    base = torch.round(scales.unsqueeze(1) * _safe_div(torch.ones_like(d), d).unsqueeze(-1))  # (n, C, 8)
    options = (base.unsqueeze(-1) + torch.tensor([-1.0, 0.0, 1.0])).clamp(-32, 31)  # (n, C, 8, 3)
    dl = d.unsqueeze(-1).unsqueeze(-1) * options  # (n, C, 8, 3)
    xe, we = x.unsqueeze(1).unsqueeze(3), w.unsqueeze(1).unsqueeze(3)  # (n, 1, 8, 1, 32)
    idx = _GRID.index(xe * _safe_div(torch.ones_like(dl), dl).unsqueeze(-1))  # (n, C, 8, 3, 32)
    err = _sum(we * (xe - dl.unsqueeze(-1) * _GRID.value(idx)) ** 2)  # (n, C, 8, 3)
    pick = err.argmin(-1, keepdim=True)
    levels = torch.gather(options, -1, pick).squeeze(-1)
    codes = torch.gather(idx, -2, pick.unsqueeze(-1).expand(*pick.shape[:-1], 1, 32)).squeeze(-2)
    return levels, codes, _sum(torch.gather(err, -1, pick).squeeze(-1))


def _fit_super_block(x: torch.Tensor, w: torch.Tensor, rounds: int = 2):
    """Super-blocks x (n, 8, 32), weights w: float16 d (n,), levels (n, 8) in [-32, 31], codes (n, 8, 32)."""
    n = x.shape[0]
    flat_x, flat_w = x.reshape(-1, 32), w.reshape(-1, 32)
    seed = _signed_absmax(flat_x) / _GRID.low
    scale16, _ = fit_symmetric(flat_x, flat_w, _GRID, _FACTORS, seed)
    scales = scale16.reshape(n, 8)
    peak = _signed_absmax(scales).unsqueeze(-1)  # (n, 1)
    d = _fp16(torch.cat([peak / -32 / _SUPER_FACTORS, peak / 31 / _SUPER_FACTORS], dim=-1))  # (n, C)
    levels, codes, err = _best_levels(x, w, d, scales)
    pick = err.argmin(-1, keepdim=True)
    best_d = torch.gather(d, -1, pick).squeeze(-1)
    best_levels = torch.gather(levels, 1, pick.unsqueeze(-1).expand(n, 1, 8)).squeeze(1)
    best_codes = torch.gather(codes, 1, pick.view(n, 1, 1, 1).expand(n, 1, 8, 32)).squeeze(1)
    best_err = torch.gather(err, -1, pick).squeeze(-1)
    for _ in range(rounds):  # refit d for the chosen levels and codes, then choose levels and codes again
        q = best_levels.unsqueeze(-1) * _GRID.value(best_codes)
        sqq = _sum(w * q * q, (-1, -2))
        d = _fp16(torch.where(sqq > 0, _safe_div(_sum(w * q * x, (-1, -2)), sqq), best_d))
        levels, codes, err = _best_levels(x, w, d.unsqueeze(-1), scales)
        better = err.squeeze(-1) < best_err
        best_d = torch.where(better, d, best_d)
        best_levels = torch.where(better.unsqueeze(-1), levels.squeeze(1), best_levels)
        best_codes = torch.where(better.view(n, 1, 1), codes.squeeze(1), best_codes)
        best_err = torch.where(better, err.squeeze(-1), best_err)
    return best_d, best_levels, best_codes


def quantize_iq4_xs(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """IQ4_XS super-blocks of `weight` (rows, K) float, K % 256 == 0, with searched super-block and block scales.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 256 * 136) uint8.
    """
    rows = weight.shape[0]
    x = as_blocks(weight, QK_K).reshape(-1, 8, 32)
    w = importance_blocks(importance, weight, QK_K).reshape(-1, 8, 32)
    parts = [
        _fit_super_block(x[i : i + _SUPER_BLOCKS], w[i : i + _SUPER_BLOCKS]) for i in range(0, len(x), _SUPER_BLOCKS)
    ]
    d, levels, codes = (torch.cat(p) for p in zip(*parts, strict=True))
    return _encode_xs(d.reshape(rows, -1), levels.reshape(rows, -1, 8), codes.reshape(rows, -1, 8, 32))
