"""The block formats' data-free mix (`hfquant.core.allocation.block_overrides`, `mixed_precision="auto"` with a block
format): which layers get which type on Llama- and BERT-shaped name lists, checked against llama.cpp's own layer
selection (`use_more_bits` in llama-quant.cpp) written out by hand."""

from __future__ import annotations

import pytest
from helpers import LLAMA_PROJECTIONS

from hfquant.core.allocation import BLOCK_LADDER, block_overrides, more_bits_layer
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
