"""`HfQuantConfig.format` and the bit widths of the block formats: defaults, agreement with `bits`, overrides."""

import json

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.config import default_format
from hfquant.nn.linear import QuantLinear


@pytest.mark.parametrize(
    ("bits", "expected"), [(2, "q2_k"), (3, "q3_k"), (4, "iq4_xs"), (5, "q5_k"), (6, "q6_k"), (8, "int")]
)
def test_auto_format_follows_the_bit_width(bits, expected):
    config = HfQuantConfig(bits=bits)
    assert config.format == expected  # "auto" is stored as what it picked
    assert default_format(bits) == expected
    assert config.layer_settings("model.layers.0.mlp.down_proj").format == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (dict(group_size=64), "int"),  # a field only "int" has asks for it
        (dict(group_size=None), "int"),  # per-channel int4
        (dict(symmetric=True), "int"),
        (dict(symmetric=False), "int"),
        (dict(clipping="mse"), "int"),
        (dict(decode_activations="int8"), "int"),
        (dict(symmetric=None), "iq4_xs"),  # None: the default, nothing asked
        (dict(format="iq4_xs", group_size=64), "iq4_xs"),  # an explicit format wins (group_size unused)
        (dict(bits=2, group_size=64), "q2_k"),  # "int" has no 2-bit codes
        (dict(bits=8, group_size=64), "int"),
    ],
)
def test_int_only_fields_ask_for_the_int_format(given, expected):
    config = HfQuantConfig(**given)
    assert config.format == expected
    assert HfQuantConfig.from_dict(config.to_dict()).format == expected


@pytest.mark.parametrize(
    ("config", "entry", "expected"),
    [
        (dict(bits=8), {"bits": 4}, "int"),  # an int8 config's int4 layers, as before iq4_xs became the default
        (dict(format="q6_k"), {"bits": 4}, "iq4_xs"),  # a block config's: the 4-bit default
        (dict(format="q6_k"), {"bits": 4, "group_size": 64}, "int"),  # the entry asks for "int"
        (dict(), {"bits": 8}, "int"),
        (dict(), {"bits": 2}, "q2_k"),
    ],
)
def test_an_entry_at_another_width_keeps_the_int_family_or_picks_that_width(config, entry, expected):
    settings = HfQuantConfig(**config, module_overrides={"down_proj": entry}).layer_settings("m.down_proj")
    assert (settings.bits, settings.format) == (entry["bits"], expected)


def test_a_block_format_gives_its_own_bit_width_and_llama_cpps_recipe():
    config = HfQuantConfig(format="q6_k")
    assert config.bits == 6
    # SINQ folded before the block search (more accurate than llama.cpp's RTN: docs/performance.md), no mixing
    assert (config.method, config.mixed_precision, config.fold_column_scales) == ("sinq", "none", True)
    assert HfQuantConfig(format="Q6_K".lower()) == config


@pytest.mark.parametrize("kwargs", [dict(format="q8_0"), dict(format="iq4_nl"), dict(format="hq3_0"), dict(bits=3)])
def test_block_formats_default_to_the_fold_at_every_width_unlike_int8(kwargs):
    config = HfQuantConfig(**kwargs)
    assert (config.method, config.fold_column_scales) == ("sinq", True)
    assert HfQuantConfig(**kwargs, method="rtn").fold_column_scales is False  # the fold follows the method
    assert HfQuantConfig(**kwargs, fold_column_scales=False).method == "sinq"  # column scales stored instead
    int8 = HfQuantConfig(bits=8)
    assert (int8.format, int8.method, int8.fold_column_scales) == ("int", "rtn", False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(format="int", bits=3), "format='int' stores [8, 4] bits, not bits=3"),
        (dict(format="q6_k", bits=4), "format='q6_k' stores 6-bit codes, not bits=4"),
        (dict(format="q7_k"), "format='q7_k' is not allowed"),
        (dict(bits=7), "bits=7 is not supported"),
        (
            dict(module_overrides={"v_proj": {"format": "q4_k", "bits": 8}}),
            "module_overrides['v_proj']: format='q4_k'",
        ),
    ],
)
def test_disagreeing_format_and_bits_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        HfQuantConfig(**kwargs)


def test_overrides_name_a_format_or_a_width():
    config = HfQuantConfig(bits=3, module_overrides={"v_proj": {"bits": 6}, "down_proj": {"format": "iq4_xs"}})
    assert config.layer_settings("model.layers.0.self_attn.v_proj").format == "q6_k"
    assert config.layer_settings("model.layers.0.mlp.down_proj")[:1] == (4,)
    assert config.layer_settings("model.layers.0.mlp.down_proj").format == "iq4_xs"
    assert config.layer_settings("model.layers.0.self_attn.q_proj").format == "q3_k"


