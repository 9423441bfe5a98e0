"""LoRA adapters (peft) over hfquant's quantized layers: QLoRA-style fine-tuning of a model loaded with `HfQuantConfig`.

peft does not know `QuantLinear`: its "all-linear" shorthand selects only `nn.Linear` / `Conv1D`, and a custom LoRA
layer registered on a `LoraConfig` (`_register_custom_module`) is not saved with the adapter. The two functions here
do exactly those two steps and return peft's own objects:

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=HfQuantConfig(bits=4, group_size=64))
    peft_model = hfquant.peft.get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    ...  # train (transformers' Trainer), peft_model.save_pretrained(adapter_dir)
    peft_model = hfquant.peft.load_adapter(model, adapter_dir)

The adapter belongs to the hfquant model it was trained over, not to the float checkpoint: with SINQ's column scales
folded (the 4-bit default), that model's norms and projections carry the scales, so its layers' inputs are not the
float model's. `load_adapter` onto a fresh load of the same model with the same `HfQuantConfig` gives the saved
model's logits (the same kernels on the same tensors).

Merging (peft's `merge_adapter()` / `merge_and_unload()`) goes into float weights, dequantized codes + B @ A * scaling
(`HfQuantLoraLinear.merge`), and logs a warning saying so: re-quantizing would round most of a LoRA update away (it is
smaller than an int4 step). `merge_and_unload()` returns the float model: the merged layers, and every other hfquant
layer dequantized (`model.dequantize()`, no `quantization_config`), in the layers' compute dtype; it saves as a plain
checkpoint. For a quantized fine-tuned model, keep the adapter unmerged over the quantized model.

Requires peft, an optional dependency: `pip install 'hfquant[peft]'` (`hfquant.core.optional.PEFT`).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch
from torch import nn

from hfquant.core.binding import bind
from hfquant.core.optional import PEFT
from hfquant.core.rtn import value_range
from hfquant.integration.counting import count_quantized_weights_in_peft
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import output_embedding

try:
    from peft import LoraConfig, PeftModel
    from peft import get_peft_model as _peft_get_peft_model
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import check_adapters_to_merge
except ModuleNotFoundError as error:  # tests/project/test_bare_install.py runs this without peft
    if not PEFT.is_missing(error):
        raise
    raise PEFT.missing() from error

__all__ = ["HfQuantLoraLinear", "get_peft_model", "load_adapter"]

logger = logging.getLogger(__name__)


class HfQuantLoraLinear(nn.Module, LoraLayer):
    """LoRA around a frozen `QuantLinear`: y = base(x) + lora_B(lora_A(dropout(x))) * scaling.

    The base layer's input gets its gradient from the stored codes (`hfquant.ops.autograd`); only lora_A (r,
    in_features) and lora_B (out_features, r) train, in the dtype peft gives them. Modelled on peft's HQQ and torchao
    LoRA layers.

    `merge()` (peft's `merge_adapter()` / `merge_and_unload()`) merges into float weights: the base layer becomes the
    float layer it stands for (`nn.Linear`, or GPT-2's `Conv1D`), holding dequantize(base) + B @ A * scaling in the
    layer's compute dtype (float32 when it has none), so the merged model computes what the adapter did, up to that
    dtype's rounding. It is no longer quantized there: re-quantizing would round the update away (most of a LoRA
    update is smaller than an int4 step). `unmerge()` puts back the original `QuantLinear` (its codes, bit for bit);
    `merge_and_unload()` returns the float model (the module docstring).

    Raises:
        ValueError: DoRA (`use_dora=True`: its weight norm would need the float weight), `lora_bias=True`, or any
            other LoRA variant (VeLoRA etc.); from `merge(safe_merge=True)`, NaN or Inf in the merged weights.
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
        # while merged: the `QuantLinear` that `unmerge` puts back (in a tuple: not a registered submodule)
        self._unmerged_base: tuple[QuantLinear, ...] = ()
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
        """Merge the active (or given) adapters into float weights: the base layer becomes the float layer of
        dequantize(codes) + the merged adapters' B @ A * scaling (see the class docstring)."""
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapter_names:
            return
        quantized = self._unmerged_base[0] if self.merged else self.get_base_layer()
        weight = quantized.dequantize(torch.float32)
        for adapter in [*self.merged_adapters, *adapter_names]:
            weight = weight + self.get_delta_weight(adapter).to(weight.device)
        if safe_merge and not value_range(weight)[2]:
            raise ValueError(f"NaN or Inf in the merged weights: adapter(s) {adapter_names} seem broken")
        layer = quantized.dequantize_to_float(quantized.compute_dtype or torch.float32)
        layer.weight.copy_(weight.t() if getattr(quantized, "transposed_source", False) else weight)
        self._unmerged_base = (quantized,)
        self.base_layer = layer
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        """Put back the `QuantLinear` as it was before `merge` (the original codes, bit for bit)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        self.base_layer = self._unmerged_base[0]
        self._unmerged_base = ()
        self.merged_adapters.clear()

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


def _merge_adapter(lora_model: LoraModel, *args: Any, **kwargs: Any) -> None:
    """peft's `merge_adapter`, with the note of where the update went."""
    type(lora_model).merge_adapter(lora_model, *args, **kwargs)
    logger.warning(
        "hfquant.peft: merge_adapter() merged LoRA into float weights (dequantized codes + B @ A, in the layers' "
        "compute dtype): the merged layers are float until unmerge_adapter(); re-quantizing would round the update "
        "away"
    )


def _merge_and_unload(lora_model: LoraModel, *args: Any, **kwargs: Any) -> nn.Module:
    """peft's `merge_and_unload`, then `model.dequantize()`: the float model, merged, without quantization_config."""
    model = type(lora_model).merge_and_unload(lora_model, *args, **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model = model.dequantize()
    logger.warning(
        "hfquant.peft: merge_and_unload() merged LoRA into float weights (dequantized codes + B @ A) and returns the "
        "float model (%s, every hfquant layer dequantized, no quantization_config): re-quantizing would round the "
        "update away. Keep the adapter unmerged (hfquant.peft.load_adapter) for a quantized model",
        getattr(model, "dtype", None),
    )
    return model


def _merge_into_float(peft_model: PeftModel) -> None:
    """Make `peft_model.merge_adapter()` / `merge_and_unload()` say where the update went, and `merge_and_unload()`
    return a float model (set on the `LoraModel` instance, as `count_quantized_weights_in_peft` sets its methods)."""
    lora_model = peft_model.base_model
    lora_model.merge_adapter = bind(_merge_adapter, lora_model)
    lora_model.merge_and_unload = bind(_merge_and_unload, lora_model)


def _with_hfquant_layers(model: nn.Module, config: LoraConfig) -> LoraConfig:
    """A copy of `config` with `QuantLinear` mapped to `HfQuantLoraLinear` and "all-linear" resolved."""
    config = copy.deepcopy(config)
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        output = output_embedding(model)
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

    On the returned model, `merge_adapter()` and `merge_and_unload()` merge into float weights (the module docstring).

    Raises:
        ValueError: from peft (no target found), or DoRA / lora_bias requested on an hfquant layer.
    """
    peft_model = _peft_get_peft_model(model, _with_hfquant_layers(model, config), **kwargs)
    count_quantized_weights_in_peft(peft_model)
    _merge_into_float(peft_model)
    return peft_model


def load_adapter(model: nn.Module, path: str, is_trainable: bool = False, **kwargs: Any) -> PeftModel:
    """`PeftModel.from_pretrained(model, path)` for a model with hfquant layers (the adapter saved by
    `PeftModel.save_pretrained` over the same hfquant model: same checkpoint, same `HfQuantConfig`). Returns peft's
    `PeftModel`, whose logits are the saved model's; `kwargs` go to `PeftModel.from_pretrained`. Merging as for
    `get_peft_model`.

    Raises:
        ValueError / OSError: from peft, e.g. no adapter_config.json at `path`.
    """
    config = _with_hfquant_layers(model, LoraConfig.from_pretrained(path))
    peft_model = PeftModel.from_pretrained(model, path, config=config, is_trainable=is_trainable, **kwargs)
    count_quantized_weights_in_peft(peft_model)
    _merge_into_float(peft_model)
    return peft_model
