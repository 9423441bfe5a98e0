"""llama.cpp's 32-weight block formats with a float16 scale: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Every block covers 32 consecutive weights of a row; its bytes are llama.cpp's `block_<type>` (ggml-common.h), little
endian, fields in this order:

| type | bytes | fields | weight j of the block |
| --- | ---: | --- | --- |
| Q8_0 | 34 | d f16, qs int8[32] | d * qs[j] |
| Q4_0 | 18 | d f16, qs[16] | d * (q[j] - 8) |
| Q4_1 | 20 | d f16, m f16, qs[16] | d * q[j] + m |
| Q5_0 | 22 | d f16, qh[4], qs[16] | d * (q[j] - 16) |
| Q5_1 | 24 | d f16, m f16, qh[4], qs[16] | d * q[j] + m |

4-bit codes: weight j < 16 is the low nibble of qs[j], weight j >= 16 the high nibble of qs[j - 16] (codes
[3, 10, ...] with q[16] = 5 give qs[0] = 0x53). 5-bit codes add bit 4 of q[j] as bit j of the little-endian
uint32 `qh`.

Two quantizers per type:
- `reference_<name>(weight)`: llama.cpp's data-free recipe (`quantize_row_<name>_ref`, which `ggml_quantize_chunk`
  runs without an imatrix), byte for byte as gguf-py's `gguf.quants.quantize` writes it;
- `quantize_<name>(weight, importance=None)`, the default: a search over scales (and minimums) that minimizes the
  (importance-weighted) squared error of the block *as stored*, float16 rounding of the scale included. It never
  does worse than the reference on a block's weighted error, because the reference's own choice is one of its
  candidates.

The search (`fit_symmetric`, `fit_affine`, shared with `iq4`): for each block, a set of candidate scales around the
one that maps the largest weight to an end of the code range (both ends: the grids are not symmetric), for each the
nearest codes and then the least-squares scale for those codes; the best candidate is rounded to float16, its codes
chosen again for the rounded scale, and the scale refit, a few times, keeping the best stored block.
"""

from __future__ import annotations

import torch

from hfquant.core.rtn import value_range

__all__ = [
    "QK",
    "Grid",
    "fit_symmetric",
    "fit_affine",
    "dequantize_q8_0",
    "dequantize_q4_0",
    "dequantize_q4_1",
    "dequantize_q5_0",
    "dequantize_q5_1",
    "quantize_q8_0",
    "quantize_q4_0",
    "quantize_q4_1",
    "quantize_q5_0",
    "quantize_q5_1",
    "reference_q8_0",
    "reference_q4_0",
    "reference_q4_1",
    "reference_q5_0",
    "reference_q5_1",
]

QK = 32
"""Weights per block of every type in this module."""

# Blocks searched at once: bounds the (blocks, candidates, 32) float32 working set to tens of MB.
_SEARCH_BLOCKS = 4096


# ---------------------------------------------------------------------------------------------------------------------
# bytes


def f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """(...,) float values -> (..., 2) uint8: their float16 (round to nearest even), little endian."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of each block (..., type_size) uint8, as float32 (...,)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes in [0, 15] -> (..., 16) uint8: code j < 16 in the low nibble of byte j, code j + 16 high."""
    codes = codes.to(torch.uint8)
    return codes[..., :16] | (codes[..., 16:] << 4)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) uint8 -> (..., 32) uint8 codes, the inverse of `pack_nibbles`."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


_BIT = 1 << torch.arange(8, dtype=torch.int32)


def pack_high_bits(codes: torch.Tensor) -> torch.Tensor:
    """(..., 32) 5-bit codes -> (..., 4) uint8 `qh`: bit 4 of code j is bit j of the little-endian uint32."""
    high = (codes.to(torch.int32) >> 4).reshape(*codes.shape[:-1], 4, 8)
    return (high * _BIT).sum(-1).to(torch.uint8)


