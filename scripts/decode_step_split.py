#!/usr/bin/env python
"""Where one thread's CPU time of an eager decode step goes: the block GEMVs, and each module class's own work.

Why (issue #30): on a memory-bound GGUF file (Q4_K_M, Q4_0, Q8_0) `from_gguf` decoded at 0.88-0.95x of llama.cpp's
CPU per token while hfquant's GEMVs alone took less than llama.cpp's whole step; this script shows how much of the
step is the GEMVs and how much the eager transformers code around them, per module class.

How: `torch.ops.hfquant_cpu.block_gemv` and `block_gemv_group` are replaced, before the model is loaded (the decode
plans bind them then), by wrappers that add each call's `time.thread_time` to a total; every module class of the
model but the Linear layers gets its `forward` wrapped the same way (inclusive time, and the GEMV time spent inside
it, so "rest" is the class's own work and that of the modules it calls that are not GEMVs). The model runs with one
thread (`torch.set_num_threads(1)`; set `OMP_NUM_THREADS=1` too), a one-token prompt, then `--steps` one-token decode
steps fed their greedy token, `--repeats` times after a warm-up. The wrappers cost about 1 us a call (two clock
reads), about 0.2 ms of a 1.2B step; eager only (a compiled graph calls the operators itself).

    OMP_NUM_THREADS=1 python scripts/decode_step_split.py FILE.gguf [--steps 32] [--repeats 2]
    OMP_NUM_THREADS=1 python scripts/decode_step_split.py CHECKPOINT_DIR --config format=iq4_xs,lm_head=int8

A folder (a bfloat16 checkpoint, e.g. the benchmark's 1.2B in the cache) is quantized on load with
`HfQuantConfig(**--config)` (comma-separated field=value pairs; `bits` and `group_size` are read as numbers); its
int8 lm_head's `int8_gemv` (and an int4 default's `int4_gemv*`) are timed as GEMVs too, each operator on its own line.
`--per-module` turns off the decoder layers' one-call step (`decode_layer_row`, csrc/torch_ops.cpp: its GEMVs run
inside that operator, untimed, so without it the layers' GEMVs show as "rest"): the layers run by their modules'
row forwards, each GEMV a timed `block_gemv_group` call. The block GEMVs are also summed per block format (a fused group's formats joined by +), with the weight bytes they
read per step and GB/s.

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hfquant.core import blocks  # noqa: E402

GEMV_OPERATORS = ("block_gemv", "block_gemv_group", "int8_gemv", "int4_gemv", "int4_gemv_avx2", "int4_gemv_a8")
"""The `hfquant_cpu` operators timed as the step's GEMVs."""

GGML_NAMES = {layout.ggml_type: name for name, layout in blocks.LAYOUTS.items()}
"""{GGML type number: hfquant's block format name}, for the block GEMVs' lines per format."""


def _type_name(code: int) -> str:
    """A block GEMV's type code as a name: the format's, with "-r8" for the R8 layout (`hfquant.ops.block_layout`)."""
    from hfquant.ops import native

    plain = code & ~native.BLOCK_ROWS8
    return GGML_NAMES.get(plain, str(plain)) + ("-r8" if code & native.BLOCK_ROWS8 else "")


NOT_WRAPPED = ("ModuleList", "QuantLinear", "SiLUActivation", "SiLU")
"""Module classes whose `forward` is not wrapped (containers; the GEMVs' own layers, timed through the operators)."""


class TimedOperator:
    """Stands in for `torch.ops.hfquant_cpu.<name>` (and its `.default`): calls the operator and adds the calling
    thread's CPU seconds to `totals["gemv"]` and to `totals[name]`."""

    def __init__(self, operator, totals: dict, name: str):
        self.default = self
        self.operator = operator
        self.totals = totals
        self.name = name

    def __call__(self, *args):
        start = time.thread_time()
        result = self.operator(*args)
        seconds = time.thread_time() - start
        self.totals["gemv"] += seconds
        self.totals[self.name] = self.totals.get(self.name, 0.0) + seconds
        if self.name in ("block_gemv", "block_gemv_group"):  # (x, weight(s), in_features, ggml type(s))
            weights, types = (args[1], args[3]) if self.name == "block_gemv_group" else ([args[1]], [args[3]])
            key = ("types", tuple(int(t) for t in types))
            seconds_so_far, nbytes = self.totals.get(key, (0.0, 0))
            self.totals[key] = (seconds_so_far + seconds, nbytes + sum(w.numel() * w.element_size() for w in weights))
        return result


