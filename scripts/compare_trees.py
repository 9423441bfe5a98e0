"""Load, decode, save and reload timings of two hfquant source trees on the same checkpoint, for a before/after claim.

    git worktree add /tmp/before <commit>
    python scripts/compare_trees.py /tmp/before . --methods int8,int4-rtn --runs 5

Each (tree, method, run) is a fresh process that imports hfquant from that tree (the tree is put first on
`sys.path`), alternating the trees so that host noise falls on both. One run: `from_pretrained` of the benchmark's
random-weight 1.2B Llama (`benchmarks/random_model.py`, built once and cached; its shards read into the page
cache first) with quantization, `generate` of 32 tokens (best of 3 after a warm-up), `save_pretrained`, a reload from
the page cache and `generate` again. Prints a markdown table of medians (min-max) per tree and the after/before ratio
of the medians, with the CPU named. The load is also given in CPU seconds of the process (user + system, every
thread: on a shared machine they move far less than the wall time) and its peak RSS.

`--load-only` times `from_pretrained` alone (`import hfquant` and transformers' model code imported first and timed
apart: a fresh process pays them once, on its first load; both figures are in the table); `--shape 8b` loads a random
Llama with Llama-3-8B's layers instead (14.8 GB of bfloat16, built once into the cache, about 10 minutes on 2 cores),
`--model` any float checkpoint:

    python scripts/compare_trees.py /tmp/before . --methods int4-default,int8 --load-only --shape 8b --runs 2

With `--paired-rounds N`, decode only, in paired rounds instead (`benchmarks.paired.run_rounds`): for every benchmark
method in `--paired-methods` (and with `--compile`, its "+compile" variant: static cache, `torch.compile` fullgraph),
one long-lived worker per tree loads the model once, then every round asks each worker for one 64-token decode, back
to back, the order changing; the table gives each tree's median tokens/s and the median (min-max) of the per-round
after/before ratios, which this machine's moving memory speed affects far less than runs minutes apart:

    python scripts/compare_trees.py /tmp/before . --paired-rounds 6 --paired-methods hfquant-int4,hfquant-int8 --compile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import describe  # noqa: E402
from benchmarks.methods import worker_env  # noqa: E402
from benchmarks.random_model import SHAPES  # noqa: E402

LOAD_FIELDS = (
    ("hfquant and transformers' model code, imported before the load, s (once per process)", "model_import_s"),
    ("quantize on load with that import (a fresh process's first load), GB/s", "first_load_gb_s"),
    ("quantize on load, s", "quantize_load_s"),
    ("quantize on load, GB/s of the source's safetensors", "quantize_load_gb_s"),
    ("quantize on load, CPU s (user + system, all threads)", "quantize_load_cpu_s"),
    ("quantize on load, GB/s per CPU second", "quantize_load_gb_cpu_s"),
    ("quantize on load, main thread CPU s (the critical path beside worker threads)", "quantize_load_main_cpu_s"),
    ("peak RSS after the load, MiB", "peak_rss_mib"),
)
FIELDS = (
    *LOAD_FIELDS,
    ("decode, tokens/s", "decode_tok_s"),
    ("save_pretrained, s", "save_s"),
    ("reload, s", "reload_s"),
    ("decode after reload, tokens/s", "reload_decode_tok_s"),
)

METHODS = {
    "int8": {"bits": 8, "group_size": None},
    "int4-rtn": {"bits": 4, "group_size": 128, "method": "rtn"},
    "int4-default": {"bits": 4, "mixed_precision": "auto"},  # SINQ folded, the data-free mixed precision
    "iq4_xs": {"format": "iq4_xs"},  # SINQ folded, then llama.cpp's IQ4_XS blocks (IQ4_NL where 256 does not divide)
}

WORKER = r"""
import gc, json, os, shutil, sys, tempfile, time
tree, fields, source, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
load_only, threads = sys.argv[5] == "1", int(sys.argv[6])
sys.path.insert(0, tree)
import resource
import torch
if threads:
    torch.set_num_threads(threads)
