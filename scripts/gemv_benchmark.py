#!/usr/bin/env python
"""One activation row times an int4 layer: aten's kernel, hfquant's bfloat16-activation GEMV and its W4A8 GEMV
(`decode_activations="int8"`), side by side, in one table with ratios against aten measured in the same run.

Two cases per layer shape:
- "cached": the same weight every call (it stays in the CPU's caches: the kernels' instruction cost);
- "streamed": distinct weights, about 256 MiB in all (`--streamed-mib`), called in turn (they come from memory, as in
  a decode step of a model larger than the last-level cache).
Each figure is the best of 5 passes, in microseconds per call; GB/s counts the codes and (scale, zero) pairs read.
The CPU model and ISA flags head the table; a kernel that does not run here is a "-". `ATEN_CPU_CAPABILITY=avx2`
measures what an AVX2 CPU runs (PyTorch's AVX2 kernels and int4 layout; hfquant's AVX2 W4A8 GEMV). Run from a
source checkout after `bash scripts/install.sh`:

    python scripts/gemv_benchmark.py                      # the 1.2B Llama's and SmolLM2's shapes, group 128 / 64
    python scripts/gemv_benchmark.py --shapes 4096x14336 --group-size 128
    ATEN_CPU_CAPABILITY=avx2 python scripts/gemv_benchmark.py

With `--formats q4_k,q6_k,...` it measures llama.cpp's block formats instead (`HfQuantConfig(format=...)`): hfquant's
block GEMV (`csrc/blocks_cpu.c`, the row quantized to int8 blocks) cached and streamed, with GB/s of block bytes read,
against the torch path a block layer runs without it (dequantize, then the float product; cached weight only, it is
far slower either way):

    python scripts/gemv_benchmark.py --formats q4_k,q6_k,q3_k,q8_0 --shapes 2048x2048,5632x2048,2048x5632,4096x14336
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import describe  # noqa: E402
from hfquant.core import blocks, packing  # noqa: E402
from hfquant.ops import gemv, kernels, torch_ops  # noqa: E402

SHAPES = ("2048x2048", "512x2048", "8192x2048", "2048x8192", "576x576", "1536x576", "576x1536")
"""N x K (out_features x in_features): the 1.2B benchmark Llama's and SmolLM2-135M's projections."""
_STREAMED_MIB = 256
_PASSES = 5


def _weights(n: int, k: int, group: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(copies):
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
        scale_zero = (torch.rand((k // group, n, 2), generator=generator) * 0.02).to(torch.bfloat16)
        out.append((packing.to_cpu_int4_layout(codes), scale_zero))
    return out


def _best_us(call, weights) -> float:
    for w, sz in weights:
        call(w, sz)
    best = float("inf")
    for _ in range(_PASSES):
        start = time.perf_counter()
        for w, sz in weights:
            call(w, sz)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK shapes")
    parser.add_argument(
        "--group-size", type=int, default=None, help="inputs per scale (default: 128 where it divides K, else 64)"
    )
    parser.add_argument(
        "--formats",
        default=None,
        help=f"comma-separated block formats to measure instead of int4 ({list(blocks.LAYOUTS)})",
    )
    parser.add_argument(
        "--streamed-mib",
        type=int,
        default=_STREAMED_MIB,
        help="MiB of distinct weights the streamed case cycles through (default: %(default)s; the tests use 1)",
    )
    args = parser.parse_args(argv)
    streamed_bytes = args.streamed_mib * 2**20
    if args.formats:
        return _block_table(
            [blocks.layout(name) for name in args.formats.split(",")], args.shapes.split(","), streamed_bytes
        )
    layout = packing.cpu_int4_layout()
    if layout is None:
        print("this PyTorch build has no CPU int4 kernel layout", file=sys.stderr)
        return 1
    avx2 = layout.block_n == 32  # PyTorch's AVX2 layout: hfquant's AVX2 GEMV
    plain_works = gemv.native_int4_avx2_works() if avx2 else gemv.native_int4_works()
    plain_gemv = torch_ops.int4_gemv_avx2 if avx2 else torch_ops.int4_gemv
    a8 = gemv.native_int4_a8_works()
    torch_ops.loaded()
    print(
        f"{describe()}; torch {torch.__version__} (kernels for {torch.backends.cpu.get_cpu_capability()}, int4 "
        f"layout of {layout.block_n}-row blocks), {torch.get_num_threads()} threads"
    )
    print("\n| N x K | group | case | aten us | bf16-act GEMV us | ratio | W4A8 us | ratio | W4A8 GB/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for text in args.shapes.split(","):
        n, k = (int(v) for v in text.lower().split("x"))
        group = args.group_size or (128 if k % 128 == 0 else 64)
        layer_bytes = n * k // 2 + (k // group) * n * 4
        for case, copies in (("cached", 1), ("streamed", max(1, streamed_bytes // layer_bytes))):
            weights = _weights(n, k, group, copies)
            x = torch.randn((1, k), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            aten = _best_us(
                lambda w, sz, x=x, group=group: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz), weights
            )
            cells = [f"{aten:.1f}", "-", "-"]
            if plain_works and n % layout.block_n == 0 and (group % 32 == 0 or not avx2):
                plain = _best_us(lambda w, sz, x=x, group=group: plain_gemv(x, w, sz, group), weights)
                cells[1:] = [f"{plain:.1f}", f"{aten / plain:.2f}x"]
            if a8 and group % 32 == 0 and n % layout.block_n == 0:
                quantized = _best_us(
                    lambda w, sz, x=x, group=group: torch_ops.int4_gemv_a8(x, w, sz, group, layout.block_n), weights
                )
                cells += [f"{quantized:.1f}", f"{aten / quantized:.2f}x", f"{layer_bytes / quantized / 1e3:.1f}"]
            else:
                cells += ["-", "-", "-"]
            print(f"| {n} x {k} | {group} | {case} | " + " | ".join(cells) + " |", flush=True)
    print("\nratio: aten's time over the kernel's (above 1: faster than aten).")
    return 0


def _block_table(formats: list[blocks.BlockLayout], shapes: list[str], streamed_bytes: int) -> int:
    """The block-format table (see the module docstring)."""
    torch_ops.loaded()
    print(f"{describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n| format | N x K | torch path us | GEMV cached us | GEMV streamed us | streamed GB/s | vs torch |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for fmt in formats:
        works = gemv.native_block_works(fmt.name)
        for text in shapes:
            n, k = (int(v) for v in text.lower().split("x"))
            generator = torch.Generator().manual_seed(0)
            rows = blocks.quantize(fmt.name, torch.randn((64, k), generator=generator))
            weight = rows.repeat(n // 64, 1).contiguous()  # (N % 64 == 0 for these shapes)
            x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
            plan = kernels.KernelPlan(
                kernels.Kernel.DEQUANT, fmt.bits, fmt.block_size, fmt.symmetric, k, n, block=fmt.name
            )
            torch_us = _best_us(lambda w, _, plan=plan, x=x: kernels._block_product(plan, w, x), [(weight, None)])
            cells = [f"{torch_us:.0f}", "-", "-", "-", "-"]
            if works:
                copies = [(weight, None)] + [
                    (weight.clone(), None) for _ in range(max(1, streamed_bytes // weight.nbytes) - 1)
                ]

                def call(w, _, x=x, k=k, t=fmt.ggml_type):
                    return torch_ops.block_gemv(x, w, k, t)

                cached, streamed = _best_us(call, copies[:1]), _best_us(call, copies)
                cells[1:] = [
                    f"{cached:.1f}",
                    f"{streamed:.1f}",
                    f"{weight.nbytes / streamed / 1e3:.1f}",
                    f"{torch_us / streamed:.0f}x",
                ]
            print(f"| {fmt.name} | {n} x {k} | " + " | ".join(cells) + " |", flush=True)
    print("\nvs torch: the torch path's time over the streamed GEMV's.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
