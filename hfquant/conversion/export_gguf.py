"""`hfquant export SRC DST.gguf --format gguf`: an hfquant checkpoint of a Llama-family model as one GGUF file.

    export_gguf("SmolLM2-int4", "SmolLM2-int4.gguf")

The quantized layers' codes are re-blocked as they are (`hfquant.checkpoint.gguf_export`: int8 -> Q8_0, int4
symmetric -> Q4_0, int4 asymmetric -> Q4_1); layers in a block format (`HfQuantConfig(format="q4_k")`, ...) already
hold GGUF's bytes, which are copied as they are (rows in llama.cpp's q/k order); norms are written as F32, the embedding and any float Linear layer as
F16 when their values are exact in fp16, else BF16 when exact in bf16, else F32; biases (Qwen2's q/k/v) as F32. Llama and Mistral are written with
GGUF's "llama" architecture (q/k rows permuted as llama.cpp expects), Qwen2 with "qwen2" (not permuted, as llama.cpp's
converter does). Hyper-parameters and the tokenizer go through the `gguf` package's own writer and vocab helpers
(`GGUFWriter`, `gguf.SpecialVocab`, and for the vocabulary `gguf.vocab.BpeVocab` for a GPT-2-style byte-level BPE
`tokenizer.json` as Llama 3, SmolLM2 and Qwen2 use, `gguf.vocab.LlamaHfVocab` for a SentencePiece-style BPE with byte
fallback as Llama 2 and Mistral use). A byte-level tokenizer's pre-tokenizer is named for llama.cpp from its
`pre_tokenizer` in `tokenizer.json` (`gguf_pre_tokenizer`); one llama.cpp does not know is written as "default" with
a warning, since llama.cpp then splits text with its default rule (ids given to it directly are unaffected). The file is written beside DST under a temporary name and
renamed at the end: an interrupted export leaves DST as it was. gguf's writer keeps the tensors it is given until it
writes them, so memory holds the re-blocked model (about its file size), not the float one.

Checked against what llama.cpp requires before anything is written (`check_layout`, `_tokenizer`): the attention
shapes (heads a multiple of the key/value heads, q/k/v rows equal to heads x head dim; a head dim other than
hidden / heads, as Mistral-Nemo's, is written as `{arch}.attention.key_length` / `value_length`, which llama.cpp
otherwise takes as hidden / heads), `vocab_size` equal to the embedding's rows, a tokenizer no larger than those rows
(llama.cpp sizes the embedding from the token list and refuses the file otherwise; a smaller one is padded with
unused tokens), and every key of `REQUIRED_KEYS` present in the header.

Refused, with the reason: other architectures; layers with a stored SINQ column scale (GGUF has no tensor for it:
quantize with the 4-bit default, which folds the scales in Llama blocks, or `method="rtn"`); group sizes that are not
a multiple of 32; scales fp16 cannot hold.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.files import (
    CONFIG_NAME,
    open_safetensors,
    read_config,
    read_headers,
    read_tensor,
    require_inside,
    tensor_files,
)
from hfquant.checkpoint.gguf_export import Reblocked, llama_permutation, reblock_int4, reblock_int8
from hfquant.checkpoint.schema import block_layers
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.config import HfQuantConfig
from hfquant.core.blocks import LAYOUTS as BLOCK_LAYOUTS
from hfquant.core.optional import GGUF, require
from hfquant.core.packing import unpack_int4
from hfquant.integration.schema_check import check_checkpoint_schema

gguf = require(GGUF)  # ImportError with the pip command when gguf is not installed

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUF_MODEL_TYPES",
    "REQUIRED_KEYS",
    "GgufResult",
    "check_layout",
    "export_gguf",
    "gguf_pre_tokenizer",
]

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
"""`config.json` model type -> the GGUF architecture it is written as."""
GGUF_MODEL_TYPES = tuple(GGUF_ARCHITECTURES)
PERMUTED_ARCHITECTURES = ("llama",)
"""GGUF architectures whose q/k rows llama.cpp stores permuted (its converter permutes Llama's, not Qwen2's)."""

REQUIRED_KEYS = (
    "general.architecture",
    "{arch}.context_length",
    "{arch}.embedding_length",
    "{arch}.block_count",
    "{arch}.feed_forward_length",
    "{arch}.attention.head_count",
    "{arch}.attention.head_count_kv",
    "{arch}.attention.layer_norm_rms_epsilon",
    "{arch}.rope.freq_base",
    "{arch}.rope.dimension_count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
)
"""Header keys every export carries (`{arch}`: its GGUF architecture): the hyper-parameters llama.cpp's loader reads
for "llama" and "qwen2" (those it defaults, head_count_kv, rope.*, are written too, since their defaults are wrong
for grouped-query attention or another rope base), and the tokenizer. Besides: `tokenizer.ggml.merges` for a
byte-level BPE ("gpt2") tokenizer, `tokenizer.ggml.scores` for a SentencePiece-style ("llama") one, and
`{arch}.attention.key_length` / `value_length` when the head dim is not hidden / heads (`_required_keys`)."""

_LLAMA3_SPLIT = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace("\\p{N}{1,3}", "\\p{N}")

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_QUANT_TYPES = {
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
} | {name.upper(): gguf.GGMLQuantizationType(fmt.ggml_type) for name, fmt in BLOCK_LAYOUTS.items() if fmt.gguf}
"""GGUF type of each tensor kind written: the re-blocked int8/int4 layers' and every block format's (copied)."""
_FILE_TYPES = {
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": gguf.LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": gguf.LlamaFileType.MOSTLY_Q3_K_S,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
    "IQ4_NL": gguf.LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": gguf.LlamaFileType.MOSTLY_IQ4_XS,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "F32": gguf.LlamaFileType.ALL_F32,
}
"""`general.file_type` for a file whose main tensor type is the key (`_add_general`)."""


class GgufResult(NamedTuple):
    """What `export_gguf` wrote: the file, tensors per GGUF type, Q4_1 blocks with an inexact fp16 offset (and the
    largest weight error that makes), seconds."""

    dst: Path
    types: dict[str, int]
    inexact_q4_1_blocks: int
    max_q4_1_error: float
    seconds: float


def _gguf_name(key: str) -> str | None:
    """Checkpoint module name -> GGUF tensor name prefix ("model.layers.3.mlp.up_proj" -> "blk.3.ffn_up")."""
    if key == "model.embed_tokens":
        return "token_embd"
    if key == "model.norm":
        return "output_norm"
    if key == "lm_head":
        return "output"
    parts = key.split(".")
    if len(parts) >= 4 and parts[:2] == ["model", "layers"]:
        local = ".".join(parts[3:])
        if local in _LAYER_NAMES:
            return f"blk.{parts[2]}.{_LAYER_NAMES[local]}"
    return None


def _float_tensor(tensor: torch.Tensor, norm: bool) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """A float tensor as llama.cpp reads it, and its raw GGUF type (None: numpy's dtype says it): norms in F32; others
    in F16 when every value is exact in fp16, else in BF16 when exact in bf16 (a bf16 checkpoint's values below
    fp16's normal range, e.g. a randomly initialized embedding), else F32."""
    wide = tensor.float()
    if not norm:
        half = wide.to(torch.float16)
        if torch.equal(half.float(), wide):
            return half.numpy(), None
        brain = wide.to(torch.bfloat16)
        if torch.equal(brain.float(), wide):
            return brain.view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16
    return wide.numpy(), None


def _add_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_rope_dimension_count(head_dim)
    if (
        head_dim != config["hidden_size"] // heads
    ):  # llama.cpp's default is hidden / heads (Mistral-Nemo: 160, not 128)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}  # transformers 5 nests rope_theta there; 4.x kept it at the top
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_type={rope.get('rope_type')!r}: the GGUF export writes the default rotary embedding only"
        )
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(config["vocab_size"])


def gguf_pre_tokenizer(pre_tokenizer: dict | None) -> str | None:
    """llama.cpp's name (`tokenizer.ggml.pre`) for a byte-level BPE `tokenizer.json` "pre_tokenizer", or None when
    llama.cpp has none for it. Recognized: GPT-2's ByteLevel regex ("gpt-2"), digits split one by one before it as
    SmolLM's ("smollm"), and the Split regexes of Llama 3 ("llama-bpe") and Qwen2 ("qwen2") (the regexes of
    `llama-vocab.cpp`'s pre-tokenizer types)."""
    if not pre_tokenizer:
        return None
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        return {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}.get(pattern)
    return None


def _added_tokens(folder: Path) -> dict[int, bool]:
    """id -> special for `tokenizer.json`'s added tokens (chat markers such as <|im_start|>). gguf's vocab helpers
    type an added token that is also in the BPE vocabulary as NORMAL, and llama.cpp then reads its text as bytes."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return {}
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    return {int(item["id"]): bool(item.get("special")) for item in added if isinstance(item, dict) and "id" in item}


def _add_general(writer: gguf.GGUFWriter, folder: Path, written: list[str]) -> None:
    """The `general.*` keys llama.cpp's converter writes besides the architecture: `general.name` (the checkpoint
    folder's name), `general.file_type` (`gguf.LlamaFileType` of the most common quantized type among the tensors
    written, as llama.cpp names a file by its main type; of the most common float type when nothing is quantized) and
    `general.quantization_version` (`gguf.GGML_QUANT_VERSION`, the block layouts' version)."""
    writer.add_name(folder.resolve().name)
    quantized = [kind for kind in written if kind in _QUANT_TYPES]
    main_type = Counter(quantized or written).most_common(1)[0][0]
    writer.add_file_type(_FILE_TYPES[main_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


class _Tokenizer(NamedTuple):
    """The tokenizer as GGUF stores it: llama.cpp's model name ("gpt2" or "llama"), pre-tokenizer, one text, score
    and `gguf.TokenType` per embedding row, and the special ids / merges (`gguf.SpecialVocab`)."""

    model: str
    pre: str | None
    tokens: list
    scores: list[float]
    types: list
    special: object


def _tokenizer(folder: Path, rows: int) -> _Tokenizer:
    """The tokenizer of `folder` for an embedding of `rows` rows (padded with unused tokens up to them).

    Raises:
        ValueError: neither a byte-level BPE nor a SentencePiece-style BPE tokenizer; more tokens than `rows`
            (llama.cpp sizes the embedding from the token list, so it would refuse the file); a byte-level BPE
            without merges (llama.cpp requires the merge list).
    """
    try:
        vocab, model, pre = gguf.vocab.BpeVocab(folder), "gpt2", None
        tokenizer_json = folder / "tokenizer.json"
        if tokenizer_json.exists() and not (folder / "vocab.json").exists():
            pre = gguf_pre_tokenizer(json.loads(tokenizer_json.read_text(encoding="utf-8")).get("pre_tokenizer"))
        if pre is None:
            logger.warning(
                "%s: llama.cpp has no pre-tokenizer matching this tokenizer's; written as 'default', so "
                "llama.cpp may split text differently (token ids given to it directly are unaffected)",
                tokenizer_json,
            )
    except (FileNotFoundError, ValueError) as bpe_error:
        try:
            vocab, model, pre = gguf.vocab.LlamaHfVocab(folder), "llama", None
        except (FileNotFoundError, TypeError, ValueError, OSError) as llama_error:
            raise ValueError(
                f"{folder}: the GGUF export writes byte-level BPE tokenizers ({bpe_error}) and "
                f"SentencePiece-style BPE with byte fallback ({llama_error}) only"
            ) from None
    tokens, scores, types = [], [], []
    for text, score, kind in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(kind)
    if len(tokens) > rows:
        raise ValueError(
            f"{folder}: the tokenizer has {len(tokens)} tokens but the embedding has {rows} rows; llama.cpp sizes the "
            "embedding from the token list and refuses the file. Allowed: at most as many tokens as rows. Resize the "
            f"float model's embeddings (model.resize_token_embeddings({len(tokens)})) and convert it again"
        )
    for index, special in _added_tokens(folder).items():
        if index < len(types):  # llama.cpp matches CONTROL / USER_DEFINED tokens in text, not NORMAL ones
            types[index] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    while len(tokens) < rows:  # embedding rows without a token
        tokens.append(f"[PAD{len(tokens)}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    special = gguf.SpecialVocab(folder, load_merges=model == "gpt2", n_vocab=len(tokens))
    if model == "gpt2" and not special.merges:
        raise ValueError(
            f"{folder}: the byte-level BPE tokenizer has no merges; llama.cpp's BPE loader requires "
            "tokenizer.ggml.merges and GGUF cannot store an empty list. Allowed: a tokenizer.json (or merges.txt) "
            "with at least one merge"
        )
    return _Tokenizer(model, pre, tokens, scores, types, special)


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: _Tokenizer) -> None:
    writer.add_tokenizer_model(tokenizer.model)
    writer.add_tokenizer_pre(tokenizer.pre or "default")
    writer.add_token_list(tokenizer.tokens)
    if tokenizer.model == "llama":
        writer.add_token_scores(tokenizer.scores)
    writer.add_token_types(tokenizer.types)
    tokenizer.special.add_to_gguf(writer)


def _required_keys(architecture: str, config: dict, tokenizer_model: str) -> list[str]:
    """The header keys llama.cpp needs in this export (`REQUIRED_KEYS` and the conditional ones)."""
    keys = [key.format(arch=architecture) for key in REQUIRED_KEYS]
    keys.append("tokenizer.ggml.merges" if tokenizer_model == "gpt2" else "tokenizer.ggml.scores")
    heads = config["num_attention_heads"]
    if (config.get("head_dim") or config["hidden_size"] // heads) != config["hidden_size"] // heads:
        keys += [f"{architecture}.attention.key_length", f"{architecture}.attention.value_length"]
    return keys


def check_layout(config: dict, shapes: dict[str, tuple[int, ...]]) -> int:
    """Check config.json's attention and vocabulary sizes against each other and the stored tensor shapes (name ->
    shape, from the safetensors headers) as llama.cpp reads them; returns the embedding's rows.

    Raises:
        ValueError: one line naming the value and what is allowed: heads not a positive multiple of the key/value
            heads; hidden size not divisible by the heads without a `head_dim`; q/k/v rows other than heads x
            head dim; `vocab_size` other than the embedding's rows; no `model.embed_tokens.weight`.
    """
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads}, num_key_value_heads={kv_heads}: llama.cpp needs the heads to be a "
            "positive multiple of the key/value heads"
        )
    head_dim = config.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and config.json has no "
                "head_dim; llama.cpp takes the head dim as hidden / heads"
            )
        head_dim = hidden // heads
    for suffix, count in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        for name, shape in shapes.items():
            if name.endswith(f"self_attn.{suffix}.weight") and shape[0] != count * head_dim:
                raise ValueError(
                    f"{name} has {shape[0]} rows; config.json gives {count} heads x head dim {head_dim} = "
                    f"{count * head_dim}, which llama.cpp would use; the checkpoint does not match its config"
                )
    embedding = shapes.get("model.embed_tokens.weight")
    if embedding is None:
        raise ValueError("no model.embed_tokens.weight; the GGUF export needs the token embedding (token_embd)")
    if config["vocab_size"] != embedding[0]:
        raise ValueError(
            f"vocab_size={config['vocab_size']} in config.json but model.embed_tokens.weight has {embedding[0]} rows; "
            "llama.cpp needs them equal"
        )
    return embedding[0]


_READ_FILES = (
    CONFIG_NAME,
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
)
"""The non-weight files of SRC the export reads (none may be a link leaving SRC)."""


def _checked_source(folder: Path) -> tuple[dict, dict[str, Path]]:
    """(config.json, tensor name -> shard) of an hfquant checkpoint of an architecture GGUF takes, without SINQ scales.

    Raises:
        ValueError: a link leaving `folder`, not an hfquant checkpoint, tensors that do not match config.json
            (`check_checkpoint_schema`), another architecture, a SINQ column scale.
    """
    for name in _READ_FILES:
        if (folder / name).exists() or (folder / name).is_symlink():
            require_inside(folder, folder / name)  # an untrusted folder: no link out of it is read
    config = read_config(folder)
    if "quantization_config" not in config or config["quantization_config"].get("quant_method") != "hfquant":
        raise ValueError(f"{folder} is not an hfquant checkpoint (config.json has no hfquant quantization_config)")
    check_checkpoint_schema(folder)  # config.json against every stored tensor, as from_pretrained checks it
    if config.get("model_type") not in GGUF_MODEL_TYPES:
        raise ValueError(
            f"{folder}: model_type={config.get('model_type')!r}; the GGUF export writes {list(GGUF_MODEL_TYPES)}"
        )
    files = tensor_files(folder)
    if any(name.endswith(".weight_col_scale") for name in files):
        layer = next(name for name in files if name.endswith(".weight_col_scale")).rpartition(".")[0]
        raise ValueError(
            f"{layer} stores a SINQ column scale, which GGUF has no tensor for: convert with the 4-bit "
            "default (it folds the scales in Llama blocks) or method='rtn'"
        )
    return config, files


def _quantized_blocks(module: str, weight: torch.Tensor, read, files, perm: torch.Tensor | None):
    """The stored codes of `module` re-blocked (`reblock_int8` / `reblock_int4`), rows in `perm` order when given."""
    scale = read(module + ".weight_scale")
    zero = read(module + ".weight_zero_point") if module + ".weight_zero_point" in files else None
    if weight.dtype == torch.int8:
        blocks = reblock_int8(weight, scale, module)
        if perm is not None:
            blocks.data = blocks.data[perm.numpy()]
        return blocks
    codes = unpack_int4(weight)
    group = codes.shape[1] // scale.shape[1]
    if perm is not None:
        codes, scale = codes[perm], scale[perm]
        zero = None if zero is None else zero[perm]
    return reblock_int4(codes, scale, zero, group, module)


def _add_module(
    writer: gguf.GGUFWriter, module: str, gguf_name: str, read, files, permutation, block: str | None
) -> tuple[list[str], Reblocked | None]:
    """Add `module`'s weight (re-blocked when quantized in int8/int4, copied when stored in the block format `block`,
    else as `_float_tensor`) and bias (F32) to `writer`; returns (the GGUF type of each tensor written, the re-blocked
    weight or None)."""
    weight = read(module + ".weight")
    perm = permutation(gguf_name, weight.shape[0])
    written: list[str] = []
    blocks = None
    if (
        block is not None and weight.dtype == torch.uint8
    ):  # GGUF's own bytes: rows copied (in `perm` order), nothing re-encoded
        data = (weight if perm is None else weight[perm]).numpy()
        writer.add_tensor(gguf_name + ".weight", data, raw_dtype=_QUANT_TYPES[block.upper()])
        written.append(block.upper())
    elif module + ".weight_scale" in files:
        blocks = _quantized_blocks(module, weight, read, files, perm)
        writer.add_tensor(gguf_name + ".weight", blocks.data, raw_dtype=_QUANT_TYPES[blocks.kind])
        written.append(blocks.kind)
    else:
        array, raw = _float_tensor(weight if perm is None else weight[perm], norm=gguf_name.endswith("norm"))
        writer.add_tensor(gguf_name + ".weight", array, raw_dtype=raw)
        written.append(raw.name if raw is not None else "F16" if array.dtype == np.float16 else "F32")
    if module + ".bias" in files:
        bias = read(module + ".bias").float()
        perm = permutation(gguf_name, bias.shape[0])
        writer.add_tensor(gguf_name + ".bias", (bias if perm is None else bias[perm]).numpy())
        written.append("F32")
    return written, blocks


def _replace_atomically(dst: Path, write) -> None:
    """`write(path)` into a temporary file beside `dst`, given the usual file mode and renamed to `dst`; on any failure
    the temporary file is removed and `dst` is left as it was."""
    while True:  # as tempfile.mkstemp, with a name that fits whatever the length of dst's (folders.hidden_sibling)
        partial = str(folders.hidden_sibling(dst, "tmp"))
        try:
            os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            break
        except FileExistsError:
            continue
    try:
        write(partial)
        # created private; a finished file gets the mode the umask asks for
        os.chmod(partial, 0o666 & ~folders.process_umask())
        os.replace(partial, dst)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def _row_permutation(architecture: str, config: dict):
    """`permutation(gguf_name, rows)`: the row order llama.cpp expects for a tensor of `architecture` (q/k of the
    permuted architectures, by their head counts in `config`), None to keep the stored order."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads

    def permutation(gguf_name: str, rows: int) -> torch.Tensor | None:
        if architecture not in PERMUTED_ARCHITECTURES or not gguf_name.endswith(("attn_q", "attn_k")):
            return None
        return llama_permutation(rows, heads if gguf_name.endswith("attn_q") else kv_heads)

    return permutation


def _inexact_offsets(reblocked: list[Reblocked]) -> tuple[int, float]:
    """(Q4_1 blocks whose fp16 offset is inexact, the largest weight error that makes) over `reblocked`, warned about
    once with what to do when there are any (0 for the other types)."""
    inexact = sum(blocks.inexact_blocks for blocks in reblocked)
    max_error = max([blocks.max_error for blocks in reblocked], default=0.0)
    if inexact:
        logger.warning(
            "GGUF Q4_1: %d block(s) whose offset -scale * zero_point is not exact in fp16, so llama.cpp's weights differ "
            "from hfquant's by at most %.3g each (a rounding of the offset, well below the quantization error itself); "
            "for blocks equal bit for bit, quantize with symmetric=True (Q4_0) or bits=8 (Q8_0)",
            inexact,
            max_error,
        )
    return inexact, max_error


def export_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> GgufResult:
    """Write the hfquant checkpoint folder `src` (Llama, Mistral or Qwen2) as the GGUF file `dst`.

    Raises:
        ValueError: not an hfquant checkpoint, another architecture, a layer GGUF cannot hold (named, with why), a
            tokenizer that is not byte-level BPE or has more tokens than the embedding has rows, attention or
            vocabulary sizes llama.cpp would read otherwise (`check_layout`); all before anything is written.
        ValueError: `dst` is `src`, an existing file in it, or contains it (links and `..` resolved; before any work).
        FileExistsError: `dst` exists and `overwrite` is False.
        OSError: the file could not be written; `dst` is left as it was.
    """
    start = time.perf_counter()
    folder, dst = Path(src), Path(dst)
    folders.check_apart_from_source(dst, folder, "the GGUF file", file=True)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    config, files = _checked_source(folder)
    headers = {}
    for path in dict.fromkeys(files.values()):
        headers.update(read_headers(path))
    rows = check_layout(config, {name: tuple(header.shape) for name, header in headers.items()})
    tokenizer = _tokenizer(folder, rows)
    architecture = GGUF_ARCHITECTURES[config["model_type"]]
    permutation = _row_permutation(architecture, config)
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = open_safetensors(path)
        return read_tensor(handles[path], path, name)

    written: list[str] = []
    reblocked: list[Reblocked] = []
    block_of = block_layers(HfQuantConfig.from_dict(config["quantization_config"]), headers)
    own = {module: fmt for module, fmt in block_of.items() if not BLOCK_LAYOUTS[fmt].gguf}
    if own:
        module, fmt = next(iter(own.items()))
        raise ValueError(
            f"{module} is stored in hfquant's own block format {fmt} ({len(own)} layer(s)), which GGUF has no type "
            "for; nothing was written. Convert with a GGUF block format (format='q3_k', 'iq4_nl', ...) to export"
        )

    def write(path: str) -> None:
        writer = gguf.GGUFWriter(path, architecture)
        _add_hyperparameters(writer, config)
        _add_tokenizer(writer, tokenizer)
        for module in sorted({name.rpartition(".")[0] for name in files if name.endswith(".weight")}):
            gguf_name = _gguf_name(module)
            if gguf_name is None:
                raise ValueError(f"{module}: no GGUF tensor of the llama architecture takes this module")
            kinds, blocks = _add_module(writer, module, gguf_name, read, files, permutation, block_of.get(module))
            written.extend(kinds)
            reblocked.extend([blocks] if blocks is not None else [])
            release_checkpoint_pages()
        _add_general(writer, folder, written)
        present = {key for shard in writer.kv_data for key in shard}
        missing = [key for key in _required_keys(architecture, config, tokenizer.model) if key not in present]
        if missing:
            raise ValueError(f"the GGUF header lacks {missing}, which llama.cpp requires; nothing was written")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        _replace_atomically(dst, write)
    finally:
        handles.clear()
    inexact, max_error = _inexact_offsets(reblocked)
    return GgufResult(dst, dict(Counter(written)), inexact, max_error, time.perf_counter() - start)
