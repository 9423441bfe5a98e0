#!/usr/bin/env python
"""Row kernel vs R8 (8 interleaved rows, csrc/blocks_r8_body.h) vs llama.cpp's ggml_gemv_iq4_nl_8x8_q8_0 for IQ4_NL,
and row vs R8 for IQ4_XS and Q3_K (csrc/blocks_r8k_body.h), on SmolLM2-135M's and the 1.2B's projection shapes
(issues #32, #30).

Per shape R rounds, each round a batch of calls of every kernel in turn (interleaved, so a load change of the shared
machine hits all alike); reported: the median over rounds of the time per call, and the ratios row / R8 (> 1: R8
faster), R8 / llama.cpp, and IQ4_XS R8 / Q3_K R8 (> 1: Q3_K R8 faster; the bytes' ratio is 136 / 110 = 1.24).
hfquant's times are `torch.ops.hfquant_cpu.block_gemv` calls (kernel plus the operator call and the activation's
quantization, as a decode step pays them); llama.cpp's is its repacked kernel alone through
ctypes on a pre-quantized activation (block_q8_0), as /tmp/m22/r8ref.py timed it. One thread (the default): the
calling thread's CPU time (`time.thread_time`), so time other processes hold the core is not counted; --threads 2:
wall-clock medians (`time.perf_counter`), state the load average with them. Weights: random codes with float16
scales 0.01 (IQ4_XS, Q3_K: random 6-bit block scales).

    OMP_NUM_THREADS=1 python scripts/block_rows8_ab.py --rounds 15
    OMP_NUM_THREADS=2 python scripts/block_rows8_ab.py --rounds 15 --threads 2
    OMP_NUM_THREADS=1 python scripts/block_rows8_ab.py --rounds 15 --models 1.2B
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

from hfquant.ops import native, torch_ops  # noqa: E402

SHAPES = {
    "SmolLM2-135M": [(576, 576), (192, 576), (1536, 576), (576, 1536)],
    "1.2B": [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192)],
}
"""(N, K) of the models' q/o, k/v, gate/up and down projections."""


def _llama():
    """llama.cpp's CPU library's ggml_gemv_iq4_nl_8x8_q8_0, or None where the engine is not installed."""
    roots = [Path(os.environ.get("HFQUANT_CACHE", Path.home() / ".cache/hfquant")), Path.home() / ".cache/hfquant"]
    for root in roots:
        found = sorted(
            (root / "engines/llama.cpp").glob(".venv-llama/lib/python*/site-packages/llama_cpp/lib/libggml-cpu.so")
        )
        if found:
            function = ctypes.CDLL(str(found[0])).ggml_gemv_iq4_nl_8x8_q8_0
            function.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
            function.argtypes += [ctypes.c_int, ctypes.c_int]
            return function
    return None


