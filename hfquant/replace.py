"""Choosing which modules to quantize and swapping them for `QuantLinear` on the (meta-device) model skeleton."""

from __future__ import annotations

import fnmatch
import logging
from typing import Iterable, NamedTuple

import torch
from torch import nn

from .linear import QuantLinear
from .rtn import effective_group_size

__all__ = ["LayerPlan", "matches_module", "plan_layers", "replace_with_quant_linear"]

logger = logging.getLogger(__name__)


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always has it
        return None
    return Conv1D


def matches_module(name: str, patterns: Iterable[str]) -> bool:
    """Whether module `name` (full dotted name) or one of its ancestors is selected by `patterns`.

    A pattern selects a module when it equals the full dotted name, equals a whole-component suffix of it
    ("down_proj" selects "model.layers.0.mlp.down_proj", never "model.layers.0.mlp.xdown_proj" or
    "lm_head_norm" for "lm_head"), or matches the full name as an fnmatch pattern ("model.layers.*.mlp.*").
    Substrings never match.
    """
    parts = name.split(".")
    candidates = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        for candidate in candidates:
            if candidate == pattern or candidate.endswith("." + pattern):
                return True
            if any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(candidate, pattern):
                return True
    return False


class LayerPlan(NamedTuple):
    """What happens to one Linear/Conv1D layer: `group_size` is None when it stays in float (`reason` says why)."""

    name: str
    in_features: int
    out_features: int
    group_size: int | None
    reason: str
    transposed: bool


def _linear_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(in_features, out_features, transposed) of a Linear or Conv1D, else None."""
    conv1d = _conv1d_class()
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features, False
    if conv1d is not None and isinstance(module, conv1d):
        return module.weight.shape[0], module.weight.shape[1], True
    return None


def plan_layers(model: nn.Module, bits: int, group_size: int | None, skip: Iterable[str]) -> list[LayerPlan]:
    """One `LayerPlan` per Linear/Conv1D module of `model`, deciding quantized or float and the group size."""
    skip = list(skip)
    plans = []
    for name, module in model.named_modules():
        shape = _linear_shape(module)
        if shape is None or isinstance(module, QuantLinear):
            continue
        in_features, out_features, transposed = shape
        if matches_module(name, skip):
            plans.append(LayerPlan(name, in_features, out_features, None, "modules_to_not_convert", transposed))
            continue
        effective = effective_group_size(in_features, group_size, bits)
        if effective is None:
            reason = f"in_features={in_features} has no power-of-two divisor >= 32" + (
                " or is odd" if bits == 4 else ""
            )
            plans.append(LayerPlan(name, in_features, out_features, None, reason, transposed))
            continue
        plans.append(LayerPlan(name, in_features, out_features, effective, "", transposed))
    return plans


def replace_with_quant_linear(
    model: nn.Module, plans: list[LayerPlan], bits: int, symmetric: bool, dtype: torch.dtype | None
) -> int:
    """Swap every planned layer that has a group size for an empty `QuantLinear` on the meta device.

    Returns the number of layers replaced. Layers kept in float are logged once each at INFO level.
    """
    replaced = 0
    for plan in plans:
        if plan.group_size is None:
            logger.info("hfquant keeps %s in float: %s", plan.name, plan.reason)
            continue
        parent_name, _, child_name = plan.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child_name)
        layer_dtype = dtype if dtype is not None else old.weight.dtype
        new = QuantLinear(
            plan.in_features,
            plan.out_features,
            bits,
            plan.group_size,
            symmetric,
            bias=old.bias is not None,
            dtype=layer_dtype,
            device="meta",
        )
        new.transposed_source = plan.transposed
        new.requires_grad_(False)
        setattr(parent, child_name, new)
        replaced += 1
    return replaced
