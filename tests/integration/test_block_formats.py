"""Block formats (llama.cpp's types, `HfQuantConfig(format=...)`) through quantize-on-load, save and reload.

Each layer must compute x @ dequantize(blocks).T exactly as its stored bytes say, store the bytes docs/format.md
describes, reload bit-exactly, and fall back to llama.cpp's type for rows its blocks do not divide. The codecs' own
accuracy and byte layout are tested against gguf-py in tests/core."""

import json

import pytest
import torch
from helpers import input_ids, model_output, tiny_model
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.core import blocks
from hfquant.core.allocation import BUDGET_FORMATS
from hfquant.nn.linear import QuantLinear

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""A tiny Llama whose rows are whole 256-weight super-blocks."""


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide") / "float"
    tiny_model("llama", **WIDE).save_pretrained(folder)
    return folder


def _layers(model):
    """The decoder's quantized layers (the lm_head follows its own field: q6_k with the 3-bit budget formats)."""
    return {
        name: module for name, module in model.named_modules() if isinstance(module, QuantLinear) and name != "lm_head"
    }


@pytest.mark.parametrize("name", list(blocks.LAYOUTS))
def test_block_format_loads_computes_and_reloads_bit_exactly(wide_checkpoint, tmp_path, name):
    model = AutoModelForCausalLM.from_pretrained(wide_checkpoint, quantization_config=HfQuantConfig(format=name))
    layers = _layers(model)
    assert len(layers) == 14
    if name in BUDGET_FORMATS:  # config.default_lm_head: llama.cpp's Q3_K_M output type (rows of 256)
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.format.block == "q6_k"
    else:
        assert not isinstance(model.lm_head, QuantLinear)
    layout = blocks.layout(name)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for layer in layers.values():
        assert layer.format.block == name
        assert layer.weight.dtype == torch.uint8
        assert tuple(layer.weight.shape) == (
            layer.out_features,
            layout.row_bytes(layer.in_features),
        )
        if layer.in_features == 256:  # the layer multiplies by exactly the weight its bytes describe
            expected = x @ blocks.dequantize(name, layer.weight).T
            torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    model.save_pretrained(tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    saved, again = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == again.keys()
    assert all(torch.equal(saved[key], again[key]) for key in saved)
    ids = input_ids()
    assert torch.equal(model_output(reloaded, ids), model_output(model, ids))


@pytest.mark.parametrize("name", ["q8_0", "q6_k", "q4_k", "iq4_xs", "q3_k", "hq3_0", "hq3_nl", "hq3_r"])
def test_block_format_stays_close_to_the_float_model(wide_checkpoint, name):
    """Logits within a tolerance that grows with the quantization step: the relative error of the logits against
    the float model's is at most 4 * 2**-bits (measured about 2**-bits on this random model)."""
    float_model = AutoModelForCausalLM.from_pretrained(wide_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(wide_checkpoint, quantization_config=HfQuantConfig(format=name))
    ids = input_ids()
    reference, got = model_output(float_model, ids), model_output(model, ids)
    error = float((got - reference).norm() / reference.norm())
    assert error < 4 * 2.0 ** -blocks.layout(name).bits, error


def test_rows_the_blocks_do_not_divide_take_llama_cpps_fallback_and_the_config_names_it(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "float")  # hidden 64, intermediate 128: no 256-weight rows
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=HfQuantConfig(bits=3))
    assert {layer.format.block for layer in _layers(model).values()} == {blocks.layout("q3_k").fallback}
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert saved["format"] == "q3_k" and saved["bits"] == 3
    assert len(saved["module_overrides"]) == 14
    assert all(entry == {"format": "iq4_nl", "method": "rtn"} for entry in saved["module_overrides"].values())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert {layer.format.block for layer in _layers(reloaded).values()} == {"iq4_nl"}


def test_gradients_flow_through_block_layers_as_through_their_dequantized_weights(wide_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(wide_checkpoint, quantization_config=HfQuantConfig(format="q4_k"))
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    layer(x).square().sum().backward()
    reference_x = x.detach().clone().requires_grad_(True)
    (reference_x @ layer.dequantize().T).square().sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=1e-4, atol=1e-4)


def test_inspect_reports_each_layers_block_format_and_its_bytes(wide_checkpoint, tmp_path):
    from hfquant.inspection import inspect_checkpoint

    config = HfQuantConfig(bits=3, module_overrides={"v_proj": {"format": "q6_k"}})
    AutoModelForCausalLM.from_pretrained(wide_checkpoint, quantization_config=config).save_pretrained(tmp_path / "q")
    report = inspect_checkpoint(tmp_path / "q")
    formats = {row["kind"]: (row["format"], row["bits"], row["count"]) for row in report["quantized"]}
    assert formats["model.layers.*.self_attn.v_proj"] == ("q6_k", 6, 2)
    assert formats["model.layers.*.mlp.down_proj"] == ("q3_k", 3, 2)
    assert report["totals"]["quantized_layers"] == 14 and not any("proj" in r["kind"] for r in report["float_layers"])
    q3_rows = [row for row in report["quantized"] if row["format"] == "q3_k"]
    assert all(row["bytes"] * 8 / (row["float_bytes"] / 4) == blocks.layout("q3_k").bits_per_weight for row in q3_rows)


@pytest.mark.parametrize(
    "spelling",
    [
        dict(format="hq3_0", mixed_precision="auto"),
        dict(format="hq3_nl", mixed_precision="auto"),
        dict(format="hq3_r", mixed_precision="auto"),
        dict(bits=3.5),
    ],
)
def test_the_3_5_bit_budget_writes_every_layers_format_and_reloads(tmp_path, spelling):
    """`format="hq3_r", mixed_precision="auto"` (or `bits=3.5`; or "hq3_nl", "hq3_0"): Q3_K where 256 divides a row,
    the format elsewhere (hq3_r: its fallback hq3_nl where 64 does not divide a row: 96 here), value
    projections raised while the stored bits stay within 3.5 per weight; config.json names each layer's format and
    the reload holds the same bytes."""
    tiny_model(
        "llama", hidden_size=96, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    ).save_pretrained(tmp_path / "float")
    config = HfQuantConfig(**spelling)
    base = config.format
    assert base == spelling.get("format", "hq3_r")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=config)
    layers = _layers(model)
    assert len(layers) == 14
    assert model.lm_head.format.block == "q8_0"  # the q6_k default's fallback on rows of 96
    stored_bits = sum(layer.weight.numel() * 8 for layer in layers.values())  # row headers included
    weights = sum(layer.in_features * layer.out_features for layer in layers.values())
    assert stored_bits / weights <= 3.5
    assert {layers[n].format.block for n in layers if n.endswith("down_proj")} <= {"q3_k", "q4_k", "q5_k"}
    first = base if 96 % blocks.layout(base).block_size == 0 else blocks.layout(base).fallback
    assert {layers[n].format.block for n in layers if n.endswith("q_proj")} == {first}
    assert any(layers[n].format.block != first for n in layers if n.endswith("v_proj"))
    model.save_pretrained(tmp_path / "q")
    saved = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert set(saved["module_overrides"]) == set(layers) | {"lm_head"}  # every table's block type, by name
    assert all(saved["module_overrides"][n]["format"] == layers[n].format.block for n in layers)
    assert saved["module_overrides"]["lm_head"] == {"format": "q8_0"}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    again = _layers(reloaded)
    assert all(torch.equal(again[n].weight, layers[n].weight) for n in layers)
    ids = input_ids()
    assert torch.equal(model_output(reloaded, ids), model_output(model, ids))


