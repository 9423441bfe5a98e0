"""4-bit packing: the plain on-disk layout, and the CPU kernel layout it is repacked into at load time.

Plain layout (what files hold, see docs/format.md): codes (N, K) uint8 in [0, 15] -> (N, K // 2) uint8 where
byte [n, j] = codes[n, 2j] | codes[n, 2j + 1] << 4 (even input column in the low nibble).
Example: codes row [3, 10, 15, 0] -> bytes [0xA3, 0x0F].

CPU kernel layout (`torch.ops.aten._weight_int4pack_mm_for_cpu`): rows are cut into blocks of BLOCK_N output
channels; a block of `nb` rows occupies `nb * K / 2` bytes ordered by input column k, then by row. For a full
block ("halves"), byte [k, j] holds row j in the low nibble and row j + BLOCK_N / 2 in the high nibble; a short
last block, and every block on CPUs without AVX ("pairs"), holds rows 2j and 2j + 1. BLOCK_N is 64 with AVX-512,
32 otherwise. Which one this PyTorch build uses is found once by packing a probe with the aten op
(`cpu_int4_layout()`), so the kernel layout never reaches a file and unpacking is exact on every CPU.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

__all__ = [
    "pack_int4",
    "unpack_int4",
    "CpuInt4Layout",
    "cpu_int4_layout",
    "to_cpu_int4_layout",
    "from_cpu_int4_layout",
]

logger = logging.getLogger(__name__)


_LITTLE_ENDIAN = sys.byteorder == "little"


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15], K even -> (N, K // 2) uint8, even column in the low nibble.

    Raises:
        ValueError: K is odd or codes are not uint8.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_int4 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {codes.shape[-1]}")
    if _LITTLE_ENDIAN and codes.is_contiguous() and codes.numel():
        # Each pair of bytes read as one little-endian int16 is c_even | c_odd << 8; folding the high byte down by
        # 4 bits gives c_even | c_odd << 4 in the low byte. Contiguous passes only, no strided slices.
        # viewed flat first: a contiguous tensor may still carry an odd stride on a dimension of size 1 (e.g. (1, K)
        # with strides (1, 1) from `.t().contiguous()`), which `view(torch.int16)` refuses
        pairs = codes.reshape(-1).view(torch.int16)
        packed = (pairs | (pairs >> 4)).to(torch.uint8)  # the integer cast keeps the low byte
        return packed.reshape(*codes.shape[:-1], codes.shape[-1] // 2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K // 2) uint8 -> (N, K) uint8 codes in [0, 15]."""
    if _LITTLE_ENDIAN and packed.numel():
        wide = packed.contiguous().to(torch.int16)
        pairs = (wide & 0x0F) | ((wide >> 4) << 8)  # little-endian bytes: c_even, c_odd
        return pairs.view(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


class CpuInt4Layout:
    """Block structure of the CPU int4 kernel's weight layout (see module docstring)."""

    def __init__(self, block_n: int, full_blocks_halves: bool):
        self.block_n = block_n
        self.full_blocks_halves = full_blocks_halves

    def __repr__(self) -> str:
        return f"CpuInt4Layout(block_n={self.block_n}, full_blocks_halves={self.full_blocks_halves})"

    def _split(self, n: int) -> tuple[int, int]:
        """Rows in full blocks handled together, and the size of the short last block (0 if none)."""
        full = n - n % self.block_n
        return full, n - full

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """(N, K) uint8 codes -> (N, K // 2) uint8 in this kernel layout. N must be a multiple of 16."""
        n, k = codes.shape
        full, tail = self._split(n)
        parts = []
        if full:
            blocks = codes[:full].view(full // self.block_n, 2, self.block_n // 2, k)
            if self.full_blocks_halves:
                low, high = blocks[:, 0], blocks[:, 1]
            else:
                pairs = codes[:full].view(full // self.block_n, self.block_n // 2, 2, k)
                low, high = pairs[:, :, 0], pairs[:, :, 1]
            parts.append((low | (high << 4)).transpose(1, 2).reshape(-1))  # (blocks, K, block_n / 2)
        if tail:
            pairs = codes[full:].view(tail // 2, 2, k)
            parts.append((pairs[:, 0] | (pairs[:, 1] << 4)).t().reshape(-1))  # (K, tail / 2)
        return torch.cat(parts).view(n, k // 2) if len(parts) > 1 else parts[0].view(n, k // 2)

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Inverse of `pack`: (N, K // 2) uint8 in kernel layout -> (N, K) uint8 codes."""
        flat = packed.reshape(-1)
        full, tail = self._split(n)
        codes = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
        if full:
            blocks = flat[: full * k // 2].view(full // self.block_n, k, self.block_n // 2).transpose(1, 2)
            low, high = blocks & 0x0F, blocks >> 4  # (blocks, block_n / 2, K)
            if self.full_blocks_halves:
                target = codes[:full].view(full // self.block_n, 2, self.block_n // 2, k)
                target[:, 0], target[:, 1] = low, high
            else:
                target = codes[:full].view(full // self.block_n, self.block_n // 2, 2, k)
                target[:, :, 0], target[:, :, 1] = low, high
        if tail:
            block = flat[full * k // 2 :].view(k, tail // 2).t()
            target = codes[full:].view(tail // 2, 2, k)
            target[:, 0], target[:, 1] = block & 0x0F, block >> 4
        return codes


_CANDIDATES = (CpuInt4Layout(64, True), CpuInt4Layout(32, True), CpuInt4Layout(32, False), CpuInt4Layout(16, False))


@functools.lru_cache(maxsize=1)
def cpu_int4_layout() -> CpuInt4Layout | None:
    """The layout `torch.ops.aten._convert_weight_to_int4pack_for_cpu` produces on this machine, or None.

    Found by packing a probe of 176 x 64 random codes (two full 64-row blocks and a 48-row tail) with the aten op
    and comparing with each known layout. None means the op is missing or its layout is unknown: the CPU int4
    kernel is then not used and layers fall back to dequantize-then-matmul.
    """
    op = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
    if op is None:
        return None
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (176, 64), dtype=torch.int32, generator=generator)
    try:
        reference = op(codes, 1)
    except RuntimeError as error:  # pragma: no cover - depends on the PyTorch build
        logger.info("CPU int4 kernel unavailable: %s", error)
        return None
    for layout in _CANDIDATES:
        if torch.equal(layout.pack(codes.to(torch.uint8)), reference.view(176, 32)):
            return layout
    logger.warning("Unknown CPU int4 kernel layout in this PyTorch build; int4 layers use dequantize-then-matmul.")
    return None


def to_cpu_int4_layout(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes -> (N, K // 2) uint8 in the CPU kernel layout. Raises RuntimeError if unknown."""
    layout = cpu_int4_layout()
    if layout is None:
        raise RuntimeError("the CPU int4 kernel layout is not available in this PyTorch build")
    return layout.pack(codes)


def from_cpu_int4_layout(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """(N, K // 2) uint8 in the CPU kernel layout -> (N, K) uint8 codes. Raises RuntimeError if unknown."""
    layout = cpu_int4_layout()
    if layout is None:
        raise RuntimeError("the CPU int4 kernel layout is not available in this PyTorch build")
    return layout.unpack(packed, n, k)


def scale_zero_for_int4(scale: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """(N, G) scale and zero point -> (G, N, 2) `dtype` tensor [scale, (8 - z) * scale] for the int4 kernels.

    Symmetric 4-bit codes carry the implicit zero point 8, so their zero term is 0.
    """
    scale32 = scale.float()
    zero = torch.zeros_like(scale32) if zero_point is None else (8.0 - zero_point.float()) * scale32
    return torch.stack((scale32.t(), zero.t()), dim=-1).to(dtype).contiguous()
