"""The machine a measurement ran on: CPU model and the instruction-set extensions that decide which kernels win.

Every speed figure names its CPU (the same code is faster on one CPU and slower on another: docs/performance.md);
`describe()` is the one line the benchmark and the accuracy script print with their tables.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["ISA_FLAGS", "cpu_name", "isa_flags", "describe"]

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "avx_vnni")
"""The /proc/cpuinfo flags that pick kernels on x86: AVX2 and AVX-512 widths, VNNI integer dot products (int8
decode), AVX512-BF16 (hfquant's int4 GEMV), AVX512-FP16 and AMX tiles."""


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU model ("AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"), or the platform's
    processor / machine string where /proc/cpuinfo has none."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_flags() -> list[str]:
    """The `ISA_FLAGS` this CPU has (empty off Linux / x86)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [flag for flag in ISA_FLAGS if flag in flags]


def describe() -> str:
    """"CPU: <model>; ISA: avx2, avx512f, ...; N logical CPUs" for a table header."""
    flags = ", ".join(isa_flags()) or "none of " + ", ".join(ISA_FLAGS)
    return f"CPU: {cpu_name()}; ISA: {flags}; {os.cpu_count()} logical CPUs"
