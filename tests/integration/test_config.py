"""Tests of hfquant.config: validation errors, defaults and the dict/JSON round-trip."""

from __future__ import annotations

import json

import pytest

from hfquant.config import FORMAT_VERSION, QUANT_METHOD, HfQuantConfig, validate_config_values

FIELDS = {
    "quant_method",
    "bits",
    "group_size",
    "symmetric",
    "modules_to_not_convert",
    "format_version",
    "embedding_dtype",
    "norm_dtype",
    "lm_head",
    "compute_dtype",
    "method",
    "module_overrides",
    "mixed_precision",
    "fold_column_scales",
    "clipping",
    "decode_activations",
}

# (field, bad value, error type the docstring promises: TypeError for a wrong type, ValueError for a wrong value)
INVALID = [
    ("bits", 3, ValueError),
    ("bits", 16, ValueError),
    ("bits", "4", TypeError),
    ("bits", True, TypeError),
    ("bits", 4.0, TypeError),
    ("bits", None, TypeError),
    ("group_size", 16, ValueError),
    ("group_size", 48, ValueError),
    ("group_size", 2048, ValueError),
    ("group_size", 0, ValueError),
    ("group_size", -1, ValueError),
    ("group_size", -64, ValueError),
    ("group_size", "64", TypeError),
    ("group_size", True, TypeError),
    ("group_size", 64.0, TypeError),
    ("symmetric", "yes", TypeError),
    ("symmetric", 1, TypeError),
    ("symmetric", 0, TypeError),
    ("modules_to_not_convert", "lm_head", TypeError),
    ("modules_to_not_convert", [""], TypeError),
    ("modules_to_not_convert", [1], TypeError),
    ("modules_to_not_convert", ["lm_head", None], TypeError),
    ("modules_to_not_convert", {"lm_head": True}, TypeError),
    ("format_version", 2, ValueError),
    ("format_version", 0, ValueError),
    ("format_version", "1", ValueError),
    ("quant_method", "gptq", ValueError),
    ("fold_column_scales", "yes", TypeError),
    ("fold_column_scales", 1, TypeError),
    ("clipping", "percentile", ValueError),
]


@pytest.mark.parametrize("field, value, error", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_constructor_rejects_invalid_value_naming_it(field, value, error):
    with pytest.raises(error) as info:
        HfQuantConfig(**{field: value})
    assert type(info.value) is error
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("field, value, error", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_from_dict_rejects_invalid_value_like_the_constructor(field, value, error):
    data = HfQuantConfig(bits=4).to_dict()
    data[field] = value
    with pytest.raises(error) as info:
        HfQuantConfig.from_dict(data)
    assert type(info.value) is error
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("field, value, error", INVALID[:-1], ids=[f"{f}={v!r}" for f, v, _ in INVALID[:-1]])
def test_validate_rejects_attribute_changed_in_place(field, value, error):
    config = HfQuantConfig(bits=8)
    config.validate()  # valid before the change
    setattr(config, field, value)
    with pytest.raises(error) as info:
        config.validate()
    assert repr(value) in str(info.value)


def test_error_messages_list_the_allowed_values():
    with pytest.raises(ValueError, match=r"\[8, 4\]"):
        HfQuantConfig(bits=3)
    with pytest.raises(ValueError, match=r"\[32, 64, 128, 256, 512, 1024\]"):
        HfQuantConfig(bits=4, group_size=48)
    with pytest.raises(ValueError, match=str(FORMAT_VERSION)):
        HfQuantConfig(format_version=2)
    with pytest.raises(ValueError, match=QUANT_METHOD):
        HfQuantConfig(quant_method="gptq")


def test_unknown_field_is_refused_naming_it():
    with pytest.raises(ValueError, match="not_a_field"):
        HfQuantConfig(bits=4, not_a_field=1)
    data = HfQuantConfig(bits=4).to_dict() | {"weight_dtype": "int4"}
    with pytest.raises(ValueError, match="weight_dtype"):
        HfQuantConfig.from_dict(data)


@pytest.mark.parametrize("value", [True, 1.0])
def test_format_version_must_be_the_integer(value):
    # True == 1 and 1.0 == 1: a plain `!=` check would accept them and write `true` / `1.0` to config.json
    with pytest.raises((TypeError, ValueError)) as info:
        HfQuantConfig(format_version=value)
    assert repr(value) in str(info.value)


def test_validate_config_values_accepts_every_allowed_combination():
    for bits in (8, 4):
        for group_size in (None, 32, 64, 128, 256, 512, 1024):
            for symmetric in (True, False):
                validate_config_values(bits, group_size, symmetric, ["lm_head", "model.*.mlp"], FORMAT_VERSION)


def test_defaults_at_8_bits():
    config = HfQuantConfig(bits=8)
    assert config.group_size is None
    assert config.symmetric is True
    assert config.modules_to_not_convert == []
    assert config.format_version == FORMAT_VERSION
    assert config.quant_method == QUANT_METHOD


def test_defaults_at_4_bits():
    for config in (HfQuantConfig(), HfQuantConfig(bits=4)):
        assert config.bits == 4
        assert config.group_size == 128
        assert config.symmetric is False
        assert config.modules_to_not_convert == []


def test_explicit_values_override_defaults():
    assert HfQuantConfig(bits=4, group_size=None).group_size is None  # explicit None = per-channel, not the default
    assert HfQuantConfig(bits=8, group_size=64).group_size == 64
    assert HfQuantConfig(bits=8, symmetric=False).symmetric is False
    assert HfQuantConfig(bits=4, symmetric=True).symmetric is True
    assert HfQuantConfig(modules_to_not_convert=("a", "b")).modules_to_not_convert == ["a", "b"]


CONFIGS = [
    dict(bits=8),
    dict(bits=4),
    dict(bits=8, group_size=128, symmetric=False),
    dict(bits=4, group_size=32, symmetric=True),
    dict(bits=4, group_size=None),
    dict(bits=4, group_size=1024, modules_to_not_convert=["lm_head", "model.layers.*.mlp.down_proj"]),
    dict(bits=4, method="sinq", module_overrides={"v_proj": {"bits": 8}, "*.o_proj": {"group_size": 64}}),
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=[repr(c) for c in CONFIGS])
def test_dict_round_trip_is_exact(kwargs):
    config = HfQuantConfig(**kwargs)
    data = config.to_dict()
    assert set(data) == FIELDS
    for key, value in kwargs.items():
        assert data[key] == value
    again = HfQuantConfig.from_dict(data)
    assert again == config
    assert again.to_dict() == data
    assert hash(again) == hash(config)


@pytest.mark.parametrize("kwargs", CONFIGS, ids=[repr(c) for c in CONFIGS])
def test_json_round_trip_is_exact(kwargs):
    config = HfQuantConfig(**kwargs)
    text = config.to_json_string()
    data = json.loads(text)
    assert data == config.to_dict()
    assert HfQuantConfig.from_dict(data) == config


def test_to_dict_returns_a_copy():
    config = HfQuantConfig(modules_to_not_convert=["lm_head"])
    config.to_dict()["modules_to_not_convert"].append("x")
    dict(config)["modules_to_not_convert"].append("y")
    assert config.modules_to_not_convert == ["lm_head"]


def test_configs_that_differ_are_not_equal():
    base = HfQuantConfig(bits=4)
    assert base != HfQuantConfig(bits=8)
    assert base != HfQuantConfig(bits=4, group_size=64)
    assert base != HfQuantConfig(bits=4, symmetric=True)
    assert base != HfQuantConfig(bits=4, modules_to_not_convert=["lm_head"])
    assert base != base.to_dict()