from transformers import AutoModelForCausalLM
# `import hfquant` is timed with the model code below: a tree whose import pulls in transformers' modeling code
# (AttentionInterface does) would otherwise move that cost out of the figure
t_hfquant = time.perf_counter()
import hfquant
t_hfquant = time.perf_counter() - t_hfquant
assert os.path.realpath(hfquant.__file__).startswith(os.path.realpath(tree)), hfquant.__file__
try:
    config = hfquant.HfQuantConfig(**{"mixed_precision": "none", **fields})
except (TypeError, ValueError):  # a tree from before mixed_precision existed (then always none)
    config = hfquant.HfQuantConfig(**fields)
ids = torch.tensor([[1, 500, 900, 1200, 40, 77, 300, 12]])
def decode(model):
    model.generate(ids, max_new_tokens=4, do_sample=False)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        best = min(best, time.perf_counter() - t0)
    return 32 / best
result = {}
for name in os.listdir(source):  # every run starts with the shards in the page cache, as the reload below does
    if name.endswith(".safetensors"):
        with open(os.path.join(source, name), "rb") as handle:
            while handle.read(1 << 24):
                pass
# Each timed step starts with no garbage pending: otherwise a full collection of the whole interpreter heap (0.2 s
# after importing torch and transformers) falls in whichever step crosses gc's threshold first, and a tree that
# allocates a few hundred more objects is charged for the imports' garbage (#28: the "slower" reload of 0.6 s).
def cpu_s():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
# The model class's module (transformers imports it lazily on the first from_pretrained, with its generation code:
# about 0.8 s here, the same for every tree and quantizer) is imported and timed apart from the load, with hfquant's.
t0 = time.perf_counter()
from transformers import AutoConfig
AutoModelForCausalLM._model_mapping[type(AutoConfig.from_pretrained(source))]
result["model_import_s"] = time.perf_counter() - t0 + t_hfquant
gc.collect()
c0, m0, t0 = cpu_s(), time.thread_time(), time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
result["quantize_load_s"] = time.perf_counter() - t0
result["quantize_load_cpu_s"] = cpu_s() - c0
result["quantize_load_main_cpu_s"] = time.thread_time() - m0
result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
shards = [os.path.join(source, n) for n in os.listdir(source) if n.endswith(".safetensors")]
gigabytes = sum(os.path.getsize(p) for p in shards) / 1e9
result["quantize_load_gb_s"] = gigabytes / result["quantize_load_s"]
result["quantize_load_gb_cpu_s"] = gigabytes / result["quantize_load_cpu_s"]
result["first_load_gb_s"] = gigabytes / (result["quantize_load_s"] + result["model_import_s"])
if load_only:
    with open(out, "w") as handle:
        json.dump(result, handle)
    sys.exit(0)
result["decode_tok_s"] = decode(model)
folder = tempfile.mkdtemp(prefix="compare-trees-")
try:
    gc.collect()
    t0 = time.perf_counter()
    model.save_pretrained(folder + "/saved")
    result["save_s"] = time.perf_counter() - t0
    del model
    for name in os.listdir(folder + "/saved"):
        with open(os.path.join(folder, "saved", name), "rb") as handle:
            while handle.read(1 << 24):
                pass
    gc.collect()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder + "/saved", dtype=torch.bfloat16)
    result["reload_s"] = time.perf_counter() - t0
    result["reload_decode_tok_s"] = decode(model)
finally:
    shutil.rmtree(folder)
with open(out, "w") as handle:
    json.dump(result, handle)
