#!/usr/bin/env python
"""CPU time per token of SmolLM2-135M's 4-bit default in eager greedy decode, with hfquant's one-row kernels off,
with the one-row RMSNorms only (`hfquant.nn.row_norm`) and with the one-row attention too (`hfquant.nn.row_attention`;
both are the default after loading), in interleaved rounds of one process (issue #32).

Per round and setting: the process time of a `new_tokens + 1`-token `generate` minus that of a 1-token one (the
prefill), divided by `new_tokens`; medians (min, max) over the rounds, the wall time beside it, whether each
setting's greedy tokens equal those without the kernels, and the load average. The machine's other work shows in
the wall time more than in the CPU time. Run from a source checkout (the model is built into `$HFQUANT_CACHE` or
~/.cache/hfquant by `benchmarks.example_model`):

    python scripts/eager_decode_ab.py --threads 1 --rounds 6 --new-tokens 64
    python scripts/eager_decode_ab.py --model ~/.cache/hfquant/random-llama-175d2c54d5   # the benchmark's 1.2B
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.example_model import build_example_model
from hfquant import HfQuantConfig
from hfquant.nn.row_attention import restore_row_attention, use_row_attention
from hfquant.nn.row_norm import restore_rms_norms, use_row_rms_norms

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
SETTINGS = ("off", "norm", "norm+attention")


def _set(model, setting: str) -> None:
    restore_rms_norms(model)
    restore_row_attention(model)
    if setting != "off":
        use_row_rms_norms(model)
    if setting == "norm+attention":
        use_row_attention(model)


def _generate(model, ids, tokens: int) -> tuple[float, float, torch.Tensor]:
    cpu, wall = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.process_time() - cpu, time.perf_counter() - wall, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--model", help="a bfloat16 checkpoint folder instead of SmolLM2 (e.g. the benchmark's 1.2B)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or build_example_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = HfQuantConfig(bits=4, group_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config, dtype=torch.bfloat16).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    per_token: dict[str, list[tuple[float, float]]] = {setting: [] for setting in SETTINGS}
    tokens: dict[str, torch.Tensor] = {}
    for setting in SETTINGS:  # warm-up
        _set(model, setting)
        _generate(model, ids, 8)
    for index in range(args.rounds):
        for setting in SETTINGS if index % 2 == 0 else SETTINGS[::-1]:
            _set(model, setting)
            cpu_prefill, wall_prefill, _ = _generate(model, ids, 1)
            cpu, wall, tokens[setting] = _generate(model, ids, args.new_tokens + 1)
            per_token[setting].append(
                ((cpu - cpu_prefill) / args.new_tokens * 1e3, (wall - wall_prefill) / args.new_tokens * 1e3)
            )
    for setting, rows in per_token.items():
        cpu = [row[0] for row in rows]
        wall = statistics.median(row[1] for row in rows)
        same = torch.equal(tokens[setting], tokens["off"])
        print(
            f"{setting:15s} CPU ms/token {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}), "
            f"wall {wall:.2f} ms ({1e3 / wall:.1f} tok/s), greedy tokens as 'off': {same}"
        )
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
