"""llama.cpp as a peer row of the benchmark, on hfquant's own weights (issue #13 item 4).

Each `llamacpp-*` method runs the weights of one hfquant method (`TWINS`): the benchmark's checkpoint is quantized
file to file by `hfquant.conversion.convert.convert` with that method's `HfQuantConfig`, exported with
`hfquant.export_checkpoint(..., format="gguf")` (int8 -> Q8_0, int4 symmetric -> Q4_0, int4 asymmetric -> Q4_1, float
tensors F16/BF16), and run by llama-cpp-python in its own virtual environment (`--llama-python`; `python
scripts/engines.py --engines llama.cpp` builds and installs it). Both are cached under `<out>/gguf/`.

The worker, in that environment, measures what the hfquant rows measure: load seconds, decode tokens/s (batch 1,
`decode_tokens` greedy tokens after the first, best of `decode_repeats`; `generate(temp=0)` from the benchmark's
prompt), prefill milliseconds (`eval` of `prefill_tokens` ids after a reset, median of `prefill_repeats`) and peak
RSS growth (VmHWM - VmRSS before loading; llama.cpp memory-maps the file, so touched weight pages count, as the bf16
rows' do). Bytes read per token: every tensor of the file but the token embedding, which is read whole only when it
is also the output layer (no `output.weight`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from benchmarks.methods import BLOCK_TWINS
from hfquant.ops.machine import isa_flags

__all__ = [
    "TWINS",
    "FASTEST_4BIT",
    "FOUR_BIT",
    "WORKER",
    "SERVER",
    "default_python",
    "gguf_read_bytes",
    "prepare",
    "measure",
    "engine_args",
    "engine_env",
    "crash_hint",
]

TWINS = {
    "llamacpp-q8_0": "hfquant-int8",
    "llamacpp-q4_0": "hfquant-int4-sym",
    "llamacpp-q4_1": "hfquant-int4-rtn",
    "llamacpp-int4": "hfquant-int4",
    "llamacpp-4bit": "hfquant-4bit",
    **BLOCK_TWINS,
}
"""llama.cpp method -> the hfquant method whose weights it runs (the int format's 4-bit default becomes Q4_1 plus Q8_0
layers; a block format's blocks are copied, the 4-bit default's int8 lm_head becomes Q8_0)."""

FASTEST_4BIT = "llamacpp-q4_0"
"""llama.cpp's fastest 4-bit type, which a user comparing engines runs (issue #32): the paired rounds of every other
4-bit group (`FOUR_BIT`) also decode it, so each hfquant 4-bit method is measured beside it as well as beside the
GGUF of its own weights."""

FOUR_BIT = ("llamacpp-q4_1", "llamacpp-int4", "llamacpp-4bit")
"""The llama.cpp methods, other than `FASTEST_4BIT`, whose twins are hfquant's int4 methods."""

_LOAD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
result = {}
try:
    import llama_cpp
    result["version"] = llama_cpp.__version__
    before = status("VmRSS")
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args["model"], n_ctx=args["prefill_tokens"] + args["decode_tokens"] + 64,
                          n_batch=512, n_threads=args["threads"], n_threads_batch=args["threads"], seed=0,
                          verbose=False)
    result["load_s"] = time.perf_counter() - start
    prompt = llm.tokenize(args["prompt"].encode(), add_bos=True)
    def decode(n):
        llm.reset()
        times = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == n + 1:
                break
        return n / (times[-1] - times[0])
    decode(8)  # warm-up
