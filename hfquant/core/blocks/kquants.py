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

__all__ = [
    "QK_K",
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
