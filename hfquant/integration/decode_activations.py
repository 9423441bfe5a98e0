"""`HfQuantConfig.decode_activations` applied to a loaded model: every `QuantLinear` learns whether its one-token
decode steps quantize their activations to int8 (W4A8, `hfquant.ops.kernels.quantized_matmul`), and a machine that
cannot run the W4A8 GEMV says so once instead of silently computing otherwise.

A hook of `HfQuantQuantizer.loaded_model_hooks`: it runs on every model the quantizer loaded, once the kernels are
prepared, and reads the config transformers attached to the model (`model.config.quantization_config`).
"""

from __future__ import annotations

import logging

from torch import nn

from hfquant.nn.linear import QuantLinear
from hfquant.ops import kernels
from hfquant.ops.kernels import Kernel

__all__ = ["apply_decode_activations"]

logger = logging.getLogger(__name__)


def apply_decode_activations(model: nn.Module) -> None:
    """Set `QuantLinear.decode_activations` on every layer of `model` from its config ("float" where the config has
    no such field). Logs a warning when "int8" is asked for CPU int4 layers on a machine without the W4A8 GEMV
    (a C compiler and AVX512-VNNI, or AVX2 where PyTorch packs int4 in 32-row blocks): those layers then decode with
    float activations."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    setting = getattr(config, "decode_activations", "float")
    layers = [module for module in model.modules() if isinstance(module, QuantLinear)]
    for layer in layers:
        layer.decode_activations = setting
    if setting == "int8" and not kernels.int8_decode_activations_available():
        if any(layer.kernel == Kernel.INT4PACK_MM_CPU for layer in layers):
            logger.warning(
                "hfquant: decode_activations='int8' asks for W4A8 decoding, which needs a C compiler and an x86-64 CPU "
                "with AVX512-VNNI or AVX2; this machine decodes the int4 layers with float activations instead"
            )
