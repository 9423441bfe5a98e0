"""transformers' checkpoint key renaming, applied without loading: which file tensor becomes which model tensor.

transformers 5.x renames checkpoint keys on load (`WeightRenaming`: legacy names, the base-model prefix) and fuses or
splits some tensors (`WeightConverter`: MoE experts); `save_pretrained` applies the reverse. `model_key_map` gives the
model name of every file tensor (for the schema check of a pre-quantized load and `hfquant verify`); `plan_outputs`
gives, for `hfquant convert`, every tensor `save_pretrained` would write, in its order and naming, with the source
tensor it comes from; `expert_scale_conversions` copies the MoE experts' weight merges for their scales and zero
points. With `hfquant.integration.quantizer` this is the only module that imports transformers' private loading
modules (`transformers.core_model_loading`, `transformers.conversion_mapping`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    apply_converters,
    apply_renamings,
    build_glob_alternation,
    dot_natural_key,
    rename_source_key,
)

from hfquant.core.dtypes import dtype_name
from hfquant.nn.experts import EXPERT_PROJECTIONS, QuantExperts

__all__ = [
    "model_key_map",
    "key_map",
    "expert_scale_conversions",
    "keep_expert_scale_conversions",
    "QuantJob",
    "Output",
    "plan_outputs",
]

logger = logging.getLogger(__name__)


def _renamed_keys(model, file_keys: Iterable[str], conversions) -> dict[str, tuple[str, object]]:
    """File key -> (model key, the converter pattern that made it or None), in transformers' key order."""
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = model.base_model_prefix
    meta_state = model.state_dict()
    renamed_keys = {}
    for key in sorted(file_keys, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in meta_state and key in meta_state:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_state)
        renamed_keys[key] = (renamed, pattern)
    return renamed_keys


def model_key_map(model, file_keys: Iterable[str], quantizer=None) -> dict[str, str | None]:
    """File tensor name -> model state_dict name as the loader renames it (None when a weight converter fuses it),
    with the model's conversions and those `quantizer` (a transformers `HfQuantizer`, or None) adds."""
    return key_map(model, file_keys, get_model_conversion_mapping(model, None, quantizer))


def key_map(model, file_keys: Iterable[str], conversions: list) -> dict[str, str | None]:
    """`model_key_map` with the weight `conversions` given (`get_model_conversion_mapping`'s list)."""
    return {
        key: renamed if pattern is None else None
        for key, (renamed, pattern) in _renamed_keys(model, file_keys, conversions).items()
    }


def _expert_scale_copies(converter, suffixes: list[str]) -> list:
    """Copies of `converter`, a merge of per-expert weights into one `QuantExperts` projection, for each of the
    `suffixes` ("_scale", "_zero_point"); none when `converter` is not such a merge."""
    if not isinstance(converter, WeightConverter):
        return []
    sources, targets = converter._original_source_patterns, converter._original_target_patterns
    if len(targets) != 1 or targets[0].rpartition(".")[2] not in EXPERT_PROJECTIONS:
        return []
    if not all(source.endswith(".weight") for source in sources):
        return []
    return [
        converter.copy(
            [source + suffix for source in sources], [targets[0] + suffix], operations=list(converter.operations)
        )
        for suffix in suffixes
    ]


def _expert_suffixes(model) -> list[str]:
    """The stored tensors besides the codes of `model`'s `QuantExperts` projections; none without experts."""
    experts = next((m for m in model.modules() if isinstance(m, QuantExperts)), None)
    if experts is None:
        return []
    return ["_scale"] + ([] if experts.symmetric else ["_zero_point"])


def expert_scale_conversions(conversions: list, model) -> list:
    """For each converter of `conversions` that merges per-expert weights into a `QuantExperts` tensor of `model`, the
    copies that merge (on load) and split (on save) its scales and zero points the same way: on disk every expert keeps
    the layout of a quantized Linear (`experts.3.w1.weight`, `.weight_scale`, `.weight_zero_point`)."""
    suffixes = _expert_suffixes(model)
    if not suffixes:
        return []
    return [copy for converter in conversions for copy in _expert_scale_copies(converter, suffixes)]


def keep_expert_scale_conversions(model) -> None:
    """After loading: make `save_pretrained` split expert scales like the expert weights whenever the weights' merge
    was used, by adding to `model._weight_conversions` (transformers keeps the used conversions there) the scale copies
    (`expert_scale_conversions`) it does not hold yet."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        return
    held = {_patterns(c) for c in conversions}
    for copy in expert_scale_conversions(list(conversions), model):
        if _patterns(copy) not in held:
            conversions.append(copy)


def _patterns(conversion) -> tuple:
    return (
        type(conversion),
        tuple(conversion._original_source_patterns),
        tuple(conversion._original_target_patterns),
        conversion.scope_prefix,
    )


class QuantJob(NamedTuple):
    """One source tensor to quantize: read `source_key` from `path`, cast to `dtype`, hand it to the quantizer as
    model tensor `model_key`; the quantizer returns the stored tensors (for a `QuantLinear` weight: weight,
    weight_scale[, weight_zero_point])."""

    path: str
    source_key: str
    model_key: str
    dtype: str


class Output(NamedTuple):
    """One output tensor: its name in the file, its model key, and its origin (a float source tensor or a job)."""

    name: str
    model_key: str
    path: str
    source_key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    job: QuantJob | None


def _tied_targets(model, state_dict_names: list[str]) -> set[str]:
    """Names that `save_pretrained` drops as tied duplicates (`remove_tied_weights_from_state_dict`, by identity)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        if name in state_dict_names:
            groups.setdefault(id(tensor), []).append(name)
    patterns = []
    for module_name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{module_name}.{key}" if module_name else key for key in tied]
    dropped = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        found = 0
        for name in sorted(names):
            if any(re.search(pattern, name) for pattern in patterns):
                found += 1
                if found < len(names):
                    dropped.add(name)
    return dropped


