"""Tests of hfquant.nn.replace: module selection by name, layer plans and the swap to QuantLinear."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant.config import HfQuantConfig, matches_module
from hfquant.core.format import StoredFormat
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import output_embedding, plan_layers, quantized_format, replace_with_quant_linear

DOWN = "model.layers.0.mlp.down_proj"
UP = "model.layers.0.mlp.up_proj"
Q = "model.layers.0.self_attn.q_proj"

MATCHES = [
    # whole dotted name
    ("lm_head", ["lm_head"], True),
    (DOWN, [DOWN], True),
    # whole-component suffix
    (DOWN, ["down_proj"], True),
    (DOWN, ["mlp.down_proj"], True),
    (DOWN, ["layers.0.mlp.down_proj"], True),
    ("model.layers.0.mlp.xdown_proj", ["down_proj"], False),
    ("model.layers.0.mlp.down_proj_x", ["down_proj"], False),
    ("lm_head_norm", ["lm_head"], False),
    ("model.lm_head_norm", ["lm_head"], False),
    ("lm_head", ["lm_head_norm"], False),
    # substrings never match
    (Q, ["proj"], False),
    (Q, ["_proj"], False),
    (Q, ["self_attn.q"], False),
    (DOWN, ["layers.0.ml"], False),
    (DOWN, ["ayers.0.mlp.down_proj"], False),
    # ancestors select their children, by name or suffix, never the reverse
    (UP, ["model.layers.0"], True),
    (UP, ["model.layers.0.mlp"], True),
    (UP, ["mlp"], True),
    (UP, ["0.mlp"], True),
    ("model.layers.10.mlp.up_proj", ["model.layers.1"], False),
    ("model.layers.10.mlp.up_proj", ["layers.1"], False),
    ("model.layers.0.mlp", [UP], False),
    # fnmatch patterns against the full dotted name
    (DOWN, ["model.layers.*.mlp.down_proj"], True),
    ("model.layers.11.mlp.down_proj", ["model.layers.*.mlp.down_proj"], True),
    (DOWN, ["model.layers.*.self_attn.o_proj"], False),
    (Q, ["*.q_proj"], True),
    (Q, ["*.k_proj"], False),
    ("model.layers.1.mlp.up_proj", ["model.layers.[01].mlp"], True),  # an ancestor matches the pattern
    ("model.layers.2.mlp.up_proj", ["model.layers.[01].mlp"], False),
    (Q, ["model.layers.?.self_attn.q_proj"], True),
    ("model.layers.12.self_attn.q_proj", ["model.layers.?.self_attn.q_proj"], False),
    ("model.layers.0.mlp", ["layers.*.mlp"], False),  # patterns are anchored at the start of the full name
    # case-sensitive, several patterns, none
    ("lm_head", ["LM_HEAD"], False),
    ("lm_head", ["LM_*"], False),
    (DOWN, ["q_proj", "down_proj"], True),
    (DOWN, [], False),
]


@pytest.mark.parametrize("name, patterns, expected", MATCHES, ids=[f"{n}~{p}" for n, p, _ in MATCHES])
def test_matches_module(name, patterns, expected):
    assert matches_module(name, patterns) is expected


def test_matches_module_accepts_any_iterable_of_patterns():
    assert matches_module(DOWN, ("down_proj",))
    assert matches_module(DOWN, (p for p in ["x", "down_proj"]))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(64, 128, bias=False)
        self.down_proj = nn.Linear(128, 64, bias=True)
        self.odd = nn.Linear(48, 16)  # 48 = 16 * 3: no power-of-two group >= 32 divides it
        self.c_attn = Conv1D(96, 64)  # GPT-2 style: weight (nx=64, nf=96)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 100, bias=False)


def _plans_by_name(model, bits, group, skip, **config):
    config.setdefault("method", "rtn")
    return {plan.name: plan for plan in plan_layers(model, HfQuantConfig(bits=bits, group_size=group, **config), skip)}


def test_plan_layers_covers_every_linear_and_conv1d():
    plans = _plans_by_name(_Tiny(), 4, 32, ["lm_head"])
    expected_names = {f"layers.{i}.{child}" for i in (0, 1) for child in ("up_proj", "down_proj", "odd", "c_attn")}
    assert set(plans) == expected_names | {"lm_head"}
    assert plans["lm_head"].group_size is None and plans["lm_head"].reason == "modules_to_not_convert"
    assert plans["layers.0.up_proj"][1:] == (64, 128, StoredFormat(4, 32, False), "", False)
    assert plans["layers.1.down_proj"][1:] == (128, 64, StoredFormat(4, 32, False), "", False)
    conv = plans["layers.0.c_attn"]
    assert (conv.in_features, conv.out_features, conv.group_size, conv.transposed) == (64, 96, 32, True)
    odd = plans["layers.0.odd"]
    assert odd.group_size is None and "48" in odd.reason


def test_plan_layers_uses_the_effective_group_size_and_per_channel():
    plans = _plans_by_name(_Tiny(), 4, 128, [])
    assert plans["layers.0.up_proj"].group_size == 64  # 128 does not divide 64 inputs
    assert plans["layers.0.down_proj"].group_size == 128
    assert plans["lm_head"].group_size == 64
    per_channel = _plans_by_name(_Tiny(), 8, None, [])
    assert per_channel["layers.0.odd"].group_size == 48  # per-channel needs no divisor
    assert per_channel["layers.0.down_proj"].group_size == 128


def test_plan_layers_honors_patterns_and_ancestors():
    plans = _plans_by_name(_Tiny(), 8, None, ["layers.1", "*.c_attn", "down_proj"])
    kept = {name for name, plan in plans.items() if plan.group_size is None}
    assert kept == {"layers.0.down_proj", "layers.0.c_attn"} | {
        f"layers.1.{child}" for child in ("up_proj", "down_proj", "odd", "c_attn")
    }


def test_plan_layers_skips_modules_that_are_already_quantized():
    model = _Tiny()
    model.layers[0].up_proj = QuantLinear(64, 128, StoredFormat(8, 64, True), bias=False)
    assert "layers.0.up_proj" not in _plans_by_name(model, 8, None, [])


@pytest.mark.parametrize("bits, symmetric", [(8, True), (4, False)])
def test_replace_with_quant_linear_swaps_planned_layers_on_meta(bits, symmetric):
    model = _Tiny()
    plans = plan_layers(model, HfQuantConfig(bits=bits, group_size=32, symmetric=symmetric), ["lm_head"])
    replaced = replace_with_quant_linear(model, plans, torch.bfloat16)
    assert replaced == 6  # up_proj, down_proj, c_attn in each of the two blocks
    for i in (0, 1):
        block = model.layers[i]
        for child, (k, n, has_bias, transposed) in {
            "up_proj": (64, 128, False, False),
            "down_proj": (128, 64, True, False),
            "c_attn": (64, 96, True, True),
        }.items():
            layer = getattr(block, child)
            assert isinstance(layer, QuantLinear), child
            assert (layer.in_features, layer.out_features, layer.bits, layer.group_size) == (k, n, bits, 32)
            assert layer.symmetric is symmetric
            assert layer.weight.device.type == "meta"
            assert (layer.bias is not None) is has_bias
            if has_bias:
                assert layer.bias.dtype == torch.bfloat16 and not layer.bias.requires_grad
            assert layer.transposed_source is transposed
        assert type(block.odd) is nn.Linear
    assert type(model.lm_head) is nn.Linear


def test_replace_keeps_the_layer_dtype_when_none_is_given():
    model = _Tiny().to(torch.float16)
    replace_with_quant_linear(model, plan_layers(model, HfQuantConfig(bits=8), []), None)
    assert model.layers[0].down_proj.bias.dtype == torch.float16
    assert model.layers[0].down_proj.compute_dtype == torch.float16


@pytest.mark.parametrize(
    "storage, config, in_features, expected",
    [
        # the layers' width: their group size (resolved for the row length) and symmetry
        ("int4", dict(bits=4, group_size=32, symmetric=True), 576, StoredFormat(4, 32, True)),
        ("int4", dict(bits=4), 576, StoredFormat(4, 64, False)),  # group 128 asked, 576 inputs -> 64
        ("int8", dict(bits=8), 576, StoredFormat(8, 576, True)),  # per-row
        # another width: that width's defaults
        ("int4", dict(bits=8), 576, StoredFormat(4, 64, False)),
        ("int8", dict(bits=4, group_size=32), 576, StoredFormat(8, 576, True)),
        # no group size fits: stays in float
        ("int4", dict(bits=8), 33, None),
        ("int8", dict(bits=8, group_size=32), 48, None),
    ],
)
def test_quantized_format_of_embeddings_and_lm_head(storage, config, in_features, expected):
    assert quantized_format(storage, HfQuantConfig(**config), in_features) == expected


def test_module_overrides_give_matching_layers_their_own_format():
    """The first matching pattern wins; a bits override alone takes that width's defaults (int8: per-channel,
    symmetric); keys it leaves out keep the config's values at the config's width; modules_to_not_convert wins."""
    overrides = {"layers.1.down_proj": {"method": "sinq"}, "down_proj": {"bits": 8}, "c_attn": {"group_size": 64}}
    plans = _plans_by_name(_Tiny(), 4, 32, ["layers.1.up_proj"], module_overrides=overrides)
    assert plans["layers.0.down_proj"].format == StoredFormat(8, 128, True)  # per-channel: group = in_features
    assert plans["layers.1.down_proj"].format == StoredFormat(4, 32, False, "sinq")
    assert plans["layers.0.c_attn"].format == StoredFormat(4, 64, False)
    assert plans["layers.0.up_proj"].format == StoredFormat(4, 32, False)
    assert plans["layers.1.up_proj"].format is None


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"v_proj": {"bits": 7}}, ["module_overrides['v_proj']", "bits=7"]),
        ({"v_proj": {"group": 64}}, ["module_overrides['v_proj']", "'group'", "bits"]),
        ({"v_proj": {"method": "gptq"}}, ["module_overrides['v_proj']", "method='gptq'"]),
        ({"": {"bits": 8}}, ["non-empty module patterns"]),
        (["v_proj"], ["must map module patterns"]),
    ],
)
def test_bad_module_overrides_are_named(overrides, words):
    with pytest.raises((TypeError, ValueError)) as info:
        HfQuantConfig(bits=4, module_overrides=overrides)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_output_embedding_of_any_module():
    """The lm_head whatever class it has (a QuantLinear once quantized), None for a module without one."""
    model = tiny_model("llama")
    assert output_embedding(model) is model.lm_head
    weight = model.lm_head.weight.detach()
    model.lm_head = QuantLinear.from_float(weight, None, StoredFormat(8, weight.shape[1], True))
    assert output_embedding(model) is model.lm_head
    assert output_embedding(model.model) is None  # the base model: no lm_head
    assert output_embedding(nn.Linear(4, 4)) is None  # no get_output_embeddings at all

    class Backbone(nn.Module):
        def get_output_embeddings(self):
            raise NotImplementedError

    assert output_embedding(Backbone()) is None
