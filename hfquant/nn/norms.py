"""Finding the normalization layers of any model family, and running modules stored in another float dtype.

Norms are found by type, never by module name: `nn.LayerNorm`, `nn.RMSNorm`, `nn.GroupNorm`, and a family's own
classes whose name contains "LayerNorm" or "RMSNorm" (`LlamaRMSNorm`, `T5LayerNorm`, `GemmaRMSNorm`, a custom
model's `RMSNorm`, ...) when they are leaves holding only 1-D parameters (weight, bias): the shape every such norm has,
which also keeps out composite modules that merely carry the word in their name.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["is_norm", "find_norms", "DtypeAdapter", "install_dtype_adapter", "remove_dtype_adapter"]

_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
_NORM_CLASS_NAME = re.compile(r"(LayerNorm|RMSNorm|RmsNorm)")


def is_norm(module: nn.Module) -> bool:
    """Whether `module` is a LayerNorm / RMSNorm of some family (see the module docstring for the rule)."""
    if isinstance(module, _NORM_TYPES):
        return True
    if not any(_NORM_CLASS_NAME.search(cls.__name__) for cls in type(module).__mro__[:-1]):
        return False
    if next(module.children(), None) is not None:
        return False
    params = list(module.parameters(recurse=False))
    return bool(params) and all(p.dim() == 1 for p in params)


def find_norms(model: nn.Module) -> list[str]:
    """Dotted names of every norm of `model` that holds parameters, in module order."""
    return [
        name
        for name, module in model.named_modules()
        if is_norm(module) and next(module.parameters(), None) is not None
    ]


class DtypeAdapter:
    """Forward hooks letting a module whose parameters are stored in `storage_dtype` run inside a model computing in
    another dtype: floating-point tensor inputs are cast to `storage_dtype` (when `cast_inputs`), and the output to
    the dtype of the first floating-point input, or to `output_dtype` when the module has none (embedding lookups).
    """

    def __init__(self, storage_dtype: torch.dtype, output_dtype: torch.dtype, cast_inputs: bool = True):
        self.storage_dtype = storage_dtype
        self.output_dtype = output_dtype
        self.cast_inputs = cast_inputs
        self.handles: list = []

    def pre_hook(self, module, args, kwargs):
        input_dtype = next((a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point()), None)
        module._hfquant_input_dtype = input_dtype
        if not self.cast_inputs or input_dtype is None or input_dtype == self.storage_dtype:
            return None
        cast = tuple(a.to(self.storage_dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)
        return cast, kwargs

    def post_hook(self, module, args, kwargs, output):
        target = getattr(module, "_hfquant_input_dtype", None) or self.output_dtype
        if torch.is_tensor(output) and output.is_floating_point() and output.dtype != target:
            return output.to(target)
        return None


def install_dtype_adapter(
    module: nn.Module, storage_dtype: torch.dtype, output_dtype: torch.dtype, cast_inputs: bool = True
) -> DtypeAdapter:
    """Attach a `DtypeAdapter` to `module` (replacing one attached before) and return it."""
    remove_dtype_adapter(module)
    adapter = DtypeAdapter(storage_dtype, output_dtype, cast_inputs)
    adapter.handles = [
        module.register_forward_pre_hook(adapter.pre_hook, with_kwargs=True),
        module.register_forward_hook(adapter.post_hook, with_kwargs=True),
    ]
    module._hfquant_dtype_adapter = adapter
    return adapter


def remove_dtype_adapter(module: nn.Module) -> None:
    """Detach the `DtypeAdapter` of `module`, if any."""
    adapter = module.__dict__.pop("_hfquant_dtype_adapter", None)
    if adapter is not None:
        for handle in adapter.handles:
            handle.remove()