def plan_outputs(model, quantizer, load_dtype: torch.dtype, files: dict[str, Path]) -> tuple[list[Output], list[str]]:
    """Every output tensor in `save_pretrained`'s order, and the model tensors that no source tensor provides.

    Source keys are mapped to model keys with transformers' own renaming (`get_model_conversion_mapping`,
    `rename_source_key`, base-model prefix added or removed) and cast like `from_pretrained` casts them; a tensor
    for which the quantizer's `param_needs_quantization` is true becomes a job, which makes that model tensor and
    its module's other stored tensors that have no source (for a `QuantLinear`: weight_scale, weight_zero_point).
    Output names are the model keys mapped back with the reverse of the renamings used, as `save_pretrained` does.
    """
    meta_state = model.state_dict()
    conversions = get_model_conversion_mapping(model, None, quantizer)
    source_of: dict[str, str] = {}  # model key -> source key
    converted: set[str] = set()  # model keys made by a WeightConverter (fused or split tensors)
    for key, (renamed, pattern) in _renamed_keys(model, files, conversions).items():
        if renamed not in meta_state:
            logger.info(
                "source tensor %s is not used by %s (from_pretrained ignores it too)", key, type(model).__name__
            )
            continue
        if pattern is not None:
            converted.add(renamed)
        source_of.setdefault(renamed, key)

    dtype_plan = model._get_dtype_plan(load_dtype) if hasattr(model, "_get_dtype_plan") else {}
    if dtype_plan:
        dtype_alternation, dtype_group, _ = build_glob_alternation(list(dtype_plan))

    def planned_dtype(model_key: str) -> torch.dtype | None:
        if dtype_plan and (match := dtype_alternation.search(model_key)) is not None:
            return dtype_plan[dtype_group[match.lastgroup]]
        return None

    jobs: dict[str, QuantJob] = {}  # model key of every tensor a job makes -> job
    for model_key, source_key in source_of.items():
        if quantizer is None or not quantizer.param_needs_quantization(model, model_key):
            continue
        if model_key in converted:
            raise ValueError(
                f"{type(model).__name__} tensor {model_key} is built by a transformers weight conversion (fused or "
                "split tensors), which hfquant convert does not run; quantize this model on load instead: "
                "from_pretrained(SRC, quantization_config=HfQuantConfig(...)).save_pretrained(DST)"
            )
        job_dtype = planned_dtype(model_key) or load_dtype
        job = QuantJob(str(files[source_key]), source_key, model_key, dtype_name(job_dtype))
        module = model_key.rpartition(".")[0]
        jobs[model_key] = job
        if model_key.endswith(".bias"):
            continue  # a bias rescaled by a fold (fold_column_scales) makes nothing else; a norm has no stored siblings
        for key in meta_state:
            if key.rpartition(".")[0] == module and key not in source_of:
                jobs[key] = job

    used = [c for c in conversions if c.was_used()][::-1]
    reverse_renamings = [c.reverse_transform() for c in used if isinstance(c, WeightRenaming)]
    reverse_converters = [c.reverse_transform() for c in used if isinstance(c, WeightConverter)]

    def saved_name(model_key: str) -> str:
        name, pattern = apply_converters(model_key, reverse_converters)
        return name if pattern is not None else apply_renamings(model_key, reverse_renamings)

    names = sorted(meta_state, key=dot_natural_key)  # save_pretrained's order (revert_weight_conversion sorts)
    dropped = _tied_targets(model, names) | set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    outputs, missing = [], []
    for model_key in names:
        if model_key in dropped:
            continue
        meta = meta_state[model_key]
        job = jobs.get(model_key)
        if job is not None:
            name = saved_name(model_key)
            outputs.append(Output(name, model_key, job.path, job.source_key, meta.dtype, tuple(meta.shape), job))
            continue
        source_key = source_of.get(model_key)
        if source_key is None:
            missing.append(model_key)
            continue
        name = source_key if model_key in converted else saved_name(model_key)
        target = planned_dtype(model_key) or meta.dtype
        outputs.append(Output(name, model_key, str(files[source_key]), source_key, target, tuple(meta.shape), None))
    return outputs, missing
