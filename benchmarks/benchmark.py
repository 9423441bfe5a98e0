"""Benchmark hfquant against bf16 and the peer quantization libraries, on CPU.

    python scripts/benchmark.py [--workload real|1b|8b|both] [--methods bf16,hfquant-int8,...] [--compile] [--quick]

Workloads: ``real`` is the SmolLM2-135M example model (:mod:`benchmarks.example_model`), measured for accuracy
(perplexity) and everything else; ``1b`` is a random-weight 1.2B Llama (:mod:`benchmarks.random_model`) for speed and
memory (perplexity is skipped: the weights are random).  ``--model PATH`` benchmarks one local checkpoint
instead (workload name ``model``).

Every method of every workload runs in its own fresh Python process (so peak RSS and import state are clean; a
crash or timeout only loses that row), which loads the checkpoint with ``from_pretrained(path, dtype=bfloat16,
device_map="cpu", quantization_config=...)`` and measures, in this order:

- ``load_s``: wall time of ``from_pretrained``, the model's Python code imported before (the same for every method);
  ``load_gbs``: the checkpoint's ``*.safetensors`` bytes over ``load_s`` (issue #13's whole-load throughput);
- ``peak_rss_growth_mib``: VmHWM after it minus RSS just before it (peak reset first, :mod:`benchmarks.memory`);
- ``tensor_bytes``: :func:`benchmarks.memory.tensor_bytes` of the parameters and buffers, plus the quantization state
  tensors bitsandbytes hangs on its parameters (``SCB``, ``quant_state``), which are neither;
- ``weight_read_bytes``: bytes read from weights per decoded token, see :func:`weight_bytes_per_token`;
- ``decode_tok_s``: :func:`hfquant.evaluation.decode_tokens_per_second` (batch 1, 64 greedy tokens, warm-up, best
  of 3, prefill excluded);
- ``prefill_ms``: median of 3 forward passes over 512 tokens (batch 1, ``use_cache=True``, ``logits_to_keep=1``
  as in ``generate``'s prefill), after one untimed pass;
- ``perplexity`` (real workload): :func:`hfquant.evaluation.perplexity` on :func:`hfquant.evaluation.reference_text`;
- ``files_bytes``: ``*.safetensors`` bytes written by ``save_pretrained`` (deleted afterwards unless
  ``--keep-saved``); ``files_note`` says why when the method cannot save.

With ``--compile`` each method gets a second process (row ``<method> +compile``): the compiled fast path of the
README, as a transformers user sets it up. The model is loaded the same way but with ``attn_implementation="eager"``
(inductor fuses the eager attention of a decode step into its own kernels, where SDPA's CPU flash kernel cost about
80 us per layer and step), ``model.generation_config`` gets ``cache_implementation = "static"`` and a
``CompileConfig(fullgraph=True, mode="default")`` with transformers' ``_compile_all_devices`` switch (its
auto-compile otherwise runs on accelerators only), so ``generate`` runs the prefill eagerly and the decode steps
through the compiled forward. One untimed full-length ``generate`` compiles (``compile_s``), then the same decode
measurement runs without its short warm-up (a different cache length would recompile).

With ``--paired-rounds N`` each llama.cpp method is also measured against its twin hfquant method (eager, and
``+compile`` with ``--compile``) in N rounds of back-to-back decodes, every engine loaded once in its own process
(:mod:`benchmarks.paired`): the ratio of engines measured seconds apart, where the rows are minutes apart while this
machine's memory speed moves. The groups of the other 4-bit methods (``llamacpp-int4``, ``llamacpp-q4_1``) also
decode llama.cpp's fastest 4-bit type, Q4_0, so that each hfquant 4-bit method is paired with it too (issue #32). The
paired medians get their own target lines.

The worker rewrites its result file after every step, so a step that fails or a timeout keeps the numbers
measured before it (the row then shows them with the error).

The parent process measures the memory bandwidth (:func:`memory_bandwidth`) before each workload and at the end
of the run, and reads every checkpoint file once before its first method so that all methods load from the page
cache; the decode bound of a row is ``max(read bandwidth) / weight_read_bytes`` tokens/s, and ``bound_pct`` is the
share of it that ``decode_tok_s`` reaches.  Ratios in the table are against the bf16 row of the same workload and
run.  A peer that is not installed is a row saying so; a method that fails shows its error in its row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks.methods import (
    DECODE_PROMPT,
    FULL,
    METHODS,
    PIP_HINT,
    QUICK,
    _installed,
    load_kwargs,
    quantization_config,
    use_compiled_decode,
    worker_env,
)

__all__ = [
    "METHODS",
    "WORKLOADS",
    "ROW_KEYS",
    "main",
    "memory_bandwidth",
    "quantization_config",
    "weight_bytes_per_token",
    "render_table",
    "check_targets",
]

WORKLOADS = ("real", "1b")
"""What `--workload both` runs; "8b" (a random Llama with Llama-3-8B's layers, 14.8 GB of bf16) is asked by name."""
RANDOM_WORKLOADS = ("1b", "8b")
"""Random-weight workloads: speed and memory only (no perplexity); the load targets apply to both."""
# Keys of every row in the JSON output (None where not measured).
ROW_KEYS = (
    "method",
    "variant",
    "status",
    "error",
    "load_s",
    "peak_rss_growth_mib",
    "tensor_bytes",
    "weight_read_bytes",
    "files_bytes",
    "files_note",
    "prefill_ms",
    "prefill_tokens",
    "decode_tok_s",
    "decode_tokens",
    "compile_s",
    "perplexity",
    "quantize_gbs",
    "load_gbs",
    "bound_tok_s",
    "bound_pct",
    "step_errors",
    "wall_s",
    "log",
)
MIB = 1024 * 1024
GB = 10**9


# ----------------------------------------------------------------------------- measurements


QUANTIZE_SAMPLE_LAYERS = 2
"""Decoder layers whose Linear weights the quantization-throughput step quantizes (all of them when fewer)."""


def quantize_gb_per_s(
    method: str, checkpoint: Path, layers: int = QUANTIZE_SAMPLE_LAYERS, repeats: int = 3
) -> float | None:
    """Quantization throughput of `method`'s RTN alone, in GB/s (10**9 bytes of bf16 weight per second, this
    process's torch threads): the 2-D weights of the first `layers` decoder layers of `checkpoint` (names with
    "layers.0.", "layers.1.", ...) are read into memory first, one is quantized untimed (warm-up), then each is
    quantized as the method does on load and the time of that call alone is summed; the best of `repeats` such
    passes is reported (as decode reports the best of its repetitions). hfquant: `linear.quantize_to_buffers` with
    the method's config (its `method`, int4 packing included; every weight at the config's own bits and group size,
    `module_overrides` aside); torchao: `quantize_` on an `nn.Linear` holding the weight. None for
    other methods.
    """
    import torch
    from safetensors import safe_open

    if not method.startswith(("hfquant-", "torchao-")):
        return None
    config = quantization_config(method)
    prefixes = tuple(f"layers.{i}." for i in range(layers))
    weights = []
    for shard in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith(".weight") and any(p in key for p in prefixes):
                    tensor = handle.get_tensor(key)
                    if tensor.dim() == 2:
                        weights.append(tensor.to(torch.bfloat16).clone())
    if not weights:
        return None
    if method.startswith("hfquant-"):
        from hfquant.core.format import StoredFormat
        from hfquant.core.rtn import effective_group_size
        from hfquant.nn.linear import quantize_to_buffers

        def quantize(weight):
            group = effective_group_size(weight.shape[1], config.group_size, config.bits)
            if group is not None:  # else kept in float: nothing to do, as on load
                quantize_to_buffers(weight, StoredFormat(config.bits, group, config.symmetric, config.method))
    else:
        from torchao.quantization import quantize_

        def quantize(weight):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            quantize_(linear, config.quant_type)

    quantize(weights[0])  # warm-up: first calls of the ops, lazy imports
    passes = []
    for _ in range(repeats):
        seconds = 0.0
        for weight in weights:
            t0 = time.perf_counter()
            quantize(weight)
            seconds += time.perf_counter() - t0
        passes.append(seconds)
    return sum(w.numel() * 2 for w in weights) / min(passes) / GB


def _side_tensors(model) -> list:
    """Quantization state that bitsandbytes keeps as attributes of its parameters (not parameters or buffers)."""
    import torch

    found = []
    for p in model.parameters():
        scb = getattr(p, "SCB", None)
        if isinstance(scb, torch.Tensor):
            found.append(scb)
        state = getattr(p, "quant_state", None)
        while state is not None:
            found += [
                t
                for t in (getattr(state, "absmax", None), getattr(state, "code", None))
                if isinstance(t, torch.Tensor)
            ]
            state = getattr(state, "state2", None)
    return found


def _all_tensors(model) -> list:
    return (
        [t for _, t in model.named_parameters(remove_duplicate=False)]
        + [t for _, t in model.named_buffers(remove_duplicate=False)]
        + _side_tensors(model)
    )


def weight_bytes_per_token(model) -> int:
    """Bytes of model tensors read from memory to decode one token (batch 1).

    Counted: every parameter and buffer once (quantized weights with their scales and zero points, float layers,
    norms, ``lm_head``, rotary tables) plus bitsandbytes' state tensors, i.e. what ``tensor_bytes`` counts, except
    the input embedding table when it is not shared with the output layer: decoding gathers one row of it, which is
    counted instead (a tied table is read whole by ``lm_head``).  Not counted: the KV cache (about 4.8 MB for the 1B
    workload at 74 positions, 0.2% of its bf16 weights) and activations.
    """
    from benchmarks.memory import tensor_bytes

    total = tensor_bytes(_all_tensors(model))
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    weight = getattr(emb, "weight", None)
    if weight is None:
        return total
    out_weight = getattr(out, "weight", None)
    tied = out_weight is not None and out_weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    if not tied:
        total -= tensor_bytes([weight])
        total += weight[0].numel() * weight.element_size()
    return total


def memory_bandwidth(size_mib: int = 1024, repeats: int = 5) -> dict:
    """Memory bandwidth of this process with torch's default thread count, in GB/s (10**9 bytes per second).

    ``read``: ``x.sum()`` over a float32 tensor of ``size_mib`` MiB (far larger than the caches), bytes of ``x``
    divided by the time; ``copy``: ``y.copy_(x)``, counting the bytes read plus written (2 x size).  The best of
    ``repeats`` timings after one untimed pass.  Decoding streams the weights, so ``read`` is the bound's numerator.
    """
    import torch

    n = size_mib * MIB // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    nbytes = x.numel() * 4

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    read = nbytes / best(lambda: x.sum().item()) / GB
    copy = 2 * nbytes / best(lambda: y.copy_(x)) / GB
    return {
        "read_gbs": read,
        "copy_gbs": copy,
        "size_mib": size_mib,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
    }


def _prefill_ids(tokenizer, n: int):
    from hfquant.evaluation import reference_text

    ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][:, :n]
    if ids.shape[1] < n:
        raise RuntimeError(f"The reference text gives {ids.shape[1]} tokens, need {n} for prefill")
    return ids


