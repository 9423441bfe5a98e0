"""`hfquant export --format gguf`: read back by the `gguf` package's reader and dequantizer, and by transformers' own
GGUF loader (`from_pretrained(..., gguf_file=)`, which undoes llama.cpp's q/k row permutation).

Q8_0 and Q4_0 re-block hfquant's codes exactly: the dequantized weights are equal to hfquant's (`torch.equal`).
Q4_1's offset m = -scale * zero_point is rounded to fp16: weights within half an fp16 step of m.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
from helpers import MERGES_VOCAB, tiny_model  # noqa: E402
from helpers import tiny_tokenizer as _byte_tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hfquant import HfQuantConfig, QuantLinear  # noqa: E402
from hfquant.checkpoint.gguf_export import llama_permutation, reblock_int4  # noqa: E402
from hfquant.conversion.convert import convert  # noqa: E402
from hfquant.conversion.export import export_checkpoint  # noqa: E402
from hfquant.conversion.export_gguf import gguf_pre_tokenizer  # noqa: E402


def tiny_tokenizer():
    """`helpers.tiny_tokenizer` with one merge: llama.cpp reads no byte-level BPE file without a merge list."""
    return _byte_tokenizer(merges=True)


CONFIGS = {
    "int8": dict(bits=8),
    "int4-sym": dict(bits=4, group_size=32, symmetric=True, method="rtn", mixed_precision="none"),
    "int4-asym": dict(bits=4, group_size=64, method="rtn", mixed_precision="none"),
    "int4-default": dict(bits=4, format="int"),  # SINQ folded into plain RTN codes in Llama blocks, late v_proj int8
    "4bit-default": dict(bits=4),  # IQ4_XS blocks copied (IQ4_NL: the tiny model's rows of 64), the lm_head Q8_0
}
TYPES = {
    "int8": {"Q8_0"},
    "int4-sym": {"Q4_0"},
    "int4-asym": {"Q4_1"},
    "int4-default": {"Q4_1", "Q8_0"},
    "4bit-default": {"IQ4_NL"},
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny Llama (4 heads, 2 key/value heads, so q and k are permuted) with a byte-level BPE tokenizer."""
    folder = tmp_path_factory.mktemp("gguf-src")
    tiny_model("llama", dtype=torch.bfloat16, **MERGES_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _quantized(source: Path, root: Path, name: str) -> Path:
    out = root / name
    convert(source, out, HfQuantConfig(**CONFIGS[name]), progress=False)
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gguf_reader_and_transformers_read_back_hfquant_weights(source, tmp_path, name):
    folder = _quantized(source, tmp_path, name)
    result = export_checkpoint(folder, folder / "model.gguf", format="gguf")
    reader = gguf.GGUFReader(folder / "model.gguf")
    kinds = {t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.") and "norm" not in t.name}
    # the 4-bit default's int8 per-channel lm_head is Q8_0 (its scale repeated per block of 32, exact); at 8 bits it
    # is kept in float: the tiny bf16 model's has values below fp16's normal range, so BF16, exact
    output = "BF16" if HfQuantConfig(**CONFIGS[name]).lm_head == "keep" else "Q8_0"
    assert {t.tensor_type.name for t in reader.tensors if t.name == "output.weight"} == {output}
    assert kinds == TYPES[name] and set(result.types) >= kinds
    # the general keys llama.cpp's converter writes: the name, the main quantized type, the block layouts' version
    fields = reader.fields
    assert bytes(fields["general.name"].parts[-1]).decode() == folder.name
    main = {"int8": "Q8_0", "int4-sym": "Q4_0", "int4-asym": "Q4_1", "int4-default": "Q4_1", "4bit-default": "IQ4_NL"}[
        name
    ]
    assert int(fields["general.file_type"].parts[-1][0]) == gguf.LlamaFileType["MOSTLY_" + main]
    assert int(fields["general.quantization_version"].parts[-1][0]) == gguf.GGML_QUANT_VERSION

    hfquant_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
    for module_name, module in hfquant_model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        expected = module.dequantize(torch.float32)
        got = gguf_model.get_submodule(module_name).weight.float()
        if module.bits == 8 or module.symmetric:
            assert torch.equal(got, expected), module_name
        else:  # Q4_1: m = -scale * zero_point rounded to fp16, at most half an fp16 step of m per weight
            m = (module.weight_scale.double() * module.weight_zero_point.double()).abs().max()
            assert (got.double() - expected.double()).abs().max() <= m * 2**-11 + 1e-7, module_name
    for name in ("lm_head", "model.embed_tokens"):
        if isinstance(hfquant_model.get_submodule(name), QuantLinear):
            continue  # the int8 lm_head: compared with the quantized layers above
        got, want = gguf_model.get_submodule(name).weight, hfquant_model.get_submodule(name).weight
        assert torch.equal(got.float(), want.float()), name
    ids = torch.tensor([[5, 77, 140, 9, 33, 200, 18]])
    with torch.no_grad():
        reference, logits = hfquant_model(ids).logits, gguf_model(ids).logits
    # same weights (or within fp16 of m), float32 both: summation order only, and hfquant's int kernels
    assert (logits - reference).abs().max() <= 1e-3 * reference.abs().max() + (1e-2 if "asym" in name else 0)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    text = "hfquant -> gguf: naïve bytes"
    assert tokenizer(text).input_ids == tiny_tokenizer()(text).input_ids


def _assert_same_model(folder: Path, name: str) -> None:
    """transformers' GGUF load of folder/model.gguf has hfquant's dequantized weights and logits."""
    hfquant_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
    for module_name, module in hfquant_model.named_modules():
        if isinstance(module, QuantLinear):
            got = gguf_model.get_submodule(module_name)
            assert torch.equal(got.weight.float(), module.dequantize(torch.float32)), module_name
            if module.bias is not None:
                assert torch.equal(got.bias.float(), module.bias.float()), module_name
    ids = torch.tensor([[5, 77, 140, 9, 33, 200, 18]])
    with torch.no_grad():
        reference, logits = hfquant_model(ids).logits, gguf_model(ids).logits
    assert (logits - reference).abs().max() <= 1e-3 * reference.abs().max(), name


@pytest.mark.parametrize("name", ["int8", "int4-sym"])
def test_qwen2_is_written_unpermuted_with_its_biases(tmp_path, name):
    from transformers import Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **MERGES_VOCAB,
    )
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():  # Qwen2 initializes its q/k/v biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    source = tmp_path / "qwen2"
    model.save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    folder = _quantized(source, tmp_path, name)
    export_checkpoint(folder, folder / "model.gguf", format="gguf")
    reader = gguf.GGUFReader(folder / "model.gguf")
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "qwen2"
    assert {"blk.0.attn_q.bias", "blk.1.attn_v.bias"} <= {t.name for t in reader.tensors}
    _assert_same_model(folder, name)


def test_pre_tokenizers_get_llama_cpp_names():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert gguf_pre_tokenizer(byte_level) == "gpt-2"
    assert (
        gguf_pre_tokenizer(
            {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
        )
        == "smollm"
    )
    regex = (
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
        "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    )
    for pattern, expected in ((regex, "llama-bpe"), (regex.replace("{1,3}", ""), "qwen2"), ("\\s+", None)):
        split = {"type": "Split", "pattern": {"Regex": json.loads(json.dumps(pattern))}, "behavior": "Isolated"}
        steps = [split, dict(byte_level, use_regex=False)]
        assert gguf_pre_tokenizer({"type": "Sequence", "pretokenizers": steps}) == expected, pattern
    assert gguf_pre_tokenizer(dict(byte_level, use_regex=False)) is None  # no llama.cpp rule: written as "default"
    assert gguf_pre_tokenizer(None) is None


def test_special_tokens_are_control_tokens_for_llama_cpp(source, tmp_path):
    """<eos> is both in the BPE vocabulary and a special added token: llama.cpp must see it as CONTROL (else it reads
    "<eos>" in a chat prompt as five bytes)."""
    folder = _quantized(source, tmp_path, "int8")
    export_checkpoint(folder, folder / "model.gguf", format="gguf")
    field = gguf.GGUFReader(folder / "model.gguf").fields["tokenizer.ggml.token_type"]
    types = [int(field.parts[i][0]) for i in field.data]
    assert types[256] == gguf.TokenType.CONTROL and set(types[:256]) == {gguf.TokenType.NORMAL}


def _sentencepiece_style_tokenizer():
    """A Llama-2 / Mistral style tokenizer.json: BPE with byte fallback over "▁"-prefixed pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{i:02X}>": 3 + i for i in range(256)})
    pieces = [
        "▁",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "▁h",
        "el",
        "lo",
        "▁hel",
        "▁hello",
        "▁w",
        "or",
        "▁wor",
        "ld",
        "▁world",
    ]
    vocab.update({piece: len(vocab) + i for i, piece in enumerate(pieces)})
    merges = [
        ("▁", "h"),
        ("e", "l"),
        ("l", "o"),
        ("▁h", "el"),
        ("▁hel", "lo"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("l", "d"),
        ("▁wor", "ld"),
    ]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_sentencepiece_style_tokenizer_is_written_as_llamas(tmp_path):
    tokenizer = _sentencepiece_style_tokenizer()
    size = len(tokenizer)
    source = tmp_path / "mistral-like"
    tiny_model(
        "llama", dtype=torch.bfloat16, vocab_size=size + 3, bos_token_id=1, eos_token_id=2, pad_token_id=0
    ).save_pretrained(source)
    tokenizer.save_pretrained(source)
    folder = _quantized(source, tmp_path, "int8")
    export_checkpoint(folder, folder / "model.gguf", format="gguf")
    reader = gguf.GGUFReader(folder / "model.gguf")
    assert bytes(reader.fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    back = AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")
    for text in ("hello world", "hello wörld 42"):  # "ö" and the digits only through byte fallback
        assert back(text).input_ids == tokenizer(text).input_ids, text


def test_q4_1_offsets_are_counted_when_fp16_cannot_hold_them():
    codes = torch.randint(0, 16, (2, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor([[0.0123], [0.5]], dtype=torch.bfloat16)
    zero = torch.tensor([[0], [13]], dtype=torch.uint8)
    result = reblock_int4(codes, scale, zero, 64, "layer")
    exact_m = (-scale.double() * zero.double()).flatten()
    inexact_rows = int((exact_m.to(torch.float16).double() != exact_m).sum())
    assert result.kind == "Q4_1" and result.inexact_blocks == 2 * inexact_rows  # 2 blocks of 32 per row
    assert result.data.shape == (2, 2 * 20)


def test_llama_permutation_is_the_inverse_of_transformers_gguf_reader():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weights = torch.arange(16 * 3).reshape(16, 3).numpy()
    stored = weights[llama_permutation(16, 2).numpy()]
    assert not (stored == weights).all()
    assert (LlamaTensorProcessor()._reverse_permute_weights(stored, 2, 2) == weights).all()


def test_refusals_name_the_reason(source, tmp_path, float_checkpoint):
    stored_scales = tmp_path / "sinq-stored"
    convert(source, stored_scales, HfQuantConfig(bits=4, fold_column_scales=False), progress=False)
    with pytest.raises(ValueError, match=r"SINQ column scale, which GGUF has no tensor for.*method='rtn'"):
        export_checkpoint(stored_scales, tmp_path / "a.gguf", format="gguf")
    gpt2 = tmp_path / "gpt2"
    convert(float_checkpoint("gpt2"), gpt2, HfQuantConfig(bits=8), progress=False)
    with pytest.raises(ValueError, match=r"model_type='gpt2'; the GGUF export writes \['llama', 'mistral', 'qwen2'\]"):
        export_checkpoint(gpt2, tmp_path / "b.gguf", format="gguf")
    with pytest.raises(ValueError, match="not an hfquant checkpoint"):
        export_checkpoint(source, tmp_path / "c.gguf", format="gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.tmp"))


def test_an_existing_dst_is_kept_unless_overwrite_and_a_failed_export_leaves_it(source, tmp_path, monkeypatch):
    folder = _quantized(source, tmp_path, "int8")
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"previous")
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(folder, dst, format="gguf")
    import hfquant.conversion.export_gguf as module

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(module.gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        export_checkpoint(folder, dst, format="gguf", overwrite=True)
    assert dst.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.undo()
    export_checkpoint(folder, dst, format="gguf", overwrite=True)
    assert dst.read_bytes()[:4] == b"GGUF"


def test_a_tokenizer_link_leaving_the_folder_is_refused(source, tmp_path):
    folder = _quantized(source, tmp_path, "int8")
    outside = tmp_path / "elsewhere.json"
    shutil.move(folder / "tokenizer.json", outside)
    (folder / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ValueError, match="tokenizer.json"):
        export_checkpoint(folder, tmp_path / "x.gguf", format="gguf")


@pytest.mark.slow
def test_smollm2_gguf_exports_decode_hfquants_greedy_tokens(tmp_path):
    """The real SmolLM2 (tied embeddings, 9 query / 3 key-value heads) at int4 g64 asymmetric (Q4_1): transformers'
    GGUF load gives the first 12 greedy tokens of the hfquant model (both in float32), and the GGUF tokenizer the same
    ids for the chat prompt. One format is enough here: what this real model adds (its head counts' permutation, the
    tied embedding, its tokenizer) does not depend on the block type, and every type's tensors are compared with the
    GGUF reader's in test_gguf_reader_and_transformers_read_back_hfquant_weights. Q4_1 is the type whose offsets are
    rounded to fp16 (not bit-exact), the one where greedy tokens could drift."""
    from benchmarks.example_model import build_example_model

    src = build_example_model()
    for name, settings in (("int4-asym", CONFIGS["int4-asym"]),):
        folder = tmp_path / name
        convert(src, folder, HfQuantConfig(**settings), progress=False)
        export_checkpoint(folder, folder / "model.gguf", format="gguf")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
        )
        assert (
            AutoTokenizer.from_pretrained(folder, gguf_file="model.gguf")(prompt).input_ids
            == tokenizer(prompt).input_ids
        )
        ids = torch.tensor([tokenizer(prompt).input_ids])
        tokens = []
        for model in (
            AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
            AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32),
        ):
            tokens.append(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :])
        assert torch.equal(tokens[0], tokens[1]), (name, tokenizer.decode(tokens[0]), tokenizer.decode(tokens[1]))


# -- what llama.cpp requires, checked before writing (issue #28 item 3) -----------------------------------------


def _field(reader, key):
    part = reader.fields[key].parts[-1]
    return bytes(part).decode() if part.dtype == "uint8" else int(part[0])


def _keys_present(path: Path, architecture: str, tokenizer_model: str) -> set[str]:
    from hfquant.conversion.export_gguf import REQUIRED_KEYS

    fields = gguf.GGUFReader(path).fields
    wanted = [key.format(arch=architecture) for key in REQUIRED_KEYS]
    wanted.append("tokenizer.ggml.merges" if tokenizer_model == "gpt2" else "tokenizer.ggml.scores")
    missing = [key for key in wanted if key not in fields]
    assert not missing, missing
    return set(fields)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_every_layout_has_the_keys_llama_cpp_requires(tmp_path, model_type):
    """Llama, Mistral and Qwen2 exports carry every key llama.cpp's loader reads for their architecture; a model whose
    head dim is hidden / heads gets no key/value length keys (llama.cpp's default is right)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **MERGES_VOCAB,
    )
    torch.manual_seed(0)
    source = tmp_path / model_type
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    folder = _quantized(source, tmp_path, "int8")
    export_checkpoint(folder, folder / "model.gguf", format="gguf")
    architecture = "qwen2" if model_type == "qwen2" else "llama"
    fields = _keys_present(folder / "model.gguf", architecture, "gpt2")
    assert f"{architecture}.attention.key_length" not in fields
    reader = gguf.GGUFReader(folder / "model.gguf")
    assert _field(reader, f"{architecture}.attention.head_count_kv") == 2
    assert _field(reader, f"{architecture}.rope.dimension_count") == 16


def test_a_head_dim_other_than_hidden_over_heads_is_written_as_key_and_value_length(tmp_path):
    """Mistral-Nemo's layout (head_dim 128 with hidden 5120 and 32 heads), tiny: hidden 64, 4 heads of 32 (not 16).
    The file says key_length = value_length = 32, and transformers' GGUF loader gives hfquant's weights and
    logits."""
    source = tmp_path / "nemo-like"
    tiny_model("llama", dtype=torch.bfloat16, head_dim=32, **MERGES_VOCAB).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    assert json.loads((source / "config.json").read_text())["head_dim"] == 32
    folder = _quantized(source, tmp_path, "int8")
    export_checkpoint(folder, folder / "model.gguf", format="gguf")
    fields = _keys_present(folder / "model.gguf", "llama", "gpt2")
    reader = gguf.GGUFReader(folder / "model.gguf")
    assert {"llama.attention.key_length", "llama.attention.value_length"} <= fields
    assert _field(reader, "llama.attention.key_length") == _field(reader, "llama.attention.value_length") == 32
    assert _field(reader, "llama.rope.dimension_count") == 32
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert int(q.shape[-1]) == 4 * 32  # rows: heads x head_dim (gguf lists dims innermost first)
    _assert_same_model(folder, "head_dim 32")


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_writing(source, tmp_path):
    """llama.cpp sizes the embedding from the token list: 258 tokens over 200 embedding rows is refused in one line
    naming both numbers and the fix, and nothing is written (not even a temporary file); so is a byte-level BPE
    without a merge list, which llama.cpp's BPE loader requires."""
    small = tmp_path / "small-vocab"
    tiny_model("llama", dtype=torch.bfloat16, vocab_size=200).save_pretrained(small)
    tiny_tokenizer().save_pretrained(small)
    folder = _quantized(small, tmp_path, "int8")
    dst = tmp_path / "out.gguf"
    with pytest.raises(ValueError, match=r"has 258 tokens but the embedding has 200 rows.*resize_token_embeddings"):
        export_checkpoint(folder, dst, format="gguf")
    assert not dst.exists() and not list(tmp_path.glob(".*.tmp"))
    no_merges = _quantized(source, tmp_path / "merges", "int8")
    _byte_tokenizer().save_pretrained(no_merges)  # 257 tokens for 258 rows, no merge
    with pytest.raises(ValueError, match=r"has no merges; llama.cpp's BPE loader requires tokenizer.ggml.merges"):
        export_checkpoint(no_merges, dst, format="gguf")
    assert not dst.exists() and not list(tmp_path.glob(".*.tmp"))


def test_attention_shapes_llama_cpp_would_misread_are_refused(source, tmp_path):
    from hfquant.conversion.export_gguf import check_layout

    config = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10}
    shapes = {
        "model.embed_tokens.weight": (10, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (32, 64),
        "model.layers.0.self_attn.v_proj.weight": (32, 64),
    }
    assert check_layout(config, shapes) == 10
    with pytest.raises(ValueError, match=r"num_attention_heads=4, num_key_value_heads=3.*multiple"):
        check_layout(dict(config, num_key_value_heads=3), shapes)
    with pytest.raises(ValueError, match=r"hidden_size=66 is not divisible by num_attention_heads=4"):
        check_layout(dict(config, hidden_size=66), shapes)
    with pytest.raises(ValueError, match=r"k_proj.weight has 32 rows; config.json gives 2 heads x head dim 32 = 64"):
        check_layout(dict(config, head_dim=32), dict(shapes, **{"model.layers.0.self_attn.q_proj.weight": (128, 64)}))
    with pytest.raises(ValueError, match=r"vocab_size=12 in config.json but model.embed_tokens.weight has 10 rows"):
        check_layout(dict(config, vocab_size=12), shapes)
