"""Quantize-on-load of tiny random transformers models: which modules are converted, accuracy, device maps."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHITECTURES, LLAMA_PROJECTIONS, auto_class, cosine_similarity, input_ids, model_output
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant import HfQuantConfig, QuantEmbedding, QuantLinear
from hfquant.core.rtn import effective_group_size
from hfquant.nn.float_linear import FloatLinear
from hfquant.nn.linear import quantize_to_buffers
from hfquant.ops.kernels import select_kernel

# Every layer in one format (mixed_precision="none"): these tests check each layer against the config's own values;
# the data-free rule of the 4-bit default is tested in tests/test_allocation.py. The lm_head: float at 8 bits, int8
# per-channel by default at 4 bits ("int4_g32"), float again with lm_head="keep" ("int4_g32_keep").
QCONFIGS = {
    "int8": dict(bits=8),
    "int4_g32": dict(bits=4, group_size=32, mixed_precision="none"),
    "int4_g32_keep": dict(bits=4, group_size=32, mixed_precision="none", lm_head="keep"),
}
# Minimum cosine similarity of the quantized model's output with the float model's. Per layer the SNR is ~43 dB at
# int8 and ~21 dB at int4 g32 (see test_linear); through two blocks with residual connections the output keeps
# 1 - cos of the order of 1e-4 (int8) and 1e-2 (int4) on these random models (observed: > 0.9999 and > 0.992).
COSINE_MIN = {"int8": 0.99, "int4_g32": 0.95, "int4_g32_keep": 0.95}


def _expected_quantized(arch: str) -> set[str]:
    """Every Linear / Conv1D of the architecture except the output embedding."""
    if arch.startswith("llama"):
        children = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        children += [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
        return {f"model.layers.{i}.{c}" for i in range(2) for c in children}
    if arch == "gpt2":
        children = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
        return {f"transformer.h.{i}.{c}" for i in range(2) for c in children}
    children = [
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "intermediate.dense",
        "output.dense",
    ]
    return {f"encoder.layer.{i}.{c}" for i in range(2) for c in children} | {"pooler.dense"}


def _load(path, arch, dtype, device_map="cpu", **qconfig):
    kwargs = dict(dtype=dtype, device_map=device_map)
    if qconfig:
        kwargs["quantization_config"] = HfQuantConfig(**qconfig)
    return auto_class(arch).from_pretrained(path, **kwargs).eval()


def _quant_layers(model) -> dict[str, QuantLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantLinear)}


def _float_layers(model) -> dict[str, nn.Module]:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D)) and not isinstance(m, QuantLinear)
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qname", list(QCONFIGS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantize_on_load(float_checkpoint, arch, qname, dtype):
    path = float_checkpoint(arch, dtype)
    qconfig = QCONFIGS[qname]
    reference = _load(path, arch, dtype)
    model = _load(path, arch, dtype, **qconfig)

    quantized = _quant_layers(model)
    int8_head = arch != "bert" and HfQuantConfig(**qconfig).lm_head == "int8"
    expected = _expected_quantized(arch) | ({"lm_head"} if int8_head else set())
    assert set(quantized) == expected
    head = quantized.pop("lm_head", None)
    assert set(_float_layers(model)) == set(_float_layers(reference)) - expected
    float_modules = dict(reference.named_modules())
    folded = set()
    for name, layer in quantized.items():
        source = float_modules[name]
        transposed = isinstance(source, Conv1D)
        n, k = source.weight.shape[::-1] if transposed else source.weight.shape
        assert (layer.in_features, layer.out_features) == (k, n)
        assert layer.bits == qconfig["bits"] and layer.symmetric is (qconfig["bits"] == 8)
        assert layer.group_size == effective_group_size(k, qconfig.get("group_size"), qconfig["bits"])
        assert layer.weight.device.type == "cpu"
        assert (layer.bias is None) == (source.bias is None)
        assert layer.kernel == select_kernel(layer.format, in_features=k, out_features=n, device="cpu")
        # What was quantized on load is what QuantLinear.from_float makes of the float weight, bit for bit; a layer
        # whose column scales were folded (the 4-bit default in Llama blocks) holds the folded weight's codes.
        weight = source.weight.t() if transposed else source.weight
        fold = model.hf_quantizer.plan.folds.get(name)
        if fold is None:
            direct = QuantLinear.from_float(weight.detach(), source.bias, layer.format).state_dict()
        else:
            assert source.bias is None  # a fold's row scale would rescale the bias too: not in these models
            direct = quantize_to_buffers(weight.detach(), layer.format, fold=fold)
        loaded_state = layer.state_dict()
        for key, value in direct.items():
            assert torch.equal(loaded_state[key], value), (name, key)
        if fold is not None:
            folded.add(name)
    # the int4 default folds the column scales of every Llama block (all of their layers are quantized here)
    assert bool(folded) is (qname.startswith("int4_g32") and arch.startswith("llama"))

    if int8_head:  # the 4-bit default: the output embedding per-channel int8, RTN codes of its float weight
        source = reference.lm_head.weight.detach()
        assert head.bits == 8 and head.symmetric and head.group_size == effective_group_size(head.in_features, None, 8)
        assert head.bias is None
        direct = QuantLinear.from_float(source, None, head.format).state_dict()
        for key, value in direct.items():  # getattr: a tied head's tensors are the embedding's (not in its state)
            assert torch.equal(getattr(head, key), value), ("lm_head", key)
        if arch in ("llama_tied", "gpt2"):  # tied: the input embedding is the same int8 tensor
            embedding = model.get_input_embeddings()
            assert isinstance(embedding, QuantEmbedding) and embedding.weight is head.weight
    elif arch != "bert":
        assert type(model.lm_head) is FloatLinear and model.lm_head.weight.dtype == dtype
        assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
        if arch in ("llama_tied", "gpt2"):
            assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()

    ids = input_ids()
    y, y_ref = model_output(model, ids), model_output(reference, ids)
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert cosine_similarity(y, y_ref) > COSINE_MIN[qname]


def test_modules_to_not_convert_are_kept_in_float(float_checkpoint):
    path = float_checkpoint("llama")
    skip = ["down_proj", "model.layers.1.self_attn", "model.layers.*.self_attn.q_proj"]
    model = _load(path, "llama", torch.float32, bits=4, group_size=32, modules_to_not_convert=skip)
    kept = {f"model.layers.{i}.mlp.down_proj" for i in range(2)} | {"model.layers.0.self_attn.q_proj"}
    kept |= {f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert set(_quant_layers(model)) == (_expected_quantized("llama") - kept) | {"lm_head"}  # int8 by default
    assert set(_float_layers(model)) == kept
    assert model.config.quantization_config.modules_to_not_convert == skip


def test_gpt2_conv1d_can_be_skipped_by_pattern(float_checkpoint):
    path = float_checkpoint("gpt2")
    model = _load(path, "gpt2", torch.float32, bits=8, modules_to_not_convert=["transformer.h.*.mlp"])
    assert set(_quant_layers(model)) == {f"transformer.h.{i}.attn.{c}" for i in range(2) for c in ("c_attn", "c_proj")}
    for i in range(2):
        assert type(model.transformer.h[i].mlp.c_fc) is Conv1D


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 128), (8, None)])
def test_in_features_without_a_group_divisor(float_checkpoint, bits, group_size):
    # intermediate_size 48: gate/up have 64 inputs, down_proj has 48 = 16 * 3 inputs (no power of two >= 32 divides)
    path = float_checkpoint("llama", intermediate_size=48)
    reference = _load(path, "llama", torch.float32)
    model = _load(path, "llama", torch.float32, bits=bits, group_size=group_size, mixed_precision="none")
    layers = _quant_layers(model)
    head = layers.pop("lm_head", None)  # the 4-bit default's lm_head: int8 per-channel, needs no divisor
    assert (head is not None and head.bits == 8 and head.group_size == 64) is (bits == 4)
    downs = {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    if group_size is None:  # per-channel needs no divisor
        assert set(layers) == _expected_quantized("llama")
        assert {layers[name].group_size for name in downs} == {48}
    else:
        assert set(layers) == _expected_quantized("llama") - downs
        for name in downs:
            assert type(model.get_submodule(name)) is FloatLinear
        assert {layer.group_size for layer in layers.values()} == {min(group_size, 64)}  # 128 asked, 64 inputs -> 64
    ids = input_ids()
    cosine = cosine_similarity(model_output(model, ids), model_output(reference, ids))
    assert cosine > COSINE_MIN["int8" if bits == 8 else "int4_g32"]


def test_group_size_falls_back_to_the_largest_power_of_two_divisor(float_checkpoint):
    path = float_checkpoint("llama", intermediate_size=96)  # down_proj: 96 inputs = 32 * 3
    model = _load(path, "llama", torch.float32, bits=4, group_size=64)
    for name, layer in _quant_layers(model).items():
        assert layer.group_size == (32 if name.endswith("down_proj") else 64), name
        assert layer.weight_scale.shape == (layer.out_features, layer.in_features // layer.group_size)


@pytest.mark.parametrize(
    "device_map",
    [
        "auto",
        {"": "cpu"},
        {
            "model.embed_tokens": "cpu",
            "model.layers": "cpu",
            "model.norm": "cpu",
            "model.rotary_emb": "cpu",
            "lm_head": "cpu",
        },
    ],
    ids=["auto", "root", "per_module"],
)
def test_device_maps(float_checkpoint, device_map):
    path = float_checkpoint("llama", torch.bfloat16)
    settings = dict(bits=4, group_size=32, mixed_precision="none")
    expected = model_output(_load(path, "llama", torch.bfloat16, **settings), input_ids())
    model = _load(path, "llama", torch.bfloat16, device_map=device_map, **settings)
    layers = _quant_layers(model)
    head = layers.pop("lm_head")  # the 4-bit default's int8 lm_head, placed by the map like the others
    assert head.bits == 8 and head.weight.device.type == "cpu"
    assert set(layers) == _expected_quantized("llama")
    assert all(layer.weight.device.type == "cpu" and layer.kernel == "int4pack_mm_cpu" for layer in layers.values())
    assert torch.equal(model_output(model, input_ids()), expected)


def test_quantized_model_reports_its_quantization(float_checkpoint):
    path = float_checkpoint("llama")
    model = _load(path, "llama", torch.float32, bits=4, group_size=64, symmetric=True)
    assert model.is_quantized
    # the 4-bit default's data-free rule, written into the config when quantizing: the value projection of the
    # second of the two layers in int8 (down projections already use groups of 64)
    rule = {"model.layers.1.self_attn.v_proj": {"bits": 8}}
    asked = HfQuantConfig(bits=4, group_size=64, symmetric=True, module_overrides=rule)
    # and, first, the fold's entries: every projection of both Llama blocks stored with RTN at its resolved format
    folded = {}
    for name in (f"model.layers.{i}.{p}" for i in range(2) for p in LLAMA_PROJECTIONS):
        bits, group_size, symmetric, _ = asked.layer_settings(name)[:4]
        folded[name] = {"bits": bits, "group_size": group_size, "symmetric": symmetric, "method": "rtn"}
    # the rule's layer is folded too: its entry, complete, replaces the rule's (a fold entry states the whole format)
    assert folded["model.layers.1.self_attn.v_proj"] == {
        "bits": 8,
        "group_size": None,
        "symmetric": True,
        "method": "rtn",
    }
    expected = HfQuantConfig(bits=4, group_size=64, symmetric=True, module_overrides=folded)
    assert model.config.quantization_config == expected
    assert list(model.config.quantization_config.module_overrides) == list(expected.module_overrides)
    assert not any(p.requires_grad for layer in _quant_layers(model).values() for p in layer.parameters())
