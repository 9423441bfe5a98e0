"""The machine a measurement ran on: CPU model and the instruction-set extensions that decide which kernels win.

Every speed figure names its CPU (the same code is faster on one CPU and slower on another: docs/performance.md);
`describe()` is the one line the benchmark and the accuracy script print with their tables. The CPU facts come from
`hfquant.ops.machine`, which the kernel choice uses too.
"""

from __future__ import annotations

import os

from hfquant.ops.machine import ISA_FLAGS, cpu_name, cpuinfo_field, isa_flags

__all__ = ["ISA_FLAGS", "cpu_name", "isa_flags", "describe"]


def describe() -> str:
    """ "CPU: <model> (family F model M); ISA: avx2, avx512f, ...; N logical CPUs" for a table header. The family and
    model numbers tell apart CPUs that a virtual machine names alike ("AMD EPYC" is Zen 4 at family 25 model 17,
    Zen 5 at family 26)."""
    flags = ", ".join(isa_flags()) or "none of " + ", ".join(ISA_FLAGS)
    family, model = cpuinfo_field("cpu family"), cpuinfo_field("model")
    numbers = f" (family {family} model {model})" if family and model else ""
    return f"CPU: {cpu_name()}{numbers}; ISA: {flags}; {os.cpu_count()} logical CPUs"
