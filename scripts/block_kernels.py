#!/usr/bin/env python
"""Op-level timing of hfquant's block GEMV per GGUF type (issue #30: each format against llama.cpp's same type).

For each type and each N x K shape (default: the 1.2B benchmark Llama's projections and its lm_head) it prints us per
call and GB/s of weight bytes for one and two threads, the ratio of that GB/s to Q4_0's measured in the same run
(types far below Q4_0 are compute-bound), and, when llama.cpp's CPU library is found, llama.cpp's own GEMV of the same
bytes: `ggml_get_type_traits_cpu(type)`'s from_float on the activation, then vec_dot once per row, looped in a small C
shim compiled here (OpenMP splits the rows). It is the fairest yardstick at op level; llama.cpp's runtime may instead
run repacked layouts (Q4_0, IQ4_NL, Q4_K on AVX2/AVX-512) that vec_dot does not show.

The weight is one tensor called repeatedly (best of several passes): the cached case for the smaller shapes, from
memory for the lm_head. Rows are 64 distinct quantized rows repeated (N % 64 == 0). Wall-clock times move with the
machine's load; scripts/block_gemv_ab.py compares two builds and llama.cpp by one thread's CPU time, interleaved.

    python scripts/block_kernels.py
    python scripts/block_kernels.py --types q4_0,q6_k --shapes 2048x2048 --threads 1
    python scripts/block_kernels.py --llama-lib path/to/libggml-cpu.so
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ggml_reference import find_library  # noqa: E402
from benchmarks.machine import describe  # noqa: E402
from hfquant.core import blocks  # noqa: E402
from hfquant.ops import gemv, torch_ops  # noqa: E402

TYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl", "hq3_r")
SHAPES = ("2048x2048", "512x2048", "8192x2048", "2048x8192", "128256x2048")
_SHIM = r"""
#include <stddef.h>
#include <stdint.h>
typedef void (*vec_dot_t)(int, float *, size_t, const void *, size_t, const void *, size_t, int);
typedef void (*from_float_t)(const float *, void *, int64_t);
void shim_gemv(void *vd, void *ff, int k, const float *x, void *xq, const uint8_t *w, size_t row_bytes,
               float *out, int64_t rows, int threads) {
    ((from_float_t)ff)(x, xq, k);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) ((vec_dot_t)vd)(k, out + r, 0, w + r * row_bytes, 0, xq, 0, 1);
}
"""


class _Traits(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


class _Llama:
    """llama.cpp's per-type from_float + vec_dot, looped over rows by the compiled shim."""

    def __init__(self, lib_path: str):
        self.cpu = ctypes.CDLL(lib_path, mode=ctypes.RTLD_GLOBAL)
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        build = Path(tempfile.mkdtemp(prefix="hfquant-llshim-"))
        (build / "shim.c").write_text(_SHIM)
        subprocess.run(
            ["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", str(build / "shim.c"), "-o", str(build / "shim.so")],
            check=True,
        )
        self.shim = ctypes.CDLL(str(build / "shim.so"))
        self.shim.shim_gemv.restype = None
        self.shim.shim_gemv.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int,
        ]

    def call(self, ggml_type: int, weight: torch.Tensor, x: torch.Tensor, threads: int):
        traits = self.cpu.ggml_get_type_traits_cpu(ggml_type).contents
        if not traits.vec_dot:
            return None
        from_float = self.cpu.ggml_get_type_traits_cpu(traits.vec_dot_type).contents.from_float
        k = x.numel()
        xq = torch.empty(4 * k, dtype=torch.uint8)  # more than any vec_dot type's row needs
        out = torch.empty(weight.shape[0], dtype=torch.float32)
        args = (
            traits.vec_dot,
            from_float,
            k,
            x.data_ptr(),
            xq.data_ptr(),
            weight.data_ptr(),
            weight.shape[1],
            out.data_ptr(),
            weight.shape[0],
            threads,
        )

        def run(keep=(weight, x, xq, out)):  # the buffers live as long as the closure
            self.shim.shim_gemv(*args)
            return keep[3]

        return run


def _best_us(call, seconds: float = 0.3, passes: int = 5) -> float:
    call()
    start = time.perf_counter()
    call()
    once = time.perf_counter() - start
    reps = max(1, int(seconds / passes / max(once, 1e-7)))
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated GGUF types (Q4_0 is always added)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK shapes")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--llama-lib", default=None, help="llama.cpp's libggml-cpu.so (default: the engines venv's)")
    args = parser.parse_args(argv)
    names = ["q4_0"] + [t for t in args.types.lower().split(",") if t != "q4_0"]
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    base = find_library()  # libggml-base.so of the engines venv (or $HFQUANT_GGML_LIB); libggml-cpu.so beside it
    cpu = base.with_name("libggml-cpu.so") if base is not None else None
    lib = args.llama_lib or (str(cpu) if cpu is not None and cpu.is_file() else None)
    llama = _Llama(lib) if lib else None
    torch_ops.loaded()
    print(f"{describe()}; torch {torch.__version__}; llama.cpp: {lib or 'not found'}")
    print("\n| type | N x K | threads | us | GB/s | vs Q4_0 GB/s | llama.cpp us | hfquant / llama.cpp speed |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    q4_0_gbs: dict[tuple, float] = {}
    for name in names:
        fmt = blocks.layout(name)
        if not gemv.native_block_works(name):
            print(f"| {name} | - | - | no native kernel | | | | |")
            continue
        for n, k in shapes:
            generator = torch.Generator().manual_seed(0)
            weight = blocks.quantize(name, torch.randn((64, k), generator=generator)).repeat(n // 64, 1).contiguous()
            x = torch.randn((1, k), generator=generator)
            xb = x.to(torch.bfloat16)
            for t in threads:
                torch.set_num_threads(t)
                us = _best_us(lambda w=weight, xb=xb, k=k, t=fmt.ggml_type: torch_ops.block_gemv(xb, w, k, t))
                gbs = weight.nbytes / us / 1e3
                q4_0_gbs.setdefault((n, k, t), gbs)
                cells = [f"{us:.1f}", f"{gbs:.1f}", f"{gbs / q4_0_gbs[(n, k, t)]:.2f}", "-", "-"]
                run = llama.call(fmt.ggml_type, weight, x.contiguous(), t) if llama and fmt.gguf else None
                if run is not None:
                    ll = _best_us(run)
                    cells[3:] = [f"{ll:.1f}", f"{ll / us:.2f}x"]
                print(f"| {name} | {n} x {k} | {t} | " + " | ".join(cells) + " |", flush=True)
            del weight
    print(
        "\nGB/s: weight bytes over time. vs Q4_0: this type's GB/s over Q4_0's at the same shape and threads. "
        "hfquant / llama.cpp speed: llama.cpp's time over hfquant's (above 1: hfquant faster)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
