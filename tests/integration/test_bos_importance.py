"""`HfQuantConfig(importance="bos_activations")`: the BOS token's forward in the fold pre-pass
(`hfquant.integration.bos_importance`) and its importance in the block search of q/k/v and gate/up."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.integration.bos_importance import BosForward
from hfquant.integration.folding import find_blocks, plan_folds
from hfquant.nn.replace import plan_layers

TOLERANCE = 1e-5
"""Relative tolerance (of the vector's max magnitude) between the carried float32 vector and the float32 model's own
layer input: the same operations in a different order (chunked matrix-vector products, one token)."""


def _model(layers: int = 3, **overrides):
    """A tiny grouped-query Llama (4 query heads, 2 kv heads) with spread-out norm weights and a few large residual
    channels, as trained models have."""
    model = tiny_model("llama", num_hidden_layers=layers, **overrides)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 + 0.1)
        model.model.embed_tokens.weight[:, :4] *= 20
    return model


def _inputs_of(model, names: list[str], token: int) -> dict[str, torch.Tensor]:
    seen = {}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda module, args, out, name=name: seen.__setitem__(name, args[0].reshape(-1).clone())
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([[token]]))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOLERANCE * float(b.abs().max())


def test_the_carried_vector_is_the_float_models_input_of_q_and_gate_for_the_bos_token():
    model = _model(attention_bias=True, mlp_bias=True)
    state = model.state_dict()
    blocks = find_blocks(model)
    seen = _inputs_of(model, [n for b in blocks for n in (b.q, b.gate)], model.config.bos_token_id)
    forward = BosForward(model, blocks, state.__getitem__)
    order = [2, 0, 1]  # the pre-pass may fold out of order
    for index in order:
        x1, x2 = forward.inputs(index)
        assert _close(x1, seen[blocks[index].q]) and _close(x2, seen[blocks[index].gate])
    other = _inputs_of(model, [blocks[1].q], 5)[blocks[1].q]  # another token's input differs: the check can fail
    assert not _close(forward.inputs(1)[0], other)


def test_a_model_without_a_bos_token_is_refused_naming_it():
    model = _model(bos_token_id=None)
    with pytest.raises(ValueError, match="no bos_token_id"):
        BosForward(model, find_blocks(model), model.state_dict().__getitem__)


def test_plan_folds_gives_the_normed_layers_the_squared_folded_input_normalised():
    model = _model()
    state = model.state_dict()
    plans = plan_layers(model, HfQuantConfig(format="iq4_nl"), ["lm_head"])
    folds = plan_folds(model, plans, state.__getitem__, progress=False, importance="bos_activations")
    plain = plan_folds(model, plans, state.__getitem__, progress=False)
    blocks = find_blocks(model)
    forward = BosForward(model, blocks, state.__getitem__)
    for index, block in enumerate(blocks):
        x1, x2 = forward.inputs(index)
        for x, name in ((x1, block.q), (x1, block.v), (x2, block.up)):
            scale = folds[name].col_scale
            expected = x.square().clamp_min(1e-12) * (scale.square() if scale is not None else 1)
            assert torch.allclose(folds[name].importance, expected / expected.mean(), rtol=1e-6)
            assert torch.equal(folds[name].col_scale, plain[name].col_scale)  # the folds themselves unchanged
        assert folds[block.o].importance is None and folds[block.down].importance is None
        assert plain[block.q].importance is None


def _stored(folder, **settings) -> dict[str, torch.Tensor]:
    config = HfQuantConfig(format="iq4_nl", **settings)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, device_map="cpu")
    return {name: buffer.clone() for name, buffer in model.named_buffers() if name.endswith(".weight")}


def test_the_importance_reaches_the_search_of_the_normed_layers_only(tmp_path):
    model = _model(layers=2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    weights = _stored(tmp_path, importance="weights")
    bos = _stored(tmp_path, importance="bos_activations")
    changed = {name for name in weights if not torch.equal(weights[name], bos[name])}
    normed = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert changed and all(name.split(".")[-2] in normed for name in changed)
    assert any("q_proj" in name for name in changed) and any("up_proj" in name for name in changed)
    auto = _stored(tmp_path)  # the default, "auto": the BOS importance on a folded Llama with a BOS token
    assert all(torch.equal(auto[name], bos[name]) for name in bos)


def test_auto_importance_is_weights_without_a_bos_token(tmp_path):
    model = _model(layers=2)
    model.config.bos_token_id = None
    model.save_pretrained(tmp_path, safe_serialization=True)
    weights = _stored(tmp_path, importance="weights")
    auto = _stored(tmp_path)
    assert all(torch.equal(auto[name], weights[name]) for name in weights)
    with pytest.raises(ValueError, match="has no bos_token_id"):
        _stored(tmp_path, importance="bos_activations")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(importance="tokens"),
            r"importance='tokens' is not allowed; use one of \['auto', 'weights', 'bos_activations'\]",
        ),
        (dict(format="int", importance="bos_activations"), r"format='int' is round-to-nearest"),
        (dict(group_size=64, importance="bos_activations"), r"format='int' is round-to-nearest"),
        (dict(format="q4_k", method="rtn", importance="bos_activations"), "runs in the fold pre-pass"),
    ],
)
def test_the_importance_errors_name_the_value(settings, message):
    with pytest.raises(ValueError, match=message):
        HfQuantConfig(**settings)


def test_the_importance_round_trips_through_config_json():
    config = HfQuantConfig(format="iq4_xs", importance="bos_activations")
    saved = config.to_dict()
    assert saved["importance"] == "bos_activations"
    assert HfQuantConfig.from_dict(saved) == config
    legacy = {k: v for k, v in HfQuantConfig(format="iq4_xs").to_dict().items() if k != "importance"}
    assert HfQuantConfig.from_dict(legacy).importance == "weights"


def _on_iq4_nl_grid(model):
    """`model` with every projection moved onto an IQ4_NL grid (its reference quantization, dequantized, of the
    weight with a few heavy columns): a model dequantized from an IQ4_NL GGUF file."""
    from hfquant.core import blocks
    from hfquant.core.blocks import iq4

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                weight = param.float().clone()
                weight[:, ::16] *= 12
                param.copy_(blocks.dequantize("iq4_nl", iq4.reference_iq4_nl(weight)))
    return model


def test_a_refused_fold_keeps_the_formats_search_and_its_grid(tmp_path):
    """Weights already on the format's grid refuse their folds (`folding._fold_lowers_error`); their layers then get no
    BOS importance (the search the error test measured) and the load gives the grid back. (Here the BOS importance
    would give it back too: the plan's assertion is the one that fails when a refused layer gets x^2.)"""
    model = _on_iq4_nl_grid(_model(layers=2))
    state = model.state_dict()
    plans = plan_layers(model, HfQuantConfig(format="iq4_nl"), ["lm_head"])
    folds = plan_folds(model, plans, state.__getitem__, progress=False, importance="bos_activations")
    normed = [n for b in find_blocks(model) for n in (b.q, b.k, b.v, b.gate, b.up)]
    assert all(folds[n].col_scale is None and folds[n].importance is None for n in normed)
    model.save_pretrained(tmp_path, safe_serialization=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=HfQuantConfig(format="iq4_nl", importance="bos_activations"), device_map="cpu"
    )
    for name in normed:
        restored, original = loaded.get_submodule(name).dequantize(), state[name + ".weight"]
        assert float((restored - original).norm() / original.norm()) < 1e-6, name