def wrap_class(cls, totals: dict, inclusive: collections.Counter, inside: collections.Counter) -> None:
    """Wrap `cls.forward`: its inclusive CPU seconds into `inclusive[name]`, the GEMV seconds within into
    `inside[name]`."""
    forward = cls.forward
    name = cls.__name__

    def timed_forward(self, *args, **kwargs):
        start, gemv = time.thread_time(), totals["gemv"]
        result = forward(self, *args, **kwargs)
        inclusive[name] += time.thread_time() - start
        inside[name] += totals["gemv"] - gemv
        return result

    cls.forward = timed_forward


def load(path: Path, config: str):
    """The model to time: `from_gguf` of a GGUF file, or a checkpoint folder quantized with `HfQuantConfig(**fields)`
    parsed from `config` ("format=iq4_xs,lm_head=int8")."""
    import hfquant

    if path.is_file():
        return hfquant.from_gguf(path)
    from gguf_cpu_per_token import config_fields
    from transformers import AutoModelForCausalLM

    quantization = hfquant.HfQuantConfig(**config_fields(config))
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, dtype=torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a GGUF file `hfquant.from_gguf` imports, or a checkpoint folder")
    parser.add_argument("--config", default="", help="HfQuantConfig fields for a folder: field=value,field=value")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="measurements after the warm-up")
    parser.add_argument(
        "--per-module",
        action="store_true",
        help="decoder layers by their modules' forwards, not one decode_layer_row call (whose GEMVs are not timed)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.machine import describe
    from hfquant.ops import torch_ops

    if not torch_ops.loaded():
        raise SystemExit("hfquant's dispatcher operators are not available here: nothing to time")
    totals = {"gemv": 0.0}
    for name in GEMV_OPERATORS:
        operator = getattr(torch.ops.hfquant_cpu, name).default
        setattr(torch.ops.hfquant_cpu, name, TimedOperator(operator, totals, name))
    model = load(args.model, args.config).eval()
    if args.per_module:
        from hfquant.nn import decode_layer

        decode_layer._DECODE_LAYER_ROW = None
    inclusive, inside = collections.Counter(), collections.Counter()
    for cls in {type(module) for module in model.modules()}:
        if cls.__name__ not in NOT_WRAPPED:
            wrap_class(cls, totals, inclusive, inside)
    print(describe())

    def measure(steps: int) -> float:
        with torch.inference_mode():
            out = model(torch.tensor([[100]]), use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            inclusive.clear(), inside.clear(), totals.clear()
            totals["gemv"] = 0.0
            start = time.process_time()
            for _ in range(steps):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            return (time.process_time() - start) / steps * 1000

    measure(8)
    for _ in range(args.repeats):
        step = measure(args.steps)
        gemv = totals["gemv"] / args.steps * 1000
        print(f"\nstep {step:.2f} ms CPU; the GEMVs {gemv:.2f} ms; the rest {step - gemv:.2f} ms")
        for name in GEMV_OPERATORS:
            if name in totals:
                print(f"  {name}: {totals[name] / args.steps * 1000:.2f} ms")
        for key in sorted(k for k in totals if isinstance(k, tuple)):
            seconds, nbytes = totals[key]
            names = "+".join(_type_name(t) for t in key[1])
            print(
                f"    {names}: {seconds / args.steps * 1000:.2f} ms, {nbytes / args.steps / 1e6:.1f} MB, "
                f"{nbytes / seconds / 1e9:.1f} GB/s"
            )
        print("| module class | inclusive ms | GEMVs inside ms | rest ms |\n| --- | ---: | ---: | ---: |")
        for name, seconds in inclusive.most_common():
            ms, gemv_ms = seconds / args.steps * 1000, inside[name] / args.steps * 1000
            print(f"| {name} | {ms:.2f} | {gemv_ms:.2f} | {ms - gemv_ms:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
