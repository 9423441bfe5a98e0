"""GGUFs that mix block types per tensor as llama.cpp's Q4_K_M, Q3_K_M, Q6_K and IQ4_XS files do (issue #29).

llama.cpp's quantizer gives attn_v / ffn_down a larger type in its "_M" mixes and a fallback type (Q5_0, IQ4_NL,
Q8_0, Q4_0) to a tensor whose row length is not a multiple of 256 (SmolLM2-135M's 576-wide inputs). CI cannot build
it (`scripts/llamacpp_gguf.py` checks the files llama.cpp itself writes, against ggml's own dequantization): here
hfquant's exporter writes files of the same mixes, and for every block tensor of the file the import's dequantization
must equal gguf-py's `dequantize`, and the export of the imported model must give the same type and bytes.
"""

import numpy as np
import pytest
import torch
from helpers import MERGES_VOCAB, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

import hfquant
from hfquant import HfQuantConfig, export_checkpoint
from hfquant.nn.linear import QuantLinear

gguf = pytest.importorskip("gguf")
from hfquant.integration import gguf_model  # noqa: E402 - needs gguf

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
LAYER = "model.layers.{}."
MIXES = {
    # main type, then the layers llama.cpp's mix gives another type (as its files for a 2-layer model have them)
    "Q4_K_M": ("q4_k", {"self_attn.v_proj": "q6_k", "mlp.down_proj": "q6_k", "1.self_attn.o_proj": "q5_0"}),
    "Q3_K_M": ("q3_k", {"self_attn.v_proj": "q5_k", "mlp.down_proj": "q4_k", "0.self_attn.o_proj": "q4_0"}),
    "Q6_K": ("q6_k", {"self_attn.q_proj": "q8_0"}),
    "IQ4_XS": ("iq4_xs", {"mlp.up_proj": "iq4_nl", "1.mlp.down_proj": "q5_1"}),
}


def _overrides(rules: dict[str, str], layers: int = 2) -> dict[str, dict]:
    """`module_overrides` of a mix: "<layer>.<module>" names one layer, "<module>" every layer."""
    overrides = {}
    for rule, kind in rules.items():
        index, _, module = rule.partition(".")
        chosen = [int(index)] if index.isdigit() else range(layers)
        module = module if index.isdigit() else rule
        overrides.update({LAYER.format(i) + module: {"format": kind} for i in chosen})
    return overrides


def _file_order(model, key: str, values: torch.Tensor) -> torch.Tensor:
    """`values` (rows of the imported layer `key`) back in the file's row order (llama.cpp's q/k permutation)."""
    order = gguf_model._row_order(key, model.config, model.config.model_type)
    if order is None:
        return values
    stored = torch.empty_like(values)
    stored[order] = values
    return stored


@pytest.mark.parametrize("mix", list(MIXES))
def test_every_block_tensor_dequantizes_as_gguf_py_and_exports_to_the_same_bytes(tmp_path, mix):
    main, rules = MIXES[mix]
    config = HfQuantConfig(format=main, module_overrides=_overrides(rules))
    float_dir, quant_dir, path = tmp_path / "float", tmp_path / "q", tmp_path / f"{mix}.gguf"
    tiny_model("llama", **WIDE, **MERGES_VOCAB).save_pretrained(float_dir)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(quant_dir)
    tiny_tokenizer(merges=True).save_pretrained(quant_dir)
    export_checkpoint(quant_dir, path, format="gguf")

    model = hfquant.from_gguf(path, dtype=torch.float32)
    names = gguf_model._name_map(model, model.config.model_type)
    file_tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    kinds = {}
    for name, tensor in file_tensors.items():
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue
        key = names[name]
        module = model.get_submodule(key.rpartition(".")[0])
        assert isinstance(module, QuantLinear), name
        assert module.format.block == tensor.tensor_type.name.lower(), name
        data = np.asarray(tensor.data).reshape(module.out_features, -1)
        reference = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type))
        assert torch.equal(
            _file_order(model, key, module.dequantize(torch.float32)), reference.reshape(data.shape[0], -1)
        )
        kinds[tensor.tensor_type.name] = kinds.get(tensor.tensor_type.name, 0) + 1
    # the mix is in the file: the main type and every override type
    assert set(kinds) == {main.upper()} | {kind.upper() for kind in rules.values()}

    result = hfquant.convert_gguf(path, tmp_path / "imported")
    assert sum(result.formats.values()) == sum(kinds.values())
    # transformers' tokenizer of this file adds "<|endoftext|>" (it has no BOS/UNK), one token more than the
    # embedding's rows, which the export refuses: the tokenizer the file was written from goes in its place
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "imported")
    export_checkpoint(tmp_path / "imported", tmp_path / "again.gguf", format="gguf")
    again = {t.name: t for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    assert again.keys() == file_tensors.keys()
    for name, tensor in file_tensors.items():
        if tensor.tensor_type.name in kinds or name.endswith("norm.weight"):
            assert again[name].tensor_type == tensor.tensor_type, name
            assert np.array_equal(np.asarray(again[name].data), np.asarray(tensor.data)), name
