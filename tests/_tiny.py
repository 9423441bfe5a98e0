"""Tiny, fully offline model + tokenizer for fast tests (no checkpoint needed)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: one token per UTF-8 byte (256) plus ``<eos>`` (id 256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def tiny_llama(seed: int = 0, tie: bool = True, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Randomly initialised 2-layer Llama with hidden size 64 and a 257-token vocabulary."""
    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=256,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.eval()
    return model
