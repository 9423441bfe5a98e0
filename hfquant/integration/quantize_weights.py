"""Quantize-on-load of one float checkpoint tensor: what hfquant stores for it, as it streams in (the weight op,
`HfQuantQuantize.convert`) or when it is read again for a disk-offloaded layer (`requantize_disk_offloaded`).

A `QuantLinear` / `QuantEmbedding` weight becomes the layer's stored tensors (`quantize_to_buffers`: weight,
weight_scale[, weight_zero_point][, weight_col_scale]), a fused `QuantExperts` projection its per-expert codes and
scales, and a norm weight or a bias that a fold rescales (`fold_column_scales`) its rescaled copy; every other tensor
passes unchanged. The members of a decode group (q/k/v, gate/up: `hfquant.nn.fused`) get their codes written into
consecutive rows of one tensor (`GroupRows`), which the group's kernels then use where it is.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from hfquant.checkpoint.files import SAFETENSORS_DTYPES, open_safetensors, read_tensor
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.core import folding, huge_pages
from hfquant.core.blocks import iq4
from hfquant.core.folding import Transform
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts, quantize_experts_tensor
from hfquant.nn.linear import QuantLinear, quantize_to_buffers

__all__ = ["GroupRows", "quantize_on_load", "quantize_layer_weight", "requantize_disk_offloaded", "stored_allocations"]


class GroupRows:
    """The stored weights of a decode group's members (`QuantLinear._decode_group`: q/k/v, gate/up) as consecutive
    row slices of one tensor per group, allocated (not touched) when its first member is quantized on load.

    Their group then repacks them for its int4 GEMV in place (`DecodeGroup.prepare(in_place=True)`) and builds on that
    tensor (`DecodeGroup.build` copies no rows already in one tensor), instead of writing every code byte into a
    second tensor after the load: its page faults and the freeing of the first cost the 1.2B's load about 0.15 s of
    its main thread (docs/performance.md, issue #32, ninth session). Only for members that all store one int4 or
    block format with the same inputs, on the CPU. Members of different block formats (bits=3.5's Q3_K q/k beside a
    Q4_K / Q5_K v; their rows differ in bytes) get consecutive byte ranges of one uint8 tensor instead, each viewed
    as its (N, row bytes) weight: their group's C call reads them where they are, and the tensor, unlike the
    members' own (each under 2 MiB on the 1.2B), lies on huge pages (`huge_pages.empty`).
    """

    def __init__(self) -> None:
        self._tensors: dict[int, torch.Tensor] = {}

    def weight_out(self, module: nn.Module, device: torch.device) -> torch.Tensor | None:
        """`module`'s rows of its group's tensor for its stored weight (quantized on `device`), or None."""
        group = getattr(module, "_decode_group", None)
        if group is None or device.type != "cpu" or not _one_tensor(group):
            return None
        if not _same_format(group.members):
            return self._block_bytes(group, module)
        index = group.members.index(module)
        fmt, in_features = module.format, module.in_features
        dtype, shape = fmt.tensor_specs((module.out_features,), in_features)["weight"]
        tensor = self._tensors.get(id(group))
        if tensor is None:
            tensor = self._tensors[id(group)] = huge_pages.empty((sum(group.sizes), *shape[1:]), dtype=dtype)
        start = sum(group.sizes[:index])
        return tensor[start : start + group.sizes[index]]

    def _block_bytes(self, group, module: nn.Module) -> torch.Tensor:
        """`module`'s (N, row bytes) uint8 weight as a view of its byte range of its group's one uint8 tensor."""
        shapes = [m.format.tensor_specs((m.out_features,), m.in_features)["weight"][1] for m in group.members]
        sizes = [shape[0] * shape[1] for shape in shapes]
        tensor = self._tensors.get(id(group))
        if tensor is None:
            tensor = self._tensors[id(group)] = huge_pages.empty((sum(sizes),), dtype=torch.uint8)
        index = group.members.index(module)
        start = sum(sizes[:index])
        return tensor[start : start + sizes[index]].view(shapes[index])

    def clear(self) -> None:
        """Forget the tensors (after the load: the layers hold their rows)."""
        self._tensors.clear()


def stored_allocations(modules: list[nn.Module]) -> list[int]:
    """The bytes of each stored tensor that a quantize-on-load on the CPU asks `huge_pages.empty` for, for `modules`
    (`QuantLinear` / `QuantEmbedding` layers, in load order), as `GroupRows` places them: one tensor for the weights
    of a decode group that shares one (at its first member: the members' total; their scales are small tensors of
    their own, `torch.empty`), else each layer's stored tensors (`StoredFormat.empty`)."""
    sizes, grouped = [], set()
    for module in modules:
        group = getattr(module, "_decode_group", None)
        if group is None or not _one_tensor(group):
            sizes.extend(_nbytes(*spec) for spec in _stored_specs(module).values())
        elif id(group) not in grouped:
            grouped.add(id(group))
            sizes.append(sum(_nbytes(*_stored_specs(member)["weight"]) for member in group.members))
    return sizes


def _stored_specs(module: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """`module.format.tensor_specs` of a `QuantLinear` (out_features rows) or a `QuantEmbedding` (a row per token)."""
    if isinstance(module, QuantEmbedding):
        return module.format.tensor_specs((module.num_embeddings,), module.embedding_dim)
    return module.format.tensor_specs((module.out_features,), module.in_features)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _one_tensor(group) -> bool:
    """Whether `GroupRows` gives the weights of the decode `group`'s members one tensor (rows or byte ranges of it)."""
    return _same_format(group.members) or _block_members(group.members)


def _block_members(members: list[nn.Module]) -> bool:
    """Whether every member is a `QuantLinear` of a block format (any type) and one in_features, its weight stored in
    the (out, in) orientation: a (N, row bytes) uint8 tensor."""
    first = members[0]
    if not all(isinstance(m, QuantLinear) and not getattr(m, "transposed_source", False) for m in members):
        return False
    return all(m.format is not None and m.format.block and m.in_features == first.in_features for m in members)


def _same_format(members: list[nn.Module]) -> bool:
    """Whether every member is a `QuantLinear` of one int4 or block format and one in_features, its weight stored in
    the (out, in) orientation."""
    first = members[0]
    if not all(isinstance(m, QuantLinear) and not getattr(m, "transposed_source", False) for m in members):
        return False
    fmt = first.format
    if fmt is None or (fmt.block is None and fmt.bits != 4):
        return False
    return all(m.format == fmt and m.in_features == first.in_features for m in members)


def quantize_layer_weight(
    module: QuantLinear | QuantEmbedding,
    tensor: torch.Tensor,
    clipping: str,
    fold: Transform | None,
    threads: int | None = None,
    weight_out: torch.Tensor | None = None,
    iq4_search: str = iq4.SEARCHES[0],
) -> dict[str, torch.Tensor]:
    """The stored tensors of `module` (by buffer name) from its float `weight` as the checkpoint holds it: (out, in)
    for a Linear or an embedding, (in, out) for GPT-2's Conv1D (`transposed_source`), transposed here. A `QuantLinear`
    uses the config's `clipping`, an embedding always "minmax"; `fold` rescales the weight first; `threads` are the C
    RTN's (None: torch's count); `weight_out` the tensor to write the codes into (`quantize_to_buffers`);
    `iq4_search` the config's (IQ4 block layers).

    Raises:
        ValueError: the weight holds NaN or Inf (from `quantize_to_buffers`, naming the problem).
    """
    if getattr(module, "transposed_source", False):
        tensor = tensor.t()
    clipping = clipping if isinstance(module, QuantLinear) else "minmax"
    return quantize_to_buffers(tensor, module.format, clipping, fold, threads, weight_out, iq4_search)


def quantize_on_load(
    module: nn.Module,
    key: str,
    tensor: torch.Tensor,
    fold: Transform | None,
    clipping: str,
    threads: int | None = None,
    rows: GroupRows | None = None,
    iq4_search: str = iq4.SEARCHES[0],
) -> tuple[dict[str, torch.Tensor], bool] | None:
    """What quantize-on-load stores for the float checkpoint tensor `key` (a model key, `x.weight`) of `module`:
    (stored tensors by model key, True when `key` was quantized), or None when `tensor` passes unchanged. `threads`:
    the C RTN's OpenMP threads for a layer weight (None: torch's count); `rows`: the load's `GroupRows` (None: every
    weight a tensor of its own); `iq4_search`: the config's.

    Raises:
        ValueError: the tensor cannot be quantized (NaN/Inf weights); MemoryError.
    """
    tensor_name = key.rpartition(".")[2]
    if isinstance(module, (QuantLinear, QuantEmbedding)) and tensor_name == "weight":
        prefix = key[: -len("weight")]
        weight_out = None if rows is None else rows.weight_out(module, tensor.device)
        buffers = quantize_layer_weight(module, tensor, clipping, fold, threads, weight_out, iq4_search)
        return {prefix + name: buffer for name, buffer in buffers.items()}, True
    if isinstance(module, QuantExperts) and tensor_name in module.shapes:
        buffers = quantize_experts_tensor(tensor, module.formats[tensor_name])
        return {key + suffix: buffer for suffix, buffer in buffers.items()}, True
    if fold is not None:  # a norm weight or a bias that a fold rescales (fold_column_scales)
        return {key: _folded(module, tensor_name, tensor, fold)}, False
    return None


def _folded(module: nn.Module, tensor_name: str, tensor: torch.Tensor, fold: Transform) -> torch.Tensor:
    """`tensor` rescaled by `fold` (in float32), in the dtype of the parameter of `module` it becomes: a norm kept in
    `norm_dtype` float32 keeps the fold's float32 values (transformers assigns what the op returns as it is)."""
    target = getattr(module, tensor_name, None)
    dtype = target.dtype if isinstance(target, torch.Tensor) and target.is_floating_point() else tensor.dtype
    return folding.apply(tensor, fold).to(dtype)


def requantize_disk_offloaded(
    model: nn.Module,
    folds: dict[str, Transform],
    clipping: str,
    dtype: torch.dtype | None,
    save: Callable[[torch.Tensor, str, str, dict], object],
    iq4_search: str = iq4.SEARCHES[0],
    changed: Callable[[str], bool] = lambda key: True,
) -> None:
    """Write what quantize-on-load made of every disk-offloaded tensor into the offload folder: the quantized weight of
    a `QuantLinear` / `QuantEmbedding`, and the norm weight or bias that a fold rescales (`fold_column_scales`).

    transformers (5.x) points the disk offload index of a tensor that is only renamed on load at the checkpoint
    file itself and does not save what the quantization op returned for it: the offloaded layer would read the
    float weight back as int8, and a folded norm its unfolded values (wrong logits, with no error). Each such tensor
    is read again, one at a time, cast to `dtype` (the load's; float32 when None) and made by `quantize_on_load`, as
    the op made it (its fold from `folds`, the config's `clipping` and `iq4_search`); what it gives is written with
    `save(tensor, name, folder, index)` (transformers' `offload_weight`), and the index entry then names the offload
    folder's file (scales were saved on load). `changed(key)`: whether the op changes checkpoint tensor `key` (the
    quantizer's `param_needs_quantization`); the others are not read. `QuantExperts` are left as they are.
    """
    for module in model.modules():
        weights_map = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
        loader, prefix = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", "")
        index = getattr(loader, "index", None) or {}
        if not index or isinstance(module, QuantExperts):
            continue
        fold = folds.get(prefix[:-1]) if prefix else None
        for key in filter(changed, _checkpoint_entries(index, prefix, loader.save_folder)):
            tensor = _read_entry(index[key], key)
            made = (
                None
                if tensor is None
                else quantize_on_load(
                    module, key, tensor.to(dtype or torch.float32), fold, clipping, iq4_search=iq4_search
                )
            )
            if made is not None:
                for name, value in made[0].items():
                    save(value, name, loader.save_folder, index)
            release_checkpoint_pages()


def _checkpoint_entries(index: dict, prefix: str, folder: str | os.PathLike) -> list[str]:
    """The keys of the module's own tensors (`prefix` + name, no deeper module) whose offload `index` entry names a
    checkpoint file (`safetensors_file` outside the offload `folder`, where the op's results are written): what
    transformers offloaded without the op's result."""
    folder = Path(folder).resolve()
    keys = []
    for key, entry in index.items():
        file = entry.get("safetensors_file")
        if key.startswith(prefix) and "." not in key[len(prefix) :] and file is not None:
            if not Path(file).resolve().is_relative_to(folder):
                keys.append(key)
    return keys


def _read_entry(entry: dict, key: str) -> torch.Tensor | None:
    """The checkpoint tensor an offload index `entry` names, or None when it is not a float tensor (already stored)."""
    path, name = entry["safetensors_file"], entry.get("weight_name", key)
    with open_safetensors(path) as handle:
        if not SAFETENSORS_DTYPES[handle.get_slice(name).get_dtype()].is_floating_point:
            return None
        return read_tensor(handle, path, name)
