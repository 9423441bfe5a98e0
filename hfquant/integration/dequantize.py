"""`model.dequantize()` under hfquant: every quantized module back to the float module it replaced.

transformers' `HfQuantizer.dequantize` calls the quantizer's `_dequantize(model, dtype)`, which is `dequantize_model`
with the load plan's ties; transformers then removes the quantization config.
"""

from __future__ import annotations

import torch
from torch import nn

from hfquant.core.dtypes import torch_dtype
from hfquant.integration.embeddings import tie_float_weights
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts
from hfquant.nn.float_linear import restore_nn_linear
from hfquant.nn.linear import QuantLinear
from hfquant.nn.row_attention import restore_row_attention
from hfquant.nn.row_decode import restore_row_decode
from hfquant.nn.row_norm import restore_rms_norms

__all__ = ["float_module", "dequantize_model"]


def float_module(module: nn.Module, dtype: torch.dtype | None) -> nn.Module | None:
    """The float module `module` replaced, its weights dequantized to `dtype` (when None: the module's compute dtype,
    float32 for a layer or experts without one), or None when `module` is not one of hfquant's quantized modules."""
    if isinstance(module, QuantLinear):
        return module.dequantize_to_float(dtype or module.compute_dtype or torch.float32)
    if isinstance(module, QuantEmbedding):
        return module.dequantize_to_float(dtype or module.compute_dtype)
    if isinstance(module, QuantExperts):
        return module.dequantize_to_float(dtype or module.compute_dtype or torch.float32)
    return None


def dequantize_model(model: nn.Module, dtype: torch.dtype | str | None, ties: list[tuple[str, str]]) -> nn.Module:
    """Replace every quantized module of `model` by its float module in `dtype` (a dtype name, as transformers passes
    `model.config.dtype` after `save_pretrained`; an unknown name counts as None), the `FloatLinear`s by
    `nn.Linear`s, the one-row RMSNorms by their own classes (`restore_rms_norms`), the one-row attention by "sdpa"
    (`restore_row_attention`), the one-token decode forwards by their own classes (`restore_row_decode`), and make
    each tied pair of `ties` (module reading, module holding) one float tensor again. Returns `model`."""
    restore_nn_linear(model)
    restore_rms_norms(model)
    restore_row_attention(model)
    restore_row_decode(model)
    if isinstance(dtype, str):
        try:
            dtype = torch_dtype(dtype)
        except ValueError:
            dtype = None
    for name, module in list(model.named_modules()):
        new = float_module(module, dtype)
        if new is None:
            continue
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, new)
    tie_float_weights(model, ties)
    return model
