"""Which kernel serves one activation row (batch-1 decode) of an int4 or int8 layer, chosen by measurement on this CPU.

For each width two kernels read the same runtime weight: PyTorch's (`aten._weight_int4pack_mm_for_cpu` on the CPU
int4 layout of `hfquant.core.packing`; `aten._weight_int8pack_mm` on the stored row-major int8 codes) and hfquant's own
GEMV (`hfquant.ops.native`). Which one is faster depends on the CPU, not on the code: hfquant's GEMVs were faster
on the AMD EPYC machines measured and slower on an Intel Xeon with AVX512-FP16 (figures in docs/performance.md). So
the first time a layer shape is planned, both kernels are timed on weights of that shape and the faster one is kept:

    uses_native = int4_row_uses_native(out_features, in_features, group_size)   # True: hfquant's GEMV
    uses_native = int8_row_uses_native(out_features, in_features)

Timing (`measure_int4_row`, `measure_int8_row`): each kernel multiplies one bfloat16 row by enough distinct copies of a
random weight of the shape to exceed the last-level cache (about 64 MiB in all, at most 256 copies; decode reads every
weight once per token, so a weight that stays in cache would flatter the faster-computing kernel), on one thread,
best of 3 passes interleaved between the kernels after a warm-up pass (`_time_kernels` says why); hfquant's GEMV is
kept only when it takes less time than aten's, so hfquant is never slower than the aten kernel on the shapes it
measured (at one thread).

Decisions are cached in memory, and on disk in `<cache>/kernel-choices.json` per CPU (model, family/model numbers,
the ISA flags of `hfquant.ops.machine`) and torch version, and logged at INFO. A timing whose thread ran under 90% of
its wall time (a busy machine) is recorded as provisional: every process uses it for `_PROVISIONAL_SECONDS`, then the
next one measures again. The first record of a shape stays (a process that measured beside another uses the record
it finds): the two kernels' outputs differ in the last bits, and the processes of one job (quantize, save, reload,
generate) must pick the same ones. The file is data only (a tampered entry can only pick the other, equally correct
kernel); a malformed one is ignored and rewritten, and so is anything at that path but a regular file of this user's
of at most `_MAX_CACHE_BYTES` (a FIFO there would block every load).
`HFQUANT_KERNEL_CHOICE` overrides: "measure" (default), "native" (always the GEMV where it works, no timing) or
"aten" (never the GEMV).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

import torch

from hfquant.core import blocks, packing, paths
from hfquant.ops import machine, native, native_build, torch_ops

__all__ = [
    "CHOICES",
    "choice_mode",
    "int4_row_uses_native",
    "int8_row_uses_native",
    "bf16_row_uses_native",
    "row_timings",
    "measure_int4_row",
    "measure_int8_row",
    "measure_bf16_row",
    "measure_block_row",
    "block_row_uses_native",
    "block_row_timings",
    "cache_file",
    "cpu_signature",
]

logger = logging.getLogger(__name__)

CHOICES = ("measure", "native", "aten")
"""Values of `HFQUANT_KERNEL_CHOICE`."""
_CACHE_NAME = "kernel-choices.json"
_MAX_CACHE_BYTES = 2**20  # thousands of entries; a larger file is not this cache
_WORKING_SET_BYTES = 64 * 2**20
_MAX_COPIES = 256  # small layers: 256 copies keep the timing short; such weights are cheap either way
_PASSES = 3
ON_CPU = "on_cpu"
"""Key of `_time_kernels`' result: the share of the timing's wall time that the timing thread ran (thread CPU time
over wall time, at most 1)."""
_MIN_ON_CPU = 0.9
"""A timing whose thread ran less of its wall time than this (other processes took the core) is recorded as
provisional (`_PROVISIONAL_SECONDS`): a choice measured on a busy machine would otherwise stay for good (the 1.2B
benchmark model's int8 lm_head went to aten at a load average of 7, where quiet timings give hfquant's GEMV about 1.9x
aten's speed; docs/performance.md, sixteenth session)."""
_PROVISIONAL_SECONDS = 24 * 3600
"""How long a busy machine's timing decides for every process before the next one measures again. Not at once: the
int8 GEMV and aten's kernel round differently (one bfloat16 step on about 2% of a layer's outputs), so two processes
of one job that each timed on a busy machine could decode differently (docs/reliability.md)."""


def choice_mode() -> str:
    """`HFQUANT_KERNEL_CHOICE` (unset: "measure").

    Raises:
        ValueError: another value, naming it and the allowed ones.
    """
    value = os.environ.get("HFQUANT_KERNEL_CHOICE", "measure").strip().lower() or "measure"
    if value not in CHOICES:
        raise ValueError(f"HFQUANT_KERNEL_CHOICE={value!r} is not understood; use one of {list(CHOICES)}")
    return value


def cache_file() -> Path:
    """`<cache>/kernel-choices.json` (`hfquant.core.paths.cache_dir`)."""
    return paths.cache_dir() / _CACHE_NAME


def cpu_signature() -> str:
    """The key of this CPU, torch build and native kernel sources in the cache file: "model name | family F model M |
    flags | torch V (aten CAPABILITY) | kernels D (ISA)" (a changed kernel is timed again; CAPABILITY is the
    instruction set PyTorch dispatches to, which `ATEN_CPU_CAPABILITY` can lower, and which sets the int4 layout; ISA
    the instruction sets hfquant's kernels may use, which `HFQUANT_ISA` can lower: `native.isa`)."""
    family, model = machine.cpuinfo_field("cpu family"), machine.cpuinfo_field("model")
    return (
        f"{machine.cpu_name()} | family {family} model {model} | {','.join(machine.isa_flags())} | "
        f"torch {torch.__version__} (aten {torch.backends.cpu.get_cpu_capability()}) | "
        f"kernels {native_build.source_digest()} ({','.join(native.isa())})"
    )


def _shape_key(kind: str, n: int, k: int, group_size: int | None) -> str:
    """ "int4 2048x2048 g128" / "int8 2048x2048" / "bf16 2048x2048" / "q4_k 2048x2048": the key of a layer shape in
    the cache."""
    return f"{kind} {n}x{k} g{group_size}" if kind == "int4" else f"{kind} {n}x{k}"


def _read_cache() -> dict:
    """The cache file's JSON object, or {} when there is none, it is malformed, or it is not a regular file of this
    user's of at most `_MAX_CACHE_BYTES` (opened without blocking and without following a link, then checked)."""
    path = cache_file()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_CACHE_BYTES or info.st_uid != os.geteuid():
            logger.info("hfquant: ignoring %s: not a regular file of this user's of at most 1 MiB", path)
            return {}
        try:
            data = json.loads(handle.read(_MAX_CACHE_BYTES + 1))
        except (OSError, ValueError):
            return {}
    return data if isinstance(data, dict) else {}


def _entry(signature: str, key: str) -> dict | None:
    """The cache file's record of `key` under `signature`, or None."""
    entries = _read_cache().get(signature, {})
    entry = entries.get(key) if isinstance(entries, dict) else None
    return entry if isinstance(entry, dict) else None


def _cached(signature: str, key: str) -> tuple[bool, tuple[float, float] | None] | None:
    """(uses the GEMV, (GEMV s, aten s) or None) as the cache file records `key` under `signature`, or None."""
    entry = _entry(signature, key)
    return _decision(entry) if _live(entry) else None


def _live(entry) -> bool:
    """Whether `entry` is a record that decides: a known kernel, and not a provisional one whose time is over."""
    return isinstance(entry, dict) and entry.get("kernel") in ("native", "aten") and not _expired(entry)


def _decision(entry: dict) -> tuple[bool, tuple[float, float] | None]:
    """(uses the GEMV, (GEMV s, aten s) or None where the record's timings are malformed) of a live record."""
    try:
        timings = float(entry["native_us"]) * 1e-6, float(entry["aten_us"]) * 1e-6
    except (KeyError, TypeError, ValueError):
        timings = None
    return entry["kernel"] == "native", timings


def _expired(entry: dict) -> bool:
    """Whether a provisional entry's time is over (a malformed time counts as over); False for a final one."""
    until = entry.get("provisional_until")
    if until is None:
        return False
    try:
        return time.time() > float(until)
    except (TypeError, ValueError):
        return True


def _store(signature: str, key: str, entry: dict) -> dict:
    """Add `entry` to the cache file (rewritten whole into a temporary file, then renamed over it) and return it; where
    another process recorded `key` while this one measured, its live record stays and is returned instead."""
    path = cache_file()
    data = _read_cache()
    mine = data.get(signature)
    mine = mine if isinstance(mine, dict) else {}
    found = mine.get(key)
    if _live(found):
        return found
    data[signature] = {**mine, key: entry}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=".kernel-choices-", suffix=".json", dir=path.parent)
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(partial, path)
    except OSError as error:  # a read-only cache: the choice stays in memory for this process
        logger.info("hfquant: cannot record the kernel choice in %s: %s", path, error)
    return entry


