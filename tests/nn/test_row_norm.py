"""The one-row RMSNorm (`hfquant.nn.row_norm`, `csrc/norm_cpu.c`): transformers' LlamaRMSNorm forward bit for bit on
single bfloat16 rows, installed on known norm classes only, and removable without a trace."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from helpers import decode_logits, graph_ops, tiny_model
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from hfquant.nn import row_norm
from hfquant.nn.row_norm import (
    ROW_RMS_NORM_CLASSES,
    RowRMSNorm,
    agrees_with_forward,
    restore_rms_norms,
    use_row_rms_norms,
)
from hfquant.ops import torch_ops

pytestmark = pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _norm(cls, size: int, eps: float, seed: int) -> torch.nn.Module:
    norm = cls(size, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 0.5 + 1.0)
    return norm


# sizes: SmolLM2 (576), 1.2B (2048), 8B (4096), 8192 (the sum's cascade levels), tails of 1-7 inputs and of vectors
@pytest.mark.parametrize("size", [1, 7, 64, 100, 576, 2048, 4099, 8192])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_kernel_gives_llama_rms_norm_bits(size, eps):
    norm = _norm(LlamaRMSNorm, size, eps, seed=size)
    generator = torch.Generator().manual_seed(1)
    for _ in range(64):
        scale = 10.0 ** (torch.rand((), generator=generator).item() * 8 - 4)
        x = (torch.randn((1, 1, size), generator=generator) * scale).to(torch.bfloat16)
        with torch.no_grad():
            expected = LlamaRMSNorm.forward(norm, x)
        got = torch.ops.hfquant_cpu.rms_norm_row(x, norm.weight, eps)
        assert got.shape == expected.shape and got.dtype == torch.bfloat16
        assert torch.equal(_bits(got), _bits(expected))


def test_kernel_keeps_zeros_and_outliers():
    norm = _norm(LlamaRMSNorm, 576, 1e-5, seed=0)
    rows = [torch.zeros(576), torch.full((576,), 3.0e38), torch.eye(576)[5] * 1e-30]
    for row in rows:
        x = row.to(torch.bfloat16).view(1, 1, 576)
        with torch.no_grad():
            expected = LlamaRMSNorm.forward(norm, x)
        assert torch.equal(_bits(torch.ops.hfquant_cpu.rms_norm_row(x, norm.weight, 1e-5)), _bits(expected))


def test_operator_refuses_what_it_cannot_compute():
    weight = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="one row of 64"):
        torch.ops.hfquant_cpu.rms_norm_row(torch.zeros(2, 64, dtype=torch.bfloat16), weight, 1e-5)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.hfquant_cpu.rms_norm_row(torch.zeros(1, 64), weight, 1e-5)


def _class(name: str) -> type:
    family = name.removesuffix("RMSNorm").lower()
    family = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "granitemoe": "granitemoe"}.get(family, family)
    return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)


@pytest.mark.parametrize("name", sorted(ROW_RMS_NORM_CLASSES))
def test_every_listed_class_computes_as_llama(name):
    """The allow-list is read from transformers' source: a class whose forward changes must leave it."""
    cls = _class(name)
    assert inspect.getsource(cls.forward) == inspect.getsource(LlamaRMSNorm.forward)
    assert inspect.getsource(cls.__init__).replace(name, "LlamaRMSNorm") == inspect.getsource(LlamaRMSNorm.__init__)


def _norms(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if isinstance(module, LlamaRMSNorm)]


def test_install_and_remove_leave_outputs_and_state_dict_unchanged(monkeypatch):
    model = tiny_model("llama", dtype=torch.bfloat16)
    before = decode_logits(model)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    weights = [norm.weight for norm in _norms(model)]
    assert use_row_rms_norms(model) == 5  # 2 per layer and the final norm
    assert all(isinstance(norm, RowRMSNorm) for norm in _norms(model))
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    calls = []
    kernel = row_norm._RMS_NORM_ROW
    monkeypatch.setattr(row_norm, "_RMS_NORM_ROW", lambda *args: calls.append(args[0].shape) or kernel(*args))
    after = decode_logits(model)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(before, after, strict=True))
    assert calls == [(1, 1, 64)] * (3 * 5)  # the one-token steps only: the prefill kept the class's forward
    assert use_row_rms_norms(model) == 0  # installed once
    assert restore_rms_norms(model) == 5
    assert all(type(norm) is LlamaRMSNorm for norm in _norms(model))
    assert [norm.weight for norm in _norms(model)] == weights
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


def test_only_listed_bfloat16_norms_get_the_kernel():
    model = torch.nn.ModuleList(
        [
            _norm(Qwen3RMSNorm, 64, 1e-6, seed=0),
            _norm(GemmaRMSNorm, 64, 1e-6, seed=0),  # (1 + weight): another forward
            LlamaRMSNorm(64),  # float32 weight
        ]
    )
    assert use_row_rms_norms(model) == 1
    assert [isinstance(module, RowRMSNorm) for module in model] == [True, False, False]
    x = torch.randn(1, 1, 64).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(_bits(model[0](x)), _bits(Qwen3RMSNorm.forward(model[0], x)))


def test_a_norm_the_kernel_disagrees_with_is_left_alone():
    class LlamaRMSNorm(Qwen3RMSNorm):  # a listed name, another forward (as a changed transformers class would be)
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    norms = torch.nn.ModuleList([_norm(LlamaRMSNorm, 64, 1e-6, seed=0), _norm(Qwen3RMSNorm, 64, 1e-6, seed=0)])
    assert not agrees_with_forward(norms[0]) and agrees_with_forward(norms[1])
    assert use_row_rms_norms(norms) == 1
    assert type(norms[0]) is LlamaRMSNorm and isinstance(norms[1], RowRMSNorm)


def test_gradients_and_compiled_graphs_take_the_class_forward():
    norm = torch.nn.ModuleList([_norm(LlamaRMSNorm, 64, 1e-6, seed=0)])
    assert use_row_rms_norms(norm) == 1
    x = torch.randn(1, 1, 64).to(torch.bfloat16).requires_grad_()
    norm[0](x).float().sum().backward()
    assert x.grad is not None and norm[0].weight.grad is not None
    outputs, ops = graph_ops(norm[0], x.detach())
    assert ops == []  # inductor fuses the class's forward
    with torch.no_grad():
        assert torch.allclose(outputs.float(), LlamaRMSNorm.forward(norm[0], x.detach()).float(), rtol=2**-7)


def test_a_quantized_model_gets_the_kernel_and_dequantize_removes_it(tmp_path):
    from transformers import AutoModelForCausalLM

    from hfquant import HfQuantConfig

    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(bits=4, group_size=32), dtype=torch.bfloat16
    )
    assert len(_norms(model)) == 5 and all(isinstance(norm, RowRMSNorm) for norm in _norms(model))
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)
    assert all(isinstance(norm, RowRMSNorm) for norm in _norms(reloaded))
    saved, again = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == again.keys() and all(torch.equal(saved[name], again[name]) for name in saved)
    model.dequantize()
    assert all(type(norm) is LlamaRMSNorm for norm in _norms(model))