def test_convert_counts_block_format_layers_as_quantized(wide_checkpoint, tmp_path):
    from hfquant.conversion.convert import convert

    result = convert(wide_checkpoint, tmp_path / "q", config=HfQuantConfig(format="q4_k"), progress=False)
    assert result.quantized_layers == 14  # one uint8 tensor per layer, no scales beside it: still a quantized layer


def test_a_mixed_block_groups_members_are_byte_ranges_of_one_tensor(tmp_path, monkeypatch):
    """`bits=3.5` raises some value projections above their Q3_K q/k siblings: quantized on load, the members of such
    a q/k/v group are consecutive byte ranges of one uint8 tensor (`GroupRows`; on huge pages where it is 2 MiB or
    more), with the state dict, the saved bytes and the logits of a load that gives each member a tensor of its
    own."""
    from hfquant.integration.quantize_weights import GroupRows

    tiny_model(
        "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    ).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=HfQuantConfig(bits=3.5))
    mixed = 0
    for layer in model.model.layers:
        members = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        if len({member.format.block for member in members}) == 1:
            continue
        mixed += 1
        weights = [member.weight for member in members]
        assert len({weight.untyped_storage().data_ptr() for weight in weights}) == 1
        assert all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(weights[:-1], weights[1:], strict=True))
    assert mixed > 0
    monkeypatch.setattr(GroupRows, "_block_bytes", lambda rows, group, module: None)
    apart = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=HfQuantConfig(bits=3.5))
    saved, reference = model.state_dict(), apart.state_dict()
    assert saved.keys() == reference.keys()
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.items())
    ids = input_ids()
    assert torch.equal(model_output(model, ids), model_output(apart, ids))
    model.save_pretrained(tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in reference.items())
    assert torch.equal(model_output(reloaded, ids), model_output(apart, ids))