def unpack_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """(..., 4) uint8 `qh` -> (..., 32) uint8 bit 4 of each code (0 or 16)."""
    bits = (qh.to(torch.int32).unsqueeze(-1) >> torch.arange(8, dtype=torch.int32)) & 1
    return (bits.reshape(*qh.shape[:-1], 32) << 4).to(torch.uint8)


def as_blocks(weight: torch.Tensor, block: int = QK) -> torch.Tensor:
    """(rows, K) float -> (rows, K // block, block) float32."""
    rows, k = weight.shape
    return weight.detach().to(torch.float32).reshape(rows, k // block, block)


def importance_blocks(importance: torch.Tensor | None, weight: torch.Tensor, block: int = QK) -> torch.Tensor:
    """The per-element weights of the squared error, (rows, K // block, block) float32 (ones for None).

    Raises:
        ValueError: `importance` is neither (K,) nor (rows, K), or has a negative or non-finite entry.
    """
    rows, k = weight.shape
    if importance is None:
        return torch.ones(rows, k // block, block)
    imp = importance.detach().to(torch.float32)
    if tuple(imp.shape) not in ((k,), (rows, k)):
        raise ValueError(f"importance must have shape ({k},) or ({rows}, {k}); got {tuple(imp.shape)}")
    low, _, finite = value_range(imp)
    if not finite or low < 0:
        raise ValueError("importance must be finite and >= 0 everywhere")
    return imp.expand(rows, k).reshape(rows, k // block, block)


def round_half_away(values: torch.Tensor) -> torch.Tensor:
    """C's `roundf`: halves away from zero (torch.round rounds them to even)."""
    magnitude = values.abs()
    whole = magnitude.floor()
    return torch.copysign(whole + (magnitude - whole >= 0.5).to(values.dtype), values)


# ---------------------------------------------------------------------------------------------------------------------
# the search


class Grid:
    """The values a code stands for, sorted: a uniform integer range or a non-uniform table (IQ4_NL's)."""

    def __init__(self, values: list[int]):
        self.values = torch.tensor(values, dtype=torch.float32)
        self.uniform = values == list(range(values[0], values[0] + len(values)))
        self.midpoints = (self.values[1:] + self.values[:-1]) / 2

    @property
    def low(self) -> float:
        return float(self.values[0])

    @property
    def high(self) -> float:
        return float(self.values[-1])

    def index(self, u: torch.Tensor) -> torch.Tensor:
        """The index (int64) of the grid value nearest to each of `u` (ties to the larger value)."""
        if self.uniform:
            return (torch.floor(u + 0.5) - self.values[0]).clamp(0, len(self.values) - 1).to(torch.int64)
        return torch.bucketize(u, self.midpoints, right=True)

    def value(self, index: torch.Tensor) -> torch.Tensor:
        return self.values[index]

    def nearest(self, u: torch.Tensor) -> torch.Tensor:
        """The grid value nearest to each of `u` (float32), as `value(index(u))` without int64 indices."""
        if self.uniform:
            return torch.floor(u + 0.5).clamp_(self.low, self.high)
        return self.values[torch.bucketize(u, self.midpoints, right=True)]


def _sum(values: torch.Tensor, dim=-1) -> torch.Tensor:
    """float32 sum over `dim`, accumulated in float64 and rounded once: independent of the summation order, so the C
    search (csrc/blocks_quant_cpu.c) takes the same decisions bit for bit (as `kquants._sum`)."""
    return values.double().sum(dim).float()


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude of each block (its first one on ties), with its sign."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True)).squeeze(-1)


def _fp16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).to(torch.float32)


def _chunked(function, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Apply `function` to (n, ...) tensors `_SEARCH_BLOCKS` rows at a time and concatenate its outputs."""
    n = tensors[0].shape[0]
    outputs = [function(*(t[i : i + _SEARCH_BLOCKS] for t in tensors)) for i in range(0, max(n, 1), _SEARCH_BLOCKS)]
    return tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))


def _symmetric_candidates(x, w, grid: Grid, factors: torch.Tensor):
    """For each block (n, 32) and candidate scale, the least-squares scale of its nearest codes and the gain
    (sum w q x)^2 / sum w q^2 (the weighted error is sum w x^2 minus the gain). Returns (n, C) scales and gains."""
    peak = _signed_absmax(x)  # (n,)
    targets = torch.cat([grid.low * factors, grid.high * factors])  # where the peak lands, both ends of the grid
    scales = peak.unsqueeze(-1) / targets  # (n, C)
    q = grid.nearest(x.unsqueeze(1) * _safe_div(torch.ones_like(scales), scales).unsqueeze(-1))  # (n, C, 32)
    wq = w.unsqueeze(1) * q
    sqx = _sum(wq * x.unsqueeze(1))
    sqq = _sum(wq * q)
    return _safe_div(sqx, sqq), _safe_div(sqx * sqx, sqq)


def _weighted_error(x, w, recon):
    return _sum(w * (x - recon) ** 2)


def _nearest_codes(x, w, grid: Grid, d):
    """Codes nearest to x / d (n, 32) int64 and the weighted error of d * grid value (n,)."""
    idx = grid.index(x * _safe_div(torch.ones_like(d), d).unsqueeze(-1))
    return idx, _weighted_error(x, w, d.unsqueeze(-1) * grid.value(idx))


def _refine_symmetric(x, w, grid: Grid, scale: torch.Tensor, seed: torch.Tensor, rounds: int):
    """Round `scale` (n,) to float16, choose codes for it, refit the scale, `rounds` times; the best stored block,
    `seed` (n,) (a scale rounded to float16 with its nearest codes) included. Returns the float16-exact scales (n,)
    float32 and code indices (n, 32) int64."""
    best_d = _fp16(seed)
    best_idx, best_err = _nearest_codes(x, w, grid, best_d)
    d = _fp16(scale)
    for _ in range(rounds):
        idx, err = _nearest_codes(x, w, grid, d)
        better = err < best_err
        best_d = torch.where(better, d, best_d)
        best_idx = torch.where(better.unsqueeze(-1), idx, best_idx)
        best_err = torch.where(better, err, best_err)
        wq = w * grid.value(idx)
        sqq = _sum(wq * grid.value(idx))
        d = _fp16(torch.where(sqq > 0, _safe_div(_sum(wq * x), sqq), d))
    return best_d, best_idx


def fit_symmetric(
    x: torch.Tensor, w: torch.Tensor, grid: Grid, factors: torch.Tensor, seed: torch.Tensor, rounds: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks x (n, b) float32 with weights w (n, b) >= 0 as d * grid.value(index): the searched float16 scale.

    Args:
        factors: (F,) how far past (> 1) or short of (< 1) each end of the grid the block's largest weight lands;
            2F candidate scales per block.
        seed: (n,) one more candidate scale per block (the reference recipe's), kept if nothing beats it, so the
            result's weighted error is at most that of the seed with its nearest codes.
        rounds: float16 rounding / code choice / refit rounds after the search.
    Returns:
        d (n,) float32 (float16-exact) and indices (n, b) int64 into `grid.values`.
    """

    def fit(xc, wc, sc):
        scales, gains = _symmetric_candidates(xc, wc, grid, factors)
        best = gains.argmax(-1, keepdim=True)
        return _refine_symmetric(xc, wc, grid, torch.gather(scales, -1, best).squeeze(-1), sc, rounds)

    return _chunked(fit, x, w, seed)


def _affine_least_squares(x, w, q):
    """The (d, m) minimizing sum w (d q + m - x)^2 for fixed codes q, along the last dim; (d, m, error)."""
    s0, s1, s2 = _sum(w), _sum(w * q), _sum(w * q * q)
    tx, tqx = _sum(w * x), _sum(w * q * x)
    det = s0 * s2 - s1 * s1
    flat = det <= 1e-12 * s0 * s2  # every code equal: the best is the weighted mean
    d = torch.where(flat, torch.zeros_like(det), _safe_div(s0 * tqx - s1 * tx, det))
    m = torch.where(flat, _safe_div(tx, s0), _safe_div(s2 * tx - s1 * tqx, det))
    return d, m


def fit_affine(
    x: torch.Tensor, w: torch.Tensor, nmax: int, shrink: torch.Tensor, rounds: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks x (n, b) float32 with weights w (n, b) >= 0 as d * q + m, q in [0, nmax]: searched float16 d and m.

    Args:
        shrink: (S,) fractions of the block's range cut from its minimum and, independently, from its maximum for
            the candidate ranges (S * S candidates per block).
        rounds: float16 rounding / code choice / refit rounds after the search.
    Returns:
        d (n,), m (n,) float32 (float16-exact) and codes (n, b) int64 in [0, nmax].
    """
    cut_low, cut_high = torch.meshgrid(shrink, shrink, indexing="ij")
    cut_low, cut_high = cut_low.reshape(-1), cut_high.reshape(-1)

    def codes(xc, d, m):
        return torch.floor((xc - m.unsqueeze(-1)) * _safe_div(torch.ones_like(d), d).unsqueeze(-1) + 0.5).clamp(
            0, nmax
        )

    def fit(xc, wc):
        lo, hi = xc.min(-1).values, xc.max(-1).values
        span = (hi - lo).unsqueeze(-1)
        c_lo = lo.unsqueeze(-1) + cut_low * span  # (n, C)
        c_d = (span - (cut_low + cut_high) * span) / nmax
        q = codes(xc.unsqueeze(1), c_d, c_lo)  # (n, C, b)
        d, m = _affine_least_squares(xc.unsqueeze(1), wc.unsqueeze(1), q)
        err = _weighted_error(xc.unsqueeze(1), wc.unsqueeze(1), d.unsqueeze(-1) * q + m.unsqueeze(-1))
        best = err.argmin(-1, keepdim=True)
        d, m = torch.gather(d, -1, best).squeeze(-1), torch.gather(m, -1, best).squeeze(-1)
        # the reference's block (min/max, float16-rounded, nearest codes) is the first to beat
        best_d, best_m = _fp16((hi - lo) / nmax), _fp16(lo)
        best_q = codes(xc, best_d, best_m)
        best_err = _weighted_error(xc, wc, best_d.unsqueeze(-1) * best_q + best_m.unsqueeze(-1))
        for _ in range(rounds):
            d, m = _fp16(d), _fp16(m)
            q = codes(xc, d, m)
            err = _weighted_error(xc, wc, d.unsqueeze(-1) * q + m.unsqueeze(-1))
            better = err < best_err
            best_d, best_m = torch.where(better, d, best_d), torch.where(better, m, best_m)
            best_q = torch.where(better.unsqueeze(-1), q, best_q)
            best_err = torch.where(better, err, best_err)
            d, m = _affine_least_squares(xc, wc, q)
        return best_d, best_m, best_q.to(torch.int64)

    return _chunked(fit, x, w)


# Candidate factors (see fit_symmetric): measured on N(0, 1) rows and SmolLM2 weights (docs/performance.md).
_FACTORS_4BIT = torch.linspace(0.8, 1.2, 21)
_FACTORS_5BIT = torch.linspace(0.85, 1.15, 13)
_FACTORS_8BIT = torch.linspace(0.95, 1.05, 5)
_SHRINK = torch.tensor([0.0, 0.025, 0.05, 0.075, 0.1, 0.15])

_Q4_0_GRID = Grid(list(range(-8, 8)))
_Q5_0_GRID = Grid(list(range(-16, 16)))
_Q8_0_GRID = Grid(list(range(-128, 128)))


# ---------------------------------------------------------------------------------------------------------------------
# Q8_0


def _assemble(rows: int, *fields: torch.Tensor) -> torch.Tensor:
    """Concatenate per-block byte fields (rows, nb, ...) into (rows, nb * type_size) uint8."""
    blocks = torch.cat([f.to(torch.uint8) for f in fields], dim=-1)
    return blocks.reshape(rows, -1)


def _blocks_of(data: torch.Tensor, type_size: int) -> torch.Tensor:
    return data.reshape(data.shape[0], -1, type_size)


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 34) uint8 Q8_0 blocks -> (rows, nb * 32) float32."""
    blocks = _blocks_of(data, 34)
    d = f16_field(blocks, 0).unsqueeze(-1)
    qs = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * qs).reshape(data.shape[0], -1)


def _encode_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return _assemble(d.shape[0], f16_bytes(d), q.to(torch.int8).view(torch.uint8))


def reference_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 (`quantize_row_q8_0_ref`): d = max|x| / 127, q = roundf(x / d). (rows, K) -> (rows, K//32*34)."""
    x = as_blocks(weight)
    d = x.abs().amax(-1) / 127
    inverse = _safe_div(torch.ones_like(d), d)
    return _encode_q8_0(d, round_half_away(x * inverse.unsqueeze(-1)))


def quantize_q8_0(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q8_0 blocks of `weight` (rows, K) float, K % 32 == 0, with the searched scale.

    Codes use the whole int8 range [-128, 127] (llama.cpp's quantizer writes [-127, 127]; -128 alone takes a tenth
    off the error on N(0, 1) rows). ggml's CPU Q8_0 dot product (llama-cpp-python 0.3.36, AVX-512) gave the exact
    result on such blocks against activations that ggml quantized (to [-127, 127]); other backends were not checked.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 34) uint8.
    """
    x, w = as_blocks(weight), importance_blocks(importance, weight)
    seed = x.abs().amax(-1) / 127
    d, idx = fit_symmetric(x.reshape(-1, QK), w.reshape(-1, QK), _Q8_0_GRID, _FACTORS_8BIT, seed.reshape(-1))
    return _encode_q8_0(d.reshape(x.shape[:2]), _Q8_0_GRID.value(idx).reshape(x.shape))


# ---------------------------------------------------------------------------------------------------------------------
# Q4_0 and Q5_0: d * (q - 2^(bits-1))


def dequantize_q4_0(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 18) uint8 Q4_0 blocks -> (rows, nb * 32) float32."""
    blocks = _blocks_of(data, 18)
    d = f16_field(blocks, 0).unsqueeze(-1)
    q = unpack_nibbles(blocks[..., 2:]).to(torch.int8) - 8
    return (d * q.float()).reshape(data.shape[0], -1)


def dequantize_q5_0(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 22) uint8 Q5_0 blocks -> (rows, nb * 32) float32."""
    blocks = _blocks_of(data, 22)
    d = f16_field(blocks, 0).unsqueeze(-1)
    q = (unpack_nibbles(blocks[..., 6:]) | unpack_high_bits(blocks[..., 2:6])).to(torch.int8) - 16
    return (d * q.float()).reshape(data.shape[0], -1)


def _encode_q4_0(d, codes):
    return _assemble(d.shape[0], f16_bytes(d), pack_nibbles(codes))


def _encode_q5_0(d, codes):
    return _assemble(d.shape[0], f16_bytes(d), pack_high_bits(codes), pack_nibbles(codes & 0x0F))


def _reference_symmetric(weight: torch.Tensor, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 / Q5_0 reference: d = peak / -half, q = min(2 half - 1, trunc(x / d + half + 0.5))."""
    x = as_blocks(weight)
    d = _signed_absmax(x) / -half
    inverse = _safe_div(torch.ones_like(d), d).unsqueeze(-1)
    codes = torch.trunc(x * inverse + (half + 0.5)).clamp(0, 2 * half - 1).to(torch.uint8)
    return d, codes


def reference_q4_0(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_0 (`quantize_row_q4_0_ref`): the largest-magnitude weight maps to code 0 (-8 d)."""
    return _encode_q4_0(*_reference_symmetric(weight, 8))


def reference_q5_0(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q5_0 (`quantize_row_q5_0_ref`): the largest-magnitude weight maps to code 0 (-16 d)."""
    return _encode_q5_0(*_reference_symmetric(weight, 16))


def _searched_symmetric(weight, importance, grid: Grid, factors):
    x, w = as_blocks(weight), importance_blocks(importance, weight)
    seed = _signed_absmax(x) / grid.low  # the reference's scale
    d, idx = fit_symmetric(x.reshape(-1, QK), w.reshape(-1, QK), grid, factors, seed.reshape(-1))
    return d.reshape(x.shape[:2]), idx.reshape(x.shape).to(torch.uint8)


def quantize_q4_0(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_0 blocks of `weight` (rows, K) float, K % 32 == 0, with the searched scale.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 18) uint8.
    """
    return _encode_q4_0(*_searched_symmetric(weight, importance, _Q4_0_GRID, _FACTORS_4BIT))


def quantize_q5_0(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_0 blocks of `weight` (rows, K) float, K % 32 == 0, with the searched scale.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 22) uint8.
    """
    return _encode_q5_0(*_searched_symmetric(weight, importance, _Q5_0_GRID, _FACTORS_5BIT))


# ---------------------------------------------------------------------------------------------------------------------
# Q4_1 and Q5_1: d * q + m


def dequantize_q4_1(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 20) uint8 Q4_1 blocks -> (rows, nb * 32) float32."""
    blocks = _blocks_of(data, 20)
    d, m = f16_field(blocks, 0).unsqueeze(-1), f16_field(blocks, 2).unsqueeze(-1)
    q = unpack_nibbles(blocks[..., 4:]).float()
    return (d * q + m).reshape(data.shape[0], -1)


def dequantize_q5_1(data: torch.Tensor) -> torch.Tensor:
    """(rows, nb * 24) uint8 Q5_1 blocks -> (rows, nb * 32) float32."""
    blocks = _blocks_of(data, 24)
    d, m = f16_field(blocks, 0).unsqueeze(-1), f16_field(blocks, 2).unsqueeze(-1)
    q = (unpack_nibbles(blocks[..., 8:]) | unpack_high_bits(blocks[..., 4:8])).float()
    return (d * q + m).reshape(data.shape[0], -1)


def _encode_q4_1(d, m, codes):
    return _assemble(d.shape[0], f16_bytes(d), f16_bytes(m), pack_nibbles(codes))


def _encode_q5_1(d, m, codes):
    return _assemble(d.shape[0], f16_bytes(d), f16_bytes(m), pack_high_bits(codes), pack_nibbles(codes & 0x0F))


def _reference_affine(weight: torch.Tensor, nmax: int):
    """llama.cpp's Q4_1 / Q5_1 reference: d = (max - min) / nmax, m = min, q = trunc((x - min) / d + 0.5)."""
    x = as_blocks(weight)
    lo, hi = x.amin(-1), x.amax(-1)
    d = (hi - lo) / nmax
    inverse = _safe_div(torch.ones_like(d), d).unsqueeze(-1)
    codes = torch.trunc((x - lo.unsqueeze(-1)) * inverse + 0.5).clamp(0, nmax).to(torch.uint8)
    return d, lo, codes


def reference_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q4_1 (`quantize_row_q4_1_ref`): min/max of each block."""
    return _encode_q4_1(*_reference_affine(weight, 15))


def reference_q5_1(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q5_1 (`quantize_row_q5_1_ref`): min/max of each block."""
    return _encode_q5_1(*_reference_affine(weight, 31))


def _searched_affine(weight, importance, nmax):
    x, w = as_blocks(weight), importance_blocks(importance, weight)
    d, m, q = fit_affine(x.reshape(-1, QK), w.reshape(-1, QK), nmax, _SHRINK)
    return d.reshape(x.shape[:2]), m.reshape(x.shape[:2]), q.reshape(x.shape).to(torch.uint8)


def quantize_q4_1(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_1 blocks of `weight` (rows, K) float, K % 32 == 0, with searched scale and minimum.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 20) uint8.
    """
    return _encode_q4_1(*_searched_affine(weight, importance, 15))


def quantize_q5_1(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_1 blocks of `weight` (rows, K) float, K % 32 == 0, with searched scale and minimum.

    Args:
        importance: optional (K,) or (rows, K) float >= 0 weights of each element's squared error (None: all 1).
    Returns:
        (rows, K // 32 * 24) uint8.
    """
    return _encode_q5_1(*_searched_affine(weight, importance, 31))
