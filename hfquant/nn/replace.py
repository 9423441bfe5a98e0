"""Choosing which modules to quantize and swapping them on the (meta-device) model skeleton: Linear / Conv1D layers
for `QuantLinear`, embeddings for `QuantEmbedding`, fused MoE experts for `QuantExperts`; float embeddings and norms
get their configured dtype here too."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hfquant.config import HfQuantConfig, default_group_size, default_symmetric, matches_module
from hfquant.core import blocks
from hfquant.core.format import Method, StoredFormat
from hfquant.core.rtn import effective_group_size
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts, experts_layout
from hfquant.nn.fused import link_decode_groups
from hfquant.nn.linear import QuantLinear

__all__ = [
    "LayerPlan",
    "ExpertsPlan",
    "matches_module",
    "plan_layers",
    "plan_experts",
    "replace_with_quant_linear",
    "replace_tied_quant_linear",
    "replace_with_quant_embedding",
    "replace_with_quant_experts",
    "embedding_kind",
    "output_embedding",
    "quantized_format",
    "cast_float_params",
]

logger = logging.getLogger(__name__)


class LayerPlan(NamedTuple):
    """What happens to one Linear/Conv1D layer: its stored `format`, or None when it stays in float (`reason` says
    why)."""

    name: str
    in_features: int
    out_features: int
    format: StoredFormat | None
    reason: str
    transposed: bool

    @property
    def group_size(self) -> int | None:
        """The layer's resolved group size, None when it stays in float."""
        return None if self.format is None else self.format.group_size


def linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in_features, out_features, transposed) of a Linear or Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1], True
    return None


def plan_layers(model: nn.Module, config: HfQuantConfig, skip: Iterable[str]) -> list[LayerPlan]:
    """One `LayerPlan` per Linear/Conv1D module of `model`: float when `skip` selects it (`matches_module`), else its
    stored format from `config.layer_settings(name)` (the config's, or a `module_overrides` entry's) with the group
    size resolved for its width (`rtn.effective_group_size`), or float when no group size fits."""
    skip = list(skip)
    plans = []
    for name, module in model.named_modules():
        shape = linear_shape(module)
        if shape is None or isinstance(module, QuantLinear):
            continue
        in_features, out_features, transposed = shape
        if matches_module(name, skip):
            plans.append(LayerPlan(name, in_features, out_features, None, "modules_to_not_convert", transposed))
            continue
        settings = config.layer_settings(name)
        if settings.format != "int":
            fmt, reason = block_format(settings.format, in_features, settings.method)
            plans.append(LayerPlan(name, in_features, out_features, fmt, reason, transposed))
            continue
        bits, group_size, symmetric, method = settings[:4]
        effective = effective_group_size(in_features, group_size, bits)
        if effective is None:
            reason = f"in_features={in_features} has no power-of-two divisor >= 32" + (
                " or is odd" if bits == 4 else ""
            )
            plans.append(LayerPlan(name, in_features, out_features, None, reason, transposed))
            continue
        fmt = StoredFormat(bits, effective, symmetric, method)
        plans.append(LayerPlan(name, in_features, out_features, fmt, "", transposed))
    return plans


def block_format(name: str, in_features: int, method: Method) -> tuple[StoredFormat | None, str]:
    """(format, reason) of a layer of `in_features` inputs asked to be stored in block type `name`: that type when
    its blocks divide the rows, else llama.cpp's fallback type for such rows (`BlockLayout.fallback`, as
    llama-quant.cpp picks it; the reason names both), else (None, why) and the layer stays in float."""
    layout = blocks.layout(name)
    if layout.divides(in_features):
        return StoredFormat.of_block(layout.name, method), ""
    fallback = blocks.layout(layout.fallback) if layout.fallback else None
    if fallback is not None and fallback.divides(in_features):
        reason = f"{layout.name} needs rows of a multiple of {layout.block_size}; in_features={in_features} uses {fallback.name}"
        return StoredFormat.of_block(fallback.name, method), reason
    return None, f"in_features={in_features} is not a multiple of {layout.block_size}, the blocks of {layout.name}"


