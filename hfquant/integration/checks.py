"""Checks on a model hfquant loads: the stored tensors of a reload against the files (before loading), their values
and the completeness of quantize-on-load (after loading), and buffers left in RAM by disk offload."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from hfquant.checkpoint.files import (
    CONFIG_NAME,
    TensorHeader,
    checkpoint_ids,
    mixed_checkpoint_problem,
    read_config,
    read_headers,
    require_inside,
)
from hfquant.checkpoint.model_config import base_type_problem
from hfquant.checkpoint.schema import problem_text, schema_error, schema_problems, value_problem
from hfquant.integration.conversions import key_map
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts
from hfquant.nn.linear import QuantLinear

__all__ = [
    "read_single_copies",
    "check_stored_tensors",
    "confirm_checkpoint_unchanged",
    "check_reloaded_values",
    "stored_value_problems",
    "weights_to_quantize",
    "warn_offloaded_buffers",
]

logger = logging.getLogger(__name__)


def read_single_copies(files) -> dict[str, TensorHeader]:
    """Headers of every tensor of the safetensors `files` (other files are skipped), each stored once.

    Raises:
        ValueError: a tensor is in two files: transformers would load one of the copies, not necessarily the one the
            index names; the message names the tensor and both files.
    """
    tensors: dict[str, TensorHeader] = {}
    for file in files:
        if not str(file).endswith(".safetensors"):
            continue
        require_inside(Path(file).parent, file)
        for key, header in read_headers(file).items():
            if key in tensors:
                raise ValueError(
                    f"{key} is stored twice, in {tensors[key].file} and {header.file}, and from_pretrained would load "
                    f"one of the copies; delete the copy model.safetensors.index.json does not name, or copy the "
                    "complete checkpoint again"
                )
            tensors[key] = header
    return tensors


def check_stored_tensors(model: nn.Module, files, conversions: list) -> int:
    """Compare hfquant's stored tensors in the safetensors `files` with the prepared skeleton `model` before a
    pre-quantized load, their names mapped with the weight `conversions` of the load (`get_model_conversion_mapping`
    with the quantizer), and config.json's base type with its `architectures`; returns the tensors compared. The
    checks of `hfquant verify`, `inspect`, `export` and `convert` (`hfquant.integration.schema_check`): the same
    `base_type_problem` and `schema_problems`, in its loading mode, and the same message (`schema_error`).

    Raises:
        ValueError: one line naming the first tensor of the wrong dtype or shape, missing, or used by nothing (a SINQ
            column scale under a config saying RTN), or a base type that is not the architecture's, with the file
            and the fix (`schema_error`); a file that
            is not safetensors; a tensor stored twice (`read_single_copies`); shards (or the index)
            of two saves, as when `convert --overwrite` replaced the folder while it was read (`mixed_checkpoint_problem`).
    """
    for file in files:
        if not str(file).endswith(".safetensors"):
            raise ValueError(f"{file} is not a safetensors file; hfquant checkpoints are stored as safetensors only")
    ids = checkpoint_ids(files)
    mixed = mixed_checkpoint_problem(ids)  # shards of two saves: a reader racing `convert --overwrite`
    if mixed is not None:
        raise ValueError(mixed)
    if any(value is not None for value in ids.values()):  # compared again after: `confirm_checkpoint_unchanged`
        model._hfquant_checkpoint_ids = ids
    tensors = read_single_copies(files)
    folder = Path(files[0]).parent if files else None
    base = base_type_problem(read_config(folder)) if folder and (folder / CONFIG_NAME).is_file() else None
    problems, compared = schema_problems(model, tensors, key_map(model, tensors, conversions), loading=True)
    problems = ([base] if base is not None else []) + problems
    if problems:
        raise ValueError(schema_error(problems))
    return compared


def confirm_checkpoint_unchanged(model) -> None:
    """After a pre-quantized load: the shards' checkpoint ids read before the weights (`check_stored_tensors`) must
    still be those of the files, else transformers may have read some shards of the previous save and some of the new
    one (a `convert --overwrite` swapped the folder while the weights streamed in). A loaded-model hook; does nothing
    for a model loaded without the check, or from files without ids.

    Raises:
        ValueError: "the checkpoint changed while loading (SHARD belongs to another save ...); retry".
    """
    before = getattr(model, "_hfquant_checkpoint_ids", None)
    if not before:
        return
    del model._hfquant_checkpoint_ids
    try:
        after = checkpoint_ids(before)
    except (OSError, ValueError) as error:  # a shard removed or being replaced right now
        raise ValueError(f"the checkpoint changed while loading ({error}); retry") from None
    for file, value in before.items():
        if value is not None and after.get(file) != value:
            raise ValueError(
                f"the checkpoint changed while loading ({Path(file).name} belongs to another save now, in "
                f"{Path(file).parent}: a convert --overwrite or a copy replaced files meanwhile, so the weights read may "
                "mix two saves); retry"
            )


def check_reloaded_values(model: nn.Module) -> None:
    """After a pre-quantized load: refuse impossible stored values by name (one NaN or zero scale would turn every
    logit NaN, silently: `stored_value_problems`), then check that the shards read are still the files'
    (`confirm_checkpoint_unchanged`: else a `convert --overwrite` swapped the folder meanwhile and the weights may mix
    two saves).

    Raises:
        ValueError: naming every impossible value (`problem_text`), or "the checkpoint changed while loading".
    """
    problems = stored_value_problems(model)
    if problems:
        raise ValueError(problem_text(problems, what="holds impossible values"))
    confirm_checkpoint_unchanged(model)


def stored_value_problems(model) -> list[str]:
    """`value_problem` of every stored (persistent, loaded) scale and zero point of hfquant's modules in `model`."""
    problems = []
    for name, module in model.named_modules():
        if not isinstance(module, (QuantLinear, QuantEmbedding, QuantExperts)):
            continue
        for buffer_name, tensor in module._buffers.items():
            if tensor is None or tensor.device.type == "meta" or buffer_name in module._non_persistent_buffers_set:
                continue
            problem = value_problem(f"{name}.{buffer_name}" if name else buffer_name, tensor, module.bits)
            if problem is not None:
                problems.append(problem)
    return problems


def weights_to_quantize(model) -> list[str]:
    """Model keys of the float tensors quantize-on-load must see: the `weight` of every `QuantLinear` and
    `QuantEmbedding` holding its own tensors (a tied copy's are non-persistent), every projection of `QuantExperts`."""
    keys = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, (QuantLinear, QuantEmbedding)) and "weight" not in module._non_persistent_buffers_set:
            keys.append(prefix + "weight")
        elif isinstance(module, QuantExperts):
            keys += [prefix + projection for projection in module.shapes]
    return keys


def warn_offloaded_buffers(model) -> None:
    """Quantized tensors are buffers: accelerate leaves them in RAM unless `offload_buffers=True` is passed."""
    device_map = getattr(model, "hf_device_map", None) or {}
    on_disk = [name for name, device in device_map.items() if device == "disk"]
    for name in on_disk:
        module = model.get_submodule(name) if name else model
        resident = [
            f"{m_name}.{n}" if m_name else n
            for m_name, m in module.named_modules()
            for n, b in m._buffers.items()
            if b is not None
            and b.device.type != "meta"
            and not b.is_floating_point()
            and n not in m._non_persistent_buffers_set
        ]
        if resident:
            logger.warning(
                "hfquant: %s is offloaded to disk but its quantized tensors (%s, ...) stay in RAM; pass "
                "offload_buffers=True to from_pretrained to offload them too",
                name or "the model",
                resident[0],
            )
            return
