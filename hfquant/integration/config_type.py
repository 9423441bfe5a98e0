"""`AutoConfig` support for `model_type: "hfquant"`, the type a saved hfquant checkpoint's config.json carries
(`hfquant.checkpoint.model_type`: so that transformers without hfquant refuses it by name).

`AutoConfig.from_pretrained` looks the type up in its `CONFIG_MAPPING` and calls `from_dict` of the class found
(`models/auto/configuration_auto.py`). hfquant registers `HfQuantCheckpointConfig` there; its `from_dict` is a
dispatcher, not a config: it restores the base `model_type` and returns the base type's config, e.g. a
`LlamaConfig` for `{"model_type": "hfquant", "hfquant_base_model_type": "llama", ...}`. The Auto model classes then
find the model class of that config as for any checkpoint.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hfquant.checkpoint.model_type import BASE_MODEL_TYPE_KEY, MODEL_TYPE, unmark

__all__ = ["HfQuantCheckpointConfig", "register_model_type", "restore_base_model_type"]


class HfQuantCheckpointConfig(PretrainedConfig):
    """The `AutoConfig` entry of `model_type == "hfquant"`. Never instantiated: `from_dict` returns the config of the
    checkpoint's base model type."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
        """The base type's `config_class.from_dict(unmarked config_dict, **kwargs)`.

        Raises:
            ValueError: the base model type is missing, or one this transformers does not know, naming it.
        """
        config_dict = unmark(config_dict)
        base = config_dict["model_type"]
        if base not in CONFIG_MAPPING:
            raise ValueError(
                f"config.json: {BASE_MODEL_TYPE_KEY}={base!r} is not a model type this transformers "
                "knows; upgrade transformers (pip install -U transformers)"
            )
        return CONFIG_MAPPING[base].from_dict(config_dict, **kwargs)


def register_model_type() -> None:
    """Register `HfQuantCheckpointConfig` with `AutoConfig` under "hfquant"; idempotent.

    Raises:
        ValueError: another class is already registered under "hfquant".
    """
    if MODEL_TYPE in CONFIG_MAPPING:
        if CONFIG_MAPPING[MODEL_TYPE] is not HfQuantCheckpointConfig:
            raise ValueError(f"model_type {MODEL_TYPE!r} is already registered by {CONFIG_MAPPING[MODEL_TYPE]!r}")
        return
    AutoConfig.register(MODEL_TYPE, HfQuantCheckpointConfig)


def restore_base_model_type(config) -> None:
    """Undo the marking on a config object parsed by a concrete class (`LlamaConfig.from_pretrained` of a marked
    checkpoint keeps `model_type="hfquant"` and `hfquant_base_model_type` as instance attributes): the class's own
    `model_type` applies again. Nothing happens to an unmarked config."""
    if config.__dict__.get("model_type") == MODEL_TYPE:
        del config.__dict__["model_type"]
    config.__dict__.pop(BASE_MODEL_TYPE_KEY, None)
