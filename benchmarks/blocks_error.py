"""Weight error of hfquant's block quantizers against llama.cpp's recipe on the same weights.

    python -m benchmarks.blocks_error [--rows 64] [--layers 0,10,20,29] [--seed 0]

For each of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS: relative MSE sum (w - w_hat)^2 / sum w^2 of
- llama.cpp's data-free quantizer (`ggml_quantize_chunk` from the llama-cpp-python wheel, through
  `benchmarks.ggml_reference`, when that module and the wheel are there; otherwise hfquant's torch re-expression
  `reference_<type>` of the same recipe, marked "recipe");
- hfquant's default `quantize_<type>`;
on N(0, 1) rows of 576, 768 and 1536, and on `--rows` rows of every linear weight of SmolLM2-135M's `--layers`
(rows of 576, and 1536 for down_proj; IQ4_XS only where 256 divides the row). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from hfquant.core import blocks, paths
from hfquant.core.blocks import iq4, legacy

FORMATS = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "iq4_xs"]
_MODULES = {"iq4_nl": iq4, "iq4_xs": iq4}


def _llama_cpp_quantizer():
    """(function(name, weight) -> uint8 blocks, label): ggml's when available, else the torch recipe."""
    try:
        ggml = importlib.import_module("benchmarks.ggml_reference")
        quantize = ggml.quantize
        quantize("q8_0", torch.zeros(1, 32))
        return quantize, "llama.cpp (ggml)"
    except (ImportError, AttributeError, OSError, RuntimeError) as error:
        print(f"ggml reference unavailable ({error}); using hfquant's reference_<type> (the same recipe in torch)")

        def recipe(name, weight):
            return getattr(_MODULES.get(name, legacy), f"reference_{name}")(weight)

        return recipe, "llama.cpp recipe"


def _smollm2_weights(layers: list[int], rows: int, seed: int) -> dict[int, torch.Tensor]:
    """Row samples of SmolLM2's linear weights, float32, stacked by row width."""
    folder = paths.cache_dir() / "smollm2-135m-instruct-bf16"
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    gen = torch.Generator().manual_seed(seed)
    by_width: dict[int, list[torch.Tensor]] = {}
    for key, shard in sorted(index.items()):
        parts = key.split(".")
        if "layers" not in parts or not key.endswith("proj.weight") or int(parts[2]) not in layers:
            continue
        with safe_open(str(Path(folder) / shard), "pt") as f:
            w = f.get_tensor(key).float()
        pick = torch.randperm(w.shape[0], generator=gen)[:rows]
        by_width.setdefault(w.shape[1], []).append(w[pick])
    return {width: torch.cat(ws) for width, ws in by_width.items()}


def _rel_mse(name: str, data: torch.Tensor, w: torch.Tensor) -> float:
    return float(((blocks.dequantize(name, data) - w) ** 2).sum() / (w**2).sum())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows sampled from each SmolLM2 matrix")
    parser.add_argument("--layers", default="0,10,20,29", help="SmolLM2 decoder layers to sample")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    llama_cpp, label = _llama_cpp_quantizer()
    gen = torch.Generator().manual_seed(args.seed)
    data = {f"N(0,1) {k}": torch.randn(256, k, generator=gen) for k in (576, 768, 1536)}
    for width, w in _smollm2_weights([int(i) for i in args.layers.split(",")], args.rows, args.seed).items():
        data[f"SmolLM2 {width}"] = w
    print(f"| format | bits/weight | weights | {label} | hfquant | ratio |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in FORMATS:
        fmt = blocks.layout(name)
        for what, w in data.items():
            if not fmt.divides(w.shape[1]):
                continue
            theirs = _rel_mse(name, llama_cpp(name, w), w)
            ours = _rel_mse(name, blocks.quantize(name, w), w)
            print(
                f"| {name.upper()} | {fmt.bits_per_weight:.3g} | {what} ({w.shape[0]} rows) | {theirs:.3e} | "
                f"{ours:.3e} | {ours / theirs:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
