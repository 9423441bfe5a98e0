#!/usr/bin/env python
"""LoRA fine-tuning of SmolLM2-135M (hfquant's example model) in bf16 vs hfquant int8 / int4 (group 64), issue #17.

Fixed settings: 4 sequences of 256 tokens per step, bf16 weights, LoRA r=16 (alpha 32, no dropout) on every linear
layer but lm_head, AdamW lr 2e-4, 100 steps, no activation checkpointing; text = pydoc_data.topics (sorted topics
joined), first half of the tokens to train, second half held out. Each method runs in its own Python process (clean
peak RSS). Prints one markdown table: held-out perplexity before/after training and after `merge_and_unload()` (for
hfquant layers: the float model, dequantized codes + B @ A), training tokens/s, peak RSS, adapter MiB.

    nice python scripts/finetune.py                 # 100 steps
    nice python scripts/finetune.py --steps 10 --eval-seqs 8 --json out.json
    nice python scripts/finetune.py --model ~/.cache/hfquant/random-llama-175d2c54d5 --steps 2 --eval-seqs 2 \
        --methods int4,bf16 --checkpointing --batch 1
        # another checkpoint (the benchmark's random 1.2B Llama: its perplexities mean nothing, its peak RSS does)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ, BATCH, RANK, LR = 256, 4, 16, 2e-4
METHODS = ("bf16", "int8", "int4")


def _token_blocks(tokenizer):
    from pydoc_data.topics import topics

    import torch

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    half = ids.numel() // 2
    train, held = ids[:half], ids[half:]
    blocks = lambda t: t[: t.numel() // SEQ * SEQ].reshape(-1, SEQ)  # noqa: E731
    return blocks(train), blocks(held), torch


def _perplexity(model, blocks, torch, batch_size: int = BATCH) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, blocks.shape[0], batch_size):
            batch = blocks[start : start + batch_size]
            loss = model(input_ids=batch, labels=batch).loss.item()
            total += loss * batch.shape[0]
            count += batch.shape[0]
    return math.exp(total / count)


def worker(
    method: str,
    steps: int,
    eval_seqs: int,
    out: Path,
    model_path: str | None = None,
    checkpointing: bool = False,
    batch: int = BATCH,
) -> dict:
    sys.path.insert(0, str(ROOT))
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    import hfquant.peft
    from benchmarks.example_model import build_example_model
    from benchmarks.memory import dir_size_bytes, peak_rss_mib
    from hfquant import HfQuantConfig

    path = model_path or build_example_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, held, torch = _token_blocks(tokenizer)
    held = held[:eval_seqs]
    kwargs = {}
    if method == "int8":
        kwargs["quantization_config"] = HfQuantConfig(bits=8)
    elif method == "int4":
        kwargs["quantization_config"] = HfQuantConfig(bits=4, group_size=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu", **kwargs)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules="all-linear")
    peft_model = hfquant.peft.get_peft_model(model, config)
    before = _perplexity(peft_model, held, torch, batch)
    data = [{"input_ids": row, "labels": row} for row in train[: steps * batch]]
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        per_device_train_batch_size=batch,
        max_steps=steps,
        learning_rate=LR,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        report_to=[],
        save_strategy="no",
        logging_steps=max(1, steps // 10),
        dataloader_num_workers=0,
        seed=0,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    trainer = Trainer(model=peft_model, args=args, train_dataset=data)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = _perplexity(peft_model, held, torch, batch)
    adapter = out / f"adapter-{method}"
    peft_model.save_pretrained(adapter)
    peak = peak_rss_mib()  # before the merge, which makes a float copy of the weights
    merged = _perplexity(peft_model.merge_and_unload(), held, torch, batch)
    return {
        "method": method,
        "steps": steps,
        "ppl_before": before,
        "ppl_after": after,
        "ppl_merged": merged,
        "tokens_per_s": steps * batch * SEQ / seconds,
        "peak_rss_mib": peak,
        "adapter_mib": dir_size_bytes(adapter) / 2**20,
        "eval_tokens": held.numel(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences of 256 tokens to score")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", help="checkpoint folder to fine-tune instead of SmolLM2-135M")
    parser.add_argument(
        "--batch", type=int, default=BATCH, help="sequences of 256 tokens per step (the fixed settings: 4)"
    )
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing (non-reentrant): less memory, not the fixed settings' timing",
    )
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(args.worker, args.steps, args.eval_seqs, args.out, args.model, args.checkpointing, args.batch)
            )
        )
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.machine import describe

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            command = [
                sys.executable,
                __file__,
                "--worker",
                method,
                "--steps",
                str(args.steps),
                "--eval-seqs",
                str(args.eval_seqs),
                "--out",
                tmp,
            ]
            command += ["--model", args.model] if args.model else []
            command += (["--checkpointing"] if args.checkpointing else []) + ["--batch", str(args.batch)]
            result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
            if result.returncode:
                rows.append({"method": method, "error": f"exit {result.returncode}"})
                continue
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    bf16 = next((r for r in rows if r["method"] == "bf16" and "error" not in r), None)
    print(
        f"\n{describe()}, {time.strftime('%Y-%m-%d', time.gmtime())}, {args.model or 'SmolLM2-135M-Instruct'}, "
        f"{args.steps} steps, held-out {args.eval_seqs} x {SEQ} tokens"
        f"{', activation checkpointing' if args.checkpointing else ''}, {args.batch} x {SEQ} tokens per step\n"
    )
    print(
        "| LoRA over | held-out ppl before | after | merged | train tokens/s | vs bf16 | peak RSS MiB | adapter MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {r['error']} | | | | | | |")
            continue
        ratio = f"{bf16['tokens_per_s'] / r['tokens_per_s']:.2f}x time" if bf16 else "-"
        print(
            f"| {r['method']} | {r['ppl_before']:.2f} | {r['ppl_after']:.2f} | {r['ppl_merged']:.2f} "
            f"| {r['tokens_per_s']:.0f} | {ratio} "
            f"| {r['peak_rss_mib']:.0f} | {r['adapter_mib']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
