"""hfquant's data-free bit allocation at 4 bits (`HfQuantConfig(mixed_precision="auto")`): which layers get more bits.

No calibration data: the rule reads only the layers' names. It rests on two measurements of the accuracy issue
(SmolLM2-135M perplexity, all-MiniLM-L6-v2 embedding cosine, docs/performance.md):

- per-layer sensitivity adds up almost linearly across layers (the linearity theorem of HIGGS, Malinovskii et al.
  2024, arXiv 2411.17525), and the attention value projections cost the most per weight, those of the later layers
  most of all: the value projections of the second half of the layers are stored in int8 (per-channel symmetric,
  int8's defaults);
- "group 128" loses most of its accuracy in the MLP down projection, whose inputs (the gated activations) are the
  most heavy-tailed: down projections use groups of at most 64.

On a Llama-8B shape this adds about 0.1 bits per weight (value projections are ~2% of the weights, down projections
~27%); on SmolLM2-135M, SINQ at group 128 asked goes from 1.191x to 1.154x bf16 perplexity at 4.46 bits per weight.

    overrides = data_free_overrides(linear_names, bits=4, group_size=128)
    # {"model.layers.15.self_attn.v_proj": {"bits": 8}, ..., "model.layers.0.mlp.down_proj": {"group_size": 64}, ...}

The result is written into the config's `module_overrides` when a model is quantized, so a saved checkpoint states
every layer's format and a reload never runs the rule again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from hfquant.core import blocks

__all__ = [
    "MIXED_PRECISION",
    "VALUE_PROJECTIONS",
    "DOWN_PROJECTIONS",
    "OUTPUT_PROJECTIONS",
    "DOWN_GROUP_SIZE",
    "BLOCK_LADDER",
    "data_free_overrides",
    "more_bits_layer",
    "block_overrides",
    "BUDGET_FORMATS",
    "budget_overrides",
]

MIXED_PRECISION = ("auto", "none")
"""`mixed_precision` values: "auto" applies `data_free_overrides` at 4 bits in the integer format and
`block_overrides` with a block format; "none" stores every layer alike."""

VALUE_PROJECTIONS = ("v_proj", "attention.self.value")
"""Name suffixes (whole components) of attention value projections: Llama / Mistral / Qwen / Phi-3 style and BERT."""

DOWN_PROJECTIONS = ("down_proj", "mlp.c_proj", "fc2", "dense_4h_to_h", "w2")
"""Name suffixes of MLP down projections: Llama family, GPT-2, OPT / Phi, GPT-NeoX / Falcon, Mixtral-style experts.
BERT's `layer.N.output.dense` (not `attention.output.dense`) is recognised by its position."""

OUTPUT_PROJECTIONS = ("o_proj", "self_attn.dense", "attn.c_proj", "attention.output.dense")
"""Name suffixes of attention output projections: Llama family, Phi, GPT-2, BERT."""

DOWN_GROUP_SIZE = 64
"""The largest group size a down projection keeps under the rule."""

_INDEX = re.compile(r"\.(\d+)(?:\.|$)")
_BERT_DOWN = re.compile(r"(?:^|\.)\d+\.output\.dense$")


