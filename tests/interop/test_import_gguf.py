"""GGUF import (issue #29): a GGUF's block tensors kept as they are on hfquant's layers (`hfquant.from_gguf`).

The GGUFs are written by hfquant's own exporter from tiny models quantized in each block type (CI cannot build
llama.cpp's quantizer); gguf-py's `dequantize` and transformers' own dequantizing GGUF load are the references.
"""

import numpy as np
import pytest
import torch
from helpers import MERGES_VOCAB, tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

import hfquant
from hfquant import HfQuantConfig, export_checkpoint
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.linear import QuantLinear

gguf = pytest.importorskip("gguf")
from hfquant.checkpoint import gguf_import  # noqa: E402 - needs gguf
from hfquant.integration import gguf_model  # noqa: E402 - needs gguf

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
IDS = torch.tensor([[1, 40, 7, 99, 200, 3, 250, 17]])


def _qwen2():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(num_hidden_layers=2, **WIDE, **MERGES_VOCAB))
    with torch.no_grad():  # Qwen2 initializes its q/k/v biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _gguf_of(tmp_path, arch: str, config: HfQuantConfig, **model_config):
    """A GGUF of a tiny `arch` model (`model_config` added to a Llama's config) quantized with `config` (hfquant's
    exporter), and the quantized folder."""
    float_dir, quant_dir, path = tmp_path / "float", tmp_path / "q", tmp_path / "model.gguf"
    model = _qwen2() if arch == "qwen2" else tiny_model(arch, **WIDE, **MERGES_VOCAB, **model_config)
    model.save_pretrained(float_dir)
    tiny_tokenizer(merges=True).save_pretrained(float_dir)
    AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=config).save_pretrained(quant_dir)
    tiny_tokenizer(merges=True).save_pretrained(quant_dir)
    export_checkpoint(quant_dir, path, format="gguf")
    return path, quant_dir


def _file_rows(path, model, layer: str, gguf_name: str) -> np.ndarray:
    """The GGUF tensor `gguf_name`'s rows as the imported layer holds them (q/k rows in transformers' order)."""
    tensor = gguf_import.read_tensors(gguf_import.open_gguf(path))[gguf_name]
    data = np.asarray(tensor.data).reshape(tensor.shape[0], -1)
    order = gguf_model._row_order(layer + ".weight", model.config, model.config.model_type)
    return data if order is None else data[order.numpy()], tensor


@pytest.mark.parametrize("name", ["q4_0", "q4_1", "q8_0", "q3_k", "q4_k", "q6_k", "iq4_xs"])
def test_import_keeps_the_files_blocks_and_computes_as_transformers(tmp_path, name):
    path, quant_dir = _gguf_of(tmp_path, "llama", HfQuantConfig(format=name))
    model = hfquant.from_gguf(path, dtype=torch.float32)
    stored = load_file(quant_dir / "model.safetensors")
    for layer, gguf_name in [
        ("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
        ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight"),
        ("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight"),
    ]:
        module = model.get_submodule(layer)
        assert isinstance(module, QuantLinear) and module.format.block == name
        rows, tensor = _file_rows(path, model, layer, gguf_name)
        assert np.array_equal(module.weight.numpy(), rows)  # the file's bytes, rows back in transformers' order
        assert torch.equal(module.weight, stored[layer + ".weight"])  # = the checkpoint the file was exported from
        reference = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(tensor.ggml_type))
        assert torch.equal(module.dequantize(), torch.from_numpy(reference).float().reshape(module.out_features, -1))
    assert model.config.quantization_config.format == name
    # transformers' own GGUF load dequantizes every tensor: same weights, so the same logits up to float32
    # summation order (1e-4 of the largest logit)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(IDS).logits, reference(IDS).logits
    assert torch.allclose(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)


