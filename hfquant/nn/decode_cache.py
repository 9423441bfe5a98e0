"""A dynamic cache layer whose keys and values live in a buffer with room to grow, written in place by a decode step.

Why: transformers' `DynamicLayer.update` grows its keys and values by `torch.cat` every token, a new tensor each,
through a few layers of Python (`Cache.update`); on SmolLM2-135M's eager decode step (30 layers) that and the views
around it cost about a millisecond of an 8 ms step (docs/performance.md, issue #32, thirteenth and fourteenth
sessions; creating one tensor, even a view, costs 4-7 us from Python on the machine measured there).

`RowDynamicLayer` is a `DynamicLayer` whose `keys` and `values` are properties: each holds a buffer (1, kv_heads,
capacity, head_dim) and how many of its positions are written, and reading it gives the view of those (what
`DynamicLayer` would hold: the same values, the same shape). `decode_attention(layer, ...)` makes a decode step's
attention in one operator call (`torch.ops.hfquant_cpu.decode_attention_row`: the rotary embedding of query and key,
key and value written into the buffers at the next position, the attention of the query over every position so far),
without creating any tensor but the output. When the buffers are full they grow to 1.5 times the length (at least 64
more positions), copied once.

Everything else transformers does to a layer works unchanged, because it goes through the properties: setting `keys`
or `values` (prefill through `DynamicLayer.update`, `crop`, `reorder_cache` for beam search, `batch_select_indices`,
`reset`, offloading) stores that tensor as it is, and the next decode step copies it into a new buffer before
writing. A view read from the layer before a step keeps its values (a step writes only beyond every earlier view's
end; a crop is a new tensor, so the buffer is not written under a longer older view).

How it is installed: `decode_attention` swaps a plain `DynamicLayer` (that exact class: not sliding-window, not
quantized, not static) of a plain cache (no offloading) to `RowDynamicLayer` in place, on its first decode step
(`hfquant.nn.row_decode`'s attention forward calls it); everything else keeps transformers' `update`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

__all__ = ["RowDynamicLayer", "decode_attention", "takes_row_cache", "step_buffers", "wrote", "static_buffers"]

MIN_GROWTH = 64
"""Positions a buffer gains at least when it grows (then 1.5 times the length)."""

_DECODE_ATTENTION_ROW = None
"""`torch.ops.hfquant_cpu.decode_attention_row.default`, looked up at the first step."""


def _buffered_get(name: str):
    def get(self):
        buffer, length = self.__dict__[name]
        return buffer if length is None else buffer.narrow(2, 0, length)

    return get


def _buffered_set(name: str):
    def set_(self, tensor):
        self.__dict__[name] = (tensor, None)  # a tensor given from outside is held as it is

    return set_


class RowDynamicLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of buffers that `decode_attention` writes in place (see the
    module docstring). Shapes, dtypes and values read through `keys` / `values` are `DynamicLayer`'s."""

    keys = property(_buffered_get("_keys"), _buffered_set("_keys"))
    values = property(_buffered_get("_values"), _buffered_set("_values"))

    def get_seq_length(self) -> int:
        """The number of cached positions (`DynamicLayer.get_seq_length`, without making a view)."""
        buffer, length = self.__dict__["_keys"]
        if length is not None:
            return length
        return super().get_seq_length()


def takes_row_cache(cache, layer_idx: int) -> bool:
    """Whether `decode_attention` may write layer `layer_idx` of `cache`: a `Cache` without offloading whose layer is
    a plain `DynamicLayer` (or already a `RowDynamicLayer`) that has been filled (the prefill made it)."""
    if not isinstance(cache, Cache) or cache.offloading or layer_idx >= len(cache.layers):
        return False
    layer = cache.layers[layer_idx]
    return type(layer) in (DynamicLayer, RowDynamicLayer) and layer.is_initialized


def _as_row_layer(layer: DynamicLayer) -> RowDynamicLayer:
    """`layer`, its class swapped in place to `RowDynamicLayer` (a no-op when it already is one)."""
    if type(layer) is not RowDynamicLayer:
        keys, values = layer.__dict__.pop("keys"), layer.__dict__.pop("values")
        layer.__class__ = RowDynamicLayer
        layer.keys, layer.values = keys, values
    return layer


