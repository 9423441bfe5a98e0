"""llama.cpp's k-quants: 256-weight super-blocks whose block scales are themselves quantized (Q2_K to Q6_K).

Every type stores a super-block of QK_K = 256 weights as the bytes of llama.cpp's `block_q<n>_K` (ggml-common.h),
float16 fields little endian. Blocks of 16 or 32 weights each have an integer scale (and, for the asymmetric types,
an integer minimum) that multiplies the super-block's float16 `d` (and `dmin`):

| type | bytes | fields in order | weight |
|---|---:|---|---|
| Q2_K | 84 | scales[16] (low nibble scale, high nibble min), qs[64] 2-bit codes, d, dmin | d*sc*q - dmin*m |
| Q3_K | 110 | hmask[32] third code bit, qs[64] low 2 bits, scales[12] sixteen 6-bit scales (+32), d | d*(sc-32)*(q-4) |
| Q4_K | 144 | d, dmin, scales[12] eight 6-bit scales and eight 6-bit mins, qs[128] 4-bit codes | d*sc*q - dmin*m |
| Q5_K | 176 | d, dmin, scales[12] as Q4_K, qh[32] fifth code bit, qs[128] low nibbles | d*sc*q - dmin*m |
| Q6_K | 210 | ql[128] low nibbles, qh[64] high 2 bits, scales[16] int8, d | d*sc*(q-32) |

Q2_K, Q3_K and Q6_K use 16 blocks of 16 weights, Q4_K and Q5_K 8 blocks of 32.

Code planes: a field of `g` groups of `w` bytes holds `8 // bits` codes per byte; bits `s*bits` of byte `j` of group
`h` hold the code of weight `h * (8 // bits) * w + s * w + j`. Q2_K's qs is 2 groups of 32 bytes (byte 0 holds
weights 0, 32, 64, 96 in bits 0-1, 2-3, 4-5, 6-7); Q3_K's hmask and Q5_K's qh are 1 group of 32 (bit b of byte j is
weight 32*b + j); Q4_K's qs is 4 groups of 32 (byte 0: weight 0 low nibble, weight 32 high nibble); Q6_K's ql is 2
groups of 64 nibbles and qh 2 groups of 32 with 2 bits each.

6-bit scale packing of Q4_K and Q5_K (`scales[12]`, sc and m for blocks 0..7): bytes 0-3 hold sc[0..3] in bits 0-5
and the top 2 bits of sc[4..7] in bits 6-7; bytes 4-7 the same for m; bytes 8-11 hold the low nibbles of sc[4..7]
(bits 0-3) and m[4..7] (bits 4-7). Q3_K's sixteen 6-bit scales (stored +32): bytes 0-7 hold the low nibbles of
scales 0-7 (bits 0-3) and 8-15 (bits 4-7); bits 2i..2i+1 of byte 8+k hold the top 2 bits of scale 4i+k.
"""

from __future__ import annotations

import torch

from hfquant.core.rtn import value_range

__all__ = [
    "QK_K",
    "llama_reference",
    "quantize_q2_k",
    "quantize_q3_k",
    "quantize_q4_k",
    "quantize_q5_k",
    "quantize_q6_k",
    "dequantize_q2_k",
    "dequantize_q3_k",
    "dequantize_q4_k",
    "dequantize_q5_k",
    "dequantize_q6_k",
]

QK_K = 256
"""Weights per super-block (llama.cpp's QK_K)."""


# ---------------------------------------------------------------------------------------------------------------------
# Byte fields


