"""The data-free importance of each weight: how much its squared error counts in a block format's search when the
caller gives no importance (no calibration data, nothing but the weight itself).

Kept apart from the searches (`legacy`, `iq4`, `kquants` and the C k-quant search in `hfquant.ops.native`), which
all take the importance as an input array: every search of a type minimizes the same weighted error, whichever
language runs it.

The rule per type (`RULES`), measured on SmolLM2-135M perplexity and MiniLM embeddings against llama.cpp's own
quantizer of the same type (docs/performance.md, "Block formats against llama.cpp's quantizer"):
- "square", x^2: the search keeps the large weights close (an unweighted search trades them for a lower mean error
  and shrinks them by about 2% on SmolLM2's IQ4_NL blocks against llama.cpp's 0.5%, which costs more perplexity
  than the lower mean error gains);
- "rms_abs", sqrt(mean of x^2 over the 32-weight block) + |x|: llama.cpp's own weighting of Q4_K and Q5_K, for the
  types whose codes are offset by a minimum and so keep a block's large weights anyway.
"""

from __future__ import annotations

import torch

__all__ = ["RULES", "default_importance", "rule_importance"]

RULES: dict[str, str] = {
    "q4_0": "square",
    "q4_1": "rms_abs",
    "q5_0": "square",
    "q5_1": "rms_abs",
    "q8_0": "square",
    "q2_k": "rms_abs",
    "q3_k": "square",
    "q4_k": "rms_abs",
    "q5_k": "rms_abs",
    "q6_k": "square",
    "iq4_nl": "square",
    "iq4_xs": "square",
}
"""Block type -> the data-free rule `default_importance` applies to it (`rule_importance`)."""


def rule_importance(rule: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The importance (rows, K) float32 of `weight` (rows, K), K a multiple of 32, under `rule`: "uniform" (None: all
    alike), "square" (x^2) or "rms_abs" (sqrt(mean of x^2 over each 32-weight block) + |x|).

    Raises:
        ValueError: an unknown rule, or a weight that is not 2-D with K a multiple of 32.
    """
    if rule not in ("uniform", "square", "rms_abs"):
        raise ValueError(f"unknown importance rule {rule!r}; allowed values are ['uniform', 'square', 'rms_abs']")
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
    return ((blocks * blocks).mean(-1, keepdim=True).sqrt() + blocks.abs()).reshape(x.shape)


def default_importance(name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The data-free importance (rows, K) float32 that block type `name`'s search uses when given none (`RULES`).

    Raises:
        ValueError: an unknown type name, or a weight that is not 2-D with K a multiple of 32.
    """
    rule = RULES.get(str(name).lower())
    if rule is None:
        raise ValueError(f"unknown block format {name!r}; allowed values are {list(RULES)}")
    return rule_importance(rule, weight)
