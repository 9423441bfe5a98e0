#!/usr/bin/env python
r"""LoRA fine-tuning over hfquant's quantized layers: on your own text (a tool), or the fixed bf16 / int8 / int4
comparison of docs/performance.md (`--preset compare`).

Fine-tune a checkpoint on a text file, a folder of .txt/.md files, a JSON Lines / JSON / CSV file (one text per row,
its `--text-column`), or a Hugging Face dataset id (needs the `datasets` package). The texts are tokenized, joined
with the EOS token and cut into blocks of `--seq-len` tokens; a float checkpoint is quantized on load (`--bits`, 4 by
default; 16 trains over bf16), an hfquant checkpoint loads as it was saved. The adapter (peft's
adapter_config.json and adapter_model.safetensors, and finetune.json: the options and the final loss) is written to
`--out`, whole or not at all (staged in a hidden folder beside it, then renamed into place).

    python scripts/finetune.py --model SRC --data notes.txt --out my-adapter
    python scripts/finetune.py --model SRC --data chats.jsonl --text-column text --out my-adapter \
        --steps 300 --lr 1e-4 --rank 8 --alpha 16 --target-modules q_proj,v_proj --eval-seqs 8
    python scripts/finetune.py --model SRC --data wikitext --dataset-config wikitext-2-raw-v1 --out my-adapter

Load the adapter later over the same checkpoint, quantized the same way (finetune.json records how):

    model = AutoModelForCausalLM.from_pretrained(SRC, quantization_config=hfquant.HfQuantConfig(bits=4))
    model = hfquant.peft.load_adapter(model, "my-adapter")

The preset `--preset compare` is the fixed comparison: SmolLM2-135M (hfquant's example model), 4 sequences of 256
tokens per step, bf16 weights, LoRA r=16 (alpha 32, no dropout) on every linear layer but lm_head, AdamW lr 2e-4,
100 steps, no activation checkpointing; text = pydoc_data.topics (sorted topics joined), first half of the tokens to
train, second half held out. Each method runs in its own Python process (clean peak RSS). Prints one markdown table:
held-out perplexity before/after training and after `merge_and_unload()` (for hfquant layers: the float model,
dequantized codes + B @ A), training tokens/s, peak RSS, adapter MiB.

    nice python scripts/finetune.py --preset compare                 # 100 steps
    nice python scripts/finetune.py --preset compare --steps 10 --eval-seqs 8 --json out.json
    nice python scripts/finetune.py --preset compare --model ~/.cache/hfquant/random-llama-175d2c54d5 --steps 2 \
        --eval-seqs 2 --methods int4,bf16 --checkpointing --batch 1
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


TEXT_SUFFIXES = (".txt", ".md", ".rst")


def _rows_text(rows, column: str, where: str) -> list[str]:
    texts = []
    for i, row in enumerate(rows):
        if isinstance(row, str):
            texts.append(row)
            continue
        if not isinstance(row, dict) or column not in row:
            names = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise SystemExit(
                f"error: row {i} of {where} has no column {column!r} (it has {names}); pass --text-column"
            )
        texts.append(str(row[column]))
    return texts


def load_texts(data: str, text_column: str = "text", dataset_config: str | None = None, split: str = "train"):
    """The training texts of `--data`: a text file (whole), a folder (its .txt/.md/.rst files, sorted), a .jsonl /
    .json / .csv file (`text_column` of each row), or else a Hugging Face dataset id (`datasets.load_dataset`)."""
    import csv

    path = Path(data).expanduser()
    if path.is_dir():
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise SystemExit(f"error: --data {data} is a folder without {'/'.join(TEXT_SUFFIXES)} files")
        return [f.read_text(encoding="utf-8") for f in files]
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            lines = path.read_text(encoding="utf-8").splitlines()
            return _rows_text([json.loads(line) for line in lines if line.strip()], text_column, data)
        if suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(rows, list):
                raise SystemExit(f"error: --data {data} holds a JSON {type(rows).__name__}; expected a list of rows")
            return _rows_text(rows, text_column, data)
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                return _rows_text(list(csv.DictReader(f)), text_column, data)
        return [path.read_text(encoding="utf-8")]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            f"error: --data {data} is no file or folder; as a Hugging Face dataset id it needs the datasets package "
            "(pip install datasets)"
        ) from None
    return _rows_text(datasets.load_dataset(data, dataset_config, split=split), text_column, data)


def token_blocks(tokenizer, texts: list[str], seq_len: int):
    """The texts tokenized, each followed by the EOS token (when the tokenizer has one), joined and cut into rows of
    `seq_len` tokens: (n_blocks, seq_len) int64; the last partial block is dropped."""
    import torch

    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = [i for text in texts for i in tokenizer(text)["input_ids"] + eos]
    if len(ids) < seq_len:
        raise SystemExit(f"error: the data is {len(ids)} tokens, fewer than --seq-len {seq_len}; lower --seq-len")
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def _quantization(model_path: Path, bits: int | None, group_size: int | None):
    """(quantization_config for from_pretrained or None, what finetune.json records)."""
    from hfquant import HfQuantConfig

    config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    stored = config.get("quantization_config")
    if isinstance(stored, dict) and stored.get("quant_method") == "hfquant":
        if bits is not None or group_size is not None:
            raise SystemExit(f"error: {model_path} is already quantized by hfquant; leave out --bits and --group-size")
        return None, {"as_stored": stored}
    if bits == 16:
        return None, None
    kwargs = {"bits": bits or 4}
    if group_size is not None:
        kwargs["group_size"] = group_size or None
    qconfig = HfQuantConfig(**kwargs)
    return qconfig, qconfig.to_dict()


def train(args) -> int:
    """Fine-tune `args.model` on `args.data` and publish the adapter at `args.out`."""
    sys.path.insert(0, str(ROOT))
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    import hfquant.peft
    from hfquant.checkpoint.publish import (
        check_apart_from_source,
        check_destination,
        give_umask_modes,
        publish_folder,
        temporary_folder,
    )
    from hfquant.checkpoint.source import resolve_source

    if not args.progress:
        hf_logging.disable_progress_bar()
    out = Path(args.out).expanduser()
    check_destination(out, args.overwrite)
    if args.model is None:
        from benchmarks.example_model import build_example_model

        args.model = str(build_example_model())
    model_path = resolve_source(args.model)
    check_apart_from_source(out, model_path, "the adapter")
    qconfig, recorded = _quantization(model_path, args.bits, args.group_size)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    blocks = token_blocks(
        tokenizer, load_texts(args.data, args.text_column, args.dataset_config, args.split), args.seq_len
    )
    if args.eval_seqs >= blocks.shape[0]:
        raise SystemExit(
            f"error: --eval-seqs {args.eval_seqs} holds out all {blocks.shape[0]} blocks of {args.seq_len} tokens; "
            "use fewer or more data"
        )
    train_blocks, held = blocks[: blocks.shape[0] - args.eval_seqs], blocks[blocks.shape[0] - args.eval_seqs :]
    print(
        f"data: {blocks.numel()} tokens, {train_blocks.shape[0]} training blocks of {args.seq_len}"
        + (f", {held.shape[0]} held out" if held.shape[0] else ""),
        flush=True,
    )
    kwargs = {"quantization_config": qconfig} if qconfig is not None else {}
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, device_map="cpu", **kwargs)
    targets = "all-linear" if args.target_modules == "all-linear" else args.target_modules.split(",")
    lora = LoraConfig(
        r=args.rank, lora_alpha=args.alpha or 2 * args.rank, lora_dropout=args.dropout, target_modules=targets
    )
    peft_model = hfquant.peft.get_peft_model(model, lora)
    before = _perplexity(peft_model, held, torch, args.batch) if held.shape[0] else None
    with tempfile.TemporaryDirectory() as trainer_dir:
        training = TrainingArguments(
            output_dir=trainer_dir,
            use_cpu=True,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            learning_rate=args.lr,
            optim="adamw_torch",
            lr_scheduler_type="constant",
            report_to=[],
            save_strategy="no",
            logging_steps=max(1, args.steps // 10),
            dataloader_num_workers=0,
            seed=args.seed,
            disable_tqdm=not args.progress,
            **(
                {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
                if args.checkpointing
                else {}
            ),
        )
        data = [{"input_ids": row, "labels": row} for row in train_blocks]
        result = Trainer(model=peft_model, args=training, train_dataset=data).train()
    after = _perplexity(peft_model, held, torch, args.batch) if held.shape[0] else None
    summary = {
        "model": str(args.model),
        "quantization_config": recorded,
        "data": str(args.data),
        "lora": {"r": args.rank, "alpha": lora.lora_alpha, "dropout": args.dropout, "target_modules": targets},
        "steps": args.steps,
        "learning_rate": args.lr,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "mean_training_loss": result.training_loss,
        "held_out_perplexity_before": before,
        "held_out_perplexity_after": after,
    }
    with temporary_folder(out) as tmp:
        peft_model.save_pretrained(tmp)
        (tmp / "finetune.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        give_umask_modes(tmp)
        publish_folder(tmp, out, args.overwrite)
    print(f"wrote {out}: {args.steps} steps, mean training loss {result.training_loss:.4f}")
    if before is not None:
        print(f"held-out perplexity: {before:.3f} before, {after:.3f} after ({held.shape[0]} x {args.seq_len} tokens)")
    return 0


_TOOL_ONLY = ("data", "out", "rank", "alpha", "dropout", "lr", "target_modules", "bits", "group_size")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        choices=["compare"],
        help="the fixed bf16 / int8 / int4 comparison (see above) instead of fine-tuning on --data",
    )
    parser.add_argument("--model", help="checkpoint folder or Hub repo id (default: SmolLM2-135M, the example model)")
    parser.add_argument("--data", metavar="FILE|FOLDER|DATASET", help="the training text (see above)")
    parser.add_argument("--out", metavar="DIR", help="folder the adapter is written to")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists (once the new one is whole)"
    )
    parser.add_argument("--text-column", default="text", help="column of a .jsonl/.json/.csv file or dataset (text)")
    parser.add_argument("--dataset-config", default=None, help="the dataset's configuration name, if it has several")
    parser.add_argument("--split", default="train", help="the dataset's split (default train)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    parser.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate, constant (default {LR})")
    parser.add_argument("--rank", type=int, default=None, help=f"LoRA rank r (default {RANK})")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    parser.add_argument("--dropout", type=float, default=None, help="LoRA dropout (default 0)")
    parser.add_argument(
        "--target-modules",
        default=None,
        metavar="NAMES",
        help="comma-separated module names the adapter wraps, e.g. q_proj,v_proj (default all-linear: every linear "
        "layer but lm_head)",
    )
    parser.add_argument(
        "--bits",
        type=int,
        choices=[4, 8, 16],
        default=None,
        help="quantize a float checkpoint on load to 4 or 8 bits, or train over bf16 (16); default 4. An hfquant "
        "checkpoint loads as saved",
    )
    parser.add_argument(
        "--group-size", type=int, default=None, help="int4 group size (0: per-channel; default: hfquant's)"
    )
    parser.add_argument("--seq-len", type=int, default=SEQ, help=f"tokens per training sequence (default {SEQ})")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"sequences per step (default {BATCH})")
    parser.add_argument(
        "--eval-seqs",
        type=int,
        default=None,
        help="held-out sequences scored before and after training (default: 0 when fine-tuning, the last ones of "
        "the data; 32 in the preset)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and LoRA initialization (0)")
    parser.add_argument(
        "--checkpointing",
        action="store_true",
        help="activation checkpointing (non-reentrant): less memory, not the fixed settings' timing",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars (stderr)")
    parser.add_argument("--methods", default=",".join(METHODS), help="the preset's methods (default bf16,int8,int4)")
    parser.add_argument("--json", type=Path, help="the preset's table as JSON, to this file")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", dest="worker_out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.preset == "compare" or args.worker:
        given = [f"--{name.replace('_', '-')}" for name in _TOOL_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(
                f"--preset compare has fixed settings; {', '.join(given)} apply to fine-tuning on --data only"
            )
        args.eval_seqs = 32 if args.eval_seqs is None else args.eval_seqs
        args.out = args.worker_out
        return compare(args)
    if args.data is None or args.out is None:
        parser.error("fine-tuning needs --data (the text) and --out (the adapter folder); or pass --preset compare")
    for name, value in (("steps", args.steps), ("seq-len", args.seq_len), ("batch", args.batch)):
        if value < 1:
            parser.error(f"--{name} must be >= 1, got {value}")
    args.eval_seqs = args.eval_seqs or 0
    if args.eval_seqs < 0:
        parser.error(f"--eval-seqs must be >= 0, got {args.eval_seqs}")
    args.lr = LR if args.lr is None else args.lr
    args.rank = RANK if args.rank is None else args.rank
    args.dropout = 0.0 if args.dropout is None else args.dropout
    args.target_modules = args.target_modules or "all-linear"
    return train(args)


def compare(args) -> int:
    """The preset: each method in a process of its own, one markdown table."""
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
                "--worker-out",
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
