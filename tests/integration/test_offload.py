"""device_map="auto" with a max_memory that sends part of a quantized model to the CPU and part to disk: offloaded
layers stay quantized (the offload folder holds the quantized bytes) and the model answers as when fully resident.
A GPU + CPU split runs only where CUDA is available."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hfquant import HfQuantConfig, QuantLinear
from hfquant.nn.embedding import QuantEmbedding

VOCAB = 512
# Offloaded layers run dequantize-then-matmul on the tensors read back from disk, the resident ones the int8 kernel:
# the same products summed in another order, float32 rounding only (observed 5e-7 of the logit range).
RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def float_checkpoint(request, tmp_path_factory):
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=request.param,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("float")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def _split_load(path, tmp_path, config=None, **kwargs):
    """Load with room in RAM for about half of the quantized model: the rest goes to `tmp_path/offload`."""
    if config is not None:  # a quantized checkpoint brings its own config
        kwargs["quantization_config"] = config
    resident = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", **kwargs)
    budget = resident.get_memory_footprint() // 2
    model = AutoModelForCausalLM.from_pretrained(
        path, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path / "offload"), **kwargs
    )
    return resident, model


def _offloaded_quantized(model) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (QuantLinear, QuantEmbedding))
        and "weight" not in m._non_persistent_buffers_set
        and m.weight.device.type == "meta"
    }


def _check_same_answers(resident, model):
    expected, got = _logits(resident), _logits(model)
    assert (got - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    prompt = _ids()[:1, :5]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kwargs), resident.generate(prompt, **kwargs))


@pytest.mark.parametrize("embedding_dtype", ["auto", "int8"])
def test_quantize_on_load_offloads_quantized_bytes(float_checkpoint, tmp_path, embedding_dtype):
    config = HfQuantConfig(bits=8, embedding_dtype=embedding_dtype)
    resident, model = _split_load(float_checkpoint, tmp_path, config, offload_buffers=True)
    assert {"cpu", "disk"} <= set(model.hf_device_map.values())
    offloaded = _offloaded_quantized(model)
    assert offloaded, model.hf_device_map
    for name, module in offloaded.items():
        weights = module._hf_hook.weights_map
        entry = weights.dataset.index[weights.prefix + "weight"]
        assert entry["safetensors_file"].startswith(str(tmp_path / "offload"))  # not the float checkpoint
        with safe_open(entry["safetensors_file"], "pt") as handle:
            stored = handle.get_slice(entry["weight_name"])
            assert stored.get_dtype() == "I8", name  # the quantized bytes landed on disk
            assert tuple(stored.get_shape()) == tuple(resident.get_submodule(name).weight.shape)
    _check_same_answers(resident, model)


@pytest.mark.parametrize(
    "config",
    [{"bits": 4}, {"bits": 4, "group_size": 32}, {"bits": 4, "norm_dtype": "float32"}],
    ids=["iq4", "int4", "float32-norms"],
)
@pytest.mark.parametrize("offload_buffers", [False, True], ids=["buffers-in-ram", "offload-buffers"])
def test_folded_norms_of_offloaded_layers_are_the_folded_ones(float_checkpoint, tmp_path, config, offload_buffers):
    """The 4-bit defaults fold SINQ's column scales into the norms: an offloaded layer's norm must be read back
    folded, as the resident model has it (transformers' offload index named the checkpoint's unfolded norm, and the
    logits were wrong by up to 30 on SmolLM2, with no error)."""
    resident, model = _split_load(float_checkpoint, tmp_path, HfQuantConfig(**config), offload_buffers=offload_buffers)
    assert "disk" in model.hf_device_map.values()
    norms = [n for n, m in model.named_modules() if n.endswith("input_layernorm") and m.weight.device.type == "meta"]
    assert norms, model.hf_device_map
    for name in norms:
        weights = model.get_submodule(name)._hf_hook.weights_map
        assert torch.equal(weights["weight"], resident.get_submodule(name).weight), name
    _check_same_answers(resident, model)


def test_quantized_checkpoint_offloads_from_its_own_file(float_checkpoint, tmp_path):
    config = HfQuantConfig(bits=4, group_size=32, embedding_dtype="int8", mixed_precision="none")
    AutoModelForCausalLM.from_pretrained(float_checkpoint, quantization_config=config).save_pretrained(tmp_path / "q")
    resident, model = _split_load(tmp_path / "q", tmp_path, offload_buffers=True)
    offloaded = _offloaded_quantized(model)
    assert offloaded and {"cpu", "disk"} <= set(model.hf_device_map.values())
    for name, module in offloaded.items():
        weights = module._hf_hook.weights_map
        entry = weights.dataset.index[weights.prefix + "weight"]
        with safe_open(entry["safetensors_file"], "pt") as handle:
            assert handle.get_slice(entry["weight_name"]).get_dtype() == "U8", name  # packed int4 codes
    _check_same_answers(resident, model)


def test_without_offload_buffers_quantized_tensors_stay_in_ram_with_a_warning(float_checkpoint, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hfquant"):
        resident, model = _split_load(float_checkpoint, tmp_path, HfQuantConfig(bits=8))
    assert "disk" in model.hf_device_map.values()
    assert "offload_buffers=True" in caplog.text
    layer = model.model.layers[-1].mlp.down_proj
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.int8  # in RAM, still quantized
    _check_same_answers(resident, model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU + CPU split needs one")
def test_gpu_and_cpu_split(float_checkpoint, tmp_path):
    config = HfQuantConfig(bits=4, group_size=32, embedding_dtype="int8")
    resident = AutoModelForCausalLM.from_pretrained(float_checkpoint, quantization_config=config, device_map="cpu")
    budget = resident.get_memory_footprint() // 2
    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint,
        quantization_config=config,
        device_map="auto",
        max_memory={0: budget, "cpu": 2**30},
    )
    assert {0, "cpu"} <= set(model.hf_device_map.values()) or {"cuda:0", "cpu"} <= set(model.hf_device_map.values())
    expected = _logits(resident)
    got = _logits(model).cpu()
    # GPU kernels (tinygemm bf16 for int4) round differently from the CPU ones: 2% of the logit range.
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