def measure_int4_row(n: int, k: int, group_size: int) -> dict[str, float]:
    """Seconds per call of each kernel for one bfloat16 row times an (N, K) int4 weight of group `group_size`.

    Args:
        n, k: the layer's out_features and in_features (N a multiple of 64, the GEMV's block).
        group_size: 32..256, dividing K.
    Returns:
        {"aten": seconds, "native": seconds, "on_cpu": share}: the best of 3 passes over distinct weight copies (about
        64 MiB in all, at most 256 copies); `ON_CPU`'s share of the passes' wall time the timing thread ran.
    Raises:
        RuntimeError: a kernel failed on this shape.
    """
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    weight = packing.to_cpu_int4_layout(codes)
    # hfquant's GEMV for the layout at hand: 64-row blocks (AVX-512) or 32-row blocks (AVX2)
    gemv_call = torch_ops.int4_gemv_avx2 if packing.cpu_int4_layout().block_n == 32 else torch_ops.int4_gemv
    groups = k // group_size
    scale_zero = (torch.rand((groups, n, 2), generator=generator) * 0.02).to(torch.bfloat16)
    copies = _copies(weight)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    kernels = {
        "aten": lambda w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group_size, scale_zero),
        "native": lambda w: gemv_call(x, w, scale_zero, group_size),
    }
    return _time_kernels(kernels, copies)