def test_a_config_json_without_format_is_the_integer_format():
    legacy = {key: value for key, value in HfQuantConfig(bits=4).to_dict().items() if key != "format"}
    assert HfQuantConfig.from_dict(legacy).format == "int"
    assert HfQuantConfig.from_dict(HfQuantConfig(bits=2).to_dict()) == HfQuantConfig(bits=2)


def test_the_4_bit_default_stores_iq4_xs_blocks_an_int8_lm_head_and_reloads_bit_exactly(tmp_path):
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    tiny_model("llama", tie_word_embeddings=False, **shape).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=HfQuantConfig(bits=4))
    formats = {n: m.format for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    head = formats.pop("lm_head")
    assert (head.bits, head.block, head.group_size, head.symmetric) == (8, None, 256, True)  # per channel
    assert {f.block for f in formats.values()} == {"iq4_xs"} and len(formats) == 14  # 2 blocks x 7 Linear layers
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert (saved["format"], saved["lm_head"], saved["importance"], saved["iq4_search"]) == (
        "iq4_xs",
        "int8",
        "auto",
        "lean",
    )
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, model(ids).logits)
    buffers = dict(again.named_buffers())
    assert all(torch.equal(buffers[name], value) for name, value in model.named_buffers())


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # rows of 256: the rule's types as asked. 2 layers: layer 1 is the last eighth, layer 0 no `use_more_bits`
        (
            dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2),
            {"0.self_attn.v_proj": "q4_k", "1.self_attn.v_proj": "q5_k", "1.mlp.down_proj": "q5_k"},
        ),
        # rows of 64 / 128: llama.cpp's fallback of each chosen type (q3_k -> iq4_nl, q4_k -> q5_0, q5_k -> q5_1)
        ({}, {"0.self_attn.v_proj": "q5_0", "1.self_attn.v_proj": "q5_1", "1.mlp.down_proj": "q5_1"}),
    ],
)
def test_block_mix_formats_land_in_config_json_and_reload(tmp_path, overrides, expected):
    tiny_model("llama", **overrides).save_pretrained(tmp_path / "float")
    config = HfQuantConfig(format="q3_k", mixed_precision="auto")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    wide = bool(overrides)
    base, out = ("q3_k", "q4_k") if wide else ("iq4_nl", "q5_0")
    for i in range(2):
        expected.setdefault(f"{i}.self_attn.o_proj", out)
        for child in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            expected.setdefault(f"{i}.{child}", base)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    again = HfQuantConfig.from_dict(saved)
    for suffix, fmt in expected.items():
        name = f"model.layers.{suffix}"
        assert again.layer_settings(name).format == fmt, name  # config.json alone names the layer's type
        for loaded in (model, reloaded):
            layer = loaded.get_submodule(name)
            assert isinstance(layer, QuantLinear) and layer.format.block == fmt, name
    assert saved["mixed_precision"] == "auto"
    saved_tensors, reloaded_tensors = model.state_dict(), reloaded.state_dict()
    assert saved_tensors.keys() == reloaded_tensors.keys()
    assert all(torch.equal(saved_tensors[key], reloaded_tensors[key]) for key in saved_tensors)


def test_bits_three_and_a_half_is_the_hq3_r_budget_and_saves_as_it():
    config = HfQuantConfig(bits=3.5)
    assert (config.bits, config.format, config.mixed_precision, config.method) == (3, "hq3_r", "auto", "sinq")
    assert config == HfQuantConfig(format="hq3_r", mixed_precision="auto")
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved["bits"] == 3 and saved["format"] == "hq3_r"  # config.json names the format, not the float
    assert HfQuantConfig.from_dict(saved) == config
    assert HfQuantConfig(bits=3.5, mixed_precision="none").mixed_precision == "none"  # every layer hq3_r: < 3.5 bpw


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            dict(bits=2.5),
            ValueError,
            r"bits=2.5 is not supported; use an int from \[8, 6, 5, 4, 3, 2\] or a bits budget",
        ),
        (dict(bits=3.25), ValueError, r"bits=3.25 is not supported"),
        (dict(bits=3.5, format="q3_k"), ValueError, r"bits=3.5 is the hq3_r bits budget; it takes format='hq3_r'"),
        (dict(bits=4.0), TypeError, r"bits must be an int"),
    ],
)
def test_other_non_integer_bits_are_refused_in_one_line(kwargs, error, message):
    with pytest.raises(error, match=message) as raised:
        HfQuantConfig(**kwargs)
    assert "\n" not in str(raised.value)
