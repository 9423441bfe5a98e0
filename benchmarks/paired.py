"""Paired decode rounds: hfquant and llama.cpp on the same weights, measured in turns under the same machine state.

Why: on the machines this benchmark runs on, the memory read speed moves between about 32 and 64 GB/s within one run
(the float32 read probe; docs/performance.md), and a decode step that streams a 1.2B model follows it. The benchmark's
rows each run in their own process, one after the other, so two rows measured minutes apart can differ by 25% for
reasons outside either engine, and their ratio with them. Here each engine is loaded once, in its own long-lived
process, and every round asks each process for one decode measurement, back to back, in an order that changes from
round to round (`balanced_order`): a round's ratio compares the engines under nearly the same conditions, and the
median over the rounds is the figure. The parent's memory read probe runs after every round, so the conditions are
shown too.

Worker protocol (both kinds): after loading (and, for "+compile", compiling with one untimed full-length `generate`)
the worker prints `READY`; then, for every line it reads on stdin, one line `TOK_S <float>`: one decode of
`decode_tokens` greedy tokens, batch 1, prefill excluded (the measurement of the benchmark's rows, one repeat). A
failure prints `ERROR <text>` and ends the worker.

    python scripts/benchmark.py --workload 1b --compile --methods hfquant-int8,llamacpp-q8_0 --paired-rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["Worker", "run_rounds", "pair_ratios", "render", "paired_targets", "hfquant_command", "for_workload"]


class Worker:
    """One engine in its own process (own session, so that closing it also ends what it started), spoken to by the
    protocol of the module docstring; its stderr goes to `log`. `hint(status)` adds to the error of a worker that
    exited with `status` (e.g. `llama_cpp.crash_hint`)."""

    def __init__(
        self, name: str, command: list[str], env: dict | None, log: Path, hint: Callable[[int], str] | None = None
    ):
        self.name, self.log, self.hint = name, log, hint
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                text=True,
                env=env,
                start_new_session=True,
            )
        # A thread reads the worker's stdout line by line (None at its end), so that a wait can time out.
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _reply(self, timeout: float) -> str:
        """The next protocol line (`READY`, `TOK_S ...`), skipping other output. Raises RuntimeError when the worker
        reports an error or exits, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no answer within {timeout:g} s (log: {self.log})") from None
            if line is None:
                status = self.proc.wait()
                hint = self.hint(status) if self.hint else ""
                raise RuntimeError(f"{self.name}: worker exited with status {status} (log: {self.log}){hint}")
            if line.startswith("ERROR "):
                raise RuntimeError(f"{self.name}: {line[6:].strip()} (log: {self.log})")
            if line.startswith(("READY", "TOK_S ")):
                return line.strip()

    def ready(self, timeout: float) -> None:
        """Wait until the worker has loaded (and compiled) its model."""
        self._reply(timeout)

    def decode(self, timeout: float) -> float:
        """One decode measurement, in tokens/s."""
        self.proc.stdin.write("decode\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        if not reply.startswith("TOK_S "):
            raise RuntimeError(f"{self.name}: unexpected reply {reply!r}")
        return float(reply.split()[1])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def balanced_order(count: int, round_index: int) -> list[int]:
    """The engine indices of round `round_index` (0-based) of `count` engines: a Williams design, the first row 0, 1,
    count - 1, 2, count - 2, ... and each next row that plus one (mod `count`); with an odd `count` the rows of every
    second block of `count` rounds are reversed. Over `count` rounds (2 * `count` when odd) each engine comes first
    once and follows every other engine equally often, so no engine always runs right after the same one (a plain
    rotation put hfquant's eager engine right after llama.cpp in 4 of 5 rounds, which biased it: docs/performance.md,
    thirteenth session). With two engines: alternation."""
    base = [0]
    low, high = 1, count - 1
    while low <= high:
        base.append(low)
        if low != high:
            base.append(high)
        low, high = low + 1, high - 1
    if count % 2 and (round_index // count) % 2:
        base.reverse()
    return [(b + round_index) % count for b in base]


def run_rounds(
    engines: dict[str, tuple[list[str], dict | None]],
    rounds: int,
    timeout: float,
    log_dir: Path,
    probe: Callable[[], float] | None = None,
    hints: dict[str, Callable[[int], str]] | None = None,
    pause: float = 0.0,
) -> dict:
    """Start every engine (one at a time: a compile takes every core), then `rounds` rounds in which each engine
    decodes once, in `balanced_order`.

    Args:
        engines: name -> (command, environment or None for this one's) of a worker speaking the protocol.
        rounds: number of rounds (>= 1).
        timeout: seconds allowed for a worker's start, and for each of its measurements.
        log_dir: where each worker's stderr goes (`paired-<name>.log`, spaces dropped, '+' as '-').
        probe: called after every round; its value (the memory read bandwidth, GB/s) is kept as `read_gbs`.
        hints: name -> the `Worker` hint of that engine (what to add when it exits), for those that have one.
        pause: seconds of sleep before each measurement. On an Intel Xeon with AMX a llama.cpp AMX decode slowed the
            measurement right after it by about 27% for seconds (hfquant's 1.2B default: 26.9 against 36-38 tok/s
            alone); with 5 s before each, both engines measured at their speed alone (docs/performance.md,
            twenty-fifth session). 0: back to back.

    Returns:
        {"engines": names, "rounds": [{"order": names, "tok_s": {name: tokens/s}, "read_gbs": float | None}],
        "error": None, or the first failure's message (the rounds completed before it are kept)}.

    Raises:
        ValueError: `rounds` < 1 or no engine.
    """
    if rounds < 1 or not engines:
        raise ValueError(
            f"paired rounds need rounds >= 1 and at least one engine, got rounds={rounds}, engines={list(engines)}"
        )
    names = list(engines)
    done: list[dict] = []
    workers: dict[str, Worker] = {}
    try:
        for name, (command, env) in engines.items():
            log = log_dir / ("paired-" + name.replace(" ", "").replace("+", "-") + ".log")
            workers[name] = Worker(name, command, env, log, (hints or {}).get(name))
            workers[name].ready(timeout)
        for r in range(rounds):
            order = [names[i] for i in balanced_order(len(names), r)]
            tok_s = {}
            for name in order:
                if pause > 0:
                    time.sleep(pause)
                tok_s[name] = workers[name].decode(timeout)
            done.append({"order": order, "tok_s": tok_s, "read_gbs": probe() if probe else None})
        error = None
    except (RuntimeError, TimeoutError, OSError) as exc:
        error = str(exc)
    finally:
        for worker in workers.values():
            worker.close()
    return {"engines": names, "rounds": done, "error": error}


def pair_ratios(result: dict, mine: str, theirs: str) -> dict | None:
    """Per-round ratios tok_s[mine] / tok_s[theirs] of a `run_rounds` result and their median, min and max, with
    each engine's median tokens/s; None when no round measured both."""
    rounds = [r["tok_s"] for r in result["rounds"] if mine in r["tok_s"] and theirs in r["tok_s"]]
    if not rounds:
        return None
    ratios = [r[mine] / r[theirs] for r in rounds]
    return {
        "mine": mine,
        "theirs": theirs,
        "rounds": len(rounds),
        "ratios": ratios,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "mine_tok_s": statistics.median(r[mine] for r in rounds),
        "theirs_tok_s": statistics.median(r[theirs] for r in rounds),
    }


def render(groups: list[dict]) -> str:
    """Markdown lines for the paired results of one workload (`groups`: `run_rounds` results with their "pairs")."""
    lines = [
        "| hfquant | llama.cpp | rounds | hfquant tok/s (median) | llama.cpp tok/s (median) | "
        "paired ratio median (min-max) | read GB/s after each round (min-max) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for group in groups:
        reads = [r["read_gbs"] for r in group["rounds"] if r.get("read_gbs")]
        spread = f"{min(reads):.1f}-{max(reads):.1f}" if reads else ""
        for pair in group["pairs"]:
            lines.append(
                f"| {pair['mine']} | {pair['theirs']} | {pair['rounds']} | {pair['mine_tok_s']:.2f} | "
                f"{pair['theirs_tok_s']:.2f} | {pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f}) | "
                f"{spread} |"
            )
        if group["error"]:
            notes.append(f"- paired rounds of {', '.join(group['engines'])} stopped: {group['error']}")
    return "\n".join(lines + notes)


def paired_targets(groups: list[dict], speed: bool) -> list[dict]:
    """The issues' comparisons with llama.cpp on the paired medians (`_wants` gives each pair's limits)."""
    checks = []
    for group in groups:
        for pair in group["pairs"]:
            for want, what in _wants(pair, speed):
                checks.append(
                    {
                        "target": f"{pair['mine']} decode >= {want}x {pair['theirs']} ({what}, paired "
                        f"median of {pair['rounds']} rounds)",
                        "value": pair["median"],
                        "limit": want,
                        "met": pair["median"] >= want,
                    }
                )
    return checks


def _wants(pair: dict, speed: bool) -> list[tuple[float, str]]:
    """(limit, what is compared) for one pair. Issue #13, the same weights: on the speed workload every hfquant
    engine >= 1.2x; on the small model the "+compile" engines >= 0.8x. Issue #32, the 4-bit default
    (`hfquant-4bit`): on the speed workload against llama.cpp's fastest 4-bit type (another model's weights) eager
    >= 1.0x, "+compile" >= 1.2x; on the small model against its own GGUF eager >= 0.8x, "+compile" >= 1.0x."""
    from benchmarks.llama_cpp import FASTEST_4BIT, TWINS

    method, compiled = pair["mine"].split()[0], pair["mine"].endswith("+compile")
    default = method == "hfquant-4bit"
    if pair["theirs"] == FASTEST_4BIT and method != TWINS[FASTEST_4BIT]:
        return [(1.2 if compiled else 1.0, "llama.cpp's fastest 4-bit type")] if speed and default else []
    if speed:
        return [(1.2, "same weights")]
    if default:
        return [(1.0 if compiled else 0.8, "same weights")]
    return [(0.8, "same weights")] if compiled else []


def hfquant_command(method: str, variant: str, model: Path, quick: bool, saved: Path | None = None) -> list[str]:
    """The command of an hfquant worker (this module run with `python -m`; the caller puts the repository on
    PYTHONPATH): it quantizes `model` on load with `method`'s config, or loads `saved`, an hfquant checkpoint folder
    of `method`'s weights, when given."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.paired",
        "--method",
        method,
        "--variant",
        variant,
        "--model",
        str(model),
    ]
    return command + (["--quick"] if quick else []) + (["--saved", str(saved)] if saved is not None else [])


def for_workload(
    model: Path, methods: list[str], args, sizes: dict, quantization_config, probe: Callable[[], float] | None
) -> list[dict]:
    """Paired rounds for every llama.cpp method in `methods`: each against its twin hfquant method
    (`benchmarks.llama_cpp.TWINS`) eager and, with `args.compile`, "+compile"; one `run_rounds` per llama.cpp method,
    `args.paired_rounds` rounds. The group of a 4-bit method other than Q4_0 (`llama_cpp.FOUR_BIT`) also runs
    llama.cpp's fastest 4-bit type (`llama_cpp.FASTEST_4BIT`, on the GGUF of its own twin's weights), and its hfquant
    engines are paired with both. A llama.cpp method without llama-cpp-python, or whose GGUF export fails, gives a
    group with the error and no rounds."""
    from benchmarks import llama_cpp
    from benchmarks.methods import BLOCK_TWINS, worker_env

    python = Path(args.llama_python) if args.llama_python else llama_cpp.default_python()
    hf_env = worker_env()
    groups = []
    for method in (m for m in methods if m in llama_cpp.TWINS):
        twin = llama_cpp.TWINS[method]
        theirs = [method] + ([llama_cpp.FASTEST_4BIT] if method in llama_cpp.FOUR_BIT else [])
        mine = {twin: "eager", **({f"{twin} +compile": "compile"} if args.compile else {})}  # engine -> variant
        try:
            if not python.exists():
                raise FileNotFoundError(f"no llama-cpp-python at {python}")
            ggufs = {name: llama_cpp.prepare(name, model, Path(args.out), quantization_config) for name in theirs}
        except Exception as exc:  # the group says why; the other groups still run
            groups.append(
                {"engines": [*mine, *theirs], "rounds": [], "error": f"{type(exc).__name__}: {exc}", "pairs": []}
            )
            continue
        # A block format's twin loads the folder its GGUF was exported from (the same bytes, quantized once).
        saved = ggufs[method].with_suffix("")
        saved = saved if twin in BLOCK_TWINS.values() and (saved / "config.json").exists() else None
        engines = {
            name: (hfquant_command(twin, variant, model, args.quick, saved), hf_env) for name, variant in mine.items()
        }
        for name, gguf in ggufs.items():
            server = [str(python), "-c", llama_cpp.SERVER, json.dumps(llama_cpp.engine_args(gguf, sizes))]
            engines[name] = (server, llama_cpp.engine_env())
        print(f"paired rounds: {', '.join(engines)} ...", flush=True)
        hints = dict.fromkeys(ggufs, llama_cpp.crash_hint)
        group = run_rounds(
            engines, args.paired_rounds, args.timeout, Path(args.out) / "logs", probe, hints, args.paired_pause
        )
        pairs = (pair_ratios(group, m, t) for t in theirs for m in mine)
        group["pairs"] = [pair for pair in pairs if pair is not None]
        groups.append(group)
    return groups


def _serve(argv: list[str] | None = None) -> int:
    """The hfquant worker: load `--model` with `--method`'s config as the benchmark's rows do, then serve."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.paired")
    p.add_argument("--method", required=True)
    p.add_argument("--variant", choices=("eager", "compile"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--saved", help="an hfquant checkpoint folder of the method's weights, loaded instead of --model")
    args = p.parse_args(argv)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from benchmarks.methods import DECODE_PROMPT, FULL, QUICK, load_kwargs, use_compiled_decode
        from hfquant.evaluation import decode_tokens_per_second

        tokens = (QUICK if args.quick else FULL)["decode_tokens"]
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        kwargs = load_kwargs(args.method, args.variant)
        if args.saved:  # its config.json names the quantization; hfquant's import registers it with transformers
            import hfquant  # noqa: F401

            kwargs.pop("quantization_config", None)
        source = args.saved or args.model
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
        if args.variant == "compile":
            use_compiled_decode(model)

        def decode() -> float:
            return decode_tokens_per_second(
                model, tokenizer, DECODE_PROMPT, new_tokens=tokens, repeats=1, warmup=False
            )

        decode()  # untimed: compiles ("+compile", same length as every later call) or warms up
        print("READY", flush=True)
        for _ in sys.stdin:
            print(f"TOK_S {decode()!r}", flush=True)
    except BaseException as exc:  # the parent reads the reason; the traceback goes to the log
        import traceback

        traceback.print_exc()
        print("ERROR " + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_serve())
