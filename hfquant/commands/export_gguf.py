"""`hfquant export SRC DST.gguf --format gguf`: an hfquant checkpoint of a Llama-family model as one GGUF file.

    export_gguf("SmolLM2-int4", "SmolLM2-int4.gguf")

The quantized layers' codes are re-blocked as they are (`hfquant.checkpoint.gguf_export`: int8 -> Q8_0, int4
symmetric -> Q4_0, int4 asymmetric -> Q4_1); norms are written as F32, the embedding and any float Linear layer as
F16 when their values are exact in fp16, else F32. Hyper-parameters and the tokenizer (a GPT-2-style byte-level BPE
`tokenizer.json`, as Llama 3, SmolLM2 and Qwen2 use) go through the `gguf` package's own writer and vocab helpers
(`GGUFWriter`, `gguf.vocab.BpeVocab`, `gguf.SpecialVocab`). The file is written beside DST under a temporary name and
renamed at the end: an interrupted export leaves DST as it was. gguf's writer keeps the tensors it is given until it
writes them, so memory holds the re-blocked model (about its file size), not the float one.

Refused, with the reason: other architectures; layers with a stored SINQ column scale (GGUF has no tensor for it:
quantize with the 4-bit default, which folds the scales in Llama blocks, or `method="rtn"`); group sizes that are not
a multiple of 32; scales fp16 cannot hold.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import torch

from hfquant.checkpoint.files import CONFIG_NAME, open_safetensors, read_config, read_tensor, require_inside, tensor_files
from hfquant.checkpoint.gguf_export import llama_permutation, reblock_int4, reblock_int8
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.core.packing import unpack_int4

__all__ = ["GGUF_MODEL_TYPES", "GgufResult", "export_gguf"]

logger = logging.getLogger(__name__)

GGUF_MODEL_TYPES = ("llama", "mistral")
"""`config.json` model types written with GGUF's "llama" architecture."""

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_QUANT_TYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0,
                "Q4_1": gguf.GGMLQuantizationType.Q4_1}


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


def _float_tensor(tensor: torch.Tensor, norm: bool) -> np.ndarray:
    """A float tensor as llama.cpp reads it: norms in F32; others in F16 when exact, else F32."""
    wide = tensor.float()
    if not norm:
        half = wide.to(torch.float16)
        if torch.equal(half.float(), wide):
            return half.numpy()
    return wide.numpy()


def _add_hyperparameters(writer: gguf.GGUFWriter, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    rope = config.get("rope_parameters") or {}  # transformers 5 nests rope_theta there; 4.x kept it at the top
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope_type={rope.get('rope_type')!r}: the GGUF export writes the default rotary embedding only")
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(config["vocab_size"])


def _add_tokenizer(writer: gguf.GGUFWriter, folder: Path, vocab_size: int) -> None:
    try:
        vocab = gguf.vocab.BpeVocab(folder)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"{folder}: the GGUF export writes GPT-2-style byte-level BPE tokenizers only ({error})") from None
    tokens, types = [], []
    for text, _score, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    while len(tokens) < vocab_size:  # embedding rows without a token
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)


def export_gguf(src: str | os.PathLike, dst: str | os.PathLike, *, overwrite: bool = False) -> GgufResult:
    """Write the hfquant checkpoint folder `src` (a Llama-family model) as the GGUF file `dst`.

    Raises:
        ValueError: not an hfquant checkpoint, another architecture, a layer GGUF cannot hold (named, with why), a
            tokenizer that is not byte-level BPE.
        FileExistsError: `dst` exists and `overwrite` is False.
        OSError: the file could not be written; `dst` is left as it was.
    """
    start = time.perf_counter()
    folder, dst = Path(src), Path(dst)
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
    for name in (CONFIG_NAME, "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                 "special_tokens_map.json", "added_tokens.json"):
        if (folder / name).exists() or (folder / name).is_symlink():
            require_inside(folder, folder / name)  # an untrusted folder: no link out of it is read
    config = read_config(folder)
    if "quantization_config" not in config or config["quantization_config"].get("quant_method") != "hfquant":
        raise ValueError(f"{folder} is not an hfquant checkpoint (config.json has no hfquant quantization_config)")
    if config.get("model_type") not in GGUF_MODEL_TYPES:
        raise ValueError(f"{folder}: model_type={config.get('model_type')!r}; the GGUF export writes {list(GGUF_MODEL_TYPES)}")
    files = tensor_files(folder)
    if any(name.endswith(".weight_col_scale") for name in files):
        layer = next(name for name in files if name.endswith(".weight_col_scale")).rpartition(".")[0]
        raise ValueError(f"{layer} stores a SINQ column scale, which GGUF has no tensor for: convert with the 4-bit "
                         "default (it folds the scales in Llama blocks) or method='rtn'")
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = open_safetensors(path)
        return read_tensor(handles[path], path, name)

    dst.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(handle)
    types: dict[str, int] = {}
    inexact, max_error = 0, 0.0
    try:
        writer = gguf.GGUFWriter(partial, "llama")
        _add_hyperparameters(writer, config)
        _add_tokenizer(writer, folder, config["vocab_size"])
        modules = sorted({name.rpartition(".")[0] for name in files if name.endswith(".weight")})
        for module in modules:
            gguf_name = _gguf_name(module)
            if gguf_name is None:
                raise ValueError(f"{module}: no GGUF tensor of the llama architecture takes this module")
            weight = read(module + ".weight")
            if module + ".weight_scale" in files:
                scale = read(module + ".weight_scale")
                zero = read(module + ".weight_zero_point") if module + ".weight_zero_point" in files else None
                if weight.dtype == torch.int8:
                    blocks = reblock_int8(weight, scale, module)
                    n = weight.shape[0]
                else:
                    codes = unpack_int4(weight)
                    n, k = codes.shape
                    group = k // scale.shape[1]
                    if gguf_name.endswith(("attn_q", "attn_k")):
                        perm = llama_permutation(n, heads if gguf_name.endswith("attn_q") else kv_heads)
                        codes, scale = codes[perm], scale[perm]
                        zero = None if zero is None else zero[perm]
                    blocks = reblock_int4(codes, scale, zero, group, module)
                    inexact += blocks.inexact_blocks
                    max_error = max(max_error, blocks.max_error)
                if weight.dtype == torch.int8 and gguf_name.endswith(("attn_q", "attn_k")):
                    perm = llama_permutation(n, heads if gguf_name.endswith("attn_q") else kv_heads)
                    blocks.data = blocks.data[perm.numpy()]
                writer.add_tensor(gguf_name + ".weight", blocks.data, raw_dtype=_QUANT_TYPES[blocks.kind])
                types[blocks.kind] = types.get(blocks.kind, 0) + 1
            else:
                if gguf_name.endswith(("attn_q", "attn_k")):
                    perm = llama_permutation(weight.shape[0], heads if gguf_name.endswith("attn_q") else kv_heads)
                    weight = weight[perm]
                array = _float_tensor(weight, norm=gguf_name.endswith("norm"))
                writer.add_tensor(gguf_name + ".weight", array)
                kind = "F16" if array.dtype == np.float16 else "F32"
                types[kind] = types.get(kind, 0) + 1
            release_checkpoint_pages()
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # mkstemp made it private; a finished file gets the usual mode
        os.replace(partial, dst)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    finally:
        handles.clear()
    if inexact:
        logger.warning("GGUF Q4_1: %d block(s) whose offset -scale * zero_point is not exact in fp16 (largest weight "
                       "error %.3g)", inexact, max_error)
    return GgufResult(dst, types, inexact, max_error, time.perf_counter() - start)