def _prefill_ms(model, ids, repeats: int) -> float:
    import torch

    times = []
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, logits_to_keep=1)  # untimed warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _save_size(model, target: Path, keep: bool) -> tuple[int | None, str | None]:
    from benchmarks.memory import dir_size_bytes

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_serializable():
        return None, f"n/a ({type(quantizer).__name__} cannot save)"
    if target.exists():
        shutil.rmtree(target)
    try:
        model.save_pretrained(target)
        return dir_size_bytes(target), None
    finally:
        if not keep:
            shutil.rmtree(target, ignore_errors=True)


# ----------------------------------------------------------------------------- worker (child process)


def _measure(args, result: dict, save_result) -> None:
    """Fill ``result`` step by step, calling ``save_result()`` after each, so that a failure or a timeout keeps
    the numbers measured before it.  Decode comes before prefill: it is the headline number, and a slow peer's
    512-token prefill passes are the likeliest to run out of time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.memory import import_model_code, peak_rss_mib, reset_peak_rss, rss_mib, tensor_bytes
    from hfquant.evaluation import decode_tokens_per_second, perplexity, reference_text

    sizes = QUICK if args.quick else FULL
    kwargs = load_kwargs(args.method, args.variant)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prefill_ids = _prefill_ids(tokenizer, sizes["prefill_tokens"])
    import_model_code(args.model)  # module imports are not the load's time or memory

    gc.collect()
    reset_ok = reset_peak_rss()
    rss_before = rss_mib()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    result["load_s"] = time.perf_counter() - t0
    source_bytes = sum(p.stat().st_size for p in Path(args.model).glob("*.safetensors"))
    result["load_gbs"] = source_bytes / result["load_s"] / 1e9
    peak = peak_rss_mib()
    result["peak_rss_growth_mib"] = None if peak is None or rss_before is None else peak - rss_before
    result["peak_reset_ok"] = reset_ok
    result["tensor_bytes"] = tensor_bytes(_all_tensors(model))
    result["weight_read_bytes"] = weight_bytes_per_token(model)
    model.eval()
    errors: dict[str, str] = {}
    result["step_errors"] = errors
    n_decode = sizes["decode_tokens"]
    result["decode_tokens"] = n_decode
    save_result()

    def step(name, fn):
        print(f"step {name} ...", flush=True)
        try:
            fn()
        except Exception as exc:  # keep measuring the other steps; the row shows the error
            traceback.print_exc()
            errors[name] = f"{type(exc).__name__}: {exc}"
        save_result()

    if args.variant == "compile":
        use_compiled_decode(model)

        def compiled_decode():
            t0 = time.perf_counter()
            decode_tokens_per_second(model, tokenizer, DECODE_PROMPT, new_tokens=n_decode, repeats=1, warmup=False)
            result["compile_s"] = time.perf_counter() - t0
            result["decode_tok_s"] = decode_tokens_per_second(
                model, tokenizer, DECODE_PROMPT, new_tokens=n_decode, repeats=sizes["decode_repeats"], warmup=False
            )

        step("decode", compiled_decode)
        return

    def decode():
        result["decode_tok_s"] = decode_tokens_per_second(
            model, tokenizer, DECODE_PROMPT, new_tokens=n_decode, repeats=sizes["decode_repeats"]
        )

    def prefill():
        result["prefill_tokens"] = prefill_ids.shape[1]
        result["prefill_ms"] = _prefill_ms(model, prefill_ids, sizes["prefill_repeats"])

    def ppl():
        result["perplexity"] = perplexity(model, tokenizer, reference_text(), max_tokens=sizes["ppl_tokens"])

    def files():
        target = Path(args.out) / "saved" / f"{args.workload}-{args.method}"
        result["files_bytes"], result["files_note"] = _save_size(model, target, args.keep_saved)

    def quantize_speed():
        result["quantize_gbs"] = quantize_gb_per_s(args.method, Path(args.model), repeats=sizes["decode_repeats"])

    step("decode", decode)
    step("prefill", prefill)
    step("quantize", quantize_speed)
    if args.workload not in RANDOM_WORKLOADS:
        step("perplexity", ppl)
    step("save", files)


def _run_worker(args) -> int:
    result: dict = {}
    path = Path(args.result)

    def save_result():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, path)  # a timeout kill never leaves a half-written file

    rc = 0
    try:
        _measure(args, result, save_result)
    except BaseException as exc:  # report everything, including KeyboardInterrupt / SystemExit
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
        rc = 1
    save_result()
    return rc


# ----------------------------------------------------------------------------- driver (parent process)


def _row(method: str, variant: str, **values) -> dict:
    row = dict.fromkeys(ROW_KEYS)
    row.update(method=method, variant=variant, **values)
    return row


def _spawn(method: str, variant: str, workload: str, model: Path, args) -> dict:
    """Run one measurement in a fresh interpreter; always returns a row (status ok / error)."""
    out = Path(args.out)
    name = f"{workload}-{method}" + ("-compile" if variant == "compile" else "")
    result_file = out / "results" / f"{name}.json"
    log = out / "logs" / f"{name}.log"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.benchmark",
        "--_worker",
        variant,
        "--_method",
        method,
        "--_workload",
        workload,
        "--_result",
        str(result_file),
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    if args.quick:
        cmd.append("--quick")
    if args.keep_saved:
        cmd.append("--keep-saved")
    env = worker_env()
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        # Own process group, so that a timeout also ends what the worker started (e.g. inductor compile workers).
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:  # timed out, or this process is being interrupted
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    data: dict = {}
    if result_file.is_file():
        try:
            data = json.loads(result_file.read_text())
        except ValueError as exc:
            data = {"error": f"unreadable result file {result_file}: {exc}"}
    if rc is None:
        data.setdefault("error", f"timed out after {args.timeout:g} s (the numbers shown were measured before)")
    elif rc != 0 and "error" not in data:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        data["error"] = f"worker exited with status {rc}: {tail[0]}"
    data.pop("peak_reset_ok", None)
    status = "error" if data.get("error") else "ok"
    row = _row(method, variant, status=status, wall_s=time.perf_counter() - t0, log=str(log))
    row.update({k: v for k, v in data.items() if k in ROW_KEYS})
    return row


def _llama_cpp_row(method: str, workload: str, model: Path, args, sizes: dict) -> dict:
    """The row of a `llamacpp-*` method (`benchmarks/llama_cpp.py`): "missing" without its venv's Python."""
    from benchmarks import llama_cpp

    python = Path(args.llama_python) if args.llama_python else llama_cpp.default_python()
    label = f"[{workload}] {method}"
    if not python.exists():
        print(f"{label}: no llama-cpp-python at {python}", flush=True)
        return _row(
            method,
            "eager",
            status="missing",
            error=f"llama-cpp-python ({python} not found: `python scripts/engines.py --engines llama.cpp` "
            "installs it, or pass --llama-python)",
        )
    print(f"{label} ...", end=" ", flush=True)
    t0 = time.perf_counter()
    values = llama_cpp.measure(method, model, Path(args.out), python, sizes, quantization_config, args.timeout)
    row = _row(method, "eager", status="error" if values.get("error") else "ok", wall_s=time.perf_counter() - t0)
    row.update({k: v for k, v in values.items() if k in ROW_KEYS})
    print(f"{row['status']} in {row['wall_s']:.1f} s" + (f": {row['error']}" if row["error"] else ""), flush=True)
    return row


