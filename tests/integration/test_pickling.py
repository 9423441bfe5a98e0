"""A quantized model pickles (`torch.save(model)`, `copy.deepcopy`): the methods hfquant sets on the instance and the
one-row RMSNorm's run-time classes used to make `torch.save` / `torch.load` fail."""

from __future__ import annotations

import copy
import subprocess
import sys

import torch
from helpers import decode_logits, tiny_model
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hfquant import HfQuantConfig
from hfquant.checkpoint import saving
from hfquant.nn.row_norm import RowRMSNorm
from hfquant.ops import torch_ops


def _quantized(tmp_path):
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(bits=4, group_size=32), dtype=torch.bfloat16
    )


def _norms(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, LlamaRMSNorm)]


def test_torch_save_and_load_give_the_same_outputs_and_counts(tmp_path):
    model = _quantized(tmp_path)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(decode_logits(model), decode_logits(loaded), strict=True))
    assert loaded.num_parameters() == model.num_parameters() > sum(p.numel() for p in model.parameters())
    if torch_ops.loaded():  # the kernel's classes pickle as transformers' own: the copy runs the class's forward
        assert len(_norms(model)) == 5 and all(isinstance(norm, RowRMSNorm) for norm in _norms(model))
        assert all(type(norm) is LlamaRMSNorm for norm in _norms(loaded))


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
