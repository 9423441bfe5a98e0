"""`fold_column_scales`: SINQ column scales folded into norms and projections (`hfquant.core.folding`).

The fold must be an identity of the float model (checked without quantization, to float32 rounding), must leave a
checkpoint of plain RTN layers that reloads bit-exactly and exports, and must act only where every matrix it changes
is quantized."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import auto_class, input_ids, model_output, tiny_model
from transformers import AutoModelForCausalLM, Qwen2Config

from hfquant import HfQuantConfig
from hfquant.commands.cli import build_parser
from hfquant.commands.options import config_from_args
from hfquant.conversion.export import export_checkpoint
from hfquant.core import folding
from hfquant.core.format import Method
from hfquant.integration.folding import find_blocks, plan_folds
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import plan_layers
from hfquant.verification import verify

TOLERANCE = 1e-4
"""Largest |logit difference| / max |logit| allowed between a float32 model and its folded copy: float32 rounding of
the rescaled weights, nothing else."""


def _with_outliers(model) -> None:
    """Give the float model what SINQ's column scales are for: norms with spread weights, input columns with
    outliers, so that the fold's scales are far from 1 and a wrong fold shows in the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 + 0.1)
            elif name.endswith(("q_proj.weight", "gate_proj.weight", "o_proj.weight", "down_proj.weight")):
                param[:, :: param.shape[1] // 4] *= 12


def _qwen2(**overrides):
    values = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**(values | overrides))).float().eval()


MODELS = {
    "llama-gqa": lambda: tiny_model("llama"),
    "llama-mha": lambda: tiny_model("llama", num_key_value_heads=4),
    "qwen2-bias": _qwen2,
}


