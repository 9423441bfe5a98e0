"""The block formats' data-free mix (`hfquant.core.allocation.block_overrides`, `mixed_precision="auto"` with a block
format): which layers get which type on Llama- and BERT-shaped name lists, checked against llama.cpp's own layer
selection (`use_more_bits` in llama-quant.cpp) written out by hand."""

from __future__ import annotations

import pytest
from helpers import LLAMA_PROJECTIONS

from hfquant.core.allocation import BLOCK_LADDER, BUDGET_FORMATS, block_overrides, budget_overrides, more_bits_layer
from hfquant.core.blocks import LAYOUTS


def llama(layers: int) -> list[str]:
    return [f"model.layers.{i}.{child}" for i in range(layers) for child in LLAMA_PROJECTIONS]


def formats(overrides: dict, child: str, layers: int) -> list[str | None]:
    return [overrides.get(f"model.layers.{i}.{child}", {}).get("format") for i in range(layers)]


def test_more_bits_layers_are_llama_cpps():
    # use_more_bits(i, 32): i < 4, i >= 28, (i - 4) % 3 == 2
    assert [i for i in range(32) if more_bits_layer(i, 32)] == [
        0,
        1,
        2,
        3,
        6,
        9,
        12,
        15,
        18,
        21,
        24,
        27,
        28,
        29,
        30,
        31,
    ]
    assert [i for i in range(6) if more_bits_layer(i, 6)] == [2, 5]


def test_q3_k_mix_on_a_16_layer_llama():
    overrides = block_overrides(llama(16), "q3_k")
    more = {0, 1, 4, 7, 10, 13, 14, 15}  # first and last 16 // 8 = 2 layers, then every third from layer 2
    edges = {0, 1, 14, 15}
    assert formats(overrides, "self_attn.v_proj", 16) == ["q5_k" if i in more else "q4_k" for i in range(16)]
    assert formats(overrides, "mlp.down_proj", 16) == [
        "q5_k" if i in edges else "q4_k" if i in more else None for i in range(16)
    ]
    assert formats(overrides, "self_attn.o_proj", 16) == ["q4_k"] * 16  # one step up at 3 bits, as Q3_K_M
    for child in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert formats(overrides, child, 16) == [None] * 16
    assert all(entry["format"] in LAYOUTS for entry in overrides.values())


def test_q4_k_mix_leaves_attention_outputs_and_steps_to_q6_k():
    overrides = block_overrides(llama(8), "q4_k")
    more = {0, 3, 6, 7}  # 8 // 8 = 1: layer 0, layers >= 7, (i - 1) % 3 == 2
    assert formats(overrides, "self_attn.v_proj", 8) == ["q6_k" if i in more else "q5_k" for i in range(8)]
    assert formats(overrides, "mlp.down_proj", 8) == [
        "q6_k" if i in (0, 7) else "q5_k" if i in more else None for i in range(8)
    ]
    assert formats(overrides, "self_attn.o_proj", 8) == [None] * 8


def test_bert_names_are_recognised():
    names = [
        f"encoder.layer.{i}.{child}"
        for i in range(6)
        for child in (
            "attention.self.query",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        )
    ]
    overrides = block_overrides(names, "q2_k")
    assert overrides["encoder.layer.5.attention.self.value"] == {"format": "q4_k"}
    assert overrides["encoder.layer.0.attention.self.value"] == {"format": "q3_k"}
    assert overrides["encoder.layer.5.output.dense"] == {"format": "q4_k"}  # the last eighth
    assert overrides["encoder.layer.2.output.dense"] == {"format": "q3_k"}
    assert "encoder.layer.0.output.dense" not in overrides
    assert overrides["encoder.layer.3.attention.output.dense"] == {"format": "q3_k"}
    assert not any(".query" in name or "intermediate" in name for name in overrides)


@pytest.mark.parametrize("fmt", ["int", "q8_0"])
def test_formats_without_a_ladder_get_nothing(fmt):
    assert block_overrides(llama(4), fmt) == {}


def test_every_step_has_at_least_the_bits_of_its_type():
    for name, steps in BLOCK_LADDER.items():
        sizes = [LAYOUTS[n].type_size * 8 / LAYOUTS[n].block_size for n in (name, *steps)]
        assert sizes == sorted(sizes), name


def smollm2_shapes(layers: int) -> dict[str, tuple[int, int]]:
    """SmolLM2-135M's projections (hidden 576, 3 KV heads of 64, MLP 1536): (in_features, out_features)."""
    shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    sizes = dict(zip(LLAMA_PROJECTIONS, shapes, strict=True))
    return {f"model.layers.{i}.{child}": sizes[child] for i in range(layers) for child in LLAMA_PROJECTIONS}


def _bits_per_weight(overrides: dict, shapes: dict) -> float:
    bits = sum(LAYOUTS[overrides[n]["format"]].row_bits_per_weight(k) * k * m for n, (k, m) in shapes.items())
    return bits / sum(k * m for k, m in shapes.values())