def _weight(n: int, k: int, block: int, size: int, generator: torch.Generator) -> torch.Tensor:
    """(N, row bytes) random blocks with d = 0.01 (float16 at byte 0)"""
    w = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, generator=generator)
    w[:, :, 0:2] = torch.full((n, k // block), 0.01, dtype=torch.float16).view(torch.uint8).view(n, k // block, 2)
    return w.reshape(n, -1).contiguous()


def _time(call, reps: int, wall: bool) -> float:
    """microseconds per call over `reps` calls (thread CPU time, or wall)"""
    clock = time.perf_counter if wall else time.thread_time
    start = clock()
    for _ in range(reps):
        call()
    return (clock() - start) / reps * 1e6


def _shape(n: int, k: int, rounds: int, wall: bool, llama) -> str:
    generator = torch.Generator().manual_seed(n + k)
    x = torch.randn(k, generator=generator).to(torch.bfloat16)
    calls = {}
    nl = _weight(n, k, 32, 18, generator)
    nl8 = native.block_interleave(nl, k, 20)
    calls["NL row"] = lambda: torch_ops.block_gemv(x, nl, k, 20)
    calls["NL R8"] = lambda: torch_ops.block_gemv(x, nl8, k, 20 | native.BLOCK_ROWS8)
    if llama is not None:
        repacked = _weight(n // 8, k, 32, 144, generator)  # block_iq4_nlx8: 8 float16 d then 128 code bytes
        q8 = torch.randint(-100, 100, (k // 32, 34), dtype=torch.int8, generator=generator)
        q8[:, 0:2] = torch.full((k // 32, 1), 0.01, dtype=torch.float16).view(torch.int8)
        out = torch.empty(n, dtype=torch.float32)
        calls["NL llama 8x8"] = lambda: llama(k, out.data_ptr(), 0, repacked.data_ptr(), q8.data_ptr(), 1, n)
    if k % 256 == 0:
        xs = _weight(n, k, 256, 136, generator)
        xs8 = native.block_interleave(xs, k, 23)
        calls["XS row"] = lambda: torch_ops.block_gemv(x, xs, k, 23)
        calls["XS R8"] = lambda: torch_ops.block_gemv(x, xs8, k, 23 | native.BLOCK_ROWS8)
        q3k = _weight(n, k, 256, 110, generator)
        q3k.view(n, k // 256, 110)[:, :, 108:110] = q3k.view(n, k // 256, 110)[:, :, 0:2]  # d = 0.01 is last in Q3_K
        q3k8 = native.block_interleave(q3k, k, 11)
        calls["Q3K row"] = lambda: torch_ops.block_gemv(x, q3k, k, 11)
        calls["Q3K R8"] = lambda: torch_ops.block_gemv(x, q3k8, k, 11 | native.BLOCK_ROWS8)
    assert torch.equal(
        native.block_dequantize_t(nl8, k, 20 | native.BLOCK_ROWS8, 0, n, torch.empty(k, n)),
        native.block_dequantize_t(nl, k, 20, 0, n, torch.empty(k, n)),
    )
    reps = max(20, int(1.5e8 / (n * k)))
    for call in calls.values():  # warm up
        _time(call, reps, wall)
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(_time(call, reps, wall))
    us = {name: statistics.median(values) for name, values in times.items()}
    cells = [f"{us[name]:.1f}" for name in calls]
    ratios = [f"{us['NL row'] / us['NL R8']:.2f}x"]
    if "NL llama 8x8" in us:
        ratios.append(f"{us['NL R8'] / us['NL llama 8x8']:.2f}")
    if "XS R8" in us:
        ratios.append(f"{us['XS row'] / us['XS R8']:.2f}x")
        ratios.append(f"{us['Q3K row'] / us['Q3K R8']:.2f}x")
        ratios.append(f"{us['XS R8'] / us['Q3K R8']:.2f}x")
    return f"| {n}x{k} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |", list(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not native.block_rows8_supported(20):
        sys.exit("the R8 GEMVs do not run here (they need AVX2 without AVX512-VNNI; try HFQUANT_ISA=avx2)")
    llama = _llama()
    wall = args.threads > 1
    print(f"threads {args.threads}, {'wall' if wall else 'thread CPU'} us per call, medians of {args.rounds} rounds;")
    print(f"load average {os.getloadavg()}")
    for model in args.models:
        shapes = SHAPES[model]
        print(f"\n{model}")
        previous = None
        for n, k in shapes:
            line, names = _shape(n, k, args.rounds, wall, llama)
            if names != previous:  # the columns (IQ4_XS only where K is whole super-blocks)
                previous = names
                ratio = (
                    ["NL row/R8"]
                    + (["NL R8/llama"] if llama else [])
                    + (["XS row/R8", "Q3K row/R8", "XS R8/Q3K R8"] if "XS R8" in names else [])
                )
                print("| N x K | " + " | ".join(names) + " | " + " | ".join(ratio) + " |")
            print(line, flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
