#!/usr/bin/env python
"""Quantize a checkpoint with hfquant (int8, the 4-bit default) and compare it with bf16, end to end.

Methods: bf16, int8 (`HfQuantConfig(bits=8)`), 4bit (`HfQuantConfig(bits=4)`: the 4-bit default, IQ4_XS blocks) and,
when asked, int4 (`HfQuantConfig(bits=4, format="int", group_size=...)`: uniform int4, what vLLM reads). For each
method two fresh Python processes run one after the other:

1. *load*: ``from_pretrained(model, dtype=bfloat16, device_map="cpu"[, quantization_config=...])``,
   timing the call and measuring peak RSS growth (VmHWM minus RSS just before the call),
   the in-memory tensor footprint, logits on a fixed token batch, then
   ``save_pretrained(<out>/<method>, max_shard_size="50MB")`` plus the tokenizer.
2. *reload*: ``from_pretrained(<out>/<method>)`` with no quantization argument, checking that
   the logits on the same batch are bit-identical to step 1 (``torch.equal``), then measuring
   perplexity on a fixed text, greedy decode tokens/s (batch 1, 64 tokens, best of 3, prefill
   excluded) and the answer to a fixed question.

Fresh processes keep each peak-RSS measurement clean.  A progress bar on stderr names the step running (off with
``--no-progress``); each step's finish is a line on stdout.  A markdown table with ratios
against bf16 (from the same run) is printed at the end; a failing method shows its error in
its row instead of stopping the run.  Worker logs go to ``<out>/logs/``.  The folders
``<out>/<method>`` are deleted and rewritten on every run.

Exit status: 0 when every method succeeded, 1 otherwise.

Examples:
    python scripts/run_example.py
    python scripts/run_example.py --methods bf16,4bit,int4 --group-size 64 --json results.json
    python scripts/run_example.py --model /path/to/my/llama --out /tmp/hfquant-run --no-progress
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

# The repository root: benchmarks/ (the memory helpers) is never installed; hfquant is found there too when it is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

METHODS = ("bf16", "int8", "4bit", "int4")
DEFAULT_METHODS = ("bf16", "int8", "4bit")
QUESTION = "What is the capital of France?"
DECODE_PROMPT = "The history of the Roman Empire begins"
DECODE_TOKENS = 64
DECODE_REPEATS = 3
SAVE_SHARD_SIZE = "50MB"
# Fixed batch for the reload exactness check: 2 rows x 64 tokens of the reference text.
CHECK_ROWS, CHECK_COLS = 2, 64
MIB = 1024 * 1024
STEPS = {
    "load": ("load and quantize", "forward pass", "save"),
    "reload": ("reload", "reload logits check", "perplexity", "decode speed", "answer"),
}
"""The steps of each worker stage, in order: the worker names each one as it starts (`_step`), the driver's bar
shows it."""


def _step(args, name: str) -> None:
    """Tell the driver that step `name` (one of `STEPS[args.worker]`) starts: a line appended to the status file."""
    if args.status:
        with open(args.status, "a", encoding="utf-8") as fh:
            fh.write(name + "\n")


# ----------------------------------------------------------------------------- workers
# They run in a fresh interpreter, write a JSON result file and exit 0 (1 on error, with
# {"error": ..., "traceback": ...} in the result file).


def _check_batch(tokenizer):
    import torch

    from hfquant.evaluation import reference_text

    ids = tokenizer(reference_text(4000, offset=100_000), return_tensors="pt")["input_ids"][0]
    n = CHECK_ROWS * CHECK_COLS
    if ids.numel() < n:
        raise RuntimeError(f"Check text tokenizes to {ids.numel()} tokens, need {n}")
    return ids[:n].reshape(CHECK_ROWS, CHECK_COLS).to(torch.long)


def _logits(model, batch):
    import torch

    with torch.inference_mode():
        return model(input_ids=batch, use_cache=False).logits.detach().clone()


def _quant_config(method: str, group_size: int | None):
    import hfquant

    if method == "int8":
        return hfquant.HfQuantConfig(bits=8)
    if method == "4bit":
        return hfquant.HfQuantConfig(bits=4)
    if method == "int4":
        return hfquant.HfQuantConfig(bits=4, format="int", group_size=group_size)
    raise ValueError(f"Unknown method {method!r}")


def worker_load(args) -> dict:
    import gc

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.memory import (
        dir_size_bytes,
        import_model_code,
        peak_rss_mib,
        reset_peak_rss,
        rss_mib,
        tensor_bytes,
    )

    out = Path(args.out)
    kwargs = {"dtype": torch.bfloat16, "device_map": "cpu"}
    if args.method != "bf16":
        kwargs["quantization_config"] = _quant_config(args.method, args.group_size)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    batch = _check_batch(tokenizer)
    import_model_code(args.model)  # module imports are not the load's time or memory

    gc.collect()
    _step(args, "load and quantize")
    peak_reset = reset_peak_rss()
    rss_before = rss_mib()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    load_s = time.perf_counter() - t0
    peak = peak_rss_mib()
    rss_after = rss_mib()
    footprint = tensor_bytes(model)

    _step(args, "forward pass")
    logits = _logits(model, batch)
    # Safetensors weights that are used as-is (bf16) are memory-mapped and only become
    # resident when first touched; RSS after one forward pass shows the working set.
    rss_after_forward = rss_mib()
    torch.save({"input_ids": batch, "logits": logits}, out / f"{args.method}-logits.pt")

    _step(args, "save")
    saved = out / args.method
    if saved.exists():
        shutil.rmtree(saved)
    t0 = time.perf_counter()
    model.save_pretrained(saved, max_shard_size=SAVE_SHARD_SIZE)
    tokenizer.save_pretrained(saved)
    save_s = time.perf_counter() - t0
    return {
        "footprint_mib": footprint / MIB,
        "files_mib": dir_size_bytes(saved) / MIB,
        "n_files": len(list(saved.glob("*.safetensors"))),
        "load_s": load_s,
        "save_s": save_s,
        "rss_before_mib": rss_before,
        "rss_after_mib": rss_after,
        "rss_after_forward_mib": rss_after_forward,
        "peak_rss_mib": peak,
        "peak_rss_growth_mib": None if peak is None or rss_before is None else peak - rss_before,
        "peak_reset_ok": peak_reset,
        "saved": str(saved),
    }


def worker_reload(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfquant  # noqa: F401  (registers quant_method "hfquant" so quantized checkpoints load)
    from hfquant.evaluation import decode_tokens_per_second, generate_answer, perplexity, reference_text

    out = Path(args.out)
    saved = out / args.method
    tokenizer = AutoTokenizer.from_pretrained(saved)
    _step(args, "reload")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(saved)
    reload_s = time.perf_counter() - t0

    _step(args, "reload logits check")
    ref = torch.load(out / f"{args.method}-logits.pt")
    logits = _logits(model, ref["input_ids"])
    exact = torch.equal(logits, ref["logits"])
    same_shape = logits.shape == ref["logits"].shape
    max_diff = (logits.float() - ref["logits"].float()).abs().max().item() if same_shape else None

    _step(args, "perplexity")
    t0 = time.perf_counter()
    ppl = perplexity(model, tokenizer, reference_text(), progress=False)
    ppl_s = time.perf_counter() - t0
    _step(args, "decode speed")
    tps = decode_tokens_per_second(
        model, tokenizer, DECODE_PROMPT, new_tokens=DECODE_TOKENS, repeats=DECODE_REPEATS, progress=False
    )
    _step(args, "answer")
    answer = generate_answer(model, tokenizer, QUESTION)
    return {
        "reload_s": reload_s,
        "reload_exact": exact,
        "reload_max_abs_diff": max_diff,
        "reload_dtype": str(model.dtype),
        "perplexity": ppl,
        "perplexity_s": ppl_s,
        "decode_tok_s": tps,
        "answer": answer,
    }


def run_worker(args) -> int:
    result_file = Path(args.result)
    try:
        fn = {"load": worker_load, "reload": worker_reload}[args.worker]
        result = fn(args)
        rc = 0
    except BaseException as exc:  # report everything, including KeyboardInterrupt / SystemExit
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        rc = 1
    result_file.write_text(json.dumps(result, indent=2))
    return rc


# ----------------------------------------------------------------------------- driver


def _run_showing_steps(cmd: list[str], log, status: Path, bar, method: str, timeout: float) -> int | None:
    """Run `cmd` (output to `log`) while `bar` shows the step it names in `status`; its exit status, None on
    timeout (the process killed)."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    start, base, seen = time.monotonic(), bar.n, 0
    while True:
        try:
            rc = proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            rc = None
        steps = status.read_text(encoding="utf-8").splitlines() if status.is_file() else []
        if len(steps) > seen:
            seen = len(steps)
            bar.set_description(f"{method}: {steps[-1]}", refresh=False)
            bar.n = base + seen - 1
        bar.refresh()
        if rc is not None:
            return rc
        if time.monotonic() - start > timeout:
            proc.kill()
            proc.wait()
            return None