def _add_bound(row: dict, read_gbs: float | None) -> None:
    if read_gbs and row.get("weight_read_bytes"):
        row["bound_tok_s"] = read_gbs * GB / row["weight_read_bytes"]
        if row.get("decode_tok_s"):
            row["bound_pct"] = 100 * row["decode_tok_s"] / row["bound_tok_s"]


def _warm_page_cache(model: Path) -> None:
    """Read the checkpoint files once so that every method loads from the page cache, the first one too."""
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 * MIB):
                pass


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _fmt(value, base=None, digits: int = 1, scale: float = 1.0) -> str:
    if value is None:
        return ""
    s = f"{value / scale:.{digits}f}"
    if base:
        s += f" ({value / base:.2f}x)"
    return s


# (header, key, digits, divisor for display, ratio against bf16)
COLUMNS = (
    ("load s", "load_s", 2, 1, True),
    ("load GB/s", "load_gbs", 2, 1, False),
    ("quantize GB/s", "quantize_gbs", 2, 1, False),
    ("peak RSS growth MiB", "peak_rss_growth_mib", 0, 1, True),
    ("tensors MiB", "tensor_bytes", 0, MIB, True),
    ("files MiB", "files_bytes", 0, MIB, True),
    ("prefill ms", "prefill_ms", 0, 1, True),
    ("decode tok/s", "decode_tok_s", 2, 1, True),
    ("bound tok/s", "bound_tok_s", 1, 1, False),
    ("% of bound", "bound_pct", 0, 1, False),
    ("perplexity", "perplexity", 3, 1, True),
)

