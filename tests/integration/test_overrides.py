"""`module_overrides`: layers in their own format (mixed precision), through load, save, reload, verify and inspect."""

from __future__ import annotations

import torch
from helpers import auto_class, input_ids, model_output
from safetensors.torch import load_file

from hfquant import HfQuantConfig, QuantLinear
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
    assert again.config.quantization_config.module_overrides == OVERRIDES
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
