#!/usr/bin/env python
"""Thread CPU time of one attention call for one query row (a batch-1 decode step), PyTorch's
`F.scaled_dot_product_attention` (its CPU flash kernel) against hfquant's `torch.ops.hfquant_cpu.attention_row`
(csrc/attention_cpu.c), at several cache lengths, in interleaved rounds of one process (issue #32).

Per round, setting and cache length: the thread CPU time of `--calls` calls divided by the calls; medians (min, max)
over the rounds in microseconds, and the share of outputs where the two differ. `HFQUANT_ISA=avx2` (or `generic`)
in the environment times the kernel's other bodies. Run from a source checkout:

    python scripts/attention_row_ab.py --rounds 7
    HFQUANT_ISA=avx2 python scripts/attention_row_ab.py --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from hfquant.ops import native, torch_ops


def _inputs(heads: int, kv_heads: int, tokens: int, dim: int):
    generator = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, heads, 1, dim, generator=generator).to(torch.bfloat16)
    k = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    return q, k, v


def _sdpa(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)


def _per_call_us(function, arguments: tuple, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        function(*arguments)
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 80, 400])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not torch_ops.loaded():
        raise SystemExit("hfquant's operators are not loaded (no C/C++ compiler?)")
    kernel = torch.ops.hfquant_cpu.attention_row.default
    scale = args.dim**-0.5
    times: dict[tuple[str, int], list[float]] = {}
    differ = {}
    cases = {tokens: _inputs(args.heads, args.kv_heads, tokens, args.dim) for tokens in args.tokens}
    with torch.inference_mode():
        for tokens, (q, k, v) in cases.items():
            flash = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
            differ[tokens] = (kernel(q, k, v, scale) != flash).double().mean().item()
        for _ in range(args.rounds):
            for tokens, (q, k, v) in cases.items():
                sdpa = _per_call_us(_sdpa, (q, k, v, scale), args.calls)
                times.setdefault(("sdpa", tokens), []).append(sdpa)
                times.setdefault(("hfquant", tokens), []).append(_per_call_us(kernel, (q, k, v, scale), args.calls))
    print(
        f"{args.heads} heads / {args.kv_heads} kv heads of {args.dim}, one query row, one thread; "
        f"HFQUANT_ISA={os.environ.get('HFQUANT_ISA', '')!r} ({', '.join(native.isa()) or 'generic'}); "
        f"load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print("| cached tokens | sdpa us | hfquant us | outputs differing |")
    print("| ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        cells = []
        for name in ("sdpa", "hfquant"):
            values = times[(name, tokens)]
            cells.append(f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")
        print(f"| {tokens} | {cells[0]} | {cells[1]} | {differ[tokens]:.1%} |")


if __name__ == "__main__":
    main()