def test_bf16_logits_match_transformers_dequantized_load(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    model = hfquant.from_gguf(path, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
    with torch.no_grad():
        ours, theirs = model(IDS).logits.float(), reference(IDS).logits.float()
    # both round activations to bfloat16 at every layer (8 significant bits): within a few bf16 steps of the largest
    # logit, far below the gap a wrong row order or block decoding makes (the same logits apart)
    scale = float(theirs.abs().max())
    assert (ours - theirs).abs().max() <= 4 * 2**-8 * scale
    assert (ours - theirs).abs().max() < 0.1 * (theirs - theirs.mean()).abs().max()


def test_qwen2_with_biases_is_imported_unpermuted(tmp_path):
    path, quant_dir = _gguf_of(tmp_path, "qwen2", HfQuantConfig(format="q8_0"))
    model = hfquant.from_gguf(path, dtype=torch.float32)
    stored = load_file(quant_dir / "model.safetensors")
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"):
        assert torch.equal(model.get_submodule(layer).weight, stored[layer + ".weight"])
        assert torch.equal(model.get_submodule(layer).bias, stored[layer + ".bias"].float())
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(IDS).logits, reference(IDS).logits
    assert torch.allclose(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)


def test_mixed_types_and_float_layers_are_described_by_the_config(tmp_path):
    config = HfQuantConfig(
        format="q4_k",
        module_overrides={"model.layers.0.mlp.down_proj": {"format": "q6_k"}},
        modules_to_not_convert=["model.layers.1.self_attn.v_proj"],
    )
    path, _ = _gguf_of(tmp_path, "llama", config)
    model = hfquant.from_gguf(path)
    imported = model.config.quantization_config
    assert imported.format == "q4_k"
    assert imported.module_overrides == {"model.layers.0.mlp.down_proj": {"format": "q6_k"}}
    assert imported.modules_to_not_convert == ["model.layers.1.self_attn.v_proj"]
    assert model.get_submodule("model.layers.0.mlp.down_proj").format.block == "q6_k"
    kept = model.get_submodule("model.layers.1.self_attn.v_proj")
    assert not isinstance(kept, QuantLinear) and kept.weight.dtype == torch.bfloat16


def test_save_reload_is_bit_exact_and_export_gives_the_same_tensor_bytes(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k", modules_to_not_convert=["*.o_proj"]))
    model = hfquant.from_gguf(path)
    model.save_pretrained(tmp_path / "imported")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "imported")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "imported")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, again(IDS).logits)
    saved = load_file(tmp_path / "imported" / "model.safetensors")
    for key, value in model.state_dict().items():
        assert torch.equal(saved[key], value), key
    export_checkpoint(tmp_path / "imported", tmp_path / "again.gguf", format="gguf")
    first = {t.name: t for t in gguf.GGUFReader(path).tensors}
    second = {t.name: t for t in gguf.GGUFReader(tmp_path / "again.gguf").tensors}
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32) and "norm" not in name:
            continue  # float tensors went through bfloat16; the blocks are the subject here
        assert second[name].tensor_type == tensor.tensor_type, name
        assert np.array_equal(np.asarray(second[name].data), np.asarray(tensor.data)), name


def test_convert_gguf_writes_a_checkpoint_that_reloads(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q5_0"))
    result = hfquant.convert_gguf(path, tmp_path / "out")
    assert result.formats == {"q5_0": 14}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, hfquant.from_gguf(path)(IDS).logits)
    with pytest.raises(FileExistsError, match="exists"):
        hfquant.convert_gguf(path, tmp_path / "out")


def test_a_file_without_bos_or_unk_converts_and_exports_again_with_its_own_tokens(tmp_path):
    from transformers import AutoTokenizer

    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    original = gguf.GGUFReader(path)
    assert "tokenizer.ggml.bos_token_id" not in original.fields  # transformers adds <|endoftext|> to such a tokenizer
    tokens = [
        str(bytes(original.fields["tokenizer.ggml.tokens"].parts[i]), "utf-8")
        for i in original.fields["tokenizer.ggml.tokens"].data
    ]
    hfquant.convert_gguf(path, tmp_path / "out")
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out")) == len(tokens)
    export_checkpoint(tmp_path / "out", tmp_path / "again.gguf", format="gguf")
    again = gguf.GGUFReader(tmp_path / "again.gguf")
    field = again.fields["tokenizer.ggml.tokens"]
    assert [str(bytes(field.parts[i]), "utf-8") for i in field.data] == tokens
    blocks = [(old, new) for old, new in zip(original.tensors, again.tensors, strict=True) if old.tensor_type == 12]
    assert len(blocks) == 14  # the Q4_K layers, byte for byte (the float ones are imported in bfloat16)
    for old, new in blocks:
        assert old.name == new.name and np.array_equal(old.data, new.data), old.name


