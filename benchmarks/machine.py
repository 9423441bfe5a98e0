"""The machine a measurement ran on: CPU model and the instruction-set extensions that decide which kernels win.

Every speed figure names its CPU (the same code is faster on one CPU and slower on another: docs/performance.md);
`describe()` is the one line the benchmark and the accuracy script print with their tables. The CPU facts come from
`hfquant.ops.machine`, which the kernel choice uses too.
"""

from __future__ import annotations

import os

from hfquant.ops.machine import ISA_FLAGS, cpu_name, isa_flags

__all__ = ["ISA_FLAGS", "cpu_name", "isa_flags", "describe"]


def describe() -> str:
    """"CPU: <model>; ISA: avx2, avx512f, ...; N logical CPUs" for a table header."""
    flags = ", ".join(isa_flags()) or "none of " + ", ".join(ISA_FLAGS)
    return f"CPU: {cpu_name()}; ISA: {flags}; {os.cpu_count()} logical CPUs"