def _ends_with(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _layer_index(name: str) -> int | None:
    found = _INDEX.search(name)
    return int(found.group(1)) if found else None


def data_free_overrides(names: Iterable[str], bits: int, group_size: int | None) -> dict[str, dict[str, Any]]:
    """`module_overrides` entries of the data-free rule for the Linear layers `names` (full dotted names).

    Args:
        names: the quantizable Linear / Conv1D layers of one model (layers kept in float may be left out).
        bits: the config's bit width; the rule only acts at 4 bits (an empty dict otherwise).
        group_size: the config's asked group size (None: per-channel).
    Returns:
        {full layer name: settings}: `{"bits": 8}` for the value projections of the second half of the layers
        (layer index >= number of layers // 2, the index being the first numeric component of the name, e.g. 17 in
        `model.layers.17.self_attn.v_proj`), `{"group_size": 64}` for down projections when the asked group is
        per-channel or larger than 64. Names without a layer index, or that no rule selects, get nothing.
    """
    if bits != 4:
        return {}
    names = list(names)
    indices = [i for i in map(_layer_index, names) if i is not None]
    if not indices:
        return {}
    first_late = (max(indices) + 1) // 2
    narrow_down = group_size is None or group_size > DOWN_GROUP_SIZE
    overrides: dict[str, dict[str, Any]] = {}
    for name in names:
        index = _layer_index(name)
        if index is None:
            continue
        if any(_ends_with(name, suffix) for suffix in VALUE_PROJECTIONS):
            if index >= first_late:
                overrides[name] = {"bits": 8}
        elif narrow_down and (any(_ends_with(name, s) for s in DOWN_PROJECTIONS) or _BERT_DOWN.search(name)):
            overrides[name] = {"group_size": DOWN_GROUP_SIZE}
    return overrides


BLOCK_LADDER: dict[str, tuple[str, ...]] = {
    "q2_k": ("q3_k", "q4_k"),
    "q3_k": ("q4_k", "q5_k"),
    "q4_k": ("q5_k", "q6_k"),
    "iq4_xs": ("q5_k", "q6_k"),
    "iq4_nl": ("q5_0", "q8_0"),
    "q4_0": ("q5_0", "q8_0"),
    "q4_1": ("q5_1", "q8_0"),
    "q5_k": ("q6_k", "q6_k"),
    "q5_0": ("q8_0", "q8_0"),
    "q5_1": ("q8_0", "q8_0"),
    "q6_k": ("q8_0", "q8_0"),
}
"""A block type's formats one and two steps up (`block_overrides`); q8_0 has none. Rows a k-quant's 256-weight
super-blocks do not divide still take llama.cpp's fallback of the chosen type when the model is quantized."""


def more_bits_layer(index: int, count: int) -> bool:
    """llama.cpp's `use_more_bits` (llama-quant.cpp): the first and last eighth of `count` layers and every third layer
    between them."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def block_overrides(names: Iterable[str], format: str) -> dict[str, dict[str, Any]]:
    """`module_overrides` entries of the data-free rule for a block format (`mixed_precision="auto"` with
    `format="q3_k"` and the like), in the spirit of llama.cpp's Q3_K_M / Q4_K_M mixes:

    - value projections: two steps up (`BLOCK_LADDER`) in `more_bits_layer` layers, one step up elsewhere;
    - MLP down projections (and BERT's `layer.N.output.dense`): two steps up in the first and last eighth of the
      layers, one step up in the other `more_bits_layer` layers;
    - attention output projections: one step up at 2 and 3 bits (as Q2_K and Q3_K_M do).

    Args:
        names: the quantizable Linear / Conv1D layers of one model (full dotted names).
        format: the config's block type (`hfquant.core.blocks.LAYOUTS`); "int" or a type without a ladder (q8_0)
            gives nothing.
    Returns:
        {full layer name: {"format": block type}} for the layers the rule raises; names without a layer index (the
        first numeric component, e.g. 17 in `model.layers.17.self_attn.v_proj`) get nothing. On a Llama-8B shape (32
        layers, rows 256 divides) q3_k becomes 3.76 bits per weight over the Linear layers (q3_k alone: 3.44), q4_k
        4.74 and q2_k 2.89.
    """
    ladder = BLOCK_LADDER.get(format)
    names = list(names)
    indices = [i for i in map(_layer_index, names) if i is not None]
    if ladder is None or not indices:
        return {}
    count = max(indices) + 1
    overrides: dict[str, dict[str, Any]] = {}
    for name in names:
        index = _layer_index(name)
        if index is None:
            continue
        more = more_bits_layer(index, count)
        step = 0
        if any(_ends_with(name, suffix) for suffix in VALUE_PROJECTIONS):
            step = 2 if more else 1
        elif any(_ends_with(name, s) for s in DOWN_PROJECTIONS) or _BERT_DOWN.search(name):
            edge = index < count // 8 or index >= 7 * count // 8
            step = 2 if edge else (1 if more else 0)
        elif any(_ends_with(name, s) for s in OUTPUT_PROJECTIONS) and blocks.LAYOUTS[format].bits <= 3:
            step = 1
        if step:
            overrides[name] = {"format": ladder[step - 1]}
    return overrides


BUDGET_FORMATS: dict[str, float] = {
    "hq3_0": blocks.LAYOUTS["hq3_0"].bits_per_weight,
    "hq3_nl": blocks.LAYOUTS["hq3_nl"].bits_per_weight,
    "hq3_r": 3.5,
}
"""Block formats whose `mixed_precision="auto"` is a bits budget (`budget_overrides`), with the budget in bits per weight:
`HfQuantConfig(format="hq3_r", mixed_precision="auto")` (`bits=3.5`) and its predecessors "hq3_nl" and "hq3_0" are
hfquant's 3.5-bit configurations (at most 3.5 bits per weight over the quantized layers)."""

_BUDGET_LADDER = {
    "q3_k": ("q4_k", "q5_k"),
    "hq3_0": ("iq4_nl", "q5_0"),
    "hq3_nl": ("iq4_nl", "q5_0"),
    "hq3_r": ("iq4_nl", "q5_0"),
}


def _row_bits(name: str, in_features: int) -> float:
    """Stored bits per weight of format `name` on rows of `in_features` weights, a row header included."""
    return blocks.LAYOUTS[name].row_bits_per_weight(in_features)


def _budget_order(names: list[str], count: int) -> list[str]:
    """The layers a budget raises, most sensitive first (the order of `block_overrides`' steps): value projections of
    `more_bits_layer` layers, down projections of the first and last eighth, the other value projections, the other
    `more_bits_layer` down projections, attention outputs of `more_bits_layer` layers; within a rank by name order."""

    def rank(name: str) -> int | None:
        index = _layer_index(name)
        if index is None:
            return None
        more, edge = more_bits_layer(index, count), index < count // 8 or index >= 7 * count // 8
        if any(_ends_with(name, s) for s in VALUE_PROJECTIONS):
            return 0 if more else 2
        if any(_ends_with(name, s) for s in DOWN_PROJECTIONS) or _BERT_DOWN.search(name):
            return 1 if edge else (3 if more else None)
        if any(_ends_with(name, s) for s in OUTPUT_PROJECTIONS):
            return 4 if more else None
        return None

    ranked = [(r, i, n) for i, n in enumerate(names) if (r := rank(n)) is not None]
    return [n for _, _, n in sorted(ranked)]


def budget_overrides(
    shapes: dict[str, tuple[int, int]], format: str, overhead: dict[str, float] | None = None
) -> dict[str, dict[str, Any]]:
    """`module_overrides` entries of a bits budget (`BUDGET_FORMATS`): every layer's block format, the total at most
    the budget in bits per weight over the layers.

    Each layer starts at llama.cpp's Q3_K (3.44 bits per weight) where 256 divides its rows, so that every GGUF
    engine reads those layers; else at `format`: hfquant's HQ3_R (3.375 + 16 / K, where 64 divides them, else its
    fallback HQ3_NL), HQ3_NL or HQ3_0, 3.5. (HQ3_R would also take the rows 256 divides, at fewer bits and better
    accuracy, but decodes slower than Q3_K: docs/performance.md, thirteenth session.) Each layer counts its real
    bits per weight (`BlockLayout.row_bits_per_weight`: HQ3_R's row header). Then, in the data-free sensitivity
    order of `block_overrides` (value and down projections, the first and last blocks first: `_budget_order`), each
    layer goes one type up (Q3_K -> Q4_K, HQ3_NL / HQ3_0 -> IQ4_NL) when the total stays within the budget, and in a
    second pass one more (Q5_K, Q5_0).

    Args:
        shapes: {full layer name: (in_features, out_features)} of the layers to quantize.
        format: a `BUDGET_FORMATS` name ("hq3_r", "hq3_nl", "hq3_0"); any other gives nothing.
        overhead: {full layer name: bits per weight the layer stores beside its blocks} (a SINQ column scale kept
            beside the layer: 16 / out_features), counted in the budget; None or a missing name: 0.
    Returns:
        {full layer name: {"format": block type}} for every layer whose rows 32 divides (the others are left out:
        they keep the config's format, which stores them in float).
    """
    budget = BUDGET_FORMATS.get(format)
    if budget is None:
        return {}
    chosen: dict[str, str] = {}
    bases = ["q3_k", format, blocks.LAYOUTS[format].fallback]  # HQ3_R's rows that 64 does not divide: HQ3_NL
    for name, (k, _) in shapes.items():
        base = next((fmt for fmt in bases if fmt is not None and blocks.LAYOUTS[fmt].divides(k)), None)
        if base is not None:
            chosen[name] = base
    weights = {name: shapes[name][0] * shapes[name][1] for name in chosen}
    allowed = budget * sum(weights.values())
    extra = {n: (overhead or {}).get(n, 0.0) for n in chosen}
    used = sum((_row_bits(chosen[n], shapes[n][0]) + extra[n]) * weights[n] for n in chosen)
    indices = [i for i in map(_layer_index, chosen) if i is not None]
    order = _budget_order(list(chosen), max(indices) + 1) if indices else []
    base = dict(chosen)
    for step in range(2):
        for name in order:
            ladder = _BUDGET_LADDER[base[name]]
            if chosen[name] != (base[name] if step == 0 else ladder[0]):
                continue
            up = ladder[step]
            k = shapes[name][0]
            cost = (_row_bits(up, k) - _row_bits(chosen[name], k)) * weights[name]
            if used + cost <= allowed:
                chosen[name], used = up, used + cost
    return {name: {"format": fmt} for name, fmt in chosen.items()}
