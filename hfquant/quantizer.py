"""The transformers glue: the only module that touches `HfQuantizer` hooks (transformers 5.x).

Loading flow (`from_pretrained(path, quantization_config=HfQuantConfig(...))`):
  1. `_process_model_before_weight_loading`: on the meta-device skeleton, Linear/Conv1D layers become empty
     `QuantLinear`s (shapes of the stored tensors known from the config), except lm_head, tied weights and
     `modules_to_not_convert`.
  2. For each checkpoint tensor `x.weight` of a `QuantLinear`, `param_needs_quantization` says yes, and
     transformers calls `HfQuantQuantize.convert` with that one float tensor just read from the file; it returns
     the quantized buffers, and the float tensor is dropped before the next one is read.
  3. `_process_model_after_weight_loading`: each layer picks its kernel and repacks for it.
Reloading a saved checkpoint (`config.json` has `quantization_config`) skips step 2: the stored tensors load as
they are, with their stored dtypes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from .config import HfQuantConfig
from .linear import QuantLinear, quantize_to_buffers
from .replace import LayerPlan, plan_layers, replace_with_quant_linear
from .streaming import release_checkpoint_pages, trim_heap

__all__ = ["HfQuantQuantizer", "HfQuantQuantize", "plan_model"]

logger = logging.getLogger(__name__)

_STORED_SUFFIXES = (".weight_scale", ".weight_zero_point")


def plan_model(model, config: HfQuantConfig) -> tuple[list[str], list[LayerPlan]]:
    """Skip list and per-layer plan for a (meta-device) transformers model, as quantize-on-load applies them.

    The skip list is transformers' default (tied weights, output embedding, last module, `_keep_in_fp32_modules`)
    plus `config.modules_to_not_convert`. `hfquant convert` uses the same function so both paths agree.
    """
    default_skips = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    skip = sorted(set(default_skips) | set(config.modules_to_not_convert))
    return skip, plan_layers(model, config.bits, config.group_size, skip)


@torch.no_grad()
def _float_layer(module: QuantLinear, dtype: torch.dtype) -> nn.Module:
    """The float layer a `QuantLinear` replaced: `nn.Linear`, or GPT-2's `Conv1D` (weight stored (in, out))."""
    weight = module.dequantize(dtype)
    if getattr(module, "transposed_source", False):
        from transformers.pytorch_utils import Conv1D

        layer = Conv1D(module.out_features, module.in_features).to(device=weight.device, dtype=dtype)
        layer.weight.copy_(weight.t())
        if module.bias is None:
            layer.bias = None
    else:
        layer = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype, device=weight.device
        )
        layer.weight.copy_(weight)
    if module.bias is not None:
        layer.bias.copy_(module.bias)
    layer.requires_grad_(False)
    return layer


class HfQuantQuantize(ConversionOps):
    """Conversion op run by transformers on one float weight tensor as it streams in: float -> stored buffers."""

    def __init__(self, hf_quantizer: "HfQuantQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model=None, **kwargs) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, tensor_name = get_module_from_name(model, key)
            if not isinstance(module, QuantLinear) or tensor_name != "weight":
                result[key] = tensor
                continue
            if getattr(module, "transposed_source", False):
                tensor = tensor.t()
            prefix = key[: -len("weight")]
            buffers = quantize_to_buffers(tensor, module.bits, module.group_size, module.symmetric)
            result.update({prefix + name: buffer for name, buffer in buffers.items()})
            del tensor, value
            release_checkpoint_pages()
        return result


class HfQuantQuantizer(HfQuantizer):
    """Quantizer for `quant_method="hfquant"`: RTN int8/int4 weight-only, quantized on load or reloaded."""

    requires_calibration = False
    quantization_config: HfQuantConfig

    def __init__(self, quantization_config: HfQuantConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.layer_plans = []

    # -- environment -------------------------------------------------------------------------------------------

    def validate_environment(self, *args, **kwargs):
        self.quantization_config.validate()

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        return dtype

    # -- before loading -----------------------------------------------------------------------------------------

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        config = self.quantization_config
        self.modules_to_not_convert, self.layer_plans = plan_model(model, config)
        compute_dtype = dtype if isinstance(dtype, torch.dtype) else None
        replaced = replace_with_quant_linear(model, self.layer_plans, config.bits, config.symmetric, compute_dtype)
        if self.pre_quantized and kwargs.get("checkpoint_files"):
            # A stored tensor of the wrong dtype or shape would be re-initialized at random or loaded as garbage by
            # transformers: compare the shard headers with the skeleton first and raise a ValueError naming it.
            from .verify import check_checkpoint_files

            check_checkpoint_files(model, kwargs["checkpoint_files"], self)
        if replaced == 0:
            logger.warning("hfquant found no Linear or Conv1D layer to quantize in %s", type(model).__name__)
        return model

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        module, tensor_name = get_module_from_name(model, param_name)
        return isinstance(module, QuantLinear) and tensor_name == "weight"

    def get_quantize_ops(self):
        return HfQuantQuantize(self)

    def get_new_dtype(self, converter, param, dtype):
        # Stored scales keep their stored dtype whatever `dtype` the user loads the model in: it is part of the
        # format, and saving must give back exactly the bytes that were loaded.
        targets = getattr(converter, "target_patterns", None) or []
        if any(str(target).endswith(_STORED_SUFFIXES) for target in targets):
            return None
        return super().get_new_dtype(converter, param, dtype)

    # -- after loading ------------------------------------------------------------------------------------------

    def _process_model_after_weight_loading(self, model, **kwargs):
        dtype = model.dtype if model.dtype.is_floating_point else None
        counts: dict[str, int] = {}
        for module in model.modules():
            if isinstance(module, QuantLinear):
                kernel = module.prepare_kernel(dtype)
                counts[kernel] = counts.get(kernel, 0) + 1
                trim_heap()  # the replaced stored-layout tensor must not stay resident
        logger.info("hfquant kernels: %s", counts)
        release_checkpoint_pages()
        from .hub import attach_model_card  # push_to_hub writes hfquant's model card, not transformers' generic one

        attach_model_card(model)
        return model

    def _dequantize(self, model, dtype=None):
        if isinstance(dtype, str):  # transformers passes `model.config.dtype`, a string after save_pretrained
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                dtype = None
        for name, module in list(model.named_modules()):
            if not isinstance(module, QuantLinear):
                continue
            target_dtype = dtype or module.compute_dtype or torch.float32
            linear = _float_layer(module, target_dtype)
            parent_name, _, child_name = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child_name, linear)
        return model

    # -- capabilities -------------------------------------------------------------------------------------------

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        """`QuantLinear.forward` traces without graph breaks (tests/test_compile.py checks fullgraph=True)."""
        return True