def measure_int8_row(n: int, k: int) -> dict[str, float]:
    """Seconds per call of each kernel for one bfloat16 row times an (N, K) per-channel int8 weight.

    Args:
        n, k: the layer's out_features and in_features (K a multiple of 16).
    Returns:
        {"aten": seconds, "native": seconds}, timed as `measure_int4_row`.
    Raises:
        RuntimeError: a kernel failed on this shape.
    """
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = (torch.rand((n,), generator=generator) * 0.02).to(torch.bfloat16)
    copies = _copies(weight)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    kernels = {
        "aten": lambda w: torch.ops.aten._weight_int8pack_mm(x, w, scale),
        "native": lambda w: torch_ops.int8_gemv(x, w, scale),
    }
    return _time_kernels(kernels, copies)


def measure_bf16_row(n: int, k: int) -> dict[str, float]:
    """Seconds per call of ATen's bf16 GEMV (oneDNN off, as `FloatLinear` calls it) and hfquant's for one bfloat16
    row times an (N, K) bfloat16 weight (K % 32 == 0), timed as `measure_int4_row` (the weight is filled with a
    constant: its values do not change the time, and drawing 10^8 random numbers would)."""
    weight = torch.empty((n, k), dtype=torch.bfloat16).fill_(0.01)
    copies = _copies(weight)
    x = torch.full((1, k), 0.5, dtype=torch.bfloat16)

    def aten(w):
        enabled = torch.backends.mkldnn.enabled
        torch.backends.mkldnn.enabled = False
        try:
            return torch.nn.functional.linear(x, w)
        finally:
            torch.backends.mkldnn.enabled = enabled

    return _time_kernels({"aten": aten, "native": lambda w: native.bf16_gemv(x, w)}, copies)


