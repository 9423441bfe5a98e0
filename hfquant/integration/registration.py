"""Registering hfquant's config and quantizer with transformers (the two registries transformers requires)."""

from __future__ import annotations

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from hfquant.config import QUANT_METHOD, HfQuantConfig

__all__ = ["register"]


def register() -> None:
    """Register `HfQuantConfig` and `HfQuantQuantizer` under `quant_method="hfquant"`; idempotent.

    Raises:
        ValueError: another package already registered a different class under "hfquant".
    """
    from hfquant.integration.quantizer import HfQuantQuantizer

    config_cls = AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD)
    if config_cls is None:
        register_quantization_config(QUANT_METHOD)(HfQuantConfig)
    elif config_cls is not HfQuantConfig:
        raise ValueError(f"quant_method {QUANT_METHOD!r} is already registered by {config_cls!r}")
    quantizer_cls = AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if quantizer_cls is None:
        register_quantizer(QUANT_METHOD)(HfQuantQuantizer)
    elif quantizer_cls is not HfQuantQuantizer:
        raise ValueError(f"quant_method {QUANT_METHOD!r} is already registered by {quantizer_cls!r}")