def _half(field: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 holding little-endian float16 values -> (N,) float32."""
    return field.contiguous().view(torch.float16).reshape(-1).float()


def _half_bytes(value: torch.Tensor) -> torch.Tensor:
    """(N,) float -> (N, 2) uint8: the little-endian bytes of its float16 rounding."""
    return value.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _shifts(bits: int) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8)


def _unpack(field: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """(N, nbytes) uint8 code plane -> (N, nbytes * 8 // bits) uint8 codes (layout in the module docstring)."""
    n, nbytes = field.shape
    shifts = _shifts(bits).view(1, 1, -1, 1)
    codes = (field.reshape(n, groups, 1, nbytes // groups) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(n, nbytes * 8 // bits)


def _pack(codes: torch.Tensor, groups: int, bits: int) -> torch.Tensor:
    """Inverse of `_unpack`: (N, n) codes in [0, 2**bits) -> (N, n * bits // 8) uint8."""
    n = codes.shape[0]
    per_byte = 8 // bits
    width = codes.shape[1] // (groups * per_byte)
    planes = codes.to(torch.uint8).reshape(n, groups, per_byte, width) << _shifts(bits).view(1, 1, -1, 1)
    return planes.sum(dim=2, dtype=torch.int32).to(torch.uint8).reshape(n, groups * width)


def _unpack_scales_k4(field: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K `scales[12]` (N, 12) -> (sc, m), each (N, 8) uint8 in [0, 63]."""
    low, mins, nibbles = field[:, 0:4], field[:, 4:8], field[:, 8:12]
    sc = torch.cat([low & 63, (nibbles & 15) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([mins & 63, (nibbles >> 4) | ((mins >> 6) << 4)], dim=1)
    return sc, m


def _pack_scales_k4(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_scales_k4`: sc, m (N, 8) in [0, 63] -> (N, 12) uint8."""
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    return torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        dim=1,
    )


def _unpack_scales_q3(field: torch.Tensor) -> torch.Tensor:
    """Q3_K `scales[12]` (N, 12) -> (N, 16) uint8 in [0, 63] (the stored scale + 32)."""
    low = torch.cat([field[:, :8] & 15, field[:, :8] >> 4], dim=1)
    high = (field[:, 8:12].reshape(-1, 1, 4) >> _shifts(2).view(1, 4, 1)) & 3
    return low | (high.reshape(high.shape[0], 16) << 4)


def _pack_scales_q3(stored: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_scales_q3`: (N, 16) in [0, 63] -> (N, 12) uint8."""
    stored = stored.to(torch.uint8)
    low = (stored[:, :8] & 15) | ((stored[:, 8:] & 15) << 4)
    high = ((stored >> 4).reshape(-1, 4, 4) << _shifts(2).view(1, 4, 1)).sum(dim=1, dtype=torch.int32)
    return torch.cat([low, high.to(torch.uint8)], dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# Fields of each type: (N, type_size) uint8 blocks <-> integer codes, block scales and float16 super-block scales.
# Codes are the stored unsigned values (Q3_K: 0..7 for q - 4 = -4..3; Q6_K: 0..63 for -32..31).


def _fields_q2_k(blocks):
    scales = blocks[:, 0:16]
    return _unpack(blocks[:, 16:80], 2, 2), scales & 15, scales >> 4, _half(blocks[:, 80:82]), _half(blocks[:, 82:84])


def _bytes_q2_k(codes, sc, m, d, dmin):
    scales = sc.to(torch.uint8) | (m.to(torch.uint8) << 4)
    return torch.cat([scales, _pack(codes, 2, 2), _half_bytes(d), _half_bytes(dmin)], dim=1)


def _fields_q3_k(blocks):
    codes = _unpack(blocks[:, 32:96], 2, 2) | (_unpack(blocks[:, 0:32], 1, 1) << 2)
    return codes, _unpack_scales_q3(blocks[:, 96:108]), _half(blocks[:, 108:110])


def _bytes_q3_k(codes, stored_scales, d):
    codes = codes.to(torch.uint8)
    return torch.cat(
        [_pack(codes >> 2, 1, 1), _pack(codes & 3, 2, 2), _pack_scales_q3(stored_scales), _half_bytes(d)], 1
    )


def _fields_q4_k(blocks):
    sc, m = _unpack_scales_k4(blocks[:, 4:16])
    return _unpack(blocks[:, 16:144], 4, 4), sc, m, _half(blocks[:, 0:2]), _half(blocks[:, 2:4])


def _bytes_q4_k(codes, sc, m, d, dmin):
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_scales_k4(sc, m), _pack(codes, 4, 4)], dim=1)


def _fields_q5_k(blocks):
    sc, m = _unpack_scales_k4(blocks[:, 4:16])
    codes = _unpack(blocks[:, 48:176], 4, 4) | (_unpack(blocks[:, 16:48], 1, 1) << 4)
    return codes, sc, m, _half(blocks[:, 0:2]), _half(blocks[:, 2:4])


def _bytes_q5_k(codes, sc, m, d, dmin):
    codes = codes.to(torch.uint8)
    planes = [_pack(codes >> 4, 1, 1), _pack(codes & 15, 4, 4)]
    return torch.cat([_half_bytes(d), _half_bytes(dmin), _pack_scales_k4(sc, m), *planes], dim=1)


def _fields_q6_k(blocks):
    codes = _unpack(blocks[:, 0:128], 2, 4) | (_unpack(blocks[:, 128:192], 2, 2) << 4)
    return codes, blocks[:, 192:208].view(torch.int8), _half(blocks[:, 208:210])


def _bytes_q6_k(codes, sc, d):
    codes = codes.to(torch.uint8)
    scales = sc.to(torch.int8).view(torch.uint8)
    return torch.cat([_pack(codes & 15, 2, 4), _pack(codes >> 4, 2, 2), scales, _half_bytes(d)], dim=1)


# ---------------------------------------------------------------------------------------------------------------------
# Dequantization


def _affine(codes, sc, m, d, dmin):
    """d*sc*q - dmin*m per block, in llama.cpp's float32 order: (N, 256)."""
    n, nsub = sc.shape
    scale = (d[:, None] * sc.float())[..., None]
    offset = (dmin[:, None] * m.float())[..., None]
    return (scale * codes.reshape(n, nsub, QK_K // nsub).float() - offset).reshape(n, QK_K)


def _symmetric(q, sc, d):
    """d*sc*q per block with signed q (N, 256) and signed sc (N, nsub): (N, 256)."""
    n, nsub = sc.shape
    scale = (d[:, None] * sc.float())[..., None]
    return (scale * q.reshape(n, nsub, QK_K // nsub).float()).reshape(n, QK_K)


def _blocks(data: torch.Tensor, type_size: int) -> torch.Tensor:
    return data.reshape(-1, type_size)


def _rows(values: torch.Tensor, data: torch.Tensor, type_size: int) -> torch.Tensor:
    return values.reshape(data.shape[0], data.shape[1] // type_size * QK_K)


def dequantize_q2_k(data: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks (rows, K // 256 * 84) uint8 -> (rows, K) float32."""
    return _rows(_affine(*_fields_q2_k(_blocks(data, 84))), data, 84)


def dequantize_q3_k(data: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks (rows, K // 256 * 110) uint8 -> (rows, K) float32."""
    codes, stored, d = _fields_q3_k(_blocks(data, 110))
    return _rows(_symmetric(codes.to(torch.int16) - 4, stored.to(torch.int16) - 32, d), data, 110)


def dequantize_q4_k(data: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks (rows, K // 256 * 144) uint8 -> (rows, K) float32."""
    return _rows(_affine(*_fields_q4_k(_blocks(data, 144))), data, 144)


def dequantize_q5_k(data: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks (rows, K // 256 * 176) uint8 -> (rows, K) float32."""
    return _rows(_affine(*_fields_q5_k(_blocks(data, 176))), data, 176)


def dequantize_q6_k(data: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks (rows, K // 256 * 210) uint8 -> (rows, K) float32."""
    codes, sc, d = _fields_q6_k(_blocks(data, 210))
    return _rows(_symmetric(codes.to(torch.int16) - 32, sc, d), data, 210)


# ---------------------------------------------------------------------------------------------------------------------
# Shared quantization steps. Blocks are (N, 256) float32 rows of super-blocks; `w` the same shape, each element's
# weight in the squared error. All steps work on every super-block at once.


def _f32(value: float) -> float:
    """`value` rounded to float32, so that a constant llama.cpp computes in float32 matches bit for bit."""
    return torch.tensor(value, dtype=torch.float32).item()


def _to_half(value: torch.Tensor) -> torch.Tensor:
    """float32 rounded through float16, as a float16 field stores it (saturating at +-65504 instead of inf)."""
    return value.clamp(-65504.0, 65504.0).to(torch.float16).float()


def _safe(value: torch.Tensor) -> torch.Tensor:
    return torch.where(value == 0, torch.ones_like(value), value)


def _signed_extreme(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax, the signed value of largest magnitude, first one on ties) over the last dim of x."""
    amax, index = x.abs().max(dim=-1)
    return amax, x.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _super_blocks(weight: torch.Tensor) -> torch.Tensor:
    if not value_range(weight)[2]:
        raise ValueError("k-quants quantize finite weights; the weight holds NaN or inf")
    return weight.detach().to(torch.float32).reshape(-1, QK_K)


def _importance_blocks(importance: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    if importance is None:
        return torch.ones(weight.numel() // QK_K, QK_K)
    imp = importance.detach().to(torch.float32)
    low, _, finite = value_range(imp)
    if imp.shape not in (weight.shape[1:], weight.shape) or low < 0 or not finite:
        raise ValueError(
            f"importance must be finite, >= 0 and of shape {tuple(weight.shape[1:])} or {tuple(weight.shape)}; got "
            f"shape {tuple(imp.shape)}"
        )
    return imp.expand(weight.shape).reshape(-1, QK_K)


def _grid(start: float, step: float, steps, nmax: int) -> list[float]:
    """`start + step * i + nmax` for each i in `steps`, computed in float32 in llama.cpp's order."""
    f32 = torch.float32
    return [((torch.tensor(start, dtype=f32) + torch.tensor(step, dtype=f32) * i) + nmax).item() for i in steps]


# ---------------------------------------------------------------------------------------------------------------------
# llama.cpp's data-free recipe (ggml-quants.c, `quantize_row_q<n>_K_ref`, what `ggml_quantize_chunk` runs without an
# importance matrix), re-expressed over all blocks at once. It is the baseline hfquant's quantizers must beat; the
# tests compare against it where llama.cpp itself is not installed.


def _llama_affine_search(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants on blocks x, w (B, n): (scale (B,), min (B,) >= 0, codes (B, n)) of x ~ scale * L - min."""
    lo = x.amin(dim=1).clamp(max=0)
    hi = x.amax(dim=1)
    flat = hi == lo
    sum_w, sum_x = w.sum(dim=1), (w * x).sum(dim=1)

    def error(scale, offset, codes):
        diff = scale[:, None] * codes + offset[:, None] - x
        return (w * (diff.abs() if use_mad else diff * diff)).sum(dim=1)

    span = _safe(hi - lo)
    iscale = nmax / span
    scale = 1 / iscale
    codes = torch.round(iscale[:, None] * (x - lo[:, None])).clamp(0, nmax)
    best = error(scale, lo, codes)
    for factor in _grid(rmin, rdelta, range(nstep + 1), nmax):
        trial = torch.round((factor / _safe(hi - lo))[:, None] * (x - lo[:, None])).clamp(0, nmax)
        sum_l, sum_l2, sum_xl = (w * trial).sum(dim=1), (w * trial * trial).sum(dim=1), (w * trial * x).sum(dim=1)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        trial_error = error(this_scale, this_min, trial)
        better = (det > 0) & (trial_error < best)
        codes = torch.where(better[:, None], trial, codes)
        best = torch.where(better, trial_error, best)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    codes = torch.where(flat[:, None], torch.zeros_like(codes), codes)
    return scale, -lo, codes


def _llama_q3_search(x, nmax):
    """make_q3_quants(do_rmse=true) on blocks x (B, n): (signed scale (B,), codes (B, n) in [-nmax, nmax - 1])."""
    amax, extreme = _signed_extreme(x)
    codes = torch.round((-nmax / _safe(extreme))[:, None] * x).clamp(-nmax, nmax - 1)
    w = x * x
    sum_lx, sum_l2 = (w * x * codes).sum(dim=1), (w * codes * codes).sum(dim=1)
    for _ in range(5):
        for i in range(x.shape[1]):
            wi, xi, li = w[:, i], x[:, i], codes[:, i]
            slx = sum_lx - wi * xi * li
            sl2 = sum_l2 - wi * li * li
            new = torch.round(xi * sl2 / _safe(slx)).clamp(-nmax, nmax - 1)
            new_lx, new_l2 = slx + wi * xi * new, sl2 + wi * new * new
            accept = (slx > 0) & (new != li) & (new_l2 > 0) & (new_lx * new_lx * sum_l2 > sum_lx * sum_lx * new_l2)
            codes[:, i] = torch.where(accept, new, li)
            sum_lx = torch.where(accept, new_lx, sum_lx)
            sum_l2 = torch.where(accept, new_l2, sum_l2)
    scale = torch.where(sum_l2 > 0, sum_lx / _safe(sum_l2), torch.zeros_like(sum_l2))
    zero = amax < 1e-15
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero[:, None], -float(nmax), codes)


def _llama_qx_search(x, nmax):
    """make_qx_quants(rmse_type=1, no weights) on blocks x (B, n): (signed scale (B,), codes (B, n) in [-nmax,
    nmax - 1])."""
    amax, extreme = _signed_extreme(x)
    w = x * x

    def trial(factor):
        codes = torch.round((factor / _safe(extreme))[:, None] * x).clamp(-nmax, nmax - 1)
        return codes, (w * x * codes).sum(dim=1), (w * codes * codes).sum(dim=1)

    codes, sum_lx, sum_l2 = trial(-nmax)
    scale = torch.where(sum_l2 > 0, sum_lx / _safe(sum_l2), torch.zeros_like(sum_l2))
    best = scale * sum_lx
    for factor in _grid(0.0, 0.1, [i for i in range(-9, 10) if i], nmax):
        new, sum_lx, sum_l2 = trial(-factor)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        codes = torch.where(better[:, None], new, codes)
        scale = torch.where(better, sum_lx / _safe(sum_l2), scale)
        best = torch.where(better, scale * sum_lx, best)
    zero = amax < 1e-15
    return torch.where(zero, torch.zeros_like(scale), scale), torch.where(zero[:, None], -float(nmax), codes)


def _requantize_affine(x, d, dmin, sc, m, codes, nmax):
    """llama.cpp's final pass: each code rounded for the stored block scale and min (blocks whose scale is 0 keep
    `codes`). x, codes (N, 256); d, dmin (N,); sc, m (N, nsub) -> codes (N, 256)."""
    n, nsub = sc.shape
    scale = (d[:, None] * sc)[..., None]
    offset = (dmin[:, None] * m)[..., None]
    blocks = x.reshape(n, nsub, -1)
    fresh = torch.round((blocks + offset) / _safe(scale)).clamp(0, nmax)
    return torch.where(scale == 0, codes.reshape(n, nsub, -1), fresh).reshape(n, QK_K)


def _requantize_symmetric(x, d, sc, codes, qmin, qmax):
    """The same for the symmetric types: codes in [qmin, qmax] (signed), sc signed."""
    n, nsub = sc.shape
    scale = (d[:, None] * sc)[..., None]
    fresh = torch.round(x.reshape(n, nsub, -1) / _safe(scale)).clamp(qmin, qmax)
    return torch.where(scale == 0, codes.reshape(n, nsub, -1), fresh).reshape(n, QK_K)


def _llama_k4(x, nmax, rmin, nstep):
    """quantize_row_q4_K_ref / q5_K_ref on x (N, 256): codes, sc, m, d, dmin."""
    n = x.shape[0]
    blocks = x.reshape(-1, 32)
    weights = (blocks * blocks).sum(dim=1, keepdim=True).div(32).sqrt() + blocks.abs()
    scales, mins, codes = _llama_affine_search(blocks, weights, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = scales.amax(dim=1).clamp(min=0)
    max_min = mins.amax(dim=1).clamp(min=0)
    inv_scale = torch.where(max_scale > 0, 63 / _safe(max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63 / _safe(max_min), torch.zeros_like(max_min))
    sc = torch.round(inv_scale[:, None] * scales).clamp(0, 63)
    m = torch.round(inv_min[:, None] * mins).clamp(0, 63)
    d, dmin = _to_half(max_scale / 63), _to_half(max_min / 63)
    codes = _requantize_affine(x, d, dmin, sc, m, codes.reshape(n, QK_K), nmax)
    return codes, sc, m, d, dmin


def _llama_q2_k(x):
    n = x.shape[0]
    blocks = x.reshape(-1, 16)
    scales, mins, codes = _llama_affine_search(blocks, blocks.abs(), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale = scales.amax(dim=1).clamp(min=0)
    max_min = mins.amax(dim=1).clamp(min=0)
    sc = torch.round((15 / _safe(max_scale))[:, None] * scales).clamp(0, 15)
    m = torch.round((15 / _safe(max_min))[:, None] * mins).clamp(0, 15)
    sc = torch.where(max_scale[:, None] > 0, sc, torch.zeros_like(sc))
    m = torch.where(max_min[:, None] > 0, m, torch.zeros_like(m))
    d, dmin = _to_half(max_scale / 15), _to_half(max_min / 15)
    codes = _requantize_affine(x, d, dmin, sc, m, codes.reshape(n, QK_K), 3)
    return _bytes_q2_k(codes, sc, m, d, dmin)


def _llama_q3_k(x):
    n = x.shape[0]
    scales, codes = _llama_q3_search(x.reshape(-1, 16), 4)
    scales = scales.reshape(n, 16)
    _, max_scale = _signed_extreme(scales)
    iscale = -32 / _safe(max_scale)
    sc = torch.round(iscale[:, None] * scales).clamp(-32, 31)
    sc = torch.where(max_scale[:, None] != 0, sc, torch.full_like(sc, -32))
    d = torch.where(max_scale != 0, _to_half(1 / iscale), torch.zeros_like(iscale))
    codes = _requantize_symmetric(x, d, sc, codes.reshape(n, QK_K), -4, 3)
    return _bytes_q3_k(codes + 4, sc + 32, d)


def _llama_q4_k(x):
    return _bytes_q4_k(*_llama_k4(x, 15, -1.0, 20))


def _llama_q5_k(x):
    return _bytes_q5_k(*_llama_k4(x, 31, -0.5, 15))


def _llama_q6_k(x):
    n = x.shape[0]
    blocks = x.reshape(-1, 16)
    scales, codes = _llama_qx_search(blocks, 32)
    scales = scales.reshape(n, 16)
    max_abs, max_scale = _signed_extreme(scales)
    zero = max_abs < 1e-15
    iscale = -128 / _safe(max_scale)
    sc = torch.round(iscale[:, None] * scales).clamp(max=127)
    d = _to_half(1 / iscale)
    codes = _requantize_symmetric(x, d, sc, codes.reshape(n, QK_K), -32, 31)
    data = _bytes_q6_k(codes + 32, sc, d)
    return torch.where(zero[:, None], torch.zeros_like(data), data)


def llama_reference(name: str, weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's own data-free quantization of `weight` (rows, K) into k-quant `name` (q2_k..q6_k), as hfquant
    re-expresses it over all blocks at once: the baseline hfquant's quantizers are measured against.

    Returns:
        (rows, K // 256 * type_size) uint8, the bytes `ggml_quantize_chunk` writes (up to float32 summation order,
        which can tip a near-tie in a scale search).
    Raises:
        ValueError: an unknown name, or a weight that is not 2-D with K a multiple of 256.
    """
    recipes = {"q2_k": _llama_q2_k, "q3_k": _llama_q3_k, "q4_k": _llama_q4_k, "q5_k": _llama_q5_k, "q6_k": _llama_q6_k}
    if name not in recipes:
        raise ValueError(f"llama_reference covers {list(recipes)}; got {name!r}")
    if weight.dim() != 2 or weight.shape[1] % QK_K:
        raise ValueError(f"{name} quantizes a (rows, K) weight with K a multiple of {QK_K}; got {tuple(weight.shape)}")
    return recipes[name](_super_blocks(weight)).reshape(weight.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------------
# hfquant's quantizers. The same search shape for every type, each step a least-squares fit or an exhaustive choice
# among a few integers, every step kept only where it lowers the weighted squared error of the super-block:
# 1. each block's float scale (and min) from a grid of starting scales, each refit by weighted least squares;
# 2. the super-block's float16 d (and dmin) from a grid, rounding the block scales to integers against it;
# 3. alternate: codes rounded for the stored scales; (d, dmin) refit by least squares for those codes and integer
#    block scales; each block's integer scale (and min) chosen among the neighbours of its least-squares fit.


def _sum(values: torch.Tensor, dim) -> torch.Tensor:
    """float32 sum over `dim`, accumulated in float64 and rounded once: independent of the summation order, so the C
    search (csrc/blocks_quant_cpu.c, which sums left to right in double) takes the same decisions bit for bit."""
    return values.double().sum(dim).float()


def _codes_affine(x, w, scale, offset, nmax):
    """Nearest codes of x ~ scale * q - offset, q in [0, nmax]: (codes, weighted squared error over the last dim).
    x, w (..., n); scale, offset (..., 1)."""
    codes = torch.round((x + offset) / _safe(scale)).clamp(0, nmax)
    codes = torch.where(scale == 0, torch.zeros_like(codes), codes)
    diff = scale * codes - offset - x
    return codes, _sum(w * diff * diff, -1)


def _codes_symmetric(x, w, scale, qmin, qmax):
    """Nearest codes of x ~ scale * q, q in [qmin, qmax] (scale signed): (codes, weighted squared error)."""
    codes = torch.round(x / _safe(scale)).clamp(qmin, qmax)
    codes = torch.where(scale == 0, torch.zeros_like(codes), codes)
    diff = scale * codes - x
    return codes, _sum(w * diff * diff, -1)


def _lstsq_affine(x, w, codes):
    """Weighted least squares of x ~ s * codes - o with o >= 0 over the last dim: (s, o), each (...,)."""
    sw, sl, sl2 = _sum(w, -1), _sum(w * codes, -1), _sum(w * codes * codes, -1)
    sx, slx = _sum(w * x, -1), _sum(w * codes * x, -1)
    det = sw * sl2 - sl * sl
    scale = (sw * slx - sx * sl) / _safe(det)
    offset = -(sl2 * sx - sl * slx) / _safe(det)
    clipped = (offset < 0) | (det <= 0)
    scale = torch.where(clipped, slx / _safe(sl2), scale).clamp(min=0)
    offset = torch.where(clipped, torch.zeros_like(offset), offset)
    # every code 0: the block is its offset alone, the negated weighted mean (a constant negative block)
    all_zero = sl2 == 0
    offset = torch.where(all_zero, (-sx / _safe(sw)).clamp(min=0), offset)
    return torch.where(all_zero, torch.zeros_like(scale), scale), offset


def _fit_affine(x, w, nmax, factors):
    """Step 1 for x ~ s * q - o (blocks x, w (B, n)): the best (s, o) over starting scales `factors` / range."""
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0)
    span = _safe(x.amax(dim=-1, keepdim=True) - lo)
    best_s = best_o = best_err = None
    for factor in factors:
        codes = torch.round((x - lo) * (factor / span)).clamp(0, nmax)
        for _ in range(2):
            s, o = _lstsq_affine(x, w, codes)
            codes, err = _codes_affine(x, w, s[..., None], o[..., None], nmax)
        if best_err is None:
            best_s, best_o, best_err = s, o, err
        else:
            better = err < best_err
            best_s, best_o = torch.where(better, s, best_s), torch.where(better, o, best_o)
            best_err = torch.where(better, err, best_err)
    return best_s, best_o


def _fit_symmetric(x, w, qmin, qmax, factors):
    """Step 1 for x ~ s * q (signed s): the best s over starting scales `factors` / the extreme value, mapping it to
    either end of the code range."""
    _, extreme = _signed_extreme(x)
    extreme = _safe(extreme)[..., None]
    best_s = best_err = None
    for factor in factors:
        for end in (qmin, qmax):
            codes = torch.round(x * (end * factor / extreme)).clamp(qmin, qmax)
            for _ in range(2):
                s = _sum(w * codes * x, -1) / _safe(_sum(w * codes * codes, -1))
                codes, err = _codes_symmetric(x, w, s[..., None], qmin, qmax)
            if best_err is None:
                best_s, best_err = s, err
            else:
                better = err < best_err
                best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return best_s


def _round_scales(values, sensitivity, top, lowest, tries):
    """Step 2: float16 super-block scale d (N,) and integers q (N, nsub) in [lowest, top] with values ~ d * q,
    minimizing sum(sensitivity * (values - d * q)**2) over d = extreme / (end + t) for t in `tries`."""
    amax, extreme = _signed_extreme(values)
    best_d = best_q = best_err = None
    for end in (top,) if lowest == 0 else (top, lowest):
        for t in tries:
            d = _to_half(extreme / (end + (t if end > 0 else -t)))
            q = torch.round(values / _safe(d)[:, None]).clamp(lowest, top)
            err = _sum(sensitivity * (values - d[:, None] * q) ** 2, -1)
            if best_err is None:
                best_d, best_q, best_err = d, q, err
            else:
                better = err < best_err
                best_d, best_q = torch.where(better, d, best_d), torch.where(better[:, None], q, best_q)
                best_err = torch.where(better, err, best_err)
    zero = amax == 0
    return torch.where(zero, torch.zeros_like(best_d), best_d), torch.where(zero[:, None], 0.0, best_q)


def _refine_affine(x, w, d, dmin, sc, m, nmax, top, rounds):
    """Step 3 for x ~ d*sc*q - dmin*m on blocks x, w (N, nsub, sub): (codes, sc, m, d, dmin)."""

    def evaluate(d, dmin, sc, m):
        return _codes_affine(x, w, (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None], nmax)

    codes, err = evaluate(d, dmin, sc, m)
    for _ in range(rounds):
        a, b = sc[..., None] * codes, m[..., None].expand_as(codes)
        saa, sab, sbb = _sum(w * a * a, (1, 2)), _sum(w * a * b, (1, 2)), _sum(w * b * b, (1, 2))
        sax, sbx = _sum(w * a * x, (1, 2)), _sum(w * b * x, (1, 2))
        det = saa * sbb - sab * sab
        new_d = _to_half((sax * sbb - sab * sbx) / _safe(det))
        new_dmin = _to_half((sab * sax - saa * sbx) / _safe(det))
        valid = (det > 0) & (new_d >= 0) & (new_dmin >= 0)
        new_d, new_dmin = torch.where(valid, new_d, d), torch.where(valid, new_dmin, dmin)
        new_codes, new_err = evaluate(new_d, new_dmin, sc, m)
        better = _sum(new_err, 1) < _sum(err, 1)
        d, dmin = torch.where(better, new_d, d), torch.where(better, new_dmin, dmin)
        codes, err = torch.where(better[:, None, None], new_codes, codes), torch.where(better[:, None], new_err, err)

        scale, offset = _lstsq_affine(x, w, codes)
        base_sc = torch.round(scale / _safe(d)[:, None])
        base_m = torch.round(offset / _safe(dmin)[:, None])
        for dsc in (-1, 0, 1):
            for dm in (-1, 0, 1):
                try_sc, try_m = (base_sc + dsc).clamp(0, top), (base_m + dm).clamp(0, top)
                new_codes, new_err = evaluate(d, dmin, try_sc, try_m)
                better = new_err < err
                sc, m = torch.where(better, try_sc, sc), torch.where(better, try_m, m)
                codes, err = torch.where(better[..., None], new_codes, codes), torch.where(better, new_err, err)
    return codes, sc, m, d, dmin


def _refine_symmetric(x, w, d, sc, qmin, qmax, lowest, top, rounds):
    """Step 3 for x ~ d*sc*q (signed d, sc, q) on blocks x, w (N, nsub, sub): (codes, sc, d)."""

    def evaluate(d, sc):
        return _codes_symmetric(x, w, (d[:, None] * sc)[..., None], qmin, qmax)

    codes, err = evaluate(d, sc)
    for _ in range(rounds):
        a = sc[..., None] * codes
        new_d = _to_half(_sum(w * a * x, (1, 2)) / _safe(_sum(w * a * a, (1, 2))))
        new_codes, new_err = evaluate(new_d, sc)
        better = _sum(new_err, 1) < _sum(err, 1)
        d = torch.where(better, new_d, d)
        codes, err = torch.where(better[:, None, None], new_codes, codes), torch.where(better[:, None], new_err, err)

        scale = _sum(w * codes * x, -1) / _safe(_sum(w * codes * codes, -1))
        base = torch.round(scale / _safe(d)[:, None])
        for step in (-1, 0, 1):
            try_sc = (base + step).clamp(lowest, top)
            new_codes, new_err = evaluate(d, try_sc)
            better = new_err < err
            sc = torch.where(better, try_sc, sc)
            codes, err = torch.where(better[..., None], new_codes, codes), torch.where(better, new_err, err)
    return codes, sc, d


def _quantize_affine(x, w, sub, nmax, top, factors, tries, rounds):
    """Steps 1-3 for Q2_K, Q4_K, Q5_K on super-blocks x, w (N, 256): (codes (N, 256), sc, m, d, dmin)."""
    n, nsub = x.shape[0], QK_K // sub
    xb, wb = x.reshape(n, nsub, sub), w.reshape(n, nsub, sub)
    scale, offset = _fit_affine(xb, wb, nmax, factors)
    codes, _ = _codes_affine(xb, wb, scale[..., None], offset[..., None], nmax)
    d, sc = _round_scales(scale, _sum(wb * codes * codes, -1), top, 0, tries)
    dmin, m = _round_scales(offset, _sum(wb, -1), top, 0, tries)
    codes, sc, m, d, dmin = _refine_affine(xb, wb, d, dmin, sc, m, nmax, top, rounds)
    return codes.reshape(n, QK_K), sc, m, d, dmin


def _quantize_symmetric(x, w, qmin, qmax, lowest, top, factors, tries, rounds):
    """Steps 1-3 for Q3_K and Q6_K (16 blocks of 16) on x, w (N, 256): (signed codes (N, 256), signed sc, d)."""
    n = x.shape[0]
    xb, wb = x.reshape(n, 16, 16), w.reshape(n, 16, 16)
    scale = _fit_symmetric(xb, wb, qmin, qmax, factors)
    codes, _ = _codes_symmetric(xb, wb, scale[..., None], qmin, qmax)
    d, sc = _round_scales(scale, _sum(wb * codes * codes, -1), top, lowest, tries)
    codes, sc, d = _refine_symmetric(xb, wb, d, sc, qmin, qmax, lowest, top, rounds)
    return codes.reshape(n, QK_K), sc, d


_TRIES = [i / 4 for i in range(-4, 5)]
_CHUNK = 4096  # super-blocks per pass: bounds the search's temporaries to a few tens of MB
_ROUNDS = 2


def _affine_factors(nmax: int) -> list[float]:
    return [nmax - 2 + 0.2 * i for i in range(16)]


_SYMMETRIC_FACTORS = [0.8 + 0.04 * i for i in range(11)]


def _by_chunks(quantize_blocks, weight, importance):
    x, w = _super_blocks(weight), _importance_blocks(importance, weight)
    parts = [quantize_blocks(x[i : i + _CHUNK], w[i : i + _CHUNK]) for i in range(0, x.shape[0], _CHUNK)]
    return (
        torch.cat(parts).reshape(weight.shape[0], -1) if parts else torch.zeros(weight.shape[0], 0, dtype=torch.uint8)
    )


def _q2_k_blocks(x, w):
    return _bytes_q2_k(*_quantize_affine(x, w, 16, 3, 15, _affine_factors(3), _TRIES, _ROUNDS))


def _q3_k_blocks(x, w):
    codes, sc, d = _quantize_symmetric(x, w, -4, 3, -32, 31, _SYMMETRIC_FACTORS, _TRIES, _ROUNDS)
    return _bytes_q3_k(codes + 4, sc + 32, d)


def _q4_k_blocks(x, w):
    return _bytes_q4_k(*_quantize_affine(x, w, 32, 15, 63, _affine_factors(15), _TRIES, _ROUNDS))


def _q5_k_blocks(x, w):
    return _bytes_q5_k(*_quantize_affine(x, w, 32, 31, 63, _affine_factors(31), _TRIES, _ROUNDS))


def _q6_k_blocks(x, w):
    codes, sc, d = _quantize_symmetric(x, w, -32, 31, -128, 127, _SYMMETRIC_FACTORS, _TRIES, _ROUNDS)
    return _bytes_q6_k(codes + 32, sc, d)


def quantize_q2_k(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q2_K blocks of `weight` (rows, K), K a multiple of 256: (rows, K // 256 * 84) uint8.

    `importance` ((K,) or (rows, K), >= 0) weights each element's squared error; None weighs all alike
    (`hfquant.core.blocks.quantize` passes the type's data-free default, `importance.default_importance`). Raises
    ValueError for a non-finite weight or a badly shaped or negative importance.
    """
    return _by_chunks(_q2_k_blocks, weight, importance)


def quantize_q3_k(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q3_K blocks of `weight` (rows, K): (rows, K // 256 * 110) uint8 (arguments as `quantize_q2_k`)."""
    return _by_chunks(_q3_k_blocks, weight, importance)


def quantize_q4_k(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q4_K blocks of `weight` (rows, K): (rows, K // 256 * 144) uint8 (arguments as `quantize_q2_k`)."""
    return _by_chunks(_q4_k_blocks, weight, importance)


def quantize_q5_k(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q5_K blocks of `weight` (rows, K): (rows, K // 256 * 176) uint8 (arguments as `quantize_q2_k`)."""
    return _by_chunks(_q5_k_blocks, weight, importance)


def quantize_q6_k(weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Q6_K blocks of `weight` (rows, K): (rows, K // 256 * 210) uint8 (arguments as `quantize_q2_k`)."""
    return _by_chunks(_q6_k_blocks, weight, importance)
