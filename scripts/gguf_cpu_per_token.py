#!/usr/bin/env python
"""One thread's CPU time per decode token of hfquant (`from_gguf`, eager) and of llama.cpp on the same GGUF file.

Why: wall-clock tokens/s on a machine shared with other jobs moves with their load (issue #30's comparisons want a
quiet machine); the CPU time one thread spends on a decode step moves much less. Each engine runs in its own process
with one thread (hfquant: `OMP_NUM_THREADS=1` and `torch.set_num_threads(1)`; llama.cpp: llama-cpp-python's
`n_threads=1`, in the engines venv), loads the file once, and per measurement: the prefill of the same prompt token ids
(not timed), then `--tokens` one-token decode steps, each fed the previous step's greedy token, timed by
`time.process_time` (the process's CPU seconds, every thread). The rounds are paired (`benchmarks.paired.run_rounds`:
one measurement of each engine per round, the order changing: `balanced_order`); the table gives the medians of
milliseconds of CPU per token and of the per-round ratio llama.cpp's / hfquant's (above 1: hfquant spends less CPU per
token).

    python scripts/gguf_cpu_per_token.py FILE.gguf [FILE.gguf ...] --rounds 7 --tokens 32
    python scripts/gguf_cpu_per_token.py FILE.gguf --baseline TREE --baseline-cache DIR   # + another hfquant tree
    python scripts/gguf_cpu_per_token.py FILE.gguf --compile   # + hfquant's generate, eager and compiled
    python scripts/gguf_cpu_per_token.py FILE.gguf --checkpoint DIR --config format=iq4_xs,lm_head=int8

`--checkpoint DIR --config FIELDS` adds an engine in the same rounds: the bfloat16 checkpoint the GGUF file was made
from, quantized on load with `HfQuantConfig(**FIELDS)` (comma-separated field=value; for example the 4-bit default
against llama.cpp's Q4_0 of the same weights), in this tree and (with `--baseline`) in the baseline tree; with
`--compile` also its compiled `generate`, and with `--module-guards` its compiled `generate` with
`compile_decoding(module_guards=True)` (torch's own guards at every step, the default before the fifteenth session) as
well.

`--baseline TREE` adds a third engine in the same rounds: hfquant from another source tree (for example `git archive`
of the commit before a kernel change, unpacked), with its own `HFQUANT_CACHE` (`--baseline-cache`) so that the two
trees' native libraries do not replace each other.

Not part of the test suite (needs the engines venv, `scripts/engines.py --engines llama.cpp`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT_IDS = list(range(100, 116))
"""The prompt's token ids (any ids of the vocabulary: the weights' speed does not depend on them)."""

_PROTOCOL = r"""
def serve(decode, tokens):
    decode(4)  # warm-up: first-call work (kernel preparation, allocations) is not a decode step's
    print("READY", flush=True)
    for _ in sys.stdin:
        print("TOK_S " + repr(decode(tokens)), flush=True)
"""

_REPORT_ERROR = r"""except BaseException as error:
    print("ERROR " + f"{type(error).__name__}: {error}".replace("\n", " ")[:300], flush=True)
    raise
"""
"""The workers' last lines: an exception's one-line ERROR for the driver, then the traceback."""

_FROM_GGUF = (
    r"""
import json, sys, time
import torch
"""
    + _PROTOCOL
    + r"""
args = json.loads(sys.argv[1])
torch.set_num_threads(1)
try:
    import hfquant
    if args.get("checkpoint"):  # a bfloat16 checkpoint quantized on load with HfQuantConfig(**args["config"])
        from transformers import AutoModelForCausalLM
        quantization = hfquant.HfQuantConfig(**args["config"])
        model = AutoModelForCausalLM.from_pretrained(
            args["checkpoint"], quantization_config=quantization, dtype=torch.bfloat16).eval()
    else:
        model = hfquant.from_gguf(args["model"]).eval()
    prompt = torch.tensor([args["prompt"]])
