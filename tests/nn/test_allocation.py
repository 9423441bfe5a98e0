"""The 4-bit default's data-free mixed precision (`hfquant.core.allocation`, `HfQuantConfig(mixed_precision="auto")`):
which layers it selects, that the user's overrides win, that it is written into the saved config and never re-run on
reload."""

from __future__ import annotations

import json

import torch
from helpers import LLAMA_PROJECTIONS, auto_class, input_ids, model_output

from hfquant import HfQuantConfig
from hfquant.core.allocation import data_free_overrides
from hfquant.nn.linear import QuantLinear

LLAMA = [f"model.layers.{i}.{child}" for i in range(4) for child in LLAMA_PROJECTIONS]
BERT = [
    f"encoder.layer.{i}.{child}"
    for i in range(6)
    for child in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    )
]


def test_llama_late_value_projections_int8_and_down_projections_group_64():
    rule = data_free_overrides(LLAMA, bits=4, group_size=128)
    assert {name for name, s in rule.items() if s == {"bits": 8}} == {
        "model.layers.2.self_attn.v_proj",
        "model.layers.3.self_attn.v_proj",
    }
    assert {name for name, s in rule.items() if s == {"group_size": 64}} == {
        f"model.layers.{i}.mlp.down_proj" for i in range(4)
    }
    assert len(rule) == 6


def test_bert_value_and_ffn_output_not_the_attention_output():
    rule = data_free_overrides(BERT, bits=4, group_size=None)  # per-channel asked: down projections get 64 too
    assert {name for name, s in rule.items() if s == {"bits": 8}} == {
        f"encoder.layer.{i}.attention.self.value" for i in (3, 4, 5)
    }
    assert {name for name, s in rule.items() if s == {"group_size": 64}} == {
        f"encoder.layer.{i}.output.dense" for i in range(6)
    }


def test_nothing_at_8_bits_at_group_64_or_without_layer_indices():
    assert data_free_overrides(LLAMA, bits=8, group_size=None) == {}
    at_64 = data_free_overrides(LLAMA, bits=4, group_size=64)
    assert set(at_64) == {"model.layers.2.self_attn.v_proj", "model.layers.3.self_attn.v_proj"}  # no down entries
    assert data_free_overrides(["encoder.v_proj", "lm_head"], bits=4, group_size=128) == {}


def test_user_overrides_win_and_none_turns_it_off():
    entry = {"bits": 4, "group_size": 32}
    config = HfQuantConfig(bits=4, format="int", module_overrides={"model.layers.3.self_attn.v_proj": entry})
    added = config.apply_mixed_precision(LLAMA)
    assert "model.layers.3.self_attn.v_proj" not in added and added["model.layers.2.self_attn.v_proj"] == {"bits": 8}
    assert list(config.module_overrides)[0] == "model.layers.3.self_attn.v_proj"  # the user's entry stays first
    assert config.layer_settings("model.layers.3.self_attn.v_proj")[:2] == (4, 32)
    assert config.layer_settings("model.layers.2.self_attn.v_proj")[:3] == (8, None, True)  # int8 defaults
    off = HfQuantConfig(bits=4, mixed_precision="none")
    assert off.apply_mixed_precision(LLAMA) == {} and off.module_overrides == {}


def test_int_default_checkpoint_lists_the_rule_and_reloads_bit_exactly(float_checkpoint, tmp_path):
    """Quantize-on-load with the int format's 4-bit defaults, save, reload: config.json names each layer the rule
    changed, the reload builds the same formats from it (the rule does not run again), same logits and tensors."""
    src = float_checkpoint("llama", torch.bfloat16, num_hidden_layers=4)
    config = HfQuantConfig(format="int")
    model = auto_class("llama").from_pretrained(src, quantization_config=config, device_map="cpu")
    assert config.module_overrides == {}  # the caller's config is not changed
    formats = {name: m.format for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    head = formats.pop("lm_head")  # the 4-bit default's lm_head: int8 per channel (its own field, not the rule's)
    assert (head.bits, head.group_size, head.symmetric, head.method.value) == (8, 64, True, "rtn")
    assert {name for name, f in formats.items() if f.bits == 8} == {
        "model.layers.2.self_attn.v_proj",
        "model.layers.3.self_attn.v_proj",
    }
    # the default folds the SINQ column scales of Llama blocks into the model: every such layer is stored as plain RTN
    assert {f.method.value for f in formats.values()} == {"rtn"}
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert (stored["method"], stored["mixed_precision"], stored["fold_column_scales"]) == ("sinq", "auto", True)
    rule = {
        "model.layers.2.self_attn.v_proj": {"bits": 8},
        "model.layers.3.self_attn.v_proj": {"bits": 8},
        **{f"model.layers.{i}.mlp.down_proj": {"group_size": 64} for i in range(4)},
    }  # 128 inputs: 128 -> 64
    folded = {
        name: {
            "bits": f.bits,
            # the group each layer stores: down projections 64 (the rule), the others one group of their 64 inputs
            # (per-channel: None) as 128 does not divide 64, int8 per-channel
            "group_size": 64 if "down_proj" in name else None,
            "symmetric": f.bits == 8,
            "method": "rtn",
        }
        for name, f in formats.items()
    }
    # each fold entry states the layer's whole format, the rule's bits and group size included, and replaces the
    # rule's entry of that layer
    assert stored["module_overrides"] == folded
    assert all(stored["module_overrides"][name].items() >= settings.items() for name, settings in rule.items())
    assert {formats[f"model.layers.{i}.mlp.down_proj"].group_size for i in range(4)} == {64}
    reloaded = auto_class("llama").from_pretrained(tmp_path, device_map="cpu")
    assert {name: m.format for name, m in reloaded.named_modules() if isinstance(m, QuantLinear)} == {
        **formats,
        "lm_head": head,
    }
    ids = input_ids()
    assert torch.equal(model_output(reloaded, ids), model_output(model, ids))
    first, second = model.state_dict(), reloaded.state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first) and set(first) == set(second)