@pytest.mark.parametrize("layers", [4, 30])
@pytest.mark.parametrize("base", ["hq3_0", "hq3_nl", "hq3_r"])
def test_budget_names_every_layer_and_stays_within_3_5_bits(layers, base):
    shapes = smollm2_shapes(layers)
    overrides = budget_overrides(shapes, base)
    assert set(overrides) == set(shapes)
    assert _bits_per_weight(overrides, shapes) <= BUDGET_FORMATS[base] + 1e-9
    # the cheapest 3-bit type of each row width: Q3_K where 256 divides it, the budget's format elsewhere
    assert set(formats(overrides, "mlp.down_proj", layers)) <= {"q3_k", "q4_k", "q5_k"}
    assert formats(overrides, "self_attn.q_proj", layers) == [base] * layers
    assert formats(overrides, "mlp.gate_proj", layers) == [base] * layers
    assert set(formats(overrides, "self_attn.v_proj", layers)) <= {base, "iq4_nl", "q5_0"}


def test_hq3_r_budget_counts_its_row_header_and_raises_more_layers_than_hq3_nl():
    """HQ3_R costs 3.375 + 16 / K bits per weight (K = 576: 3.403): the 0.1 bits below 3.5 go to raised layers; rows
    64 does not divide (K = 96) take its fallback HQ3_NL."""
    shapes = smollm2_shapes(30)
    r, nl = budget_overrides(shapes, "hq3_r"), budget_overrides(shapes, "hq3_nl")
    assert 3.49 < _bits_per_weight(r, shapes) <= 3.5
    raised = {
        name: sum(o[n]["format"] not in (name, "q3_k") for n in shapes) for name, o in (("hq3_r", r), ("hq3_nl", nl))
    }
    assert raised["hq3_r"] >= 2 * raised["hq3_nl"] > 0  # measured 30 against 15
    assert budget_overrides({"model.layers.0.mlp.up_proj": (96, 64)}, "hq3_r") == {
        "model.layers.0.mlp.up_proj": {"format": "hq3_nl"}
    }


def test_budget_raises_value_projections_of_the_first_and_last_layers_first():
    layers = 30
    overrides = budget_overrides(smollm2_shapes(layers), "hq3_0")
    raised = [i for i, f in enumerate(formats(overrides, "self_attn.v_proj", layers)) if f != "hq3_0"]
    assert raised, "the budget left room for no value projection"
    assert {0, 1, 2, layers - 1} <= set(raised)
    more = {i for i in range(layers) if more_bits_layer(i, layers)}
    assert more <= set(raised)  # all of these before any other value projection
    assert len(raised) < layers  # 3.5 bits do not pay for all of them


def test_budget_with_room_raises_down_projections_of_the_edges():
    # value projections cost little here: a wide MLP in rows 256 divides leaves room after them
    shapes = {f"model.layers.{i}.{child}": (512, 512) for i in range(8) for child in LLAMA_PROJECTIONS}
    shapes.update({f"model.layers.{i}.self_attn.v_proj": (96, 32) for i in range(8)})
    overrides = budget_overrides(shapes, "hq3_0")
    assert _bits_per_weight(overrides, shapes) <= 3.5
    assert formats(overrides, "self_attn.v_proj", 8)[0] == "q5_0"  # two steps up: HQ3_0 -> IQ4_NL -> Q5_0
    assert formats(overrides, "mlp.down_proj", 8)[0] != "q3_k"
    assert formats(overrides, "mlp.gate_proj", 8) == ["q3_k"] * 8


def test_budget_only_for_budget_formats_and_rows_32_divides():
    shapes = {"model.layers.0.self_attn.v_proj": (100, 64), "model.layers.0.mlp.up_proj": (64, 96)}
    assert budget_overrides(shapes, "q3_k") == {}
    assert budget_overrides(shapes, "hq3_0") == {"model.layers.0.mlp.up_proj": {"format": "hq3_0"}}


def test_budget_counts_the_bits_stored_beside_the_blocks():
    layers = 30
    shapes = smollm2_shapes(layers)
    plain = budget_overrides(shapes, "hq3_0")
    # a small per-layer extra (a stored column scale) on the down projections, the only layers below 3.5 bits
    extra = {n: 0.03 for n in shapes if n.endswith("down_proj")}
    counted = budget_overrides(shapes, "hq3_0", extra)
    weights = {n: k * m for n, (k, m) in shapes.items()}
    total = sum(extra.get(n, 0.0) * w for n, w in weights.items()) / sum(weights.values())
    assert _bits_per_weight(counted, shapes) + total <= BUDGET_FORMATS["hq3_0"] + 1e-9
    raised = sum(counted[n]["format"] not in ("hq3_0", "q3_k") for n in shapes)
    assert 0 < raised < sum(plain[n]["format"] not in ("hq3_0", "q3_k") for n in shapes)
