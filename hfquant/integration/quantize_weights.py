"""Quantize-on-load of one float checkpoint tensor: what hfquant stores for it, as it streams in (the weight op,
`HfQuantQuantize.convert`) or when it is read again for a disk-offloaded layer (`requantize_disk_offloaded`).

A `QuantLinear` / `QuantEmbedding` weight becomes the layer's stored tensors (`quantize_to_buffers`: weight,
weight_scale[, weight_zero_point][, weight_col_scale]), a fused `QuantExperts` projection its per-expert codes and
scales, and a norm weight or a bias that a fold rescales (`fold_column_scales`) its rescaled copy; every other tensor
passes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hfquant.checkpoint.files import SAFETENSORS_DTYPES, open_safetensors, read_tensor
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.core import folding
from hfquant.core.folding import Transform
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts, quantize_experts_tensor
from hfquant.nn.linear import QuantLinear, quantize_to_buffers

__all__ = ["quantize_on_load", "quantize_layer_weight", "requantize_disk_offloaded"]


def quantize_layer_weight(
    module: QuantLinear | QuantEmbedding, tensor: torch.Tensor, clipping: str, fold: Transform | None
) -> dict[str, torch.Tensor]:
    """The stored tensors of `module` (by buffer name) from its float `weight` as the checkpoint holds it: (out, in)
    for a Linear or an embedding, (in, out) for GPT-2's Conv1D (`transposed_source`), transposed here. A `QuantLinear`
    uses the config's `clipping`, an embedding always "minmax"; `fold` rescales the weight first.

    Raises:
        ValueError: the weight holds NaN or Inf (from `quantize_to_buffers`, naming the problem).
    """
    if getattr(module, "transposed_source", False):
        tensor = tensor.t()
    return quantize_to_buffers(tensor, module.format, clipping if isinstance(module, QuantLinear) else "minmax", fold)


def quantize_on_load(
    module: nn.Module, key: str, tensor: torch.Tensor, fold: Transform | None, clipping: str
) -> tuple[dict[str, torch.Tensor], bool] | None:
    """What quantize-on-load stores for the float checkpoint tensor `key` (a model key, `x.weight`) of `module`:
    (stored tensors by model key, True when `key` was quantized), or None when `tensor` passes unchanged.

    Raises:
        ValueError: the tensor cannot be quantized (NaN/Inf weights); MemoryError.
    """
    tensor_name = key.rpartition(".")[2]
    if isinstance(module, (QuantLinear, QuantEmbedding)) and tensor_name == "weight":
        prefix = key[: -len("weight")]
        buffers = quantize_layer_weight(module, tensor, clipping, fold)
        return {prefix + name: buffer for name, buffer in buffers.items()}, True
    if isinstance(module, QuantExperts) and tensor_name in module.shapes:
        buffers = quantize_experts_tensor(tensor, module.formats[tensor_name])
        return {key + suffix: buffer for suffix, buffer in buffers.items()}, True
    if fold is not None:  # a norm weight or a bias that a fold rescales (fold_column_scales)
        return {key: folding.apply(tensor, fold).to(tensor.dtype)}, False
    return None


def requantize_disk_offloaded(
    model: nn.Module,
    folds: dict[str, Transform],
    clipping: str,
    dtype: torch.dtype | None,
    save: Callable[[torch.Tensor, str, str, dict], object],
) -> None:
    """Write the quantized weight of every disk-offloaded `QuantLinear` / `QuantEmbedding` into the offload folder.

    transformers (5.x) points the disk offload index of a tensor that is only renamed on load at the checkpoint
    file itself and does not save what the quantization op returned for it: the offloaded layer would read the
    float weight back as int8. Each such weight is read again, one at a time, cast to `dtype` (float32 when None),
    quantized as on load (its fold from `folds`) and written with `save(tensor, name, folder, index)` (transformers'
    `offload_weight`); the index entry then names the quantized file (scales were saved on load).
    """
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        weights_map = getattr(hook, "weights_map", None)
        if not isinstance(module, (QuantLinear, QuantEmbedding)) or weights_map is None:
            continue
        loader, prefix = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", "")
        index = getattr(loader, "index", None) or {}
        entry = index.get(prefix + "weight")
        if entry is None or entry.get("safetensors_file") is None:
            continue
        path, name = entry["safetensors_file"], entry.get("weight_name", prefix + "weight")
        with open_safetensors(path) as handle:
            if not SAFETENSORS_DTYPES[handle.get_slice(name).get_dtype()].is_floating_point:
                continue  # already the quantized tensor
            tensor = read_tensor(handle, path, name).to(dtype or torch.float32)
        buffers = quantize_layer_weight(module, tensor, clipping, folds.get(prefix[:-1]))
        del tensor
        for buffer_name, buffer in buffers.items():
            save(buffer, prefix + buffer_name, loader.save_folder, index)
        release_checkpoint_pages()