"""


def run(tree: Path, method: str, source: Path, load_only: bool = False, threads: int = 0) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        fields = json.dumps(METHODS[method])
        command = [
            sys.executable,
            "-c",
            WORKER,
            str(tree),
            fields,
            str(source),
            out.name,
            str(int(load_only)),
            str(threads),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=tempfile.gettempdir())
        if done.returncode:
            raise SystemExit(f"{tree} {method} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def paired(args, source: Path) -> None:
    """Decode of both trees in paired rounds (see the module docstring); prints the table."""
    from benchmarks.paired import hfquant_command, pair_ratios, run_rounds

    variants = ["eager", "compile"] if args.compile else ["eager"]
    lines = [
        "| method | variant | rounds | before tok/s (median) | after tok/s (median) | after / before per round, median "
        "(min-max) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="compare-trees-logs-"))
    trees = (("before", args.before.resolve()), ("after", args.after.resolve()))
    # `python -m` puts the working directory first on a worker's sys.path, ahead of PYTHONPATH: work from a folder
    # that holds neither tree, so that each worker imports hfquant and benchmarks/ from its own
    os.chdir(log_dir)
    for _, tree in trees:
        _check_imports_from(tree)
    for method in args.paired_methods.split(","):
        for variant in variants:
            engines = {
                name: (hfquant_command(method, variant, source, False), worker_env(tree)) for name, tree in trees
            }
            result = run_rounds(engines, args.paired_rounds, timeout=1800, log_dir=log_dir)
            pair = pair_ratios(result, "after", "before")
            if pair is None:
                lines.append(f"| {method} | {variant} | 0 | | | failed: {result['error']} |")
                continue
            lines.append(
                f"| {method} | {variant} | {pair['rounds']} | {pair['theirs_tok_s']:.2f} | {pair['mine_tok_s']:.2f} | "
                f"{pair['median']:.3f}x ({pair['min']:.3f}-{pair['max']:.3f}) |"
            )
            print(lines[-1], file=sys.stderr)
    print(f"{describe()};  paired rounds; before = {args.before}, after = {args.after}; worker logs in {log_dir}\n")
    print("\n".join(lines))


def _check_imports_from(tree: Path) -> None:
    """Raise SystemExit unless a worker's environment imports hfquant and benchmarks/ from `tree`."""
    code = "import hfquant, benchmarks.paired as p; print(hfquant.__file__); print(p.__file__)"
    done = subprocess.run([sys.executable, "-c", code], env=worker_env(tree), capture_output=True, text=True)
    files = done.stdout.split()
    if done.returncode or len(files) != 2 or not all(Path(f).resolve().is_relative_to(tree) for f in files):
        raise SystemExit(f"a worker for {tree} would import {files or done.stderr[-500:]}, not that tree")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="source tree of the baseline (a git worktree)")
    parser.add_argument("after", type=Path, help="source tree to compare")
    parser.add_argument("--methods", default="int8,int4-rtn", help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--runs", type=int, default=3, help="processes per tree and method (default 3)")
    parser.add_argument("--paired-rounds", type=int, default=0, help="decode only, in N paired rounds (see above)")
    parser.add_argument(
        "--paired-methods", default="hfquant-int4,hfquant-int8", help="benchmark methods for --paired-rounds"
    )
    parser.add_argument("--compile", action="store_true", help="with --paired-rounds: the +compile variant too")
    parser.add_argument("--model", type=Path, help="this float checkpoint instead of the random 1.2B")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="1b",
        help="the random Llama's shape (benchmarks.random_model.SHAPES; 8b: Llama-3-8B's layers, 14.8 GB, built once "
        "into the cache)",
    )
    parser.add_argument("--load-only", action="store_true", help="time from_pretrained only (no decode, save, reload)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each run (default: torch's)")
    args = parser.parse_args(argv)
    from benchmarks.random_model import build_random_llama

    source = args.model.resolve() if args.model else build_random_llama(**SHAPES[args.shape])
    if args.paired_rounds:
        paired(args, source)
        return 0
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"method {method!r} is not one of {list(METHODS)}")
    results = {(tree, method): [] for tree in ("before", "after") for method in methods}
    for index in range(args.runs):
        for method in methods:
            for name, tree in (("before", args.before), ("after", args.after)):
                results[name, method].append(run(tree.resolve(), method, source, args.load_only, args.threads))
                print(f"run {index + 1}/{args.runs} {method} {name}: {results[name, method][-1]}", file=sys.stderr)
    print(f"{describe()};  {args.runs} runs per cell; before = {args.before}, after = {args.after}\n")
    header = "| | " + " | ".join(f"{m} before | {m} after | after / before" for m in methods) + " |"
    print(header)
    print("| --- |" + " ---: | ---: | ---: |" * len(methods))
    for label, key in LOAD_FIELDS if args.load_only else FIELDS:
        cells = []
        for method in methods:
            before = [r[key] for r in results["before", method]]
            after = [r[key] for r in results["after", method]]
            ratio = statistics.median(after) / statistics.median(before)
            cells += [cell(before), cell(after), f"{ratio:.2f}x"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
