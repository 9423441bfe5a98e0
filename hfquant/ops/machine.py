"""The CPU this process runs on: its model and the instruction-set extensions that decide which kernel wins.

The same kernel is faster on one CPU and slower on another (docs/performance.md): kernel choices measured here are
cached per CPU (`hfquant.ops.choice`), and every speed figure of the scripts names its CPU (`benchmarks.machine`).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

__all__ = ["ISA_FLAGS", "cpuinfo_field", "cpu_name", "gemm_dtype", "isa_flags"]

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "avx_vnni")
"""The /proc/cpuinfo flags that pick kernels on x86: AVX2 and AVX-512 widths, VNNI integer dot products (int8
decode), AVX512-BF16 (hfquant's int4 GEMV), AVX512-FP16 and AMX tiles."""


def cpuinfo_field(name: str) -> str | None:
    """The value of the first /proc/cpuinfo line whose key is `name` ("model name", "cpu family", "flags"), or None
    (not Linux, or no such line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, colon, value = line.partition(":")
            if colon and key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model ("AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"), or the platform's
    processor / machine string where /proc/cpuinfo has none."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The `ISA_FLAGS` this CPU has (empty off Linux / x86)."""
    flags = set((cpuinfo_field("flags") or "").split())
    return [flag for flag in ISA_FLAGS if flag in flags]


def _onednn_half_support() -> dict[torch.dtype, bool]:
    """Whether oneDNN has a GEMM for bfloat16 / float16 on this CPU (AVX512 or AMX for bfloat16; AVX512-FP16 or
    AMX-FP16 for float16). True where torch has no such query (not built with oneDNN): nothing changes there."""
    try:
        ops = torch.ops.mkldnn
        return {torch.bfloat16: ops._is_mkldnn_bf16_supported(), torch.float16: ops._is_mkldnn_fp16_supported()}
    except (AttributeError, RuntimeError):
        return {torch.bfloat16: True, torch.float16: True}


_HALF_GEMM = _onednn_half_support()


def gemm_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a float GEMM of `dtype` operands runs in on `device`: float32 for bfloat16 / float16 on a CPU where
    oneDNN has no GEMM of that dtype, else `dtype` itself.

    Why: without oneDNN, PyTorch (2.13) multiplies bfloat16 and float16 matrices on the CPU in a scalar loop. On an AMD
    EPYC Zen 3 (AVX2, no AVX-512) a (4, 2048) x (2048, 1024) bfloat16 `torch.mm` took 22 ms against 1.2 ms in float32
    (one thread; docs/performance.md, "CPUs without AVX-512"): quantized layers' prefill (`kernels._dequantized_gemm`)
    and float layers kept in bfloat16 multiply in float32 there and round the result once to `dtype`, which is at
    least as accurate (oneDNN's bfloat16 GEMM also sums in float32)."""
    if torch.device(device).type == "cpu" and not _HALF_GEMM.get(dtype, True):
        return torch.float32
    return dtype