"""
)
"""The hfquant workers' first lines: one thread, the GGUF file imported by `hfquant.from_gguf` (or a checkpoint folder
quantized on load), the prompt."""

HFQUANT_WORKER = (
    _FROM_GGUF
    + r"""
    def decode(n):
        with torch.inference_mode():
            out = model(prompt, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.process_time()
            for _ in range(n):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return n / (time.process_time() - start)

    serve(decode, args["tokens"])
"""
    + _REPORT_ERROR
)
"""The hfquant worker (`benchmarks.paired`'s protocol, TOK_S: decode tokens per CPU second)."""

GENERATE_WORKER = (
    _FROM_GGUF
    + r"""    if args.get("compile"):
        guards = {"module_guards": True} if args.get("module_guards") else {}
        hfquant.compile_decoding(model, max_cache_len=len(args["prompt"]) + args["tokens"] + 8, **guards)

    def generate(n):
        start = time.process_time()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.process_time() - start

    def decode(n):
        first = generate(1)  # the prefill and its token
        return n / (generate(n + 1) - first)

    decode(args["tokens"])  # compiles the decode step (the protocol's warm-up then runs one more)
    serve(decode, args["tokens"])
"""
    + _REPORT_ERROR
)
"""The worker of hfquant's decode through `generate` (eager, or with `"compile"` in its arguments compiled:
`hfquant.compile_decoding`, a static cache and `torch.compile(fullgraph=True)` of the decode step): `generate` of n + 1
tokens less `generate` of 1 (the prefill and its token), in CPU seconds, so `generate`'s own per-token work (logits
processors, stopping criteria) is in the time, as it is in `scripts/llamacpp_gguf.py`'s bench."""

LLAMA_WORKER = (
    r"""
import json, sys, time
import numpy as np
"""
    + _PROTOCOL
    + r"""
args = json.loads(sys.argv[1])
try:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=args["model"], n_threads=1, n_threads_batch=1, verbose=False,
                          n_ctx=len(args["prompt"]) + args["tokens"] + 8)

    def decode(n):
        llm.reset()
        llm.eval(args["prompt"])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        start = time.process_time()
        for _ in range(n):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return n / (time.process_time() - start)

    serve(decode, args["tokens"])
"""
    + _REPORT_ERROR
)
"""The llama.cpp worker (llama-cpp-python in the engines venv; the same protocol)."""


def measure(
    path: Path,
    rounds: int,
    tokens: int,
    python: Path,
    baseline: tuple[Path, Path] | None = None,
    compiled: bool = False,
    checkpoint: tuple[Path, dict] | None = None,
    module_guards: bool = False,
) -> dict:
    """Paired rounds of the engines' one-thread decode on `path` (hfquant eager; with `compiled` hfquant's `generate`,
    eager and compiled, and with `module_guards` the checkpoint's compiled `generate` with
    `compile_decoding(module_guards=True)` too; `baseline`'s hfquant: (tree, cache) when given; llama.cpp): the
    rounds, the medians of CPU milliseconds per token and of each hfquant's per-round ratio llama.cpp / hfquant, the
    load averages before and after."""
    from benchmarks import llama_cpp, paired
    from benchmarks.methods import worker_env

    args = json.dumps({"model": str(path), "prompt": PROMPT_IDS, "tokens": tokens})
    # PYTHONSAFEPATH: `python -c` would put the working directory before PYTHONPATH, so a baseline tree's worker
    # imported this tree's hfquant
    one = {"OMP_NUM_THREADS": "1", "PYTHONSAFEPATH": "1"}
    mine = dict(worker_env(), **one)
    base = None if baseline is None else dict(worker_env(baseline[0]), HFQUANT_CACHE=str(baseline[1]), **one)
    engines = {"hfquant": ([sys.executable, "-c", HFQUANT_WORKER, args], mine)}
    if compiled:
        for name, compile_ in (("hfquant generate", False), ("hfquant generate +compile", True)):
            worker_args = json.dumps(dict(json.loads(args), compile=compile_))
            engines[name] = ([sys.executable, "-c", GENERATE_WORKER, worker_args], mine)
    if base is not None:
        engines["hfquant baseline"] = ([sys.executable, "-c", HFQUANT_WORKER, args], base)
    if checkpoint is not None:
        folder_args = json.dumps(dict(json.loads(args), checkpoint=str(checkpoint[0]), config=checkpoint[1]))
        label = ",".join(f"{name}={value}" for name, value in checkpoint[1].items()) or "(default config)"
        engines[f"hfquant {label}"] = ([sys.executable, "-c", HFQUANT_WORKER, folder_args], mine)
        if base is not None:
            engines[f"hfquant baseline {label}"] = ([sys.executable, "-c", HFQUANT_WORKER, folder_args], base)
        if compiled:
            worker_args = json.dumps(dict(json.loads(folder_args), compile=True))
            engines[f"hfquant {label} generate +compile"] = (
                [sys.executable, "-c", GENERATE_WORKER, worker_args],
                mine,
            )
        if compiled and module_guards:
            worker_args = json.dumps(dict(json.loads(folder_args), compile=True, module_guards=True))
            engines[f"hfquant {label} generate +compile module_guards=True"] = (
                [sys.executable, "-c", GENERATE_WORKER, worker_args],
                mine,
            )
    engines["llama.cpp"] = ([str(python), "-c", LLAMA_WORKER, args], dict(llama_cpp.engine_env(), **one))
    before = os.getloadavg()
    with tempfile.TemporaryDirectory() as logs:
        group = paired.run_rounds(engines, rounds, 1800, Path(logs))
        if group["error"]:
            for log in Path(logs).iterdir():
                print(f"{log.name}: {log.read_text()[-2000:]}", file=sys.stderr)
    per_token = {
        name: statistics.median(1000 / r["tok_s"][name] for r in group["rounds"]) for name in group["engines"]
    }
    ratios = {
        name: [r["tok_s"][name] / r["tok_s"]["llama.cpp"] for r in group["rounds"]]
        for name in group["engines"]
        if name != "llama.cpp"
    }
    return {
        "file": path.name,
        "rounds": group["rounds"],
        "error": group["error"],
        "cpu_ms_per_token": per_token,
        "ratios": {name: (statistics.median(r), min(r), max(r)) for name, r in ratios.items() if r},
        "load_average": (before, os.getloadavg()),
    }


def config_fields(text: str) -> dict:
    """ "format=iq4_xs,lm_head=int8" -> {"format": "iq4_xs", "lm_head": "int8"} (`bits` and `group_size` as numbers)."""
    fields = dict(pair.split("=", 1) for pair in text.split(",") if pair)
    for name in ("bits", "group_size"):
        if name in fields:
            fields[name] = float(fields[name]) if "." in fields[name] else int(fields[name])
    return fields


def main(argv: list[str] | None = None) -> int:
    from benchmarks import llama_cpp
    from benchmarks.machine import describe

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="+", type=Path, help="GGUF files (each measured on both engines)")
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds per file")
    parser.add_argument("--tokens", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--llama-python", type=Path, default=llama_cpp.default_python(), help="the venv's python")
    parser.add_argument("--baseline", type=Path, default=None, help="another hfquant source tree to time too")
    parser.add_argument("--baseline-cache", type=Path, default=None, help="its HFQUANT_CACHE")
    parser.add_argument("--compile", action="store_true", help="time hfquant's generate, eager and compiled, too")
    parser.add_argument("--json", type=Path, default=None, help="write every result here")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a bfloat16 checkpoint folder to quantize too")
    parser.add_argument(
        "--module-guards", action="store_true", help="with --compile --checkpoint: also module_guards=True"
    )
    parser.add_argument("--config", default="", help="its HfQuantConfig fields: field=value,field=value")
    args = parser.parse_args(argv)
    checkpoint = (args.checkpoint, config_fields(args.config)) if args.checkpoint is not None else None
    if (args.baseline is None) != (args.baseline_cache is None):
        parser.error("--baseline and --baseline-cache go together")
    baseline = (args.baseline, args.baseline_cache) if args.baseline is not None else None
    print(describe())
    print(
        "\n| file | engine | rounds | CPU ms / token (median) | llama.cpp / it, median (min-max) "
        "| load average before / after |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    results = []
    for path in args.gguf:
        result = measure(
            path,
            args.rounds,
            args.tokens,
            args.llama_python,
            baseline,
            args.compile,
            checkpoint,
            args.module_guards,
        )
        results.append(result)
        loads = " / ".join(f"{a[0]:.2f} {a[1]:.2f} {a[2]:.2f}" for a in result["load_average"])
        for name, ms in result["cpu_ms_per_token"].items():
            median, low, high = result["ratios"].get(name, (1.0, 1.0, 1.0))
            print(
                f"| {path.name} | {name} | {len(result['rounds'])} | {ms:.1f} | {median:.2f}x ({low:.2f}-{high:.2f}) "
                f"| {loads} |",
                flush=True,
            )
        if result["error"]:
            print(f"  stopped: {result['error']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
