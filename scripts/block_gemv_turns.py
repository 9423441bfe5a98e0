#!/usr/bin/env python
"""One thread's block GEMV from memory, as in a model's decode step: 16 distinct weights of one type and shape called
in turn, for one or more builds of hfquant's C library side by side.

`scripts/block_gemv_ab.py` repeats 64 quantized rows into one weight and calls it again and again: a weight that fits
the L3 is then read from the L3. In a decode step each layer's weight comes from memory (the step reads far more bytes
than the L3 holds). Here each round calls 16 copies of the weight in turn, 4 times, for each library in turn; the
result is the median over rounds of the calling thread's CPU time per call (`time.thread_time`, `OMP_NUM_THREADS=1`)
and the bytes of weight read per second of it. It checks that every library returns the same bytes. The copies sit
on transparent huge pages as a loaded model's weights do (`hfquant.core.huge_pages`); `--small-pages` puts them on
4 KiB pages (IQ4_XS 1.1-1.2x slower there on AMD EPYC family 26, docs/performance.md, fifteenth session).

    OMP_NUM_THREADS=1 python scripts/block_gemv_turns.py BEFORE.so,AFTER.so iq4_nl:2048x8192,q6_k:8192x2048 --rounds 5
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfquant.core import blocks, huge_pages  # noqa: E402

COPIES = 16
PASSES = 4


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.hfquant_block_gemv.restype = ctypes.c_int
    lib.hfquant_block_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return lib


def _copy(weight: torch.Tensor, small_pages: bool) -> torch.Tensor:
    """A copy of `weight` where a loaded model's weight sits: on huge pages (`huge_pages.empty`), or with
    `small_pages` on torch's own (4 KiB) pages."""
    if small_pages:
        return weight.clone()
    return huge_pages.empty(tuple(weight.shape), weight.dtype).copy_(weight)


def _row(spec: str, libs: list[ctypes.CDLL], rounds: int, small_pages: bool) -> str:
    """One table row: `type:NxK`'s median us per call and GB/s of weight bytes for each library."""
    name, shape = spec.split(":")
    n, k = (int(v) for v in shape.lower().split("x"))
    fmt = blocks.layout(name)
    generator = torch.Generator().manual_seed(0)
    first = blocks.quantize(name, torch.randn((64, k), generator=generator)).repeat(n // 64, 1)
    weights = [_copy(first, small_pages) for _ in range(COPIES)]
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    outputs = [torch.empty(n, dtype=torch.bfloat16) for _ in libs]
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(rounds):
        for lib, y, spent in zip(libs, outputs, times, strict=True):
            start = time.thread_time()
            for _ in range(PASSES):
                for w in weights:
                    lib.hfquant_block_gemv(x.data_ptr(), w.data_ptr(), y.data_ptr(), n, k, fmt.ggml_type)
            spent.append((time.thread_time() - start) / (PASSES * COPIES) * 1e6)
    cells = []
    for spent in times:
        us = statistics.median(spent)
        cells.append(f"{us:.1f} | {first.numel() / us / 1e3:.1f}")
    same = "same bytes" if all(torch.equal(outputs[0], y) for y in outputs) else "outputs differ"
    return f"| {name} | {n} x {k} | " + " | ".join(cells) + f" | {same} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("libraries", help="comma-separated int4_cpu.so paths")
    parser.add_argument("specs", help="comma-separated type:NxK, e.g. iq4_nl:2048x8192 (N a multiple of 64)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument(
        "--small-pages", action="store_true", help="weights on 4 KiB pages (a model's are on 2 MiB pages)"
    )
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        parser.error("run with OMP_NUM_THREADS=1: the times are one thread's CPU time")
    torch.set_num_threads(1)
    libs = [_library(path) for path in args.libraries.split(",")]
    print(f"load average at start: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    heads = " | ".join(f"lib {i} us | lib {i} GB/s" for i in range(len(libs)))
    print(f"\n| type | N x K | {heads} | outputs |")
    print("| --- | --- | " + " | ".join("---: | ---:" for _ in libs) + " | --- |")
    for spec in args.specs.split(","):
        print(_row(spec, libs, args.rounds, args.small_pages), flush=True)
    print(f"\nload average at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