"""
"""The start of both llama.cpp scripts: load the GGUF file, tokenize the prompt, `decode(n)` -> tokens/s, warm up."""

WORKER = (
    _LOAD
    + r"""
    result["decode_tok_s"] = max(decode(args["decode_tokens"]) for _ in range(args["decode_repeats"]))
    ids = [1000 + i % 20000 for i in range(args["prefill_tokens"])]
    times = []
    for _ in range(args["prefill_repeats"]):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        times.append(time.perf_counter() - start)
    result["prefill_ms"] = 1000 * sorted(times)[len(times) // 2]
    result["peak_rss_growth_mib"] = status("VmHWM") - before
except BaseException as error:
    import traceback
    traceback.print_exc()
    result["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
print("LLAMA_RESULT " + json.dumps(result), flush=True)
"""
)
"""The row's script: decode (best of `decode_repeats`), prefill, peak RSS; prints one `LLAMA_RESULT <json>` line."""

SERVER = (
    _LOAD
    + r"""
    print("READY", flush=True)
    for line in sys.stdin:
        print("TOK_S " + repr(decode(args["decode_tokens"])), flush=True)
except BaseException as error:
    print("ERROR " + f"{type(error).__name__}: {error}".replace("\n", " ")[:300], flush=True)
    raise
"""
)
"""`benchmarks.paired`'s llama.cpp worker: after loading, one `TOK_S <float>` line (one decode of `decode_tokens`)
per line read from stdin."""


def default_python() -> Path:
    """The Python of the venv `scripts/engines.py` installs llama-cpp-python into."""
    return Path.home() / ".cache" / "hfquant" / "engines" / "llama.cpp" / ".venv-llama" / "bin" / "python"


def gguf_read_bytes(path: str | os.PathLike) -> int:
    """Bytes a decode step reads from the GGUF file `path`: all tensors but `token_embd.weight` (one row is looked
    up), which is counted when there is no `output.weight` (then it is the output layer too)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    embedding = tensors.pop("token_embd.weight", 0)
    return sum(tensors.values()) + (embedding if "output.weight" not in tensors else 0)


def prepare(method: str, model: Path, out: Path, quantization_config) -> Path:
    """The GGUF file of `method`'s twin weights for the checkpoint `model`, made once under `out/gguf/`.

    Args:
        quantization_config: the benchmark's `quantization_config` function (method -> HfQuantConfig).
    """
    import hfquant
    from hfquant.conversion.convert import convert

    twin = TWINS[method]
    folder = out / "gguf" / f"{model.name}-{twin}"
    target = folder.with_suffix(".gguf")
    if not target.exists():
        if not (folder / "config.json").exists():
            convert(model, folder, quantization_config(twin), progress=False, overwrite=True)
        hfquant.export_checkpoint(folder, target, format="gguf", overwrite=True)
    return target


def engine_args(path: Path, sizes: dict) -> dict:
    """The JSON argument of `WORKER` and `SERVER` for the GGUF file `path` and the benchmark's `sizes`: the prompt,
    all CPUs as threads, token counts and repeats."""
    from benchmarks.methods import DECODE_PROMPT

    return {
        "model": str(path),
        "prompt": DECODE_PROMPT,
        "threads": os.cpu_count() or 1,
        "decode_tokens": sizes["decode_tokens"],
        "decode_repeats": sizes["decode_repeats"],
        "prefill_tokens": sizes["prefill_tokens"],
        "prefill_repeats": sizes["prefill_repeats"],
    }


def engine_env() -> dict:
    """The environment of a llama.cpp worker: this one's without PYTHONPATH (its venv has its own packages)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def crash_hint(status: int | None) -> str:
    """What to add to the error of a llama.cpp worker that exited with `status`: on a CPU with AMX, for a segmentation
    fault, how to build llama.cpp without it (its native build's AMX matrix product crashed at every prompt of more
    than one token on an Intel Xeon: llama.cpp issue 20824, docs/performance.md, twenty-fifth session); else ""."""
    if status != -signal.SIGSEGV or "amx_int8" not in isa_flags():
        return ""
    return (
        "; on this AMX CPU llama.cpp's native build crashes in prompt evaluation (llama.cpp issue 20824): build its "
        "wheel without AMX as scripts/engines.py's docstring says"
    )


def measure(
    method: str, model: Path, out: Path, python: Path, sizes: dict, quantization_config, timeout: float
) -> dict:
    """One llama.cpp row's values (`ROW_KEYS` of the benchmark), or {"error": ...}; never raises for a failed run."""
    try:
        path = prepare(method, model, out, quantization_config)
    except Exception as error:  # the row says why; the other rows still run
        return {"error": f"GGUF export of {TWINS[method]} failed: {type(error).__name__}: {error}"}
    args = engine_args(path, sizes)
    env = engine_env()
    log = out / "logs" / f"{model.name}-{method}.log"
    try:
        done = subprocess.run(
            [str(python), "-c", WORKER, json.dumps(args)], capture_output=True, text=True, env=env, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    result = next(
        (
            json.loads(line.removeprefix("LLAMA_RESULT "))
            for line in reversed(done.stdout.splitlines())
            if line.startswith("LLAMA_RESULT ")
        ),
        None,
    )
    if result is None:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
        hint = crash_hint(done.returncode)
        return {"error": f"llama.cpp worker exited {done.returncode}: {tail[0][:200]} (see {log}){hint}"}
    result.pop("version", None)
    result.update(
        files_bytes=path.stat().st_size,
        weight_read_bytes=gguf_read_bytes(path),
        decode_tokens=sizes["decode_tokens"],
        prefill_tokens=sizes["prefill_tokens"],
        log=str(log),
    )
    return result
