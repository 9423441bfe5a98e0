"""The model skeleton of a checkpoint: built on the meta device from config.json as `from_pretrained` builds it.

`hfquant convert`, `verify` and `inspect` read checkpoints file by file, without loading weights; the skeleton tells
them every tensor's name, dtype and shape. Only transformers' own classes are built (`trust_remote_code` stays
off): a checkpoint's code is never run.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hfquant.checkpoint.files import first_float_dtype, tensor_files
from hfquant.config import HfQuantConfig
from hfquant.core.dtypes import torch_dtype
from hfquant.integration.quantizer import HfQuantQuantizer

__all__ = ["model_class", "resolve_dtype", "build_skeleton"]


def model_class(model_config):
    """The transformers model class named by `model_config.architectures`, else the Auto class for its model type.

    Raises:
        ValueError: the architecture is not a transformers model class (custom code is never run; a name such as
            "TrainingArguments" is a class but not a model), naming it.
    """

    architectures = getattr(model_config, "architectures", None) or []
    for name in architectures:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    if architectures:
        raise ValueError(
            f"architecture {architectures[0]!r} of config.json is not a transformers model class; hfquant does not run "
            "custom (remote) code. Quantize such a model on load with from_pretrained(..., trust_remote_code=True, "
            "quantization_config=HfQuantConfig(...)) and save_pretrained it"
        )
    return AutoModelForCausalLM if type(model_config) in MODEL_FOR_CAUSAL_LM_MAPPING else AutoModel


def resolve_dtype(dtype: str | torch.dtype, model_config, files: dict[str, Path] | None) -> torch.dtype:
    """The load dtype: "auto" is config.json's `dtype`, else the checkpoint's first float dtype (as transformers does).

    Raises:
        ValueError: `dtype` is not a floating torch dtype, naming it and the allowed values.
    """
    if dtype == "auto":
        configured = getattr(model_config, "dtype", None)
        if configured is not None:
            return torch_dtype(configured)
        return first_float_dtype(files.values()) if files else torch.float32
    try:
        value = torch_dtype(dtype)
    except ValueError:
        value = None
    if value is None or not value.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a torch floating dtype; use auto, bfloat16, float16 or float32")
    return value


def build_skeleton(
    folder: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    quantization_config: HfQuantConfig | None = None,
    *,
    pre_quantized: bool = False,
    folds: dict | None = None,
):
    """(model on the meta device, load dtype, quantizer or None) for the checkpoint in `folder`; no weight is read.

    The model is built like `from_pretrained` builds it: its architecture class from config.json, in the load dtype
    (`dtype`, resolved as transformers does, then passed through the quantizer's `update_dtype`). With a
    `quantization_config`, hfquant's quantizer runs its `preprocess_model` on it: the planned layers become meta
    `QuantLinear`s and `config.quantization_config` is set, as in quantize-on-load (`pre_quantized=False`) or in the
    reload of a quantized checkpoint (`pre_quantized=True`). `folds` (from another skeleton's `quantizer.plan.folds`, with
    that quantizer's resolved config) spares a second reading of the checkpoint for `fold_column_scales`.

    Raises:
        ValueError: the architecture is not a transformers model class, or a bad `dtype`; OSError / ValueError from
            transformers when config.json cannot be read.
    """

    folder = Path(folder)
    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    cls = model_class(model_config)
    try:
        files = tensor_files(folder)
    except (FileNotFoundError, ValueError):
        files = None
    load_dtype = resolve_dtype(dtype, model_config, files)
    quantizer = None
    if quantization_config is not None:
        # folds computed once by the caller (`fold_column_scales`) are not read from the checkpoint again
        quantizer = HfQuantQuantizer(quantization_config, folds=folds, pre_quantized=pre_quantized)
        quantizer.validate_environment()
        load_dtype = quantizer.update_dtype(load_dtype)
    with torch.device("meta"):
        if cls.__name__.startswith("Auto"):
            model = cls.from_config(model_config, dtype=load_dtype)
        else:
            model = cls._from_config(model_config, dtype=load_dtype)
    if quantizer is not None:
        # from_pretrained runs preprocess_model inside its init context, where torch's default dtype is the load dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(load_dtype)
        try:
            with torch.device("meta"):
                # a float checkpoint's files let the quantizer read what it needs before loading (fold_column_scales)
                checkpoint_files = sorted({str(p) for p in files.values()}) if files and not pre_quantized else None
                quantizer.preprocess_model(
                    model=model, dtype=load_dtype, device_map={"": "cpu"}, checkpoint_files=checkpoint_files
                )
        finally:
            torch.set_default_dtype(default)
        model.config.quantization_config = quantizer.quantization_config
    return model, load_dtype, quantizer
