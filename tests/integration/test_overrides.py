"""`module_overrides`: layers in their own format (mixed precision), through load, save, reload, verify and inspect."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import auto_class, input_ids, model_output
from safetensors.torch import load_file

from hfquant import HfQuantConfig, QuantLinear
from hfquant.checkpoint.files import read_headers
from hfquant.conversion.convert import convert
from hfquant.core.format import Method, StoredFormat
from hfquant.inspection import inspect_checkpoint
from hfquant.verification import verify

OVERRIDES = {"v_proj": {"bits": 8}, "model.layers.1.mlp.*": {"method": "sinq", "group_size": 64}}


def test_mixed_precision_checkpoint_round_trips(float_checkpoint, tmp_path):
    src = float_checkpoint("llama")
    config = HfQuantConfig(bits=4, group_size=32, method="rtn", mixed_precision="none", module_overrides=OVERRIDES)
    model = auto_class("llama").from_pretrained(src, quantization_config=config, device_map="cpu")
    formats = {name: m.format for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert formats["model.layers.0.self_attn.v_proj"] == StoredFormat(8, 64, True)  # int8 defaults: per-channel
    assert formats["model.layers.1.mlp.up_proj"] == StoredFormat(4, 64, False, Method.SINQ)
    assert formats["model.layers.0.mlp.up_proj"] == StoredFormat(4, 32, False)
    ids = input_ids()
    logits = model_output(model, ids)
    model.save_pretrained(tmp_path / "q")
    again = auto_class("llama").from_pretrained(tmp_path / "q", device_map="cpu")
    # config.json names each layer stored in another format than the config's fields, by its full name, before the
    # user's patterns (which stay)
    int8 = {"bits": 8, "group_size": None, "symmetric": True, "method": "rtn"}  # int8's defaults: per-channel
    sinq = {"bits": 4, "group_size": 64, "symmetric": False, "method": "sinq"}
    assert again.config.quantization_config.module_overrides == {
        **{f"model.layers.{i}.self_attn.v_proj": int8 for i in range(2)},
        **{f"model.layers.1.mlp.{p}": sinq for p in ("gate_proj", "up_proj", "down_proj")},
        **OVERRIDES,
    }
    assert {n: m.format for n, m in again.named_modules() if isinstance(m, QuantLinear)} == formats
    assert torch.equal(model_output(again, ids), logits)
    assert verify(tmp_path / "q").problems == []
    rows = inspect_checkpoint(tmp_path / "q")["quantized"]
    v_proj = [r for r in rows if r["kind"] == "model.layers.*.self_attn.v_proj"]
    assert v_proj == [dict(v_proj[0], bits=8, group_size=64, symmetric=True, method="rtn", count=2)]
    assert any(r["kind"] == "model.layers.*.mlp.up_proj" and r["method"] == "sinq" and r["count"] == 1 for r in rows)


def test_convert_writes_the_same_mixed_precision_files(float_checkpoint, tmp_path):
    src = float_checkpoint("llama")
    config = HfQuantConfig(bits=4, group_size=32, module_overrides=OVERRIDES)
    auto_class("llama").from_pretrained(src, quantization_config=config, device_map="cpu").save_pretrained(
        tmp_path / "a"
    )
    convert(src, tmp_path / "b", config, progress=False)
    want, got = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    configs = [json.loads((tmp_path / f / "config.json").read_text())["quantization_config"] for f in "ab"]
    assert configs[0] == configs[1] and len(configs[0]["module_overrides"]) > len(OVERRIDES)


def _stored_formats(folder, in_features: dict[str, int]) -> dict[str, tuple]:
    """{layer: (bits, group size, symmetric, method)} as the tensor headers of `folder` store each quantized layer of
    `in_features` (layer name -> K): 8 bits when the codes have K columns, group K / scale columns."""
    headers = {}
    for path in folder.glob("*.safetensors"):
        headers.update(read_headers(path))
    formats = {}
    for layer, k in in_features.items():
        bits = 8 if headers[f"{layer}.weight"].shape[-1] == k else 4
        group = k // headers[f"{layer}.weight_scale"].shape[-1]
        symmetric = f"{layer}.weight_zero_point" not in headers
        formats[layer] = (bits, group, symmetric, "sinq" if f"{layer}.weight_col_scale" in headers else "rtn")
    return formats


def _recorded_formats(folder, in_features: dict[str, int]) -> dict[str, tuple]:
    """{layer: (bits, group size, symmetric, method)} as config.json records them, read literally: the layer's
    `module_overrides` entry completed by the config's fields (`layer_settings`), group None meaning K; no fallback
    for a group that does not divide K."""
    stored = json.loads((folder / "config.json").read_text())["quantization_config"]
    config = HfQuantConfig.from_dict(stored)
    formats = {}
    for layer, k in in_features.items():
        bits, group, symmetric, method = config.layer_settings(layer)[:4]
        if layer == "lm_head":  # the `lm_head` field: int8 per channel, symmetric, RTN (the 4-bit defaults)
            assert config.lm_head == "int8"
            bits, group, symmetric, method = 8, None, True, Method.RTN
        formats[layer] = (bits, k if group is None else group, symmetric, method.value)
    return formats


@pytest.mark.parametrize(
    "arch, settings, shape",
    [
        # the int format's 4-bit defaults on Llama blocks: folded (RTN), v_proj of layer 1 in int8, 96 inputs at 32
        ("llama", dict(format="int"), dict(hidden_size=96, intermediate_size=192)),
        # GPT-2 Conv1D layers are not folded: SINQ column scales stored; c_fc's 96 inputs fall back to 32
        ("gpt2", dict(bits=4, method="sinq", group_size=128), dict(n_embd=96)),
        # int8 per-channel with a 4-bit override at group 128 where 96 inputs take 32
        ("llama", dict(bits=8, module_overrides={"o_proj": {"bits": 4}}), dict(hidden_size=96)),
    ],
    ids=["llama-int4-default", "gpt2-sinq", "int8-override"],
)
def test_config_records_the_format_each_layer_is_stored_in(float_checkpoint, tmp_path, arch, settings, shape):
    """Issue #27 item 3: config.json read literally (no group fallback) gives every layer the bits, group size,
    symmetry and method its tensors store; the reload builds the same layers and the same logits."""
    src = float_checkpoint(arch, **shape)
    model = auto_class(arch).from_pretrained(src, quantization_config=HfQuantConfig(**settings), device_map="cpu")
    model.save_pretrained(tmp_path / "q")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tied = model.get_input_embeddings().weight  # GPT-2's lm_head is stored once, as wte (tests/nn/test_embedding.py)
    in_features = {name: layer.in_features for name, layer in layers.items() if layer.weight is not tied}
    stored = _stored_formats(tmp_path / "q", in_features)
    assert 32 in {group for _, group, _, _ in stored.values()}  # some layers fell back from the asked group
    assert _recorded_formats(tmp_path / "q", in_features) == stored
    again = auto_class(arch).from_pretrained(tmp_path / "q", device_map="cpu")
    assert {n: m.format for n, m in again.named_modules() if isinstance(m, QuantLinear)} == {
        n: m.format for n, m in layers.items()
    }
    ids = input_ids()
    assert torch.equal(model_output(again, ids), model_output(model, ids))


def test_checkpoint_without_the_entries_still_loads(float_checkpoint, tmp_path):
    """A config.json written before the stored formats were recorded (group 128 asked, 96 inputs stored at 32, no
    entry) loads the same layers: the group is read back as before, from the fallback rule."""
    src = float_checkpoint("llama", hidden_size=96)
    # lm_head "keep": such a checkpoint was written before the 4-bit default's int8 lm_head, with a float one
    config = HfQuantConfig(bits=4, format="int", method="rtn", mixed_precision="none", lm_head="keep")
    model = auto_class("llama").from_pretrained(src, quantization_config=config, device_map="cpu")
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    written = json.loads(path.read_text())
    assert written["quantization_config"]["module_overrides"]  # the 96-input layers are recorded at group 32
    written["quantization_config"]["module_overrides"] = {}
    path.write_text(json.dumps(written))
    again = auto_class("llama").from_pretrained(tmp_path, device_map="cpu")
    formats = {n: m.format for n, m in again.named_modules() if isinstance(m, QuantLinear)}
    assert formats == {n: m.format for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert {f.group_size for f in formats.values()} == {32, 128}
    ids = input_ids()
    assert torch.equal(model_output(again, ids), model_output(model, ids))
