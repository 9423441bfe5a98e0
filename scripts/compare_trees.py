"""Load, decode, save and reload timings of two hfquant source trees on the same checkpoint, for a before/after claim.

    git worktree add /tmp/before <commit>
    python scripts/compare_trees.py /tmp/before . --methods int8,int4-rtn --runs 5

Each (tree, method, run) is a fresh process that imports hfquant from that tree (the tree is put first on
`sys.path`), alternating the trees so that host noise falls on both. One run: `from_pretrained` of the benchmark's
random-weight 1.2B Llama (`benchmarks/random_model.py`, built once and cached) with quantization, `generate` of 32
tokens (best of 3 after a warm-up), `save_pretrained`, a reload from the page cache and `generate` again. Prints a
markdown table of medians (min-max) per tree and the after/before ratio of the medians, with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.machine import describe  # noqa: E402

FIELDS = (
    ("quantize on load, s", "quantize_load_s"),
    ("decode, tokens/s", "decode_tok_s"),
    ("save_pretrained, s", "save_s"),
    ("reload, s", "reload_s"),
    ("decode after reload, tokens/s", "reload_decode_tok_s"),
)

METHODS = {"int8": {"bits": 8, "group_size": None}, "int4-rtn": {"bits": 4, "group_size": 128, "method": "rtn"}}

WORKER = r"""
import json, os, shutil, sys, tempfile, time
tree, fields, source, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, tree)
import torch
import hfquant
from transformers import AutoModelForCausalLM
assert os.path.realpath(hfquant.__file__).startswith(os.path.realpath(tree)), hfquant.__file__
try:
    config = hfquant.HfQuantConfig(**fields, mixed_precision="none")
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
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=torch.bfloat16)
result["quantize_load_s"] = time.perf_counter() - t0
result["decode_tok_s"] = decode(model)
folder = tempfile.mkdtemp(prefix="compare-trees-")
try:
    t0 = time.perf_counter()
    model.save_pretrained(folder + "/saved")
    result["save_s"] = time.perf_counter() - t0
    del model
    for name in os.listdir(folder + "/saved"):
        with open(os.path.join(folder, "saved", name), "rb") as handle:
            while handle.read(1 << 24):
                pass
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder + "/saved", dtype=torch.bfloat16)
    result["reload_s"] = time.perf_counter() - t0
    result["reload_decode_tok_s"] = decode(model)
finally:
    shutil.rmtree(folder)
with open(out, "w") as handle:
    json.dump(result, handle)
"""


def run(tree: Path, method: str, source: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-c", WORKER, str(tree), json.dumps(METHODS[method]), str(source), out.name]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=tempfile.gettempdir())
        if done.returncode:
            raise SystemExit(f"{tree} {method} failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="source tree of the baseline (a git worktree)")
    parser.add_argument("after", type=Path, help="source tree to compare")
    parser.add_argument("--methods", default="int8,int4-rtn", help=f"comma-separated, of {list(METHODS)}")
    parser.add_argument("--runs", type=int, default=3, help="processes per tree and method (default 3)")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    for method in methods:
        if method not in METHODS:
            parser.error(f"method {method!r} is not one of {list(METHODS)}")
    from benchmarks.random_model import build_random_llama

    source = build_random_llama()
    results = {(tree, method): [] for tree in ("before", "after") for method in methods}
    for index in range(args.runs):
        for method in methods:
            for name, tree in (("before", args.before), ("after", args.after)):
                results[name, method].append(run(tree.resolve(), method, source))
                print(f"run {index + 1}/{args.runs} {method} {name}: {results[name, method][-1]}", file=sys.stderr)
    print(f"{describe()};  {args.runs} runs per cell; before = {args.before}, after = {args.after}\n")
    header = "| | " + " | ".join(f"{m} before | {m} after | after / before" for m in methods) + " |"
    print(header)
    print("| --- |" + " ---: | ---: | ---: |" * len(methods))
    for label, key in FIELDS:
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
