"""Tests of hfquant.config: validation errors, defaults and the dict/JSON round-trip."""

from __future__ import annotations

import inspect
import json

import pytest

from hfquant import config as config_module
from hfquant.config import (
    FIELD_NAMES,
    FORMAT_VERSION,
    QUANT_METHOD,
    Clipping,
    DecodeActivations,
    EmbeddingDtype,
    FloatDtype,
    HfQuantConfig,
    Importance,
    Iq4SearchMode,
    LmHead,
    Method,
    MixedPrecision,
    QuantFormat,
    validate_config_values,
)
from hfquant.core import allocation, blocks, dtypes, rtn

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
    "iq4_search",
    "importance",
    "decode_activations",
    "format",
}

# (field, bad value, error type the docstring promises: TypeError for a wrong type, ValueError for a wrong value)
INVALID = [
    ("bits", 7, ValueError),
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
    with pytest.raises(ValueError, match=r"\[8, 6, 5, 4, 3, 2\]"):
        HfQuantConfig(bits=7)
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


# -- the field table and its closed choices ------------------------------------------------------------------------


def test_fields_table_is_the_constructor_the_dict_and_the_docstring():
    assert set(FIELD_NAMES) == FIELDS and len(FIELD_NAMES) == len(FIELDS)
    keywords = [
        p
        for p in inspect.signature(HfQuantConfig).parameters.values()
        if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    assert [p.name for p in keywords] == [
        "bits",
        "group_size",
        "symmetric",
        "modules_to_not_convert",
        "format_version",
        "quant_method",
        "format",
        "embedding_dtype",
        "norm_dtype",
        "lm_head",
        "compute_dtype",
        "method",
        "module_overrides",
        "mixed_precision",
        "fold_column_scales",
        "clipping",
        "iq4_search",
        "importance",
        "decode_activations",
    ]  # positional order of the public constructor
    assert list(HfQuantConfig().to_dict()) == list(FIELD_NAMES)
    for field in config_module.FIELDS:
        assert f"        {field.name}" in HfQuantConfig.__doc__ and field.help in HfQuantConfig.__doc__


def test_defaults_come_from_the_table():
    for bits in (8, 4):
        config = HfQuantConfig(bits=bits)
        resolved = config_module.resolve_defaults({"bits": bits})
        assert config.to_dict() == {name: config_module._plain(value) for name, value in resolved.items()}
    assert HfQuantConfig(bits=8).to_dict() == HfQuantConfig(bits=8, method=None, symmetric=None).to_dict()
    with pytest.raises(TypeError, match="embedding_dtype must be a string"):
        HfQuantConfig(embedding_dtype=None)  # None means the default only where the table says so


def test_to_json_string_is_unchanged():
    # The exact text of config.json's quantization_config: a saved checkpoint must stay byte-identical.
    assert HfQuantConfig().to_json_string() == (
        '{\n  "bits": 4,\n  "clipping": "minmax",\n  "compute_dtype": "auto",\n  "decode_activations": "float",\n'
        '  "embedding_dtype": "auto",\n  "fold_column_scales": true,\n  "format": "iq4_xs",\n  "format_version": 1,\n'
        '  "group_size": 128,\n  "importance": "auto",\n  "iq4_search": "lean",\n'
        '  "lm_head": "int8",\n  "method": "sinq",\n  "mixed_precision": "none",\n  "module_overrides": {},\n'
        '  "modules_to_not_convert": [],\n  "norm_dtype": "auto",\n  "quant_method": "hfquant",\n  "symmetric": false\n}\n'
    )
    assert json.loads(HfQuantConfig(bits=8).to_json_string()) == {
        "bits": 8,
        "clipping": "minmax",
        "compute_dtype": "auto",
        "decode_activations": "float",
        "embedding_dtype": "auto",
        "fold_column_scales": False,
        "format": "int",
        "format_version": 1,
        "group_size": None,
        "importance": "auto",
        "iq4_search": "lean",
        "lm_head": "keep",
        "method": "rtn",
        "mixed_precision": "none",
        "module_overrides": {},
        "modules_to_not_convert": [],
        "norm_dtype": "auto",
        "quant_method": "hfquant",
        "symmetric": True,
    }


CHOICES = {
    "method": (Method, "sinq", Method.SINQ),
    "mixed_precision": (MixedPrecision, "none", MixedPrecision.NONE),
    "clipping": (Clipping, "mse", Clipping.MSE),
    "iq4_search": (Iq4SearchMode, "fast", Iq4SearchMode.FAST),
    "importance": (Importance, "bos_activations", Importance.BOS_ACTIVATIONS),
    "embedding_dtype": (EmbeddingDtype, "int8", EmbeddingDtype.INT8),
    "norm_dtype": (FloatDtype, "float32", FloatDtype.FLOAT32),
    "lm_head": (LmHead, "int4", LmHead.INT4),
    "compute_dtype": (FloatDtype, "bfloat16", FloatDtype.BFLOAT16),
    "decode_activations": (DecodeActivations, "int8", DecodeActivations.INT8),
    "format": (QuantFormat, "q4_k", QuantFormat.Q4_K),
}


CHOICE_NEEDS = {"importance": {"format": "iq4_xs"}}
"""Other fields a choice of `CHOICES` needs (the BOS importance weighs a block format's search)."""


@pytest.mark.parametrize("field", list(CHOICES))
def test_closed_choices_are_str_enums_stored_as_members_and_written_as_strings(field):
    enum_class, text, member = CHOICES[field]
    assert issubclass(enum_class, str)
    for given in (text, member):
        config = HfQuantConfig(**{field: given}, **CHOICE_NEEDS.get(field, {}))
        assert getattr(config, field) is member and getattr(config, field) == text
        value = config.to_dict()[field]
        assert type(value) is str and value == text
        assert json.loads(config.to_json_string())[field] == text
        assert HfQuantConfig.from_dict(config.to_dict()) == config
    assert str(member) == text and f"{member}" == text
    if field != "method":  # a config Choice quotes as its value (`lm_head='int4'`); Method keeps the enum's repr
        assert repr(member) == repr(text)
    config = HfQuantConfig(bits=8)
    setattr(config, field, text)  # in place, as a plain string: stored as the member too
    assert getattr(config, field) is member
    setattr(config, field, "no-such-value")  # kept as given, for validate() to name
    with pytest.raises(ValueError, match="no-such-value"):
        config.validate()


def test_every_closed_choice_of_the_table_is_an_enum():
    enums = {f.name: f.choices for f in config_module.FIELDS if isinstance(f.choices, type)}
    assert {name: enums[name] for name in CHOICES} == {name: c[0] for name, c in CHOICES.items()}
    assert set(enums) == set(CHOICES)


def test_enums_match_the_values_the_core_modules_accept():
    assert tuple(m.value for m in MixedPrecision) == allocation.MIXED_PRECISION
    assert tuple(m.value for m in Clipping) == rtn.CLIPPING
    assert {m.value for m in FloatDtype} - {"auto"} == set(dtypes.FLOAT_DTYPES)
    assert {m.value for m in EmbeddingDtype} == {m.value for m in FloatDtype} | {"int8", "int4"}
    assert HfQuantConfig().layer_settings("x") == (4, 128, False, Method.SINQ, "iq4_xs")
    assert HfQuantConfig(format="int").layer_settings("x") == (4, 128, False, Method.SINQ, "int")
    assert {m.value for m in QuantFormat} == {"auto", "int"} | set(blocks.LAYOUTS)


def test_choice_error_names_the_value_the_allowed_ones_and_the_field():
    with pytest.raises(ValueError) as info:
        HfQuantConfig(clipping="p99")
    assert str(info.value) == (
        "clipping='p99' is not allowed; use one of ['minmax', 'mse'] (each group's range for Linear / Conv1D "
        "weights, after SINQ's column scale or a fold)."
    )


def test_another_quantizers_config_is_refused_for_its_quant_method_first():
    with pytest.raises(ValueError, match="quant_method='gptq' is not handled by HfQuantConfig") as gptq:
        HfQuantConfig.from_dict({"quant_method": "gptq", "bits": 4, "desc_act": True})
    assert "hfquant import" not in str(gptq.value)
    with pytest.raises(ValueError, match=r"\(hfquant import SRC DST makes an hfquant checkpoint of it\)\.$"):
        HfQuantConfig.from_dict({"quant_method": "compressed-tensors", "format": "pack-quantized"})


def test_config_json_of_earlier_versions_loads_with_what_it_stored():
    first = {
        "quant_method": "hfquant",
        "bits": 4,
        "group_size": 64,
        "symmetric": False,
        "modules_to_not_convert": [],
        "format_version": 1,
    }
    config = HfQuantConfig.from_dict(first)
    assert (config.method, config.mixed_precision, config.fold_column_scales, config.clipping) == (
        Method.RTN,
        MixedPrecision.NONE,
        False,
        Clipping.MINMAX,
    )
    assert config.decode_activations is DecodeActivations.FLOAT and config.embedding_dtype is EmbeddingDtype.AUTO
    sinq_before_folding = HfQuantConfig.from_dict(first | {"method": "sinq"})
    assert sinq_before_folding.fold_column_scales is False  # column scales were stored beside the layers
    assert config_module.LEGACY_DEFAULTS == {
        "method": "rtn",
        "mixed_precision": "none",
        "clipping": "minmax",
        "iq4_search": "thorough",
        "importance": "weights",
        "fold_column_scales": False,
        "format": "int",
        "lm_head": "keep",
    }
    assert config.format == "int"  # written before block formats existed
    assert config.lm_head == "keep"  # written before the 4-bit default's lm_head became int8


@pytest.mark.parametrize(
    "given, lm_head",
    [
        ({}, "int8"),  # the 4-bit default (iq4_xs)
        (dict(group_size=64), "int8"),  # the 4-bit int format
        (dict(format="iq4_xs"), "keep"),  # a block format asked by name: a GGUF export's own output type
        (dict(bits=4, format="int", group_size=32, symmetric=True, method="rtn"), "int8"),
        (dict(embedding_dtype="auto"), "int8"),
        (dict(bits=8), "keep"),
        (dict(format="q4_k"), "keep"),  # a block format: a GGUF export's own output type
        (dict(bits=3), "keep"),
        (dict(bits=3.5), "q6_k"),  # the 3-bit budget formats: llama.cpp's Q3_K_M output type
        (dict(format="hq3_r"), "q6_k"),
        (dict(format="hq3_nl", mixed_precision="none"), "q6_k"),
        (dict(bits=3.5, embedding_dtype="bfloat16"), "keep"),
        (dict(embedding_dtype="int8"), "keep"),  # a tied head follows the quantized embedding as before
        (dict(embedding_dtype="int4"), "keep"),
        (dict(embedding_dtype="bfloat16"), "keep"),  # an int8 default would conflict with a tied float table
        (dict(lm_head="keep"), "keep"),  # an explicit value always wins
        (dict(lm_head="int4"), "int4"),
        (dict(bits=8, lm_head="int8"), "int8"),
        (dict(embedding_dtype="int4", lm_head="int8"), "int8"),  # wins here too (a tied model then refuses it)
    ],
)
def test_the_lm_head_default_is_int8_for_the_4_bit_int_format_and_q6_k_for_the_3_bit_budget(given, lm_head):
    config = HfQuantConfig(**given)
    assert config.lm_head == lm_head and isinstance(config.lm_head, LmHead)
    assert HfQuantConfig.from_dict(config.to_dict()).lm_head == lm_head  # saved, it reloads as written
    if "lm_head" not in given:  # the format as the constructor saw it: "auto" when it was left to pick
        picked = "format" not in given and config.format == config_module.default_format(config.bits)
        fmt = "auto" if picked else config.format
        assert config_module.default_lm_head(config.bits, fmt, config.embedding_dtype) == lm_head


def test_an_entry_naming_a_layer_exactly_wins_over_a_pattern_listed_before_it():
    # config.json sorts its keys on save: "*.q_proj" comes back before "model.layers.0.self_attn.q_proj"
    config = HfQuantConfig(
        module_overrides={"*.q_proj": {"bits": 8}, "model.layers.0.self_attn.q_proj": {"format": "q4_k"}}
    )
    assert config.layer_settings("model.layers.0.self_attn.q_proj").format == "q4_k"
    assert config.layer_settings("model.layers.1.self_attn.q_proj").bits == 8
