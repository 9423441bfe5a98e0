"""A quantized model pickles (`torch.save(model)`, `copy.deepcopy`): the methods hfquant sets on the instance and the
one-row RMSNorm's run-time classes used to make `torch.save` / `torch.load` fail; a copy decodes as fast as the
original (the row classes and the projections' decode groups rebuilt), to the same tokens."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from helpers import decode_logits, tiny_model
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hfquant import HfQuantConfig
from hfquant.checkpoint import saving
from hfquant.nn.row_decode import RowDecodeAttention, RowDecodeLayer, RowDecodeLayers, RowDecodeMLP
from hfquant.nn.row_norm import RowRMSNorm
from hfquant.ops import torch_ops


def _quantized(tmp_path, **config):
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    config = config or dict(bits=4, group_size=32)
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(**config), dtype=torch.bfloat16
    )


def _norms(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, LlamaRMSNorm)]


def test_torch_save_and_load_give_the_same_outputs_and_counts(tmp_path):
    model = _quantized(tmp_path)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(decode_logits(model), decode_logits(loaded), strict=True))
    assert loaded.num_parameters() == model.num_parameters() > sum(p.numel() for p in model.parameters())
    if torch_ops.loaded():  # the copy runs the same kernels as the original
        assert _fast_paths(loaded) == _fast_paths(model)
        assert _fast_paths(model)[:4] == (5, 2, 2, 2)


def _fast_paths(model) -> tuple:
    """(row norms, row-decode attention / MLP / decoder layers, whether layer 0's q/k/v share a decode group, whether
    it is built: its one GEMV runs)"""
    kinds = (RowRMSNorm, RowDecodeAttention, RowDecodeMLP, RowDecodeLayer)
    counts = tuple(sum(isinstance(module, kind) for module in model.modules()) for kind in kinds)
    attention = model.model.layers[0].self_attn
    group = attention.q_proj._decode_group
    linked = group is not None and group is attention.k_proj._decode_group is attention.v_proj._decode_group
    return (*counts, linked, linked and group.build())


def test_a_deep_copy_decodes_through_the_same_kernels_to_the_same_logits(tmp_path):
    model = _quantized(tmp_path, bits=4)  # the default: block formats, whose decode groups build on any CPU
    clone = copy.deepcopy(model)
    if torch_ops.loaded():
        assert _fast_paths(clone) == _fast_paths(model) == (5, 2, 2, 2, True, True)
        assert type(clone.model.layers) is RowDecodeLayers
    assert all(torch.equal(a, b) for a, b in zip(decode_logits(model), decode_logits(clone), strict=True))
    ids = torch.tensor([[5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(clone.generate(ids, max_new_tokens=6, do_sample=False), expected)


def test_a_copy_without_the_operators_runs_the_transformers_forwards(tmp_path, monkeypatch):
    model = _quantized(tmp_path)
    if not torch_ops.loaded():
        pytest.skip("needs hfquant's operators for the original's row classes")
    monkeypatch.setattr(torch_ops, "loaded", lambda: False)
    clone = copy.deepcopy(model)
    assert _fast_paths(clone)[:4] == (0, 0, 0, 0)
    assert all(type(norm) is LlamaRMSNorm for norm in _norms(clone))


def test_a_deep_copy_saves_itself_through_the_staged_writer(tmp_path):
    model = _quantized(tmp_path)
    clone = copy.deepcopy(model)
    assert clone.save_pretrained.func is saving._staged_save_pretrained
    assert clone.save_pretrained.args[0] is clone
    clone.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    saved, again = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[name], again[name]) for name in saved)


def test_a_fresh_process_loads_the_pickled_model_and_decodes_the_same(tmp_path):
    """Unpickled in a new process, the layers' kernel plans name operators and an attention function that only an
    hfquant call had set up in the first one: both are found again (the greedy tokens are the first process's)."""
    model = _quantized(tmp_path)
    ids = torch.tensor([[5, 6, 7]])
    expected = model.generate(ids, max_new_tokens=6, do_sample=False).tolist()
    torch.save(model, tmp_path / "model.pt")
    code = (
        "import sys, torch\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        "ids = torch.tensor([[5, 6, 7]])\n"
        "print(model.config._attn_implementation)\n"
        "print(model.generate(ids, max_new_tokens=6, do_sample=False).tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    attention, tokens = done.stdout.strip().splitlines()[-2:]
    assert attention == model.config._attn_implementation
    assert tokens == str(expected)
