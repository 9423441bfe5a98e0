#!/usr/bin/env python
"""Interleaved before / after timing of the block GEMV of two builds of hfquant's C library, with llama.cpp's vec_dot.

`scripts/block_kernels.py` times one tree's kernels by wall clock, best of several passes: on a shared machine the
load of other jobs moves those numbers by 2x between runs. This script loads two built `int4_cpu.so` (for example
the main tree's and a branch's, each from its own `native_build.build_c_library`) and llama.cpp's CPU library into one
process and, per type and N x K shape, runs R rounds, each round a batch of calls of before, after and llama.cpp in
turn; it reports the median over rounds of the calling thread's CPU time per call (`time.thread_time`: one thread,
`OMP_NUM_THREADS=1`, so the time other processes hold the core is not counted) and the ratios. It checks that both
builds return the same bytes (a changed kernel may also round differently: then it says so). Weights and activations
as in block_kernels.py (64 distinct quantized rows repeated, one float row).

    OMP_NUM_THREADS=1 python scripts/block_gemv_ab.py BEFORE.so AFTER.so --types q4_0,q6_k,q3_k --rounds 7

A tree's built library (compiled on first use into its cache):

    HFQUANT_CACHE=DIR python -c "from hfquant.ops import native_build as b; print(b.build_c_library(b.c_compiler()))"
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from block_kernels import SHAPES, _Llama  # noqa: E402

from benchmarks.ggml_reference import find_library  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from hfquant.core import blocks  # noqa: E402


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.hfquant_block_gemv.restype = ctypes.c_int
    lib.hfquant_block_gemv.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return lib


def _cpu_us(call, reps: int) -> float:
    """The calling thread's CPU microseconds per call over `reps` calls."""
    start = time.thread_time()
    for _ in range(reps):
        call()
    return (time.thread_time() - start) / reps * 1e6


def _row(name: str, n: int, k: int, libs: list, llama: _Llama | None, rounds: int) -> str:
    """One table row: medians of the interleaved rounds of each build (and llama.cpp) on one N x K weight."""
    fmt = blocks.layout(name)
    generator = torch.Generator().manual_seed(0)
    weight = blocks.quantize(name, torch.randn((64, k), generator=generator)).repeat(n // 64, 1).contiguous()
    x = torch.randn((1, k), generator=generator)
    xb = x.to(torch.bfloat16).contiguous()
    outputs = [torch.empty(n, dtype=torch.bfloat16) for _ in libs]

    def gemv(lib, y):
        return lambda: lib.hfquant_block_gemv(xb.data_ptr(), weight.data_ptr(), y.data_ptr(), n, k, fmt.ggml_type)

    calls = [gemv(lib, y) for lib, y in zip(libs, outputs, strict=True)]
    if llama is not None and fmt.gguf:  # hfquant's own types (HQ3_R, ...) are not llama.cpp's: no vec_dot to ask for
        calls.append(llama.call(fmt.ggml_type, weight, x.contiguous(), 1))
    for call in calls:
        call()
    same = "same bytes" if torch.equal(outputs[0], outputs[1]) else "outputs differ"
    start = time.perf_counter()
    calls[0]()
    reps = max(3, int(0.05 / max(time.perf_counter() - start, 1e-7)))  # about 50 ms per batch
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(rounds):
        for i, call in enumerate(calls):
            times[i].append(_cpu_us(call, reps))
    before, after, *rest = (statistics.median(t) for t in times)
    cells = [f"{before:.1f}", f"{after:.1f}", f"{before / after:.2f}x"]
    cells += [f"{rest[0]:.1f}", f"{rest[0] / before:.2f}x", f"{rest[0] / after:.2f}x"] if rest else ["-"] * 3
    return f"| {name} | {n} x {k} | " + " | ".join(cells) + f" | {same} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="the int4_cpu.so to compare against")
    parser.add_argument("after", help="the int4_cpu.so under test")
    parser.add_argument("--types", default="q4_0,q6_k,q3_k", help="comma-separated GGUF types")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK shapes")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per shape (medians)")
    parser.add_argument("--llama-lib", default=None, help="llama.cpp's libggml-cpu.so (default: the engines venv's)")
    args = parser.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") != "1":
        parser.error("run with OMP_NUM_THREADS=1: the times are one thread's CPU time")
    torch.set_num_threads(1)
    base = find_library()
    cpu = base.with_name("libggml-cpu.so") if base is not None else None
    lib = args.llama_lib or (str(cpu) if cpu is not None and cpu.is_file() else None)
    llama = _Llama(lib) if lib else None
    libs = [_library(args.before), _library(args.after)]
    print(f"{describe()}; torch {torch.__version__}; llama.cpp: {lib or 'not found'}")
    print(f"load average at start: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print(
        "\n| type | N x K | before us | after us | after speed | llama.cpp us | before vs llama.cpp "
        "| after vs llama.cpp | outputs |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in args.types.lower().split(","):
        for shape in args.shapes.lower().split(","):
            n, k = (int(v) for v in shape.split("x"))
            print(_row(name, n, k, libs, llama, args.rounds), flush=True)
    print(f"\nload average at end: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    print("us: median over rounds of one thread's CPU time per call. Speeds: the other's time over this one's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
