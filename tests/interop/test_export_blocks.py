"""Export of block-format checkpoints: GGUF copies the blocks (they are its own bytes, issue #30), compressed-tensors refuses them by name."""

import numpy as np
import pytest
import torch
from helpers import MERGES_VOCAB, tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig, export_checkpoint
from hfquant.checkpoint.gguf_export import llama_permutation

gguf = pytest.importorskip("gguf")

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "iq4_xs", "q5_0"])
def test_block_layers_are_copied_byte_for_byte(tmp_path, name):
    model = tiny_model("llama", **WIDE, **MERGES_VOCAB)
    model.save_pretrained(tmp_path / "float")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "float")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(format=name)
    )
    quantized.save_pretrained(tmp_path / "q")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "q")
    export_checkpoint(tmp_path / "q", tmp_path / "q.gguf", format="gguf")
    stored = load_file(tmp_path / "q" / "model.safetensors")
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    tensors = {t.name: t for t in reader.tensors}
    assert (
        reader.fields["general.file_type"].parts[-1][0]
        == gguf.LlamaFileType[
            {"q4_k": "MOSTLY_Q4_K_S", "q6_k": "MOSTLY_Q6_K", "iq4_xs": "MOSTLY_IQ4_XS", "q5_0": "MOSTLY_Q5_0"}[name]
        ]
    )
    for layer, gguf_name, heads in [
        ("model.layers.0.mlp.down_proj", "blk.0.ffn_down", None),
        ("model.layers.1.self_attn.v_proj", "blk.1.attn_v", None),
        ("model.layers.0.self_attn.q_proj", "blk.0.attn_q", 4),
    ]:
        tensor = tensors[gguf_name + ".weight"]
        assert tensor.tensor_type == gguf.GGMLQuantizationType[name.upper()]
        blocks = stored[layer + ".weight"]
        if heads is not None:  # llama.cpp's q/k row order
            blocks = blocks[llama_permutation(blocks.shape[0], heads)]
        assert np.array_equal(np.asarray(tensor.data).reshape(blocks.shape), blocks.numpy())
        # gguf-py reads back the weights hfquant computes with
        weights = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        module = quantized.get_submodule(layer)
        expected = module.dequantize()
        if heads is not None:
            expected = expected[llama_permutation(expected.shape[0], heads)]
        assert torch.equal(torch.from_numpy(weights.reshape(expected.shape)).float(), expected)


def test_compressed_tensors_export_refuses_block_formats_before_writing(tmp_path):
    tiny_model("llama", **WIDE).save_pretrained(tmp_path / "float")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "float", quantization_config=HfQuantConfig(format="q4_k"))
    model.save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"block format q4_k \(14 layer\(s\) in block formats\).*--format gguf"):
        export_checkpoint(tmp_path / "q", tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("name", ["hq3_0", "hq3_r"])
def test_both_exports_refuse_hfquants_own_block_format_by_name_before_writing(tmp_path, name):
    """HQ3_0 and HQ3_R (hfquant's 3-bit blocks) have no GGUF type and no compressed-tensors form."""
    model = tiny_model("llama", **MERGES_VOCAB)  # rows of 64 and 128: every layer in the format
    model.save_pretrained(tmp_path / "float")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "float")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(format=name)
    )
    quantized.save_pretrained(tmp_path / "q")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=rf"hfquant's own block format {name} \(14 layer\(s\)\).*nothing was written"):
        export_checkpoint(tmp_path / "q", tmp_path / "q.gguf", format="gguf")
    assert not (tmp_path / "q.gguf").exists()
    # 15: the 14 layers and the lm_head, q8_0 (the 3-bit formats' q6_k lm_head on rows of 64)
    with pytest.raises(
        ValueError, match=rf"hfquant's block format {name} \(15 layer\(s\) in block formats\)"
    ) as error:
        export_checkpoint(tmp_path / "q", tmp_path / "ct")
    assert "--format gguf" not in str(error.value)
    assert not (tmp_path / "ct").exists()


@pytest.mark.parametrize("name", ["q4_k", "iq4_nl"])
def test_the_default_fold_is_exported_and_the_gguf_computes_the_same_function(tmp_path, name):
    """Block formats fold SINQ's column scales by default: the norms change (GGUF stores them as floats), the folded
    layers are plain blocks, and transformers' GGUF load of the export computes hfquant's logits."""
    model = tiny_model("llama", **WIDE, **MERGES_VOCAB)
    model.save_pretrained(tmp_path / "float")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "float")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=HfQuantConfig(format=name), dtype=torch.float32
    )
    norm = "model.layers.0.input_layernorm"
    assert not torch.equal(quantized.get_submodule(norm).weight, model.get_submodule(norm).weight)  # folded
    quantized.save_pretrained(tmp_path / "q")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "q")
    assert not any(key.endswith("weight_col_scale") for key in load_file(tmp_path / "q" / "model.safetensors"))
    export_checkpoint(tmp_path / "q", tmp_path / "q" / "model.gguf", format="gguf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "q", gguf_file="model.gguf", dtype=torch.float32)
    assert torch.equal(exported.get_submodule(norm).weight, reloaded.get_submodule(norm).weight)
    ids = torch.tensor([[5, 77, 140, 9, 33, 200, 18]])
    with torch.no_grad():
        reference, logits = reloaded(ids).logits, exported(ids).logits
    assert (logits - reference).abs().max() <= 1e-3 * reference.abs().max()
