"""`HfQuantConfig(importance="bos_activations")`: the float model's inputs to its normed layers for the BOS token.

The fold pre-pass (`hfquant.integration.folding`) reads each decoder block's float weights; this module runs the
float model, beside it, on one length-1 sequence holding the BOS token (`config.bos_token_id`), block by block, and
gives each block's two normed inputs:

    x1 = rmsnorm(h) * input_layernorm.weight                 # the input of q/k/v
    h += o_proj(repeat_kv(v_proj(x1)))                      # a length-1 sequence attends only to itself
    x2 = rmsnorm(h) * post_attention_layernorm.weight        # the input of gate/up
    h += down_proj(act(gate_proj(x2)) * up_proj(x2))

in float32 with the unquantized weights (biases where the model has them), starting from the BOS row of the input
embedding. x^2 weighs the block search's columns of those layers (`folding._Planner`): a few residual channels carry
most of their input energy in a Llama-family model and the BOS token shows them (docs/performance.md, "Block formats:
an activation-scale importance for the IQ4 search", issue #30). Memory: a few vectors per block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN

from hfquant.ops import native

__all__ = ["BosForward", "bos_token_id"]

logger = logging.getLogger(__name__)

_CHUNK_ELEMENTS = 1 << 20
"""Weight elements converted to float32 at a time by `_linear`'s torch path (4 MiB): a 2048 x 8192 bfloat16 matrix
is not copied whole."""


def _linear(read, name: str, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """(N,) float32: the Linear layer `name`'s weight (N, K) read from the checkpoint, times x (K,) float32, plus its
    bias when `bias`. A contiguous bfloat16 CPU weight (a checkpoint's, as the load maps it) goes through
    `native.bf16_f32_gemv` where the library runs: read once as stored, no float32 copy (the conversion and a second
    read of the copy cost the 1.2B's load about 0.4 CPU s, docs/performance.md, issue #32, twelfth session); else row
    chunks of about `_CHUNK_ELEMENTS` are converted to float32 at a time. Both are float32 products of the same
    values, summed in another order (within float32 rounding of each other)."""
    weight = read(name + ".weight")
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and native.built_library() is not None:
        out = native.bf16_f32_gemv(weight.contiguous(), x.contiguous())
    else:
        step = max(1, _CHUNK_ELEMENTS // max(1, k))
        out = torch.cat([weight[s : s + step].float() @ x for s in range(0, n, step)])
    if bias:
        out += read(name + ".bias").float()
    return out


def _rmsnorm(read, name: str, h: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(h) * weight in float32 (Llama's `LlamaRMSNorm`, weight read from the checkpoint)."""
    return h * torch.rsqrt(h.square().mean() + eps) * read(name + ".weight").float()


def bos_token_id(model: nn.Module) -> int | None:
    """The model's BOS token id: its text config's `bos_token_id`, else its config's (the first of a list), or None."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    bos = getattr(config, "bos_token_id", None)
    if bos is None:
        bos = getattr(model.config, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return None if bos is None else int(bos)


class BosForward:
    """The BOS token's forward through the foldable decoder blocks of `model`, one block at a time and on demand.

    `inputs(i)` gives block i's (x1, x2) (K,) float32, running blocks 0 .. i in order the first time (the pre-pass may
    fold blocks out of order: a block not yet run is run then, reading its weights once more); afterwards only the
    vectors are kept. Not thread-safe: the fold pre-pass folds one block at a time.

    Args:
        model: the (meta-device) transformers model (its config and which layers have biases are read here).
        blocks: `folding.find_blocks(model)`, in the model's order (the residual stream's).
        read: model tensor name -> its float tensor from the checkpoint (`folding.checkpoint_reader`).
    Raises:
        ValueError: the model's config has no `bos_token_id` (naming the model), or no input embedding.
    """

    def __init__(self, model: nn.Module, blocks: list, read: Callable[[str], torch.Tensor]):
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        bos = bos_token_id(model)
        name = getattr(model.config, "name_or_path", None) or type(model).__name__
        if bos is None:
            raise ValueError(
                f"importance='bos_activations' runs the model on its BOS token, and {name}'s config has no "
                "bos_token_id: use importance='weights'"
            )
        embedding = model.get_input_embeddings()
        embed_name = next((n for n, m in model.named_modules() if m is embedding), None)
        if embed_name is None:
            raise ValueError(f"importance='bos_activations': {name} has no input embedding to read the BOS row from")
        self.read, self.blocks = read, blocks
        self.bos, self.embed_name = int(bos), embed_name
        self.eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.act = ACT2FN[config.hidden_act]
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.bias = {
            n: getattr(model.get_submodule(n), "bias", None) is not None for b in blocks for n in (b.v, b.o) + b[6:]
        }
        self.h: torch.Tensor | None = None  # the residual stream entering block len(self.done)
        self.done: list[tuple[torch.Tensor, torch.Tensor]] = []

    def inputs(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block `index`'s (input of q/k/v, input of gate/up) for the BOS token, (hidden,) float32 each."""
        if self.h is None:
            self.h = self.read(self.embed_name + ".weight")[self.bos].float().clone()
        while len(self.done) <= index:
            self.done.append(self._block(self.blocks[len(self.done)]))
        return self.done[index]

    def _block(self, block) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance `self.h` through `block`; returns its (x1, x2)."""
        read, h = self.read, self.h
        x1 = _rmsnorm(read, block.attention_norm, h, self.eps)
        v = _linear(read, block.v, x1, self.bias[block.v])
        # grouped-query attention: kv head j serves query heads j * group .. (j + 1) * group - 1
        v = v.view(self.kv_heads, -1).repeat_interleave(self.heads // self.kv_heads, dim=0).reshape(-1)
        h = h + _linear(read, block.o, v, self.bias[block.o])
        x2 = _rmsnorm(read, block.mlp_norm, h, self.eps)
        gate = self.act(_linear(read, block.gate, x2, self.bias[block.gate]))
        up = _linear(read, block.up, x2, self.bias[block.up])
        self.h = h + _linear(read, block.down, gate * up, self.bias[block.down])
        return x1, x2