_STEP_OF = {
    "prefill_ms": "prefill",
    "decode_tok_s": "decode",
    "perplexity": "perplexity",
    "files_bytes": "save",
    "quantize_gbs": "quantize",
}
"""Column key -> the worker step that measures it (a failed step shows its error in that cell)."""

# Cells shown in '+compile' rows; the others repeat the eager row's load measurements.
COMPILE_KEYS = ("decode_tok_s", "bound_tok_s", "bound_pct")


def render_table(rows: list[dict]) -> str:
    """Markdown table of one workload's rows; ratios (in parentheses) against its eager bf16 row."""
    base = next((r for r in rows if r["method"] == "bf16" and r["variant"] == "eager" and r["status"] == "ok"), None)
    lines = [
        "| method | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for r in rows:
        name = r["method"] + (" +compile" if r["variant"] == "compile" else "")
        if r["status"] == "missing":
            cells = [f"not installed: {_cell(r['error'])}"] + [""] * (len(COLUMNS) - 1)
        elif r["status"] == "error" and r.get("load_s") is None:
            cells = [f"**error:** {_cell(r['error'])[:300]}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells = []
            for _, key, digits, scale, ratio in COLUMNS:
                b = base.get(key) if ratio and base is not None and r is not base else None
                if r["variant"] == "compile" and key not in COMPILE_KEYS:
                    cells.append("")  # measured as in the eager row (kept in the JSON)
                elif key == "files_bytes" and r.get("files_note"):
                    cells.append(_cell(r["files_note"]))
                elif r.get("step_errors") and key in _STEP_OF:
                    step = _STEP_OF[key]
                    err = r["step_errors"].get(step)
                    cells.append(f"**error:** {_cell(err)[:120]}" if err else _fmt(r.get(key), b, digits, scale))
                else:
                    cells.append(_fmt(r.get(key), b, digits, scale))
            if r["status"] == "error":
                cells[-1] = (cells[-1] + f" **error:** {_cell(r['error'])[:200]}").strip()
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _get(rows: list[dict], method: str, variant: str = "eager") -> dict | None:
    return next(
        (r for r in rows if r["method"] == method and r["variant"] == variant and r["status"] != "missing"), None
    )


LLAMA_CPP_PEERS = {
    8: (("hfquant-int8", "llamacpp-q8_0"),),
    4: (
        ("hfquant-int4-rtn", "llamacpp-q4_1"),
        ("hfquant-int4", "llamacpp-int4"),
        ("hfquant-4bit", "llamacpp-4bit"),
        ("hfquant-int4-sym", "llamacpp-q4_0"),
        ("hfquant-int4-a8", "llamacpp-int4"),
        ("hfquant-int4-sym-a8", "llamacpp-q4_0"),
    ),
}
"""bits -> (hfquant method, the llama.cpp method running its weights): issue #13 asks hfquant >= 1.2x llama.cpp."""


def check_targets(rows: list[dict], speed: bool = True) -> list[dict]:
    """The issue's targets for hfquant, evaluated on one workload's rows (skipped where a number is missing).

    With `speed` (the 1B workload, which the speed targets are set for): decode int8 >= 2.0x bf16, int4 >= 3.0x bf16,
    both >= 1.2x torchao at the same bits and >= 1.2x llama.cpp on the same weights (`LLAMA_CPP_PEERS`); prefill
    <= 1.2x bf16; quantization >= 1.5 GB/s for RTN, >= 0.25 GB/s for
    SINQ (the 4-bit default); hfquant-int4 decode within 5% of hfquant-int4-rtn (the load: `load_targets`). Without
    `speed` (the small model): the compiled fast path ('+compile' rows) of each int4 method >= 0.8x llama.cpp on the
    same weights. On every workload: peak RSS growth <= 1.05 x tensor bytes + 64 MiB.
    """
    checks = []

    def add(name, value, limit, ok):
        checks.append({"target": name, "value": value, "limit": limit, "met": ok})

    bf16 = _get(rows, "bf16") if speed else None  # the speed ratios need it; without `speed` none is computed
    for bits, want in ((8, 2.0), (4, 3.0)):
        ours = _get(rows, f"hfquant-int{bits}")
        if ours is None:
            continue
        peer = _get(rows, f"torchao-int{bits}") if speed else None
        if bf16 and ours.get("decode_tok_s") and bf16.get("decode_tok_s"):
            x = ours["decode_tok_s"] / bf16["decode_tok_s"]
            add(f"hfquant-int{bits} decode >= {want}x bf16", x, want, x >= want)
        if peer and ours.get("decode_tok_s") and peer.get("decode_tok_s"):
            x = ours["decode_tok_s"] / peer["decode_tok_s"]
            add(f"hfquant-int{bits} decode >= 1.2x torchao-int{bits}", x, 1.2, x >= 1.2)
        if bf16 and ours.get("prefill_ms") and bf16.get("prefill_ms"):
            x = ours["prefill_ms"] / bf16["prefill_ms"]
            add(f"hfquant-int{bits} prefill time <= 1.2x bf16", x, 1.2, x <= 1.2)
        if speed and ours.get("quantize_gbs"):
            gbs, method = ours["quantize_gbs"], quantization_config(f"hfquant-int{bits}").method
            floor = 1.5 if method == "rtn" else 0.25
            add(f"hfquant-int{bits} {method.upper()} quantization >= {floor} GB/s", gbs, floor, gbs >= floor)
        rtn = _get(rows, "hfquant-int4-rtn") if bits == 4 and speed else None
        if rtn and ours.get("decode_tok_s") and rtn.get("decode_tok_s"):
            x = ours["decode_tok_s"] / rtn["decode_tok_s"]
            add("hfquant-int4 decode >= 0.95x hfquant-int4-rtn", x, 0.95, x >= 0.95)
        if ours.get("peak_rss_growth_mib") is not None and ours.get("tensor_bytes"):
            limit = 1.05 * ours["tensor_bytes"] / MIB + 64
            add(
                f"hfquant-int{bits} peak RSS growth <= 1.05 x tensors + 64 MiB (MiB)",
                ours["peak_rss_growth_mib"],
                limit,
                ours["peak_rss_growth_mib"] <= limit,
            )
    # against llama.cpp on the same weights: eager rows at 1.2x on the 1B workload, the compiled fast path of the
    # int4 methods at 0.8x on the small model
    pairs = [pair for pairs in LLAMA_CPP_PEERS.values() for pair in pairs] if speed else LLAMA_CPP_PEERS[4]
    variant, label, want = ("eager", "", 1.2) if speed else ("compile", " +compile", 0.8)
    for twin, peer_name in pairs:
        mine, theirs = _get(rows, twin, variant), _get(rows, peer_name)
        if mine and theirs and mine.get("decode_tok_s") and theirs.get("decode_tok_s"):
            x = mine["decode_tok_s"] / theirs["decode_tok_s"]
            add(f"{twin}{label} decode >= {want}x {peer_name} (same weights)", x, want, x >= want)
    return checks


def load_targets(rows: list[dict]) -> list[dict]:
    """Whole `from_pretrained` >= 1.0 GB/s of source bytes for the RTN methods (hfquant-int8, hfquant-int4-rtn) and,
    issue #32, the 4-bit default (hfquant-4bit) and the int format's (hfquant-int4), on the random workloads (1.2B and
    the 8B shape)."""
    checks = []
    for method in ("hfquant-int8", "hfquant-int4-rtn", "hfquant-int4", "hfquant-4bit"):
        row = _get(rows, method)
        if row and row.get("load_gbs"):
            checks.append(
                {
                    "target": f"{method} whole load >= 1.0 GB/s of source (from_pretrained)",
                    "value": row["load_gbs"],
                    "limit": 1.0,
                    "met": row["load_gbs"] >= 1.0,
                }
            )
    return checks


def _parse_methods(text: str, parser) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        parser.error(f"--methods: unknown {', '.join(bad) or '(empty)'}; choose from {','.join(METHODS)}")
    return methods


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/benchmark.py",
        description="Benchmark hfquant int8/int4 against bf16 and peer libraries (torchao, optimum-quanto, "
        "bitsandbytes) on CPU: load time, peak RSS, sizes, prefill, decode speed and its memory-bandwidth "
        "bound, perplexity.  Each method runs in its own process.",
    )
    p.add_argument(
        "--workload",
        choices=("real", "1b", "8b", "both"),
        default="both",
        help="real: SmolLM2-135M (accuracy and speed); 1b: random-weight 1.2B Llama (speed, memory); 8b: random "
        "weights in Llama-3-8B's shape (14.8 GB, for the load GB/s); default both (real and 1b)",
    )
    p.add_argument("--model", default=None, help="benchmark this local checkpoint folder instead of the workloads")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument(
        "--compile", action="store_true", help="add '+compile' rows: static-cache decode under torch.compile"
    )
    p.add_argument("--out", default="out/benchmark", help="folder for logs, per-row results and the table")
    p.add_argument("--json", default=None, help="write the results here (default: <out>/benchmark.json)")
    p.add_argument(
        "--quick", action="store_true", help="few tokens and one repetition (for tests; numbers are not meaningful)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per method process (default 900)")
    p.add_argument("--keep-saved", action="store_true", help="keep the save_pretrained folders under <out>/saved")
    p.add_argument(
        "--llama-python",
        help="Python of a venv with llama-cpp-python, for the llamacpp-* rows (default: "
        "the one `scripts/engines.py --engines llama.cpp` installs)",
    )
    p.add_argument(
        "--paired-rounds",
        type=int,
        default=0,
        metavar="N",
        help="also measure each llama.cpp method against its twin hfquant method (eager, and +compile "
        "with --compile) in N rounds of back-to-back decodes, each engine loaded once in its own "
        "process (benchmarks/paired.py; the other 4-bit groups also run Q4_0); default 0: off",
    )
    p.add_argument(
        "--paired-pause",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep before each paired measurement (default 0: back to back; 5 on AMX CPUs, where a llama.cpp "
        "decode slows the next one: docs/performance.md)",
    )
    p.add_argument("--_worker", dest="worker", choices=("eager", "compile"), help=argparse.SUPPRESS)
    p.add_argument("--_method", dest="method", help=argparse.SUPPRESS)
    p.add_argument("--_workload", dest="workload_name", help=argparse.SUPPRESS)
    p.add_argument("--_result", dest="result", help=argparse.SUPPRESS)
    return p


def _workloads(args) -> dict[str, Path]:
    if args.model is not None:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {path} is not a checkpoint folder (no config.json)")
        return {"model": path}
    names = WORKLOADS if args.workload == "both" else (args.workload,)
    paths = {}
    for name in names:
        print(f"Preparing the {name} workload checkpoint...", flush=True)
        if name == "real":
            from benchmarks.example_model import build_example_model

            paths[name] = build_example_model()
        else:
            from benchmarks.random_model import SHAPES, build_random_llama

            paths[name] = build_random_llama(**SHAPES[name])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scripts/benchmark.py`` and ``python -m benchmarks.benchmark``; 0 when no method failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        args.variant, args.workload = args.worker, args.workload_name
        return _run_worker(args)
    methods = _parse_methods(args.methods, parser)
    if args.paired_rounds < 0:
        parser.error(f"--paired-rounds must be >= 0, got {args.paired_rounds}")
    if not args.paired_pause >= 0:
        parser.error(f"--paired-pause must be >= 0 seconds, got {args.paired_pause}")

    import torch
    import transformers

    try:
        workloads = _workloads(args)
    except (ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = Path(args.out).resolve()
    for sub in ("logs", "results"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    sizes = QUICK if args.quick else FULL

    from benchmarks.machine import cpu_name, describe, isa_flags

    meta = {
        "cpu": cpu_name(),
        "isa": isa_flags(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "loadavg_start": _loadavg(),
        "sizes": sizes,
        "peers": {m: _version(m) for m in ("torchao", "optimum.quanto", "bitsandbytes")},
    }
    print(describe(), flush=True)
    print(
        f"python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['threads']} threads, {meta['cpus']} CPUs, load average {meta['loadavg_start']}",
        flush=True,
    )
    bandwidth: list[dict] = []

    def measure_bandwidth(when: str) -> None:
        bandwidth.append(dict(memory_bandwidth(sizes["bandwidth_mib"], sizes["bandwidth_repeats"]), when=when))
        print(
            f"memory bandwidth ({when}): read {bandwidth[-1]['read_gbs']:.1f} GB/s, "
            f"copy {bandwidth[-1]['copy_gbs']:.1f} GB/s",
            flush=True,
        )

    results: dict[str, dict] = {}
    for workload, model in workloads.items():
        measure_bandwidth(f"before {workload}")
        _warm_page_cache(model)
        rows = []
        results[workload] = {"model": str(model), "rows": rows}
        for method in methods:
            variants = ("eager", "compile") if args.compile else ("eager",)
            requires = METHODS[method][0]
            if requires == "llama.cpp":
                rows.append(_llama_cpp_row(method, workload, model, args, sizes))
                continue
            for variant in variants:
                label = f"[{workload}] {method}" + (" +compile" if variant == "compile" else "")
                if requires is not None and not _installed(requires):
                    rows.append(_row(method, variant, status="missing", error=f"{requires} ({PIP_HINT})"))
                    print(f"{label}: {requires} not installed", flush=True)
                    continue
                print(f"{label} ...", end=" ", flush=True)
                row = _spawn(method, variant, workload, model, args)
                rows.append(row)
                print(
                    f"{row['status']} in {row['wall_s']:.1f} s" + (f": {row['error']}" if row["error"] else ""),
                    flush=True,
                )
        if args.paired_rounds:
            from benchmarks import paired

            def probe() -> float:
                return memory_bandwidth(sizes["bandwidth_mib"], 2)["read_gbs"]

            results[workload]["paired"] = paired.for_workload(model, methods, args, sizes, quantization_config, probe)

    measure_bandwidth("end")
    read_gbs = max(b["read_gbs"] for b in bandwidth)
    meta["loadavg_end"] = _loadavg()
    report = [
        describe() + f"; python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers']}.",
        f"Memory bandwidth (float32 sum / copy of {sizes['bandwidth_mib']} MiB, best of "
        f"{sizes['bandwidth_repeats']}, {meta['threads']} threads), read: "
        + ", ".join(f"{b['read_gbs']:.1f} ({b['when']})" for b in bandwidth)
        + f" GB/s, the bound uses the highest, {read_gbs:.1f}; copy (read + written bytes): "
        + ", ".join(f"{b['copy_gbs']:.1f}" for b in bandwidth)
        + " GB/s.",
        f"Load average (1/5/15 min): {meta['loadavg_start']} at the start, {meta['loadavg_end']} at the end, "
        f"{meta['cpus']} CPUs.",
    ]
    for workload, entry in results.items():
        for row in entry["rows"]:
            _add_bound(row, read_gbs)
        entry["targets"] = check_targets(entry["rows"], speed=workload == "1b")
        entry["targets"] += load_targets(entry["rows"]) if workload in RANDOM_WORKLOADS else []
        report += ["", f"### {workload}: {entry['model']}", "", render_table(entry["rows"])]
        if entry.get("paired"):
            from benchmarks import paired

            entry["targets"] += paired.paired_targets(entry["paired"], speed=workload == "1b")
            report += [
                "",
                f"Paired decode rounds ({args.paired_rounds} per group; every engine loaded once, one decode "
                f"each per round, {f'{args.paired_pause:g} s apart' if args.paired_pause else 'back to back'}, "
                "order changing; ratio per round, then the median):",
                "",
                paired.render(entry["paired"]),
            ]
        for row in entry["rows"]:
            for step, err in (row.get("step_errors") or {}).items():
                report.append(f"- {row['method']} ({row['variant']}) {step} failed: {_cell(err)[:400]}")
            if row.get("compile_s") is not None:
                report.append(f"- {row['method']} +compile: compile and first run {row['compile_s']:.0f} s")
        if entry["targets"]:
            report.append("")
            report += [
                f"- target {t['target']}: {t['value']:.2f} (limit {t['limit']:.2f}) "
                f"{'met' if t['met'] else '**not met**'}"
                for t in entry["targets"]
            ]
    report += ["", _notes(sizes)]
    text = "\n".join(report)
    print("\n" + text)
    (out / "benchmark.md").write_text(text + "\n")
    json_path = Path(args.json) if args.json else out / "benchmark.json"
    payload = {"meta": meta, "bandwidth": bandwidth, "bound_read_gbs": read_gbs, "workloads": results}
    json_path.write_text(json.dumps(payload, indent=2))
    print(f"\nWrote {json_path} and {out / 'benchmark.md'}; logs in {out / 'logs'}")
    failed = [r for e in results.values() for r in e["rows"] if r["status"] == "error"]
    return 1 if failed else 0


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    dist = {"optimum.quanto": "optimum-quanto"}.get(module, module)
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _notes(sizes: dict) -> str:
    return (
        f"Ratios in parentheses: against bf16 (eager) of the same workload and run. Prefill: {sizes['prefill_tokens']} "
        f"tokens, batch 1, median of {sizes['prefill_repeats']}. Decode: batch 1, {sizes['decode_tokens']} greedy "
        f"tokens, best of {sizes['decode_repeats']}, prefill excluded. Bound: read bandwidth / bytes read per "
        "token (all parameters, buffers and quantization state except the unshared input embedding table, of which "
        "one row; KV cache not counted). Peak RSS growth: VmHWM - RSS before from_pretrained; bf16 weights stay "
        "memory-mapped, so it can be below their size. Files: save_pretrained *.safetensors. +compile: eager "
        "attention, static cache, generate's compiled decode (CompileConfig(fullgraph=True)). Quantize GB/s: bf16 bytes of the first "
        f"{QUANTIZE_SAMPLE_LAYERS} decoder layers' weights quantized per second by the method's own quantization call "
        f"(hfquant: RTN and int4 packing; torchao: quantize_ on an nn.Linear), reading excluded, best of "
        f"{sizes['decode_repeats']} passes."
    )


if __name__ == "__main__":
    sys.exit(main())
