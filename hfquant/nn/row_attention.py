"""One-query-row attention for decoding: transformers' "sdpa" attention, except that a batch-1 decode step (one query
row) on bfloat16 CPU tensors runs hfquant's C kernel (`torch.ops.hfquant_cpu.attention_row`, `csrc/attention_cpu.c`)
instead of PyTorch's CPU flash-attention kernel: without a mask (eager decoding, a dynamic cache) or with a static
cache's bool mask (`attention_row_masked`: the kernel over the positions written so far, the mask's True prefix), in
eager mode and in compiled graphs (`hfquant.compile_decoding` switches a model to it).

Why: that kernel costs 16 us at 16 cached tokens, 60 us at 80 and 290 us at 400 for SmolLM2-135M's 9 heads of one
query (one thread, Zen 5), the C kernel 4 / 8 / 28 us; 30 calls a step (docs/performance.md, issue #32). In a graph
compiled with "eager" attention over a static cache, inductor's code reads every position of the cache each step
(the 1.2B default at one thread: 28.7 / 35.7 / 54.7 ms CPU a step with a cache of 128 / 512 / 2048), the masked
kernel only those written (issue #32, eleventh session).

How it is installed: the function is registered with transformers' `AttentionInterface` (and "sdpa"'s mask function
with `AttentionMaskInterface`) under `ATTENTION_NAME`, and a model whose `config._attn_implementation` is "sdpa"
switches to that name (`use_row_attention`; `restore_row_attention` switches back; transformers does not save the
field, so a saved config.json is unchanged). hfquant's quantizer calls `use_row_attention` after loading (quantizing
or reloading) unless `attn_implementation` was passed to `from_pretrained` by name, so `attn_implementation="sdpa"`
keeps PyTorch's kernel and "eager" stays eager; `model.dequantize()` restores "sdpa"; `model.set_attn_implementation`
works as usual. Everything else (prefill, batches, float or other masks, sliding windows, other dtypes or devices,
gradients) calls transformers' "sdpa" function (`sdpa_attention_forward`) with the same arguments; a bool mask that
is not a prefix (padding) goes to PyTorch's SDPA inside the masked operator.

Accuracy: as the flash kernel's (PyTorch 2.13, bfloat16): float32 scores, softmax sums and products, the
unnormalized probabilities rounded to bfloat16 for the product with V, the softmax in blocks of 512 keys with the
running max. Not bit for bit: PyTorch's exp (`exp_u20`, a faster polynomial) and its products (MKL's bfloat16 GEMM,
whose summation order is not public) are not reproduced, so a few outputs in a hundred differ from it by one
bfloat16 step (1-14% over the shapes of docs/performance.md); tests/nn/test_row_attention.py bounds the error
against a float64 reference, the mean error not above the flash kernel's. Prefill (and so perplexity) is unchanged;
greedy tokens can differ where two logits are a step or two apart, as they do between transformers' "eager" and
"sdpa" (1 of 4 SmolLM2 prompts within 64 tokens, docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import nn

from hfquant.ops import torch_ops

__all__ = [
    "ATTENTION_NAME",
    "row_attention_forward",
    "register_attention",
    "use_row_attention",
    "available_attention",
    "restore_row_attention",
]

ATTENTION_NAME = "hfquant_sdpa"
"""The `attn_implementation` name of `row_attention_forward` in transformers' interfaces."""

MAX_HEAD_SIZE = 256
"""The largest head size the C kernel takes (csrc/attention_cpu.c's MAX_CHUNKS * LANES)."""

_ATTENTION_ROW = None
"""`torch.ops.hfquant_cpu.attention_row.default`, set by `use_row_attention` once the operators are loaded."""

_ATTENTION_ROW_MASKED = None
"""`torch.ops.hfquant_cpu.attention_row_masked.default` (the same kernel over a bool mask's prefix), set with
`_ATTENTION_ROW`."""

_SDPA = None
"""transformers' "sdpa" attention function (`sdpa_attention_forward`), which every other call goes to; set by
`register_attention`."""


