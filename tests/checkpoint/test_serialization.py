"""Saving quantized models: sharded files, config.json, the on-disk schema, exact reloads and dequantize()."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import auto_class, input_ids, model_output
from safetensors import safe_open
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant import HfQuantConfig, QuantEmbedding, QuantLinear
from hfquant.config import matches_module
from hfquant.nn.float_linear import FloatLinear

# name -> (architecture, dtype, HfQuantConfig kwargs): every stored layout, both dtypes, bias and Conv1D. One format per
# model (plain RTN, no mixed precision): the SINQ column scale and the 4-bit default's rule have their own round trips
# in test_sinq.py and test_allocation.py.
UNIFORM_RTN = dict(method="rtn", mixed_precision="none")
VARIANTS = {
    "llama-int4-g32-asym-bf16": ("llama", torch.bfloat16, dict(bits=4, group_size=32, **UNIFORM_RTN)),
    "llama_tied-int8-sym-fp32": ("llama_tied", torch.float32, dict(bits=8, modules_to_not_convert=["layers.1.mlp"])),
    "gpt2-int4-g64-sym-bf16": ("gpt2", torch.bfloat16, dict(bits=4, group_size=64, symmetric=True, **UNIFORM_RTN)),
    "bert-int8-g32-asym-fp32": ("bert", torch.float32, dict(bits=8, group_size=32, symmetric=False)),
}
SHARD_SIZE = "40KB"  # the tiny models are 100-300 KB: several shards each

# Relative tolerances (of max |reference|) where two computations of the same quantized model may round differently:
# float32 differs only in summation order, per layer ~1e-7 relative, 1e-4 leaves room for two blocks of it; for
# bfloat16, 2% as in test_kernels (a few bfloat16 roundings of 2**-9 per layer; observed 0.5%).
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class Saved:
    def __init__(self, name, arch, dtype, qconfig, model, path):
        self.name, self.arch, self.dtype, self.qconfig, self.model, self.path = name, arch, dtype, qconfig, model, path
        self.ids = input_ids()
        self.output = model_output(model, self.ids)

    def load(self, **kwargs):
        return auto_class(self.arch).from_pretrained(self.path, **kwargs).eval()


@pytest.fixture(scope="module")
def saved(float_checkpoint, tmp_path_factory):
    """Factory: quantize a tiny float checkpoint on load and save it sharded (once per variant)."""
    cache = {}

    def make(name: str) -> Saved:
        if name not in cache:
            arch, dtype, qconfig = VARIANTS[name]
            model = (
                auto_class(arch)
                .from_pretrained(
                    float_checkpoint(arch, dtype),
                    quantization_config=HfQuantConfig(**qconfig),
                    dtype=dtype,
                    device_map="cpu",
                )
                .eval()
            )
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, max_shard_size=SHARD_SIZE)
            cache[name] = Saved(name, arch, dtype, qconfig, model, path)
        return cache[name]

    return make


def _read_files(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every .safetensors file in `path`; a key present in two files is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                assert key not in tensors, f"{key} stored twice"
                tensors[key] = handle.get_tensor(key)
    return tensors


def _quant_layers(model) -> dict[str, QuantLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, QuantLinear)}


def _assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    limit = RELATIVE_TOLERANCE[dtype] * expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= limit


@pytest.mark.parametrize("name", VARIANTS)
def test_sharded_save_writes_an_index_covering_every_tensor(saved, name):
    path = saved(name).path
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 2 and "model.safetensors" not in shards
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map.values()) == set(shards)
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as handle:
            for key in handle.keys():
                assert weight_map[key] == shard
    assert set(weight_map) == set(_read_files(path))


@pytest.mark.parametrize("name", VARIANTS)
def test_config_json_holds_the_quantization_config_exactly(saved, name):
    case = saved(name)
    config = HfQuantConfig(**case.qconfig)
    stored = json.loads((case.path / "config.json").read_text())["quantization_config"]
    # json.dumps distinguishes True from 1 and 1 from 1.0, which == on dicts does not
    assert json.dumps(stored, sort_keys=True) == json.dumps(config.to_dict(), sort_keys=True)
    assert HfQuantConfig.from_dict(stored) == config


@pytest.mark.parametrize("name", VARIANTS)
def test_on_disk_schema_of_every_quantized_layer(saved, name, float_checkpoint):
    case = saved(name)
    tensors = _read_files(case.path)
    qconfig = case.model.config.quantization_config
    layers = _quant_layers(case.model)
    assert layers
    # the 4-bit default's int8 lm_head (its `lm_head` field, per-channel symmetric); tied, its one tensor is stored
    # under the input embedding's name (a QuantEmbedding), the lm_head's buffers are not persistent
    heads = {"lm_head"} if qconfig.lm_head == "int8" else set()
    for name, module in case.model.named_modules():
        if isinstance(module, QuantEmbedding) and "weight" not in module._non_persistent_buffers_set:
            heads.add(name)
            layers[name] = module
    layers = {name: m for name, m in layers.items() if "weight" not in m._non_persistent_buffers_set}
    for layer_name, layer in layers.items():
        if isinstance(layer, QuantEmbedding):
            n, k, g = layer.num_embeddings, layer.embedding_dim, layer.group_size
        else:
            n, k, g = layer.out_features, layer.in_features, layer.group_size
        bits, symmetric = (8, True) if layer_name in heads else (qconfig.bits, qconfig.symmetric)
        assert g == k or layer_name not in heads  # per channel
        expected = {"weight", "weight_scale"} | (set() if symmetric else {"weight_zero_point"})
        expected |= {"bias"} if getattr(layer, "bias", None) is not None else set()
        assert {key[len(layer_name) + 1 :] for key in tensors if key.startswith(layer_name + ".")} == expected
        weight = tensors[f"{layer_name}.weight"]
        if bits == 4:
            assert weight.dtype == torch.uint8 and weight.shape == (n, k // 2)
        else:
            assert weight.dtype == (torch.int8 if symmetric else torch.uint8) and weight.shape == (n, k)
        scale = tensors[f"{layer_name}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == (n, k // g) and bool((scale > 0).all())
        if not symmetric:
            zero_point = tensors[f"{layer_name}.weight_zero_point"]
            assert zero_point.dtype == torch.uint8 and zero_point.shape == (n, k // g)
            assert int(zero_point.max()) < 2**bits
        if getattr(layer, "bias", None) is not None:
            bias = tensors[f"{layer_name}.bias"]
            assert bias.dtype == case.dtype and bias.shape == (n,)
    # Everything else is the float checkpoint's tensors, unchanged in name and dtype.
    float_tensors = _read_files(float_checkpoint(case.arch, case.dtype))
    added = {f"{name}.{suffix}" for name in layers for suffix in ("weight_scale", "weight_zero_point")}
    assert set(tensors) == set(float_tensors) | (added & set(tensors))
    for key, value in tensors.items():
        if key.rsplit(".", 1)[0] not in layers:
            assert value.dtype == float_tensors[key].dtype and torch.equal(value, float_tensors[key]), key
    assert not any("scale_zero" in key for key in tensors)


@pytest.mark.parametrize("name", VARIANTS)
def test_reload_gives_identical_logits_and_tensors(saved, name, tmp_path):
    case = saved(name)
    reloaded = case.load()
    assert reloaded.dtype == case.dtype
    assert set(_quant_layers(reloaded)) == set(_quant_layers(case.model))  # modules_to_not_convert kept on reload
    skipped = case.qconfig.get("modules_to_not_convert", [])
    for pattern in skipped:
        assert not [n for n in _quant_layers(reloaded) if matches_module(n, [pattern])]
        assert [n for n, m in reloaded.named_modules() if type(m) is FloatLinear and matches_module(n, [pattern])]
    assert reloaded.config.quantization_config == HfQuantConfig(**case.qconfig)
    assert {n: m.kernel for n, m in _quant_layers(reloaded).items()} == {
        n: m.kernel for n, m in _quant_layers(case.model).items()
    }
    assert torch.equal(model_output(reloaded, case.ids), case.output)

    reloaded.save_pretrained(tmp_path, max_shard_size="1MB")
    first, second = _read_files(case.path), _read_files(tmp_path)
    assert set(second) == set(first)
    for key, value in first.items():
        assert second[key].dtype == value.dtype and torch.equal(second[key], value), key
    config_first = json.loads((case.path / "config.json").read_text())["quantization_config"]
    config_second = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config_second == config_first


@pytest.mark.parametrize("name", VARIANTS)
def test_reload_in_bfloat16(saved, name, tmp_path):
    case = saved(name)
    reloaded = case.load(dtype=torch.bfloat16)
    output = model_output(reloaded, case.ids)
    assert output.dtype == torch.bfloat16
    if case.dtype == torch.bfloat16:
        assert torch.equal(output, case.output)
    else:  # same stored integers and scales, bfloat16 activations: close (see RELATIVE_TOLERANCE)
        _assert_close(output, case.output, torch.bfloat16)
    # The stored tensors keep their stored dtypes whatever dtype the model is loaded in.
    reloaded.save_pretrained(tmp_path)
    first, second = _read_files(case.path), _read_files(tmp_path)
    assert set(second) == set(first)
    for key in first:
        if key.endswith((".weight_scale", ".weight_zero_point")) or key.rsplit(".", 1)[0] in _quant_layers(reloaded):
            if key.endswith(".bias"):
                assert torch.equal(second[key], first[key].to(torch.bfloat16)), key
            else:
                assert second[key].dtype == first[key].dtype and torch.equal(second[key], first[key]), key


_CHILD = textwrap.dedent(
    """
    import sys
    import torch
    import hfquant  # registers quant_method="hfquant" with transformers
    from transformers import AutoModel, AutoModelForCausalLM

    ids = torch.load(sys.argv[1])
    outputs = {}
    for name, arch, path in zip(sys.argv[3::3], sys.argv[4::3], sys.argv[5::3]):
        cls = AutoModel if arch == "bert" else AutoModelForCausalLM
        model = cls.from_pretrained(path).eval()
        with torch.no_grad():
            out = model(input_ids=ids)
        outputs[name] = out.logits if hasattr(out, "logits") else out.last_hidden_state
    torch.save(outputs, sys.argv[2])
    """
)


def test_reload_in_a_fresh_process_gives_identical_logits(saved, tmp_path):
    cases = [saved(name) for name in VARIANTS]
    ids_file, out_file = tmp_path / "ids.pt", tmp_path / "outputs.pt"
    torch.save(cases[0].ids, ids_file)
    arguments = [str(x) for case in cases for x in (case.name, case.arch, case.path)]
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ids_file), str(out_file), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outputs = torch.load(out_file)
    assert set(outputs) == set(VARIANTS)
    for case in cases:
        assert torch.equal(case.ids, input_ids())
        assert torch.equal(outputs[case.name], case.output), case.name


@pytest.mark.parametrize("name", VARIANTS)
def test_batches_of_1_4_and_17_sequences(saved, name):
    case = saved(name)
    model = case.load()
    ids = input_ids(17, 7, seed=3)
    rows = [0, 1, 2, 3, 16]
    single = {i: model_output(model, ids[i : i + 1]) for i in rows}
    for batch in (1, 4, 17):
        output = model_output(model, ids[:batch])
        assert output.shape[:2] == (batch, 7) and output.dtype == case.dtype
        assert bool(torch.isfinite(output).all())
        # a row is the same sequence run alone, up to the summation order of a different batch size
        for i in (i for i in rows if i < batch):
            _assert_close(output[i : i + 1], single[i], case.dtype)


@pytest.mark.parametrize("name", VARIANTS)
def test_dequantize_gives_plain_float_layers_with_close_outputs(saved, name):
    case = saved(name)
    model = case.load()
    quantized = _quant_layers(model)
    weights = {n: layer.dequantize(case.dtype) for n, layer in quantized.items()}
    biases = {n: layer.bias for n, layer in quantized.items()}
    plain = model.dequantize()
    assert not _quant_layers(plain)
    for layer_name, weight in weights.items():
        layer = plain.get_submodule(layer_name)
        assert type(layer) in (nn.Linear, Conv1D)  # Conv1D (GPT-2) may come back as Linear or Conv1D
        layer_weight = layer.weight.t() if isinstance(layer, Conv1D) else layer.weight
        assert layer.weight.dtype == case.dtype and torch.equal(layer_weight, weight), layer_name
        assert (layer.bias is None) == (biases[layer_name] is None)
        if layer.bias is not None:
            assert torch.equal(layer.bias, biases[layer_name])
    assert not getattr(plain, "is_quantized", False)
    assert getattr(plain.config, "quantization_config", None) is None
    _assert_close(model_output(plain, case.ids), case.output, case.dtype)


@pytest.mark.parametrize("name", VARIANTS)
def test_dequantized_model_saves_and_reloads_as_a_float_checkpoint(saved, name, tmp_path):
    case = saved(name)
    plain = case.load().dequantize()
    plain.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = auto_class(case.arch).from_pretrained(tmp_path, dtype=case.dtype).eval()
    assert not _quant_layers(again)
    assert torch.equal(model_output(again, case.ids), model_output(plain, case.ids))


@pytest.mark.parametrize("name", VARIANTS)
def test_dequantize_after_save_pretrained(saved, name, tmp_path, float_checkpoint):
    # save_pretrained leaves model.config.dtype as a string ("float32"), which transformers hands to dequantize()
    case = saved(name)
    arch, dtype, qconfig = VARIANTS[name]
    model = (
        auto_class(arch)
        .from_pretrained(
            float_checkpoint(arch, dtype), quantization_config=HfQuantConfig(**qconfig), dtype=dtype, device_map="cpu"
        )
        .eval()
    )
    model.save_pretrained(tmp_path)
    plain = model.dequantize()
    assert not _quant_layers(plain)
    _assert_close(model_output(plain, case.ids), case.output, case.dtype)
