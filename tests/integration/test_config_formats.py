"""`HfQuantConfig.format` and the bit widths of the block formats: defaults, agreement with `bits`, overrides."""

import pytest

from hfquant import HfQuantConfig
from hfquant.config import default_format


@pytest.mark.parametrize(
    ("bits", "expected"), [(2, "q2_k"), (3, "q3_k"), (4, "int"), (5, "q5_k"), (6, "q6_k"), (8, "int")]
)
def test_auto_format_follows_the_bit_width(bits, expected):
    config = HfQuantConfig(bits=bits)
    assert config.format == expected  # "auto" is stored as what it picked
    assert default_format(bits) == expected
    assert config.layer_settings("model.layers.0.mlp.down_proj").format == expected


def test_a_block_format_gives_its_own_bit_width_and_llama_cpps_recipe():
    config = HfQuantConfig(format="q6_k")
    assert config.bits == 6
    assert (config.method, config.mixed_precision, config.fold_column_scales) == ("rtn", "none", False)
    assert HfQuantConfig(format="Q6_K".lower()) == config


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
