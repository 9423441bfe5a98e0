"""Quantizing one weight needs bounded transient memory whatever its size (row chunks).

A synthetic 1 GiB float32 Linear weight is quantized in a fresh process; the peak RSS above what the input and
the outputs occupy must stay under 64 MiB, for int8 and int4 (packing included).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_WORKER = textwrap.dedent(
    """
    import json, sys, torch
    from hfquant.core.format import StoredFormat
    from hfquant.nn.linear import quantize_to_buffers
    from benchmarks.memory import peak_rss_mib, reset_peak_rss, rss_mib
    bits, group_size = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    weight = torch.empty((16384, 16384), dtype=torch.float32)  # 1 GiB
    weight.normal_(0.0, 0.02)
    assert reset_peak_rss()
    before = rss_mib()
    buffers = quantize_to_buffers(weight, StoredFormat(bits, group_size, symmetric=bits == 8))
    out_mib = sum(t.numel() * t.element_size() for t in buffers.values()) / 2**20
    print(json.dumps({"transient_mib": peak_rss_mib() - before - out_mib, "out_mib": out_mib}))
    """
)


@pytest.mark.parametrize("bits,group_size", [(8, 16384), (4, 128)], ids=["int8", "int4-g128"])
def test_transient_memory_of_quantizing_a_1gib_weight(bits, group_size):
    result = subprocess.run(
        [sys.executable, "-c", _WORKER, str(bits), str(group_size)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],  # the repository root, where `-c` code finds benchmarks/
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["transient_mib"] < 64, measured
