"""The CPU this process runs on: its model and the instruction-set extensions that decide which kernel wins.

The same kernel is faster on one CPU and slower on another (docs/performance.md): kernel choices measured here are
cached per CPU (`hfquant.ops.choice`), and every speed figure of the scripts names its CPU (`benchmarks.machine`).
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpuinfo_field", "cpu_name", "isa_flags"]

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
