"""LoRA adapters (peft) over hfquant's quantized layers: QLoRA-style fine-tuning of a model loaded with `HfQuantConfig`.

peft does not know `QuantLinear`: its "all-linear" shorthand selects only `nn.Linear` / `Conv1D`, and a custom LoRA
layer registered on a `LoraConfig` (`_register_custom_module`) is not saved with the adapter. The two functions here
do exactly those two steps and return peft's own objects:

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=HfQuantConfig(bits=4, group_size=64))
    peft_model = hfquant.peft.get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    ...  # train (transformers' Trainer), peft_model.save_pretrained(adapter_dir)
    peft_model = hfquant.peft.load_adapter(model, adapter_dir)

Requires peft, an optional dependency: `pip install 'hfquant[peft]'` (`hfquant.core.optional.PEFT`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import nn

from hfquant.core.optional import PEFT
from hfquant.integration.counting import count_quantized_weights_in_peft
from hfquant.nn.linear import QuantLinear

try:
    from peft import LoraConfig, PeftModel
    from peft import get_peft_model as _peft_get_peft_model
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import check_adapters_to_merge
except ModuleNotFoundError as error:  # tests/project/test_bare_install.py runs this without peft
    if not PEFT.is_missing(error):
        raise
    raise PEFT.missing() from error

__all__ = ["HfQuantLoraLinear", "get_peft_model", "load_adapter"]


class HfQuantLoraLinear(nn.Module, LoraLayer):
    """LoRA around a frozen `QuantLinear`: y = base(x) + lora_B(lora_A(dropout(x))) * scaling.

    The base layer's input gets its gradient from the stored codes (`hfquant.ops.autograd`); only lora_A (r,
    in_features) and lora_B (out_features, r) train, in the dtype peft gives them. Modelled on peft's HQQ and torchao
    LoRA layers.

    `merge()` re-quantizes dequantize(base) + B @ A * scaling into a new `QuantLinear` of the same `StoredFormat`
    (bits, group size, symmetry, method) and keeps the original layer, so `unmerge()` restores the original codes
    exactly. A merged model is therefore still hfquant-quantized, with one more rounding of the weights.

    Raises:
        ValueError: DoRA (`use_dora=True`: its weight norm would need the float weight), `lora_bias=True`, or any
            other LoRA variant (VeLoRA etc.).
    """

    def __init__(
        self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0, lora_alpha: int = 1, **kwargs
    ) -> None:
        if config.lora_bias:
            raise ValueError(f"{type(self).__name__} does not support lora_bias=True; set it to False")
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self._original_base: dict[str, QuantLinear] = {}
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        if config.use_dora:
            raise ValueError(
                "DoRA over hfquant layers is not supported (its weight norms would need the float weight): "
                "set use_dora=False"
            )
        if getattr(config, "velora_config", None) is not None:
            raise ValueError(f"{type(self).__name__} does not support VeLoRA")
        return None

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """(out_features, in_features) float32 B @ A * scaling of `adapter`."""
        a = self.lora_A[adapter].weight.float()
        b = self.lora_B[adapter].weight.float()
        return (b @ a) * self.scaling[adapter]

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Re-quantize the weights with the active (or given) adapters added, in the base layer's format."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        for adapter in adapter_names:
            if adapter not in self.lora_A:
                continue
            base = self.get_base_layer()
            weight = base.dequantize(torch.float32) + self.get_delta_weight(adapter).to(base.weight.device)
            if safe_merge and not torch.isfinite(weight).all():
                raise ValueError(f"NaN or Inf in the merged weights: adapter {adapter!r} seems broken")
            self._original_base[adapter] = base
            self.base_layer = _requantized(base, weight)
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        """Put back the layer as it was before `merge` (the original codes, bit for bit)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        while self.merged_adapters:
            adapter = self.merged_adapters.pop()
            self.base_layer = self._original_base.pop(adapter)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError(f"{type(self).__name__} does not support mixed adapter batches (adapter_names)")
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.merged:
            return result
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
            h = self._cast_input_dtype(x, lora_a.weight.dtype)
            delta = lora_b(lora_a(self.lora_dropout[adapter](h))) * self.scaling[adapter]
            result = result + delta.to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def _requantized(base: QuantLinear, weight: torch.Tensor) -> QuantLinear:
    """A new `QuantLinear` in `base`'s format (and kernel dtype) holding `weight` (out_features, in_features)."""
    bias = None if base.bias is None else base.bias.detach()
    layer = QuantLinear.from_float(weight, bias, base.format)
    for name in ("transposed_source",):
        if hasattr(base, name):
            setattr(layer, name, getattr(base, name))
    layer.compute_dtype = base.compute_dtype
    layer.prepare_kernel(base.compute_dtype)
    layer.decode_activations = base.decode_activations
    return layer


def _with_hfquant_layers(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """A copy of `config` with `QuantLinear` mapped to `HfQuantLoraLinear` and "all-linear" resolved."""
    config = copy.deepcopy(config)
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = {
            name.rpartition(".")[2]
            for name, module in model.named_modules()
            if isinstance(module, (QuantLinear, nn.Linear)) and module is not output
        }
        config.target_modules = names
    config._register_custom_module({QuantLinear: HfQuantLoraLinear})
    return config


def get_peft_model(model: nn.Module, config: LoraConfig, **kwargs: Any) -> PeftModel:
    """`peft.get_peft_model` for a model with hfquant layers: LoRA layers around `QuantLinear`s too.

    `config.target_modules="all-linear"` selects every `QuantLinear` and `nn.Linear` but the output embedding
    (lm_head), by their last name component, as peft does for float models. Returns peft's `PeftModel`; `kwargs` go to
    `peft.get_peft_model`. The caller's `config` is not modified.

    Raises:
        ValueError: from peft (no target found), or DoRA / lora_bias requested on an hfquant layer.
    """
    peft_model = _peft_get_peft_model(model, _with_hfquant_layers(model, config), **kwargs)
    count_quantized_weights_in_peft(peft_model)
    return peft_model


def load_adapter(model: nn.Module, path: str, is_trainable: bool = False, **kwargs: Any) -> PeftModel:
    """`PeftModel.from_pretrained(model, path)` for a model with hfquant layers (the adapter saved by
    `PeftModel.save_pretrained` over the same hfquant checkpoint). Returns peft's `PeftModel`; `kwargs` go to
    `PeftModel.from_pretrained`.

    Raises:
        ValueError / OSError: from peft, e.g. no adapter_config.json at `path`.
    """
    config = _with_hfquant_layers(model, LoraConfig.from_pretrained(path))
    peft_model = PeftModel.from_pretrained(model, path, config=config, is_trainable=is_trainable, **kwargs)
    count_quantized_weights_in_peft(peft_model)
    return peft_model