def _fold_state(model, config: HfQuantConfig):
    """(the folds plan_folds computes for `model`, its state dict with every fold applied, in float32)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plans = plan_layers(model, config, ["lm_head"])
    transforms = plan_folds(model, plans, state.__getitem__, progress=False, select=False)
    folded = dict(state)
    for module, transform in transforms.items():
        for name in ("weight", "bias"):
            key = f"{module}.{name}"
            if key in folded:
                folded[key] = folding.apply(folded[key], transform).to(folded[key].dtype)
    return transforms, folded


@pytest.mark.parametrize("name", MODELS)
def test_fold_is_an_identity_of_the_float_model(name):
    model = MODELS[name]()
    _with_outliers(model)
    ids = input_ids()
    before = model_output(model, ids)
    transforms, folded = _fold_state(model, HfQuantConfig(bits=4, group_size=32))
    blocks = find_blocks(model)
    assert len(blocks) == 2 and set(transforms) == {m for b in blocks for m in b}
    spread = max(
        (t.col_scale if t.col_scale is not None else t.row_scale).log().abs().max().item() for t in transforms.values()
    )
    assert spread > 0.5  # scales far from 1: a wrong fold would show
    model.load_state_dict(folded)
    after = model_output(model, ids)
    assert (after - before).abs().max().item() <= TOLERANCE * before.abs().max().item()


def test_a_fold_without_its_producer_changes_the_model():
    """The identity test can fail: the consumers' column scales without the norm's (or v_proj's) share do not."""
    model = tiny_model("llama")
    _with_outliers(model)
    ids = input_ids()
    before = model_output(model, ids)
    transforms, folded = _fold_state(model, HfQuantConfig(bits=4, group_size=32))
    for key in [k for k in folded if "layernorm" in k or "v_proj" in k]:
        folded[key] = model.state_dict()[key]
    model.load_state_dict(folded)
    assert (model_output(model, ids) - before).abs().max().item() > 100 * TOLERANCE * before.abs().max().item()


def test_share_across_heads_takes_the_geometric_mean_of_each_group():
    scale = torch.tensor([1.0, 4.0, 4.0, 1.0, 2.0, 2.0, 8.0, 8.0])  # 4 heads of dimension 2, 2 key/value heads
    rows, expanded = folding.share_across_heads(scale, num_heads=4, num_kv_heads=2)
    assert torch.allclose(rows, torch.tensor([2.0, 2.0, 4.0, 4.0]))
    assert torch.allclose(expanded, torch.tensor([2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0]))
    with pytest.raises(ValueError, match="3 query and 2 key/value heads"):
        folding.share_across_heads(scale[:6], num_heads=3, num_kv_heads=2)


def test_fold_into_norm_gives_back_the_norm_exactly():
    g = torch.tensor([0.5, -1.25, 0.0, 3.0], dtype=torch.bfloat16)
    c = torch.tensor([1.3, 0.7, 2.0, 1.01])
    transform, effective = folding.fold_into_norm(g, c)
    new = folding.apply(g, transform).to(torch.bfloat16)
    assert torch.equal(new, (g.float() * c).to(torch.bfloat16))  # g' = round(g * c)
    recovered = new.float() / effective
    assert torch.allclose(recovered[g != 0], g.float()[g != 0], rtol=1e-6)  # consumers divide by g' / g
    assert effective[2] == c[2]  # a zero weight keeps the column scale


def test_default_4bit_checkpoint_is_plain_rtn_reloads_bit_exactly_and_exports(float_checkpoint, tmp_path):
    src = float_checkpoint("llama", torch.bfloat16)
    model = auto_class("llama").from_pretrained(
        src, quantization_config=HfQuantConfig(bits=4, group_size=32), device_map="cpu"
    )
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert layers and all(
        m.format.method is Method.RTN and "weight_col_scale" not in m._buffers for m in layers.values()
    )
    source = auto_class("llama").from_pretrained(src, device_map="cpu")
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(model.state_dict()[norm], source.state_dict()[norm])  # the fold moved into the norm
    ids = input_ids()
    logits = model_output(model, ids)
    model.save_pretrained(tmp_path / "q")
    stored = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert stored["fold_column_scales"] is True
    head = layers.pop("lm_head")  # the 4-bit default's int8 lm_head: its own field, RTN, no fold entry
    assert head.format.method is Method.RTN and head.bits == 8 and "lm_head" not in stored["module_overrides"]
    assert all(stored["module_overrides"][name]["method"] == "rtn" for name in layers)
    again = auto_class("llama").from_pretrained(tmp_path / "q", device_map="cpu")
    assert torch.equal(model_output(again, ids), logits)
    first, second = model.state_dict(), again.state_dict()
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert verify(tmp_path / "q").problems == []
    # no stored column scale: compressed-tensors holds every layer (transformers' reader takes the mixed q/k/v set
    # that the data-free rule's int8 v_proj makes; vLLM's would get that set in float)
    result = export_checkpoint(tmp_path / "q", tmp_path / "ct", engine="transformers")
    assert result.quantized_layers == len(layers)


def test_folded_int4_is_closer_to_float_than_plain_rtn(float_checkpoint, tmp_path):
    """On weights with outlier input columns, the folded model's logits are nearer the float model's than RTN's."""
    model = tiny_model("llama")
    _with_outliers(model)
    model.save_pretrained(tmp_path / "src")
    ids = input_ids()
    reference = model_output(model, ids)
    errors = {}
    for fold in (False, True):
        config = HfQuantConfig(bits=4, group_size=32, method="rtn", fold_column_scales=fold)
        quantized = auto_class("llama").from_pretrained(tmp_path / "src", quantization_config=config, device_map="cpu")
        errors[fold] = (model_output(quantized, ids) - reference).norm().item() / reference.norm().item()
    assert errors[True] < 0.8 * errors[False], errors


def test_a_fold_needs_every_matrix_it_changes_quantized(float_checkpoint):
    config = HfQuantConfig(bits=4, group_size=32, modules_to_not_convert=["o_proj"])
    model = auto_class("llama").from_pretrained(
        float_checkpoint("llama"), quantization_config=config, device_map="cpu"
    )
    folds = model.hf_quantizer.plan.folds
    assert "model.layers.0.self_attn.o_proj" not in folds
    assert folds["model.layers.0.self_attn.v_proj"].row_scale is None  # nothing of o_proj moved into v_proj
    assert folds["model.layers.0.self_attn.v_proj"].col_scale is not None  # q/k/v still share the norm's fold
    assert torch.isfinite(model_output(model, input_ids())).all()


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_other_architectures_keep_stored_column_scales(float_checkpoint, arch):
    config = HfQuantConfig(bits=4, group_size=32)
    assert config.fold_column_scales is True and config.method == "sinq"
    model = auto_class(arch).from_pretrained(float_checkpoint(arch), quantization_config=config, device_map="cpu")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    head = layers.pop("lm_head", None)  # the 4-bit default's int8 lm_head: RTN, never SINQ or folded
    assert head is None or head.format.method is Method.RTN
    assert layers and all(m.format.method is Method.SINQ for m in layers.values())
    assert model.hf_quantizer.plan.folds == {}


def test_defaults_and_the_cli_flag():
    assert HfQuantConfig(bits=4).fold_column_scales is True
    assert HfQuantConfig(bits=4, method="rtn").fold_column_scales is False
    assert HfQuantConfig(bits=8).fold_column_scales is False
    assert (
        HfQuantConfig.from_dict(
            {"bits": 4, "group_size": 64, "symmetric": True, "modules_to_not_convert": [], "format_version": 1}
        ).fold_column_scales
        is False
    )  # written before the field
    parser = build_parser()
    assert (
        config_from_args(parser.parse_args(["convert", "a", "b", "--no-fold-column-scales"])).fold_column_scales
        is False
    )
    assert (
        config_from_args(
            parser.parse_args(["convert", "a", "b", "--method", "rtn", "--fold-column-scales"])
        ).fold_column_scales
        is True
    )
