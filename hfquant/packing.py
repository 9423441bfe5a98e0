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


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 codes in [0, 15], K even -> (N, K // 2) uint8, even column in the low nibble.

    Raises:
        ValueError: K is odd or codes are not uint8.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_int4 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (N, K // 2) uint8 -> (N, K) uint8 codes in [0, 15]."""
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

    def _blocks(self, n: int):
        for start in range(0, n, self.block_n):
            size = min(self.block_n, n - start)
            yield start, size, self.full_blocks_halves and size == self.block_n

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """(N, K) uint8 codes -> (N, K // 2) uint8 in this kernel layout. N must be a multiple of 16."""
        n, k = codes.shape
        out = torch.empty((n * k // 2,), dtype=torch.uint8, device=codes.device)
        offset = 0
        for start, size, halves in self._blocks(n):
            block = codes[start : start + size]  # (size, K)
            if halves:
                low, high = block[: size // 2], block[size // 2 :]
            else:
                low, high = block[0::2], block[1::2]
            packed = (low | (high << 4)).t()  # (K, size // 2)
            out[offset : offset + packed.numel()] = packed.reshape(-1)
            offset += packed.numel()
        return out.view(n, k // 2)

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """Inverse of `pack`: (N, K // 2) uint8 in kernel layout -> (N, K) uint8 codes."""
        flat = packed.reshape(-1)
        codes = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
        offset = 0
        for start, size, halves in self._blocks(n):
            count = size * k // 2
            block = flat[offset : offset + count].view(k, size // 2).t()  # (size // 2, K)
            offset += count
            low, high = block & 0x0F, block >> 4
            if halves:
                codes[start : start + size // 2] = low
                codes[start + size // 2 : start + size] = high
            else:
                codes[start : start + size : 2] = low
                codes[start + 1 : start + size : 2] = high
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
