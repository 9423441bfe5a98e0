"""config.json read and checked before anything is built from it: `read_model_config` (a JSON object whose
`model_type` this transformers knows) and `read_quantization_config` (an hfquant `quantization_config`, parsed by
`HfQuantConfig.from_dict`). Every error names the file, the value and the fix."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import transformers
from transformers import CONFIG_MAPPING

from hfquant.checkpoint.files import CONFIG_NAME, read_config
from hfquant.checkpoint.model_type import BASE_MODEL_TYPE_KEY
from hfquant.config import QUANT_METHOD, HfQuantConfig

__all__ = ["read_model_config", "read_quantization_config", "check_source_config", "base_type_problem"]


def read_model_config(folder: str | os.PathLike) -> dict[str, Any]:
    """`read_config`, and a `model_type` this transformers knows (transformers' own error is a page of text).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: as `read_config`, or an unknown `model_type`, naming the file, the value and the fix.
    """
    config = read_config(folder)
    model_type = config.get("model_type")
    if model_type is not None and (not isinstance(model_type, str) or model_type not in CONFIG_MAPPING):
        raise ValueError(
            f"{Path(folder) / CONFIG_NAME}: model_type={model_type!r} is not a model type transformers "
            f"{transformers.__version__} knows; upgrade transformers (pip install -U transformers), or restore "
            "config.json from the original checkpoint"
        )
    return config


def read_quantization_config(folder: str | os.PathLike) -> tuple[dict, HfQuantConfig]:
    """(config.json as a dict, its `HfQuantConfig`).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: config.json is not a JSON object or malformed (`read_model_config`), has no `quantization_config`, or one of another method, or one
            `HfQuantConfig` refuses (unknown field, unknown format version, bad value); the message says which.
        TypeError: a field has the wrong type (from `HfQuantConfig`).
    """
    folder = Path(folder)
    config = read_model_config(folder)
    quant = config.get("quantization_config")
    if quant is None:
        raise ValueError(
            f"{CONFIG_NAME} has no quantization_config: {folder} is not a quantized checkpoint; quantize it with "
            "hfquant convert SRC DST"
        )
    method = quant.get("quant_method")
    if method != QUANT_METHOD:
        raise ValueError(
            f"{CONFIG_NAME}: quantization_config has quant_method={method!r}, not {QUANT_METHOD!r}; this checkpoint "
            "was quantized by another method: load it with the library for that method, not hfquant"
        )
    return config, HfQuantConfig.from_dict(dict(quant))


def check_source_config(folder: str | os.PathLike) -> None:
    """Refuse, in one line naming the file and the fix, a local SRC whose config.json transformers would fail on with a
    traceback or a page of text (`read_model_config`). A folder without config.json is left to the caller to report."""
    folder = Path(folder).expanduser()
    if (folder / CONFIG_NAME).is_file():
        read_model_config(folder)


def base_type_problem(config: dict[str, Any]) -> str | None:
    """The problem of a config.json (`read_config`'s dict, the base type back in `model_type`) whose base model type is
    not the type of the class its `architectures` names, or None. `AutoModelForCausalLM.from_pretrained` builds the
    class of the base type, `hfquant verify` and `convert` the class `architectures` names: with
    `hfquant_base_model_type` "gpt2" over a Llama's tensors, the load refused what verify passed; with "mistral" or
    "qwen3", the load computed another model than the files were written for. A name that is not a transformers model
    class is left to `hfquant.integration.skeleton.model_class`, an unknown type to `read_model_config`."""
    base = config.get("model_type")
    if not isinstance(base, str) or base not in CONFIG_MAPPING:
        return None
    for name in config.get("architectures") or []:
        cls = getattr(transformers, name, None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            continue
        wanted = cls.config_class
        if wanted is None or issubclass(CONFIG_MAPPING[base], wanted):
            return None
        return (
            f"{CONFIG_NAME}: the base model type {base!r} ({BASE_MODEL_TYPE_KEY}, or model_type) is not the type of its "
            f"architecture {name} ({wanted.model_type!r}), so from_pretrained would build another model than the "
            f"files hold; write {BASE_MODEL_TYPE_KEY}={wanted.model_type!r} or restore config.json from the quantized "
            "checkpoint"
        )
    return None