def test_a_linear_type_without_a_layout_is_refused_by_name():
    with torch.device("meta"):
        model = tiny_model("llama", **WIDE)
    names = gguf_model._name_map(model, "llama")
    data = np.zeros((256, 256 // 256 * 66), dtype=np.uint8)
    tensors = {"blk.0.ffn_up.weight": gguf_import.GgufTensor("blk.0.ffn_up.weight", 16, "IQ2_XXS", (512, 256), data)}
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight \(model\.layers\.0\.mlp\.up_proj\).*IQ2_XXS.*Q4_K"):
        gguf_model.gguf_layer_plan(model, tensors, names)


def test_another_architecture_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"GGUF model type 'gpt2' is not imported by hfquant; allowed: \['llama'"):
        gguf_model._gguf_config(tmp_path / "x.gguf", {"general.architecture": "gpt2"}, [])


def test_llama_row_order_undoes_the_export_permutation():
    from hfquant.checkpoint.gguf_export import llama_permutation

    for rows, heads in [(64, 4), (32, 2), (8, 1)]:
        perm = llama_permutation(rows, heads)
        assert torch.equal(perm[gguf_import.llama_row_order(rows, heads)], torch.arange(rows))
    with pytest.raises(ValueError, match="6 rows cannot be 4 heads"):
        gguf_import.llama_row_order(6, 4)


def _tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("tied", [True, False])
def test_block_embedding_and_output_keep_the_files_blocks(tmp_path, tied):
    tables = {"model.embed_tokens": {"format": "q8_0"}} | ({} if tied else {"lm_head": {"format": "q6_k"}})
    config = HfQuantConfig(format="q4_0", module_overrides=tables)
    path, quant_dir = _gguf_of(tmp_path, "llama", config, tie_word_embeddings=tied)
    first = _tensors(path)
    assert first["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert ("output.weight" not in first) if tied else first["output.weight"].tensor_type.name == "Q6_K"
    model = hfquant.from_gguf(path, dtype=torch.float32)
    embedding, head = model.model.embed_tokens, model.lm_head
    assert isinstance(embedding, QuantEmbedding) and embedding.format.block == "q8_0"
    assert np.array_equal(embedding.weight.numpy(), np.asarray(first["token_embd.weight"].data))
    assert isinstance(head, QuantLinear) and head.format.block == ("q8_0" if tied else "q6_k")
    if tied:  # one tensor: the lm_head's block GEMV reads the embedding's bytes
        assert head.weight.data_ptr() == embedding.weight.data_ptr()
    else:
        assert np.array_equal(head.weight.numpy(), np.asarray(first["output.weight"].data))
    # a lookup decodes the gathered rows as gguf-py decodes the table
    table = gguf.quants.dequantize(np.asarray(first["token_embd.weight"].data), gguf.GGMLQuantizationType.Q8_0)
    with torch.no_grad():
        assert torch.equal(embedding(IDS)[0], torch.from_numpy(table)[IDS[0]])
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ours, theirs = model(IDS).logits, reference(IDS).logits
    assert torch.allclose(ours, theirs, atol=1e-4 * float(theirs.abs().max()), rtol=0)
    model.save_pretrained(tmp_path / "imported")
    tiny_tokenizer(merges=True).save_pretrained(tmp_path / "imported")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "imported")
    assert isinstance(again.model.embed_tokens, QuantEmbedding) and again.model.embed_tokens.format.block == "q8_0"
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, again(IDS).logits)
    export_checkpoint(tmp_path / "imported", tmp_path / "again.gguf", format="gguf")
    second = _tensors(tmp_path / "again.gguf")
    for name in ["token_embd.weight", "blk.0.attn_q.weight"] + ([] if tied else ["output.weight"]):
        assert second[name].tensor_type == first[name].tensor_type, name
        assert np.array_equal(np.asarray(second[name].data), np.asarray(first[name].data)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_config_is_transformers_reading_of_the_header(tmp_path, arch):
    path, _ = _gguf_of(tmp_path, arch, HfQuantConfig(format="q8_0"))
    metadata, tensors = gguf_import.read_gguf(path)
    ours = gguf_model._gguf_config(path, metadata, tensors)
    theirs = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert ours.to_dict() == theirs.to_dict()


def test_read_gguf_reads_what_gguf_py_reads(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k", modules_to_not_convert=["*.o_proj"]))
    metadata, tensors = gguf_import.read_gguf(path)
    reference = gguf.GGUFReader(path)
    expected = gguf_import.read_tensors(reference)
    assert list(tensors) == list(expected)
    for name, tensor in expected.items():
        ours = tensors[name]
        assert (ours.ggml_type, ours.type_name, ours.shape) == (tensor.ggml_type, tensor.type_name, tensor.shape)
        assert ours.data.dtype == tensor.data.dtype and np.array_equal(ours.data, tensor.data), name
        assert ours.offset == tensor.offset > 0, name  # where stored_blocks reads it
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            assert metadata[key] == len(field.data), key  # a string array: its length only
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            assert metadata[key] == [field.contents(i) for i in range(len(field.data))], key
        else:
            assert metadata[key] == field.contents(), key


def test_blocks_read_into_place_equal_the_mapped_rows_even_on_short_reads(tmp_path, monkeypatch):
    rows, row_bytes, heads = 2112, 18, 4  # more rows than one preadv call takes (1024 buffers)
    data = np.random.default_rng(0).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
    path = tmp_path / "rows.bin"
    path.write_bytes(b"x" * 100 + data.tobytes())
    order = gguf_import.llama_row_order(rows, heads)
    real = gguf_import.os.preadv
    calls = []

    def short(fd, buffers, offset):  # a read ending inside a buffer, as the kernel may return
        calls.append(len(buffers))
        first = buffers[0][:7]
        return real(fd, [first], offset)

    with open(path, "rb") as handle:
        assert np.array_equal(gguf_import._read_rows(handle.fileno(), 100, rows, row_bytes, order), data[order])
        assert np.array_equal(gguf_import._read_rows(handle.fileno(), 100, rows, row_bytes, None), data)
        monkeypatch.setattr(gguf_import.os, "preadv", short)
        assert np.array_equal(gguf_import._read_rows(handle.fileno(), 100, rows, row_bytes, order), data[order])
        assert max(calls) == 1024 and len(calls) > rows
        with pytest.raises(ValueError, match="the file ends before offset"):
            gguf_import._read_rows(handle.fileno(), 200, rows, row_bytes, None)


def test_stored_blocks_read_from_the_file_equal_the_mapped_ones(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    _, tensors = gguf_import.read_gguf(path)
    tensor = tensors["blk.0.attn_q.weight"]
    order = gguf_import.llama_row_order(tensor.shape[0], WIDE["num_attention_heads"])
    with open(path, "rb") as handle:
        for index in (None, order):
            read = gguf_import.stored_blocks(tensor, index, handle.fileno())
            assert torch.equal(read, gguf_import.stored_blocks(tensor, index))


def test_float_tensors_read_from_the_file_equal_the_mapped_ones(tmp_path):
    # from_gguf reads float tensors and dequantized blocks with os.preadv: a read through the map faulted in whole
    # folios around each 2 KiB norm vector (62 MiB of SmolLM2's file resident on Linux 6.18)
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    _, tensors = gguf_import.read_gguf(path)
    norm, weight = tensors["blk.0.attn_norm.weight"], tensors["blk.0.attn_q.weight"]
    order = gguf_import.llama_row_order(weight.shape[0], WIDE["num_attention_heads"])
    with open(path, "rb") as handle:
        for tensor, index in ((norm, None), (weight, None), (weight, order)):
            read = gguf_import.float_tensor(tensor, torch.bfloat16, index, handle.fileno())
            assert torch.equal(read, gguf_import.float_tensor(tensor, torch.bfloat16, index))


def test_read_gguf_refuses_a_truncated_file_in_one_line(tmp_path):
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q8_0"))
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"short\.gguf is not a GGUF file hfquant can read: a tensor of \d+ bytes"):
        gguf_import.read_gguf(tmp_path / "short.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"header\.gguf is not a GGUF file hfquant can read"):
        gguf_import.read_gguf(tmp_path / "header.gguf")
    (tmp_path / "other.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="no GGUF magic"):
        gguf_import.read_gguf(tmp_path / "other.gguf")


@pytest.mark.parametrize("name", ["mistral", "Mistral 7B", None])
def test_the_config_of_a_llama_file_named_mistral_is_transformers(tmp_path, name):
    # transformers reads a "llama" file whose general.name is exactly "mistral" as a Mistral model
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    if name is not None:
        writer.add_name(name)
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, tensors = gguf_import.read_gguf(path)
    assert metadata["tokenizer.ggml.tokens"] == 3
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert theirs.model_type == ("mistral" if name == "mistral" else "llama") and theirs.vocab_size == 3
    assert gguf_model._gguf_config(path, metadata, tensors).to_dict() == theirs.to_dict()


def test_sibling_projections_are_read_into_their_fused_groups_tensor(tmp_path, monkeypatch):
    # q/k/v and gate/up of one block type are read into consecutive rows of one tensor, which their fused decode
    # group then computes from as it is: a group concatenating separately read weights held a second copy of them
    # while from_pretrained kept the state dict (peak RSS 1.5x the file)
    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    read = {}
    sibling_rows = gguf_model._sibling_rows
    monkeypatch.setattr(gguf_model, "_sibling_rows", lambda *args: read.update(sibling_rows(*args)) or read)
    model = hfquant.from_gguf(path, dtype=torch.bfloat16)
    for parent, children in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        members = [model.get_submodule(f"model.layers.1.{parent}.{child}") for child in children]
        group = members[0]._decode_group
        assert group is not None and group.weight is not None and group.members == members
        first = read[f"model.layers.1.{parent}.{children[0]}.weight"]
        assert group.weight.data_ptr() == first.data_ptr()
        assert group.weight.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    with open(path, "rb") as handle:
        _, tensors = gguf_import.read_gguf(path)
        tensor = tensors["blk.0.attn_k.weight"]
        out = torch.empty(gguf_import.stored_blocks(tensor).shape, dtype=torch.uint8)
        for fd in (handle.fileno(), None):
            assert gguf_import.stored_blocks(tensor, None, fd, out=out) is out
            assert torch.equal(out, gguf_import.stored_blocks(tensor))
        with pytest.raises(ValueError, match=r"out must be a contiguous \("):
            gguf_import.stored_blocks(tensor, None, None, out=out[1:])


def test_the_one_row_attention_is_on_unless_sdpa_is_asked_for(tmp_path):
    # as from_pretrained does (hfquant.nn.row_attention): a GGUF import whose skeleton wrote "sdpa" into the config
    # kept PyTorch's flash attention at decode (2.1 of 30.9 ms CPU per token of the 1.2B's Q4_K_M, one thread)
    from hfquant.nn import row_attention
    from hfquant.ops import torch_ops

    path, _ = _gguf_of(tmp_path, "llama", HfQuantConfig(format="q4_k"))
    expected = row_attention.ATTENTION_NAME if torch_ops.loaded() else "sdpa"
    assert hfquant.from_gguf(path).config._attn_implementation == expected
    assert hfquant.from_gguf(path, attn_implementation="sdpa").config._attn_implementation == "sdpa"
