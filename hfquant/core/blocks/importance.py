"""The data-free importance of each weight: how much its squared error counts in a block format's search when the
caller gives no importance (no calibration data, nothing but the weight itself).

Kept apart from the searches (`legacy`, `iq4`, `kquants` and the C k-quant search in `hfquant.ops.native`), which
all take the importance as an input array: every search of a type minimizes the same weighted error, whichever
language runs it.

The rule per type (`RULES`), chosen by SmolLM2-135M perplexity and MiniLM embeddings with every decoder linear
weight quantized -> dequantized (docs/performance.md, "Block formats: the data-free importance"):
- "rms_abs", sqrt(mean of x^2 over the 32-weight block) + |x|: llama.cpp's own weighting of Q4_K and Q5_K, the better
  of the two on SmolLM2's `down_proj`;
- "rms_abs_square", (sqrt(mean of x^2 over the block) + |x|)^2, for hfquant's HQ3_0: at 3 bits the large weights of
  SmolLM2's folded layers matter more still (`HfQuantConfig(bits=3.5)`, first 3 windows of the accuracy text: 1.76x
  bf16's perplexity against 1.82x with "rms_abs" and 1.98x "uniform"); MiniLM (not folded, column scales stored)
  prefers "uniform" (cosine 0.933 against 0.931 "rms_abs", 0.920 "square"), which is what a layer with stored SINQ
  column scales gets (`STORED_SCALE_RULES`, `stored_scale_importance`);
- "uniform" (every element alike) for the other types: llama.cpp's x^2 ("square") keeps the largest weights closer
  (they shrink by 0.2% instead of 1.8% on SmolLM2's IQ4_NL blocks) but gave a worse perplexity with hfquant's IQ4_NL
  search (1.235x bf16 against 1.224x unweighted; llama.cpp's own quantizer 1.182x), so it is not the default.
"""

from __future__ import annotations

import torch

__all__ = ["RULES", "STORED_SCALE_RULES", "default_importance", "rule_importance", "stored_scale_importance"]

RULES: dict[str, str] = {
    "q4_0": "uniform",
    "q4_1": "uniform",
    "q5_0": "uniform",
    "q5_1": "uniform",
    "q8_0": "uniform",
    "q2_k": "uniform",
    "q3_k": "uniform",
    "q4_k": "rms_abs",
    "q5_k": "rms_abs",
    "q6_k": "uniform",
    "iq4_nl": "uniform",
    "iq4_xs": "uniform",
    "hq3_0": "rms_abs_square",
    "hq3_nl": "rms_abs_square",
    "hq3_r": "rms_abs_square",
}
"""Block type -> the data-free rule `default_importance` applies to it (`rule_importance`)."""

STORED_SCALE_RULES: dict[str, str] = {"hq3_0": "uniform", "hq3_nl": "uniform", "hq3_r": "uniform"}
"""Block type -> the rule of a layer whose SINQ column scales are stored beside it (not folded: MiniLM and other
models `find_blocks` does not fold), where it differs from `RULES`. HQ3_0's (rms + |x|)^2 is chosen on SmolLM2's folded
layers; on MiniLM's stored-scale layers "uniform" is better (`HfQuantConfig(bits=3.5)`: cosine 0.9325 against 0.9255;
weighting by the column scales squared, the error of the unscaled weight, 0.9282; docs/performance.md)."""


def rule_importance(rule: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The importance (rows, K) float32 of `weight` (rows, K), K a multiple of 32, under `rule`: "uniform" (None: all
    alike), "square" (x^2), "rms_abs" (sqrt(mean of x^2 over each 32-weight block) + |x|) or "rms_abs_square" (the
    square of "rms_abs").

    Raises:
        ValueError: an unknown rule, or a weight that is not 2-D with K a multiple of 32.
    """
    if rule not in ("uniform", "square", "rms_abs", "rms_abs_square"):
        raise ValueError(
            f"unknown importance rule {rule!r}; allowed values are ['uniform', 'square', 'rms_abs', 'rms_abs_square']"
        )
    if weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(
            f"importance is computed for a (rows, K) weight with K a multiple of 32; got {tuple(weight.shape)}"
        )
    if rule == "uniform":
        return None
    x = weight.detach().to(torch.float32)
    if rule == "square":
        return x * x
    blocks = x.reshape(x.shape[0], -1, 32)
    rms_abs = ((blocks * blocks).mean(-1, keepdim=True).sqrt() + blocks.abs()).reshape(x.shape)
    return rms_abs * rms_abs if rule == "rms_abs_square" else rms_abs


def default_importance(name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The data-free importance (rows, K) float32 that block type `name`'s search uses when given none (`RULES`);
    None for the "uniform" rule (every element alike).

    Raises:
        ValueError: an unknown type name, or a weight that is not 2-D with K a multiple of 32.
    """
    rule = RULES.get(str(name).lower())
    if rule is None:
        raise ValueError(f"unknown block format {name!r}; allowed values are {list(RULES)}")
    return rule_importance(rule, weight)


def stored_scale_importance(name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The importance (rows, K) or (K,) float32 of block type `name`'s search for `weight` (rows, K), the layer's weight
    already divided by SINQ column scales that are stored beside it: (K,) ones for a "uniform" rule of
    `STORED_SCALE_RULES`, the rule's array for another, None (the type's default) for a type it does not name.

    Raises:
        ValueError: a weight that is not 2-D with K a multiple of 32.
    """
    rule = STORED_SCALE_RULES.get(str(name).lower())
    if rule is None:
        return None
    found = rule_importance(rule, weight)
    return torch.ones(weight.shape[1], dtype=torch.float32) if found is None else found
