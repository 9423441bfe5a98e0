"""TinyGLM: a ChatGLM-shaped causal LM written for hfquant's tests, loaded with trust_remote_code=True.

What it shares with ChatGLM and transformers' own models does not: its own RMSNorm class (not a transformers one),
a fused `query_key_value` Linear with bias, a fused SwiGLU `dense_h_to_4h`, and the output layer inside the base
model (`transformer.output_layer`, not `lm_head`), found only through `get_output_embeddings()`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tinyglm import TinyGLMConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return (self.weight * hidden_states).to(dtype)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        batch, length, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(batch, length, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.dense(context.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        gate, up = self.dense_h_to_4h(hidden_states).chunk(2, dim=-1)
        return self.dense_4h_to_h(F.silu(gate) * up)


class GLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.mlp = MLP(config)

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids):
        return self.word_embeddings(input_ids)


class TinyGLMPreTrainedModel(PreTrainedModel):
    config_class = TinyGLMConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GLMBlock"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class TinyGLMModel(TinyGLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.layers = nn.ModuleList(GLMBlock(config) for _ in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids):
        hidden_states = self.embedding(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.final_layernorm(hidden_states)


class TinyGLMForCausalLM(TinyGLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.transformer = TinyGLMModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embedding.word_embeddings

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden_states = self.transformer(input_ids)
        return CausalLMOutput(logits=self.transformer.output_layer(hidden_states))