def measure_block_row(name: str, n: int, k: int) -> dict[str, float]:
    """Seconds per call of the torch path (`blocks.dequantize` chunk by chunk, then the float product: what a block
    layer runs without hfquant's GEMV) and of the block GEMV (`torch_ops.block_gemv`) for one bfloat16 row times an
    (N, K) weight of block type `name`. The blocks are the type's quantization of 64 random rows, repeated (finite
    scales; the values do not change the time). The GEMV is timed as `measure_int4_row`; the torch path, tens of
    times slower, on one copy.

    Raises:
        RuntimeError: a kernel failed on this shape.
    """
    from hfquant.ops import kernels  # kernels -> gemv -> torch_ops: no cycle, but only this measurement needs it

    fmt = blocks.layout(name)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn((min(n, 64), k), generator=generator)
    # the C search where it builds (the same bytes; the torch codec takes seconds per shape for IQ4_XS)
    rows = native.block_codes(name, sample)
    weight = rows.repeat((n + rows.shape[0] - 1) // rows.shape[0], 1)[:n].contiguous()
    copies = _copies(weight)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    plan = kernels.KernelPlan(kernels.Kernel.DEQUANT, fmt.bits, fmt.block_size, fmt.symmetric, k, n, block=fmt.name)
    seconds = _time_kernels({"aten": lambda w: kernels._block_product(plan, w, x)}, copies[:1])
    on_cpu = seconds[ON_CPU]
    seconds.update(_time_kernels({"native": lambda w: torch_ops.block_gemv(x, w, k, fmt.ggml_type)}, copies))
    seconds[ON_CPU] = min(on_cpu, seconds[ON_CPU])
    return seconds


def block_row_uses_native(name: str, n: int, k: int) -> bool:
    """`int4_row_uses_native` for an (N, K) layer of block type `name`: the block GEMV against the torch path
    (`measure_block_row`; the caller has checked `gemv.native_block_works(name)`)."""
    return _decide(name, n, k, None)


def block_row_timings(name: str, n: int, k: int) -> tuple[float, float] | None:
    """`row_timings` for an (N, K) layer of block type `name`: (GEMV s, torch path s) or None."""
    if choice_mode() != "measure":
        return None
    return _measured(name, n, k, None)[1]


def bf16_row_uses_native(n: int, k: int) -> bool:
    """`int4_row_uses_native` for an (N, K) bfloat16 layer kept in float (`FloatLinear`)."""
    return _decide("bf16", n, k, None)


def _copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and clones of it, about `_WORKING_SET_BYTES` in all (at most `_MAX_COPIES`)."""
    count = min(_MAX_COPIES, max(1, _WORKING_SET_BYTES // max(weight.nbytes, 1)))
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _time_kernels(kernels: dict, copies: list[torch.Tensor]) -> dict[str, float]:
    """Best seconds per call of each kernel over `copies`, on one thread, the kernels' passes interleaved, and under
    `ON_CPU` the share of the passes' wall time this thread ran.

    One thread: the choice is about the kernels' work on this CPU; at two threads a machine shared with other
    processes makes an OpenMP kernel's team wait for a descheduled thread (15-30x slower small calls, against a
    single-threaded aten call), and that moment's answer would be cached for good (docs/performance.md, issue #32,
    tenth session). Interleaved: a change of the machine's speed during the measurement reaches both kernels."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run in kernels.values():
            for w in copies:  # warm-up pass
                run(w)
        seconds = dict.fromkeys(kernels, float("inf"))
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(_PASSES):
            for name, run in kernels.items():
                start = time.perf_counter()
                for w in copies:
                    run(w)
                seconds[name] = min(seconds[name], (time.perf_counter() - start) / len(copies))
        seconds[ON_CPU] = min(1.0, (time.thread_time() - cpu) / max(time.perf_counter() - wall, 1e-9))
        return seconds
    finally:
        torch.set_num_threads(threads)