def replace_with_quant_linear(model: nn.Module, plans: list[LayerPlan], dtype: torch.dtype | None) -> int:
    """Swap every planned layer that has a format for an empty `QuantLinear` on the meta device, stored in
    `plan.format`.

    Returns the number of layers replaced. Layers kept in float are logged once each at INFO level. Sibling
    projections of one format that read the same input (q/k/v, gate/up) are linked into decode groups
    (`fused.link_decode_groups`), which compute their one-row products as one GEMV once their kernels are prepared.
    """
    replaced = 0
    for plan in plans:
        if plan.format is None:
            logger.info("hfquant keeps %s in float: %s", plan.name, plan.reason)
            continue
        parent_name, _, child_name = plan.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child_name)
        layer_dtype = dtype if dtype is not None else old.weight.dtype
        new = QuantLinear(
            plan.in_features,
            plan.out_features,
            plan.format,
            bias=old.bias is not None,
            dtype=layer_dtype,
            device="meta",
        )
        new.transposed_source = plan.transposed
        new.requires_grad_(False)
        hide_empty_kernel_buffer(new)
        setattr(parent, child_name, new)
        replaced += 1
    link_decode_groups(model, QuantLinear)
    return replaced


# -- embeddings, lm_head, norms, experts: what else a model holds besides Linear layers ------------------------------

QUANTIZED_STORAGE = {"int8": 8, "int4": 4}
"""Storage names of `embedding_dtype` / `lm_head` that mean a quantized tensor, and their bit width."""


def quantized_format(storage: str, config: HfQuantConfig, in_features: int) -> StoredFormat | None:
    """The stored format of an embedding / lm_head stored as `storage` ("int8"/"int4") whose rows have `in_features`
    values, or None when no group size fits them (it then stays in float).

    With the layers' bit width (`config.bits`) it uses the layers' `group_size` and `symmetric`; otherwise that width's
    defaults (per-row symmetric at 8 bits, group 128 asymmetric at 4 bits), as `HfQuantConfig` would pick them. The
    group size is then resolved for `in_features` as for a layer (`rtn.effective_group_size`).
    """
    bits = QUANTIZED_STORAGE[storage]
    if bits == config.bits:
        asked_group, symmetric = config.group_size, config.symmetric
    else:
        asked_group, symmetric = default_group_size(bits), default_symmetric(bits)
    group_size = effective_group_size(in_features, asked_group, bits)
    return None if group_size is None else StoredFormat(bits, group_size, symmetric)


def embedding_kind(module: nn.Module) -> str | None:
    """How `QuantEmbedding` can stand in for `module`: "plain", "scaled" (lookup times `scalar_embed_scale`, the
    Gemma/BART-style scaled word embedding), or None (not an embedding, or a subclass with its own forward, whose
    semantics hfquant cannot know, e.g. OPT's learned positional embedding; such tables stay in float).
    """
    if not isinstance(module, nn.Embedding):
        return None
    if module.max_norm is not None or next(module.children(), None) is not None:
        return None
    if type(module).forward is nn.Embedding.forward:
        return "plain"
    if isinstance(getattr(module, "scalar_embed_scale", None), (int, float)):
        return "scaled"
    return None


def output_embedding(model: nn.Module) -> nn.Module | None:
    """`model`'s output embedding (lm_head) whatever it is now (`nn.Linear`, `QuantLinear`, `FloatLinear`, a peft
    wrapper), or None: no `get_output_embeddings` (a bare `nn.Module`), one that returns None (transformers' models
    without an lm_head) or raises AttributeError / NotImplementedError (backbones whose input embedding is not
    defined)."""
    getter = getattr(model, "get_output_embeddings", None)
    if getter is None:
        return None
    try:
        return getter()
    except (AttributeError, NotImplementedError):
        return None


def cast_float_params(module: nn.Module, dtype: torch.dtype) -> None:
    """Give the floating-point parameters of `module` (not its children) `dtype`; on the meta device this decides the
    dtype the checkpoint tensors are loaded in."""
    for name, param in list(module._parameters.items()):
        if param is not None and param.is_floating_point() and param.dtype != dtype:
            module._parameters[name] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)