def _spawn(stage: str, method: str, args, log_dir: Path, bar) -> dict:
    """Run one worker stage in a fresh interpreter, `bar` showing its steps; always returns a dict (maybe with
    "error")."""
    out = Path(args.out)
    result = out / f"{method}-{stage}.json"
    result.unlink(missing_ok=True)
    status = out / f"{method}-{stage}.steps"
    status.unlink(missing_ok=True)
    log = log_dir / f"{method}-{stage}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_worker",
        stage,
        "--_method",
        method,
        "--_result",
        str(result),
        "--_status",
        str(status),
        "--model",
        str(args.model),
        "--out",
        str(out),
    ]
    if args.group_size is not None:
        cmd += ["--group-size", str(args.group_size)]
    t0 = time.perf_counter()
    start = bar.n
    with open(log, "w") as fh:
        rc = _run_showing_steps(cmd, fh, status, bar, method, args.timeout)
    bar.n = start + len(STEPS[stage])
    bar.refresh()
    wall = time.perf_counter() - t0
    data: dict = {}
    if result.is_file():
        try:
            data = json.loads(result.read_text())
        except ValueError as exc:
            data = {"error": f"unreadable result file {result}: {exc}"}
    if rc is None:
        data.setdefault("error", f"timed out after {args.timeout:.0f} s")
    elif rc != 0 and "error" not in data:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        data["error"] = f"worker exited with status {rc}: {tail[0]}"
    data["wall_s"] = wall
    data["log"] = str(log)
    return data


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _cell_text(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _fmt(value, base, digits: int) -> str:
    if value is None:
        return "n/a"
    s = f"{value:.{digits}f}"
    if base not in (None, 0):
        s += f" ({value / base:.2f}x)"
    return s


COLUMNS = [  # (header, key, digits)
    ("footprint MiB", "footprint_mib", 1),
    ("files MiB", "files_mib", 1),
    ("load s", "load_s", 2),
    ("peak RSS growth MiB", "peak_rss_growth_mib", 1),
    ("perplexity", "perplexity", 3),
    ("decode tok/s", "decode_tok_s", 1),
]


def render_table(results: dict[str, dict]) -> str:
    """Markdown table with ratios vs the bf16 row of the same run."""
    base = results.get("bf16", {})
    headers = ["method"] + [h for h, _, _ in COLUMNS] + ["reload exact"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] + ["---:"] * len(COLUMNS) + [":---:"]) + "|"]
    for method, r in results.items():
        load_err, reload_err = r.get("load", {}).get("error"), r.get("reload", {}).get("error")
        if load_err:
            cells = [f"**error (load):** {_cell_text(load_err)[:300]}"] + [""] * len(COLUMNS)
        else:
            merged = {**r.get("load", {}), **r.get("reload", {})}
            base_merged = {**base.get("load", {}), **base.get("reload", {})}
            cells = []
            for _, key, digits in COLUMNS:
                b = None if method == "bf16" or base_merged.get("error") else base_merged.get(key)
                cells.append(_fmt(merged.get(key), b, digits) if key in merged else "")
            if merged.get("peak_reset_ok") is False and merged.get("peak_rss_growth_mib") is not None:
                cells[3] += " *"
            if reload_err:
                cells.append(f"**error (reload):** {_cell_text(reload_err)[:300]}")
            else:
                cells.append("yes" if merged.get("reload_exact") else "**no**")
        lines.append("| " + " | ".join([method] + cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Quantize a checkpoint with hfquant and compare bf16 / int8 / 4bit / int4 (size, load, memory, "
        "perplexity, decode speed, reload exactness)."
    )
    parser.add_argument(
        "--model", default=None, help="local checkpoint folder (default: build/use the SmolLM2-135M example)"
    )
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated subset of {','.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=128,
        help="the int4 method's group size in input columns (default: 128; 0 = per-channel)",
    )
    parser.add_argument(
        "--out",
        default="out/run_example",
        help="output folder for saved models, logits, logs (default: out/run_example)",
    )
    parser.add_argument("--json", default=None, help="also write all measurements to this JSON file")
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds allowed per worker process (default: 1800)"
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar (it goes to stderr)"
    )
    parser.add_argument("--_worker", dest="worker", choices=["load", "reload"], help=argparse.SUPPRESS)
    parser.add_argument("--_method", dest="method", help=argparse.SUPPRESS)
    parser.add_argument("--_result", dest="result", help=argparse.SUPPRESS)
    parser.add_argument("--_status", dest="status", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group_size is not None and args.group_size <= 0:
        args.group_size = None

    if args.worker:
        return run_worker(args)

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        parser.error(f"--methods must be a comma-separated subset of {','.join(METHODS)}, got {args.methods!r}")

    if args.model is None:
        from benchmarks.example_model import build_example_model

        print("Preparing the example model (SmolLM2-135M-Instruct, bf16 safetensors)...", flush=True)
        try:
            args.model = str(build_example_model())
        except ImportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    model_path = Path(args.model)
    if not (model_path / "config.json").is_file():
        parser.error(f"--model {model_path} is not a checkpoint folder (no config.json)")

    out = Path(args.out).resolve()
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out = str(out)

    import torch
    import transformers

    print(f"model: {model_path}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: benchmarks/
    from benchmarks.machine import describe

    print(describe())
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, int4 group size: "
        f"{args.group_size or 'per-channel'}, load average {_loadavg()}",
        flush=True,
    )
    load_before = _loadavg()

    from tqdm.auto import tqdm

    results: dict[str, dict] = {}
    total = len(methods) * sum(len(steps) for steps in STEPS.values())
    with tqdm(total=total, unit="step", disable=not args.progress, file=sys.stderr) as bar:
        for method in methods:
            entry: dict = {}
            results[method] = entry
            for stage, label in (("load", "load + save"), ("reload", "reload + evaluate")):
                entry[stage] = _spawn(stage, method, args, log_dir, bar)
                done = entry[stage]
                if "error" in done:
                    bar.write(f"[{method}] {label}: FAILED ({done['error']}; log: {done['log']})", file=sys.stdout)
                    bar.n = bar.n + (len(STEPS["reload"]) if stage == "load" else 0)
                    break
                bar.write(f"[{method}] {label}: done in {done['wall_s']:.1f} s", file=sys.stdout)
        sys.stdout.flush()

    print()
    print(render_table(results))
    notes = []
    notes.append(
        "Peak RSS growth: VmHWM minus RSS just before from_pretrained, in a fresh process. Weights used "
        "as stored (bf16) stay memory-mapped from the safetensors files and are not resident until first "
        "used, so this can be below the footprint."
    )
    notes.append(
        f"Timings are wall-clock on a possibly shared machine: load average {load_before} before, "
        f"{_loadavg()} after (1/5/15 min) on {os.cpu_count()} CPUs."
    )
    if any(r.get("load", {}).get("peak_reset_ok") is False for r in results.values()):
        notes.append("* peak RSS could not be reset in the worker; the value includes the import-time peak.")
    from hfquant.evaluation import DEFAULT_REFERENCE_CHARS

    notes.append(
        f"Perplexity: fixed {DEFAULT_REFERENCE_CHARS}-character slice of CPython's pydoc topics, 512-token windows. Decode: batch 1, greedy, "
        f"{DECODE_TOKENS} tokens, best of {DECODE_REPEATS}, prefill excluded. Reload exact: logits of "
        "from_pretrained(saved) == logits right after quantize-on-load (torch.equal)."
    )
    print()
    for n in notes:
        print(n)
    print()
    print(f"Answers to {QUESTION!r} (greedy, chat template):")
    for method, r in results.items():
        ans = r.get("reload", {}).get("answer")
        print(f"- {method}: {ans!r}" if ans is not None else f"- {method}: (not available)")

    failed = [
        m for m, r in results.items() if "error" in r.get("load", {}) or "error" in r.get("reload", {"error": 1})
    ]
    if failed:
        print()
        for m in failed:
            r = results[m]
            stage = "load" if "error" in r["load"] else "reload"
            print(f"{m} failed during {stage}; full output: {r[stage]['log']}")

    if args.json:
        payload = {
            "model": str(model_path),
            "group_size": args.group_size,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"\nWrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