def int4_row_uses_native(n: int, k: int, group_size: int) -> bool:
    """Whether one bfloat16 row of an (N, K) int4 layer of this group size runs hfquant's GEMV (True) or the aten
    kernel (False) on this CPU: measured once per shape and CPU (see the module docstring), then cached.

    The caller has checked that the GEMV works here (`gemv.native_int4_works`). A failed measurement keeps aten.

    Raises:
        ValueError: a bad `HFQUANT_KERNEL_CHOICE`.
    """
    return _decide("int4", n, k, group_size)


def row_timings(n: int, k: int, group_size: int | None) -> tuple[float, float] | None:
    """(hfquant GEMV seconds, aten seconds) of one row of this shape on this CPU (int8 when `group_size` is None), as
    the decision recorded them (measured first where this process has not decided yet), or None when the choice was
    forced (`HFQUANT_KERNEL_CHOICE`) or the measurement failed."""
    if choice_mode() != "measure":
        return None
    return _measured("int4" if group_size is not None else "int8", n, k, group_size)[1]


def int8_row_uses_native(n: int, k: int) -> bool:
    """`int4_row_uses_native` for an (N, K) per-channel int8 layer (the caller has checked
    `gemv.native_int8_works`)."""
    return _decide("int8", n, k, None)


def _decide(kind: str, n: int, k: int, group_size: int | None) -> bool:
    mode = choice_mode()
    if mode != "measure":
        return mode == "native"
    return _measured(kind, n, k, group_size)[0]


@functools.cache
def _measured(kind: str, n: int, k: int, group_size: int | None) -> tuple[bool, tuple[float, float] | None]:
    """(uses hfquant's GEMV, (GEMV s, aten s) or None) for one row of a `kind` ("int4", "int8", "bf16", or a block type
    such as "q4_k", whose "aten" is the torch dequantization path) layer of this
    shape: from the cache file, else measured and recorded there. Cached per process (`_measured.cache_clear()`
    forgets, as a new process would)."""
    key = _shape_key(kind, n, k, group_size)
    signature = cpu_signature()
    cached = _cached(signature, key)
    if cached is not None:
        return cached
    try:
        if kind == "int4":
            seconds = measure_int4_row(n, k, group_size)
        elif kind in blocks.LAYOUTS:
            seconds = measure_block_row(kind, n, k)
        else:
            seconds = measure_int8_row(n, k) if kind == "int8" else measure_bf16_row(n, k)
    except RuntimeError as error:
        logger.info("hfquant: timing the kernels on %s failed (%s); using aten's", key, error)
        return False, None
    native_wins = seconds["native"] < seconds["aten"]
    entry = {
        "kernel": "native" if native_wins else "aten",
        "native_us": round(seconds["native"] * 1e6, 2),
        "aten_us": round(seconds["aten"] * 1e6, 2),
    }
    on_cpu = seconds.get(ON_CPU, 1.0)
    if on_cpu < _MIN_ON_CPU:  # other processes took the core: every process uses it for a while, then times again
        entry["provisional_until"] = round(time.time() + _PROVISIONAL_SECONDS)
        logger.info(
            "hfquant: the kernel timing of %s ran on the CPU %.0f%% of its time (a busy machine): recorded in %s for "
            "%d hours, then timed again",
            key,
            on_cpu * 100,
            cache_file(),
            _PROVISIONAL_SECONDS // 3600,
        )
    recorded = _store(signature, key, entry)
    if recorded is not entry:  # another process recorded the shape while this one timed it: its choice holds
        return _decision(recorded)
    logger.info(
        "hfquant kernel choice for one row of %s on %s: hfquant GEMV %.1f us, aten %.1f us -> %s",
        key,
        machine.cpu_name(),
        seconds["native"] * 1e6,
        seconds["aten"] * 1e6,
        "hfquant GEMV" if native_wins else "aten",
    )
    return native_wins, (entry["native_us"] * 1e-6, entry["aten_us"] * 1e-6)