def _room(layer: RowDynamicLayer, kv_heads: int, head_dim: int, like: torch.Tensor) -> int | None:
    """Make sure `layer`'s buffers have a free position after the cached ones; returns that position, or None when
    the cached keys / values are not one batch-1 bfloat16 CPU cache of `kv_heads` heads of `head_dim` (the caller
    then takes transformers' update)."""
    (key_buffer, key_length), (value_buffer, value_length) = layer.__dict__["_keys"], layer.__dict__["_values"]
    if key_length is not None and key_length == value_length and key_length < key_buffer.shape[2]:
        return key_length
    keys, values = layer.keys, layer.values
    if keys.numel() == 0 and values.numel() == 0:
        keys = values = like.new_empty((1, kv_heads, 0, head_dim))
    shape = (1, kv_heads, keys.shape[-2] if keys.dim() == 4 else -1, head_dim)
    if not (
        keys.dim() == 4
        and tuple(keys.shape) == shape
        and tuple(values.shape) == shape
        and keys.dtype == values.dtype == torch.bfloat16
        and keys.device.type == values.device.type == "cpu"
    ):
        return None
    length = shape[2]
    # both views when a buffer was full, `DynamicLayer`'s own tensors at the first step, anything set from outside
    capacity = length + max(length // 2, MIN_GROWTH)
    key_buffer = keys.new_empty((1, kv_heads, capacity, head_dim))
    value_buffer = values.new_empty((1, kv_heads, capacity, head_dim))
    key_buffer[:, :, :length].copy_(keys)
    value_buffer[:, :, :length].copy_(values)
    layer.__dict__["_keys"], layer.__dict__["_values"] = (key_buffer, length), (value_buffer, length)
    return length


def step_buffers(cache, layer_idx: int, kv_heads: int, head_dim: int, like: torch.Tensor):
    """The buffers a decode step writes layer `layer_idx` of `cache` into (`takes_row_cache(cache, layer_idx)` must
    hold): (the layer, now a `RowDynamicLayer`, its key buffer, its value buffer, the position to write), each
    buffer (1, kv_heads, capacity > position, head_dim) bfloat16; None when the cached keys / values are not a batch-1
    bfloat16 CPU cache of this shape (nothing changed but the layer's class; the caller takes transformers' path).
    After writing, `wrote(layer, position)` records the position (`decode_attention`, `hfquant.nn.decode_layer`)."""
    layer = _as_row_layer(cache.layers[layer_idx])
    position = _room(layer, kv_heads, head_dim, like)
    if position is None:
        return None
    return layer, layer.__dict__["_keys"][0], layer.__dict__["_values"][0], position


def wrote(layer: RowDynamicLayer, position: int) -> None:
    """Record that a decode step wrote `layer`'s buffers (`step_buffers`) at `position`: it holds position + 1."""
    key_buffer, value_buffer = layer.__dict__["_keys"][0], layer.__dict__["_values"][0]
    layer.__dict__["_keys"], layer.__dict__["_values"] = (key_buffer, position + 1), (value_buffer, position + 1)


def static_buffers(cache, layer_idx: int, kv_heads: int, head_dim: int):
    """The tensors a compiled decode step writes layer `layer_idx` of a static cache through
    (`hfquant_cpu.decode_layer_static`, `hfquant.nn.decode_layer.graph_step`): (keys, values, length), the layer's
    (1, kv_heads, capacity, head_dim) bfloat16 CPU buffers and its one-element int64 `cumulative_length` (the position
    the step writes, which the operator advances as `StaticLayer.update` does); None unless `cache` is a `Cache`
    without offloading whose layer is a filled `StaticLayer` (that exact class: not sliding-window, not indexed) of
    batch 1 and this shape. Called while torch.compile traces: what it reads (classes, shapes) is fixed for a graph."""
    if not isinstance(cache, Cache) or cache.offloading or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    if type(layer) is not StaticLayer or not layer.is_initialized:
        return None
    keys, values, length = layer.keys, layer.values, layer.cumulative_length
    if not (
        keys.dim() == 4
        and keys.shape[0] == 1
        and keys.shape[1] == kv_heads
        and keys.shape[3] == head_dim
        and values.shape == keys.shape
        and values.stride() == keys.stride()
        and keys.stride(3) == 1
        and keys.dtype == values.dtype == torch.bfloat16
        and keys.device.type == values.device.type == length.device.type == "cpu"
        and length.dtype == torch.int64
        and length.numel() == 1
    ):
        return None
    return keys, values, length


def decode_attention(
    cache, layer_idx: int, qkv: torch.Tensor, cos, sin, kv_heads: int, head_dim: int, scaling: float
) -> torch.Tensor | None:
    """One decode step's rotary embedding, cache write and attention for layer `layer_idx` of `cache`, in one
    `hfquant_cpu.decode_attention_row` call; the layer becomes a `RowDynamicLayer` holding one more position.

    Args:
        cache: the model's cache; `takes_row_cache(cache, layer_idx)` must hold.
        qkv: the step's query, key and value rows one after the other, before the rotary embedding: one contiguous
            bfloat16 CPU row of (heads + 2 * kv_heads) * head_dim values (a fused q/k/v GEMV's output, not split).
        cos, sin: the step's rotary tables, head_dim contiguous bfloat16 values each.
        kv_heads, head_dim: the key / value heads and the values per head; scaling: the attention's score scale.
    Returns:
        The attention output (1, 1, heads * head_dim) bfloat16 (o_proj's input), or None (the cached tensors are not
        a batch-1 bfloat16 CPU cache of this shape: nothing was written, the caller takes transformers' path).
    """
    global _DECODE_ATTENTION_ROW
    buffers = step_buffers(cache, layer_idx, kv_heads, head_dim, qkv)
    if buffers is None:
        return None
    layer, key_buffer, value_buffer, position = buffers
    if _DECODE_ATTENTION_ROW is None:
        _DECODE_ATTENTION_ROW = torch.ops.hfquant_cpu.decode_attention_row.default
    output = _DECODE_ATTENTION_ROW(qkv, cos, sin, key_buffer, value_buffer, position, scaling)
    wrote(layer, position)
    return output