def replace_with_quant_embedding(
    model: nn.Module,
    name: str,
    fmt: StoredFormat,
    dtype: torch.dtype,
    persistent: bool = True,
):
    """Swap the embedding `name` for an empty `QuantEmbedding` on the meta device and return it.

    `persistent=False` makes its tensors non-persistent buffers: a tied copy whose tensors come from another module
    after loading, so they are neither read from nor written to the checkpoint.
    """
    old = model.get_submodule(name)
    scale = getattr(old, "scalar_embed_scale", None) if embedding_kind(old) == "scaled" else None
    new = QuantEmbedding(
        old.num_embeddings,
        old.embedding_dim,
        fmt,
        old.padding_idx,
        dtype,
        "meta",
        float(scale) if scale is not None else None,
    )
    if not persistent:
        new._non_persistent_buffers_set.update(new._buffers)
    new.__dict__["_source"] = old  # kept for dequantize(), not registered: no state_dict keys, no parameters
    _set_submodule(model, name, new)
    return new


def replace_tied_quant_linear(
    model: nn.Module, name: str, fmt: StoredFormat, dtype: torch.dtype | None
) -> QuantLinear:
    """Swap the output embedding `name` (tied to a quantized input embedding) for a `QuantLinear` whose tensors are
    non-persistent buffers: they are the embedding's, assigned after loading, and saved once, under its name."""
    old = model.get_submodule(name)
    new = QuantLinear(
        old.in_features,
        old.out_features,
        fmt,
        bias=old.bias is not None,
        dtype=dtype if dtype is not None else old.weight.dtype,
        device="meta",
    )
    new._non_persistent_buffers_set.update(n for n in new._buffers if n != "bias")
    new.requires_grad_(False)
    hide_empty_kernel_buffer(new)
    _set_submodule(model, name, new)
    return new


_KERNEL_BUFFERS = ("scale_zero",)


def hide_empty_kernel_buffer(layer: QuantLinear) -> None:
    """Take QuantLinear's kernel-only buffer, registered as None until `prepare_kernel`, out of the non-persistent set
    while it is None: accelerate's dispatch with `offload_buffers=True` moves every non-persistent buffer name to the
    execution device and fails on a None. A None buffer is never saved nor loaded either way."""
    for name in _KERNEL_BUFFERS:
        if name in layer._buffers and layer._buffers[name] is None:
            layer._non_persistent_buffers_set.discard(name)


def restore_kernel_buffers(layer: QuantLinear) -> None:
    """Undo `hide_empty_kernel_buffer` (before `prepare_kernel` fills the buffer, which must then stay unsaved)."""
    for name in _KERNEL_BUFFERS:
        if name in layer._buffers:
            layer._non_persistent_buffers_set.add(name)


class ExpertsPlan(NamedTuple):
    """One experts module: `shapes` {projection: (E, N, K)}, `group_sizes` {projection: g}; empty when it stays in
    float (`reason` says why)."""

    name: str
    shapes: dict
    group_sizes: dict
    reason: str


def plan_experts(model: nn.Module, bits: int, group_size: int | None, skip: Iterable[str]) -> list[ExpertsPlan]:
    """One `ExpertsPlan` per module holding fused 3-D expert weights (transformers 5 MoE experts)."""
    skip = list(skip)
    plans = []
    for name, module in model.named_modules():
        shapes, reason = experts_layout(module)
        if not shapes:
            continue
        if not reason and matches_module(name, skip):
            reason = "modules_to_not_convert"
        group_sizes = {}
        if not reason:
            for projection, (_, _, k) in shapes.items():
                group_sizes[projection] = effective_group_size(k, group_size, bits)
                if group_sizes[projection] is None:
                    reason = f"{projection} in_features={k} has no power-of-two divisor >= 32"
        plans.append(ExpertsPlan(name, shapes, group_sizes if not reason else {}, reason))
    return plans


def replace_with_quant_experts(
    model: nn.Module, plan: ExpertsPlan, bits: int, symmetric: bool, dtype: torch.dtype | None
):
    """Swap the experts module of `plan` for an empty `QuantExperts` on the meta device and return it; each projection
    is stored as `StoredFormat(bits, plan.group_sizes[projection], symmetric)`."""
    old = model.get_submodule(plan.name)
    formats = {projection: StoredFormat(bits, group, symmetric) for projection, group in plan.group_sizes.items()}
    new = QuantExperts(old, plan.shapes, formats, dtype, "meta")
    new.requires_grad_(False)
    _set_submodule(model, plan.name, new)
    return new


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child_name, module)
