"""Tiny random checkpoints for the model and serialization tests (no Hub access, a few hundred KB each)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, BertConfig, GPT2Config, LlamaConfig

ARCHITECTURES = ("llama", "llama_tied", "gpt2", "bert")


def tiny_config(arch: str, **overrides):
    """Config of a 2-layer model with hidden size 64 and a 256-token vocabulary."""
    if arch in ("llama", "llama_tied"):
        values = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=arch == "llama_tied",
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        return LlamaConfig(**(values | overrides))
    if arch == "gpt2":  # Conv1D layers, lm_head tied to wte
        values = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
        return GPT2Config(**(values | overrides))
    if arch == "bert":  # encoder without an output embedding, Linear layers with bias
        values = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, pad_token_id=0,
        )
        return BertConfig(**(values | overrides))
    raise ValueError(arch)


def auto_class(arch: str):
    return AutoModel if arch == "bert" else AutoModelForCausalLM


def model_output(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a causal LM, last hidden state of an encoder."""
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def input_ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def float_checkpoint(tmp_path_factory):
    """Factory: `float_checkpoint(arch, dtype=torch.float32, **config_overrides)` -> directory of a saved random model.

    Built once per argument set with `from_config` (fixed seed) and `save_pretrained`.
    """
    cache = {}

    def make(arch: str, dtype: torch.dtype = torch.float32, **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            torch.manual_seed(0)
            model = auto_class(arch).from_config(tiny_config(arch, **overrides)).to(dtype).eval()
            path = tmp_path_factory.mktemp(f"{arch}_{str(dtype).removeprefix('torch.')}")
            model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make