def _prefix_mask(attention_mask: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `attention_mask` is a bool (1, 1, 1, kv_len) CPU tensor, the kind a batch-1 decode step over a static
    cache gets ("sdpa"'s mask function), which `attention_row_masked` takes (its kernel reads the allowed prefix)."""
    return (
        _ATTENTION_ROW_MASKED is not None
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.device.type == "cpu"
        and tuple(attention_mask.shape) == (1, 1, 1, key.shape[2])
    )


def _one_row(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs
) -> bool:
    return (
        _ATTENTION_ROW is not None
        and (attention_mask is None or _prefix_mask(attention_mask, key))
        and query.shape[0] == 1
        and query.shape[2] == 1
        and query.shape[3] <= MAX_HEAD_SIZE
        and query.dtype == torch.bfloat16
        and key.dtype == torch.bfloat16
        and query.device.type == "cpu"
        and dropout == 0.0
        and kwargs.get("sliding_window") is None
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
        and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad))
    )


def row_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function signature: query (batch, heads, q_len, dim), key and value (batch,
    kv_heads, kv_len, dim); returns ((batch, q_len, heads, dim), None). One bfloat16 CPU query row without mask goes to
    the C kernel (scale `scaling`, or dim ** -0.5), anything else to transformers' "sdpa" function."""
    if _SDPA is None:  # called before any registration (tests, a direct call)
        register_attention()
    if _ATTENTION_ROW is None:
        _load_kernel()
    if _one_row(module, query, key, attention_mask, dropout, kwargs) and key.stride(3) == 1 and value.stride(3) == 1:
        if value.stride(1) == key.stride(1) and value.stride(2) == key.stride(2) and query.stride(3) == 1:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            if attention_mask is None:
                return _ATTENTION_ROW(query, key, value, scale), None
            return _ATTENTION_ROW_MASKED(query, key, value, scale, attention_mask), None
    return _SDPA(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_attention() -> None:
    """Register `row_attention_forward` (and "sdpa"'s mask function) under `ATTENTION_NAME` with transformers'
    interfaces; idempotent. Called by `use_row_attention`, and by `QuantLinear.__setstate__`, so that a model pickled
    with this attention (`torch.save(model)`) finds it when loaded in a fresh process. Not on import: the interfaces
    live in transformers' modeling_utils, whose import (about 0.7 s) `import hfquant` should not pay."""
    global _SDPA
    if _SDPA is not None:
        return
    from transformers import AttentionInterface, AttentionMaskInterface

    _SDPA = AttentionInterface()["sdpa"]
    AttentionInterface.register(ATTENTION_NAME, row_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, AttentionMaskInterface()["sdpa"])


def _load_kernel() -> None:
    global _ATTENTION_ROW, _ATTENTION_ROW_MASKED
    if torch_ops.loaded():
        _ATTENTION_ROW = torch.ops.hfquant_cpu.attention_row.default
        _ATTENTION_ROW_MASKED = torch.ops.hfquant_cpu.attention_row_masked.default


def available_attention() -> str | None:
    """`ATTENTION_NAME`, registered with transformers, where hfquant's operators load (`torch_ops.loaded()`); None
    where they do not. `hfquant.compile_decoding` switches a model to it."""
    if not torch_ops.loaded():
        return None
    register_attention()
    _load_kernel()
    return ATTENTION_NAME


def use_row_attention(model: nn.Module) -> bool:
    """Switch `model` (its config's `_attn_implementation`) from "sdpa" to `row_attention_forward`, where hfquant's
    operators are loaded (`torch_ops.loaded()`) and the model uses "sdpa" (a string, no per-submodel dict). Returns
    whether it switched."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not torch_ops.loaded():
        return False
    register_attention()
    _load_kernel()
    config._attn_implementation = ATTENTION_NAME
    return True


def restore_row_attention(model: nn.Module) -> bool:
    """Inverse of `use_row_attention`: the model's config back to "sdpa". Returns whether it switched."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTENTION_NAME:
        return False
    config._attn_implementation = "sdpa"
    return True
