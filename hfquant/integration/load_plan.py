"""What a load does to the model, decided once before any weight is read: `LoadPlan`.

The pre-load hook (`HfQuantQuantizer._process_model_before_weight_loading`) builds it on the meta-device skeleton from
functions that return values, then applies it; the hooks after loading read it (ties, dtype adapters, folds):

    skip, layers = plan_model(model, config, quantizing=True)      # `quantizer.plan_model`: skips, Linear formats
    folds, layers = plan_checkpoint_folds(model, config, skip, layers, files, device_map)   # fold_column_scales
    layers = record_stored_formats(model, config, skip, layers)   # each layer's stored format into config.json
    plan = plan_load(model, config, compute, skip, layers, folds)  # + embeddings, lm_head, ties, experts, norms
    apply_plan(model, plan, config)                                # the swaps and casts, nothing read yet
    ... the weights load ...
    install_adapters(model, plan.adapters, compute)                # modules stored in another float dtype
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from hfquant.config import HfQuantConfig, matches_module
from hfquant.core.dtypes import torch_dtype
from hfquant.core.folding import Transform
from hfquant.core.format import StoredFormat
from hfquant.integration.bos_importance import bos_token_id
from hfquant.integration.embeddings import EmbeddingPlan, plan_embeddings, replace_embeddings
from hfquant.integration.folding import FoldStream, find_blocks, fold_overrides
from hfquant.nn.norms import find_norms, install_dtype_adapter
from hfquant.nn.replace import (
    ExpertsPlan,
    LayerPlan,
    cast_float_params,
    plan_experts,
    plan_layers,
    replace_with_quant_experts,
    replace_with_quant_linear,
)

__all__ = [
    "LoadPlan",
    "plan_checkpoint_folds",
    "record_stored_formats",
    "stored_entry",
    "plan_quantized_experts",
    "plan_norm_casts",
    "plan_load",
    "apply_plan",
    "install_adapters",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadPlan:
    """Every decision of one load, made on the meta-device skeleton before the weights stream in.

    Attributes:
        compute_dtype: the dtype the model computes in (None before the pre-load hook ran).
        skip: the modules kept in float: transformers' defaults plus `modules_to_not_convert`.
        layers: one `LayerPlan` per Linear/Conv1D layer (its stored format, or None and why), an untied quantized
            lm_head included.
        embeddings: embedding -> stored format, for each embedding that becomes a `QuantEmbedding` holding its tensors.
        ties: (module reading the tensors, module holding them): tied embedding copies and a tied lm_head.
        experts: the fused MoE experts modules that become `QuantExperts`.
        casts: float module (embedding, norm) -> the dtype it is stored in, other than `compute_dtype`.
        adapters: module -> (storage dtype, cast its float inputs): modules whose output is cast back to
            `compute_dtype` after loading.
        folds: module name -> its `Transform` (`fold_column_scales`), applied to its tensors as they stream in: a
            `FoldStream` when the load computes them (its values computed beside the load; closed after it).
    """

    compute_dtype: torch.dtype | None = None
    skip: list[str] = field(default_factory=list)
    layers: list[LayerPlan] = field(default_factory=list)
    embeddings: dict[str, StoredFormat] = field(default_factory=dict)
    ties: list[tuple[str, str]] = field(default_factory=list)
    experts: list[ExpertsPlan] = field(default_factory=list)
    casts: dict[str, torch.dtype] = field(default_factory=dict)
    adapters: dict[str, tuple[torch.dtype, bool]] = field(default_factory=dict)
    folds: Mapping[str, Transform] = field(default_factory=dict)


def plan_checkpoint_folds(
    model: nn.Module,
    config: HfQuantConfig,
    skip: list[str],
    layers: list[LayerPlan],
    files: Iterable[str | os.PathLike],
    device_map=None,
) -> tuple[Mapping[str, Transform], list[LayerPlan]]:
    """`fold_column_scales`: read each decoder block's float weights once from the checkpoint `files`
    (`hfquant.integration.folding`) and return (the folds for the streaming load, the layer plans). The folds are a
    `FoldStream`: the first block's computed by the pre-load hook (`FoldStream.fold_first`), the others on a worker
    thread while the load runs. The folded layers are stored with RTN: their entries are put first in
    `config.module_overrides` and the layers planned again. Without a safetensors checkpoint (a GGUF file, a state
    dict) nothing is folded and a warning says so.

    Raises:
        ValueError: `device_map` places modules on "disk" (folds are not supported with disk offload).
    """
    files = [str(f) for f in files]
    if not files or not all(f.endswith(".safetensors") for f in files):
        logger.warning(
            "hfquant: fold_column_scales needs a safetensors checkpoint to read before loading (got %s); "
            "the layers are quantized without folding",
            files or "no checkpoint files",
        )
        return {}, layers
    if isinstance(device_map, dict) and "disk" in device_map.values():
        raise ValueError(
            "fold_column_scales does not support disk offload (device_map places modules on 'disk'): quantize with "
            "a device_map without 'disk' and save, or use fold_column_scales=False"
        )
    folds = FoldStream(
        model,
        layers,
        files,
        clipping=config.clipping,
        importance=_importance(model, config, layers),
        iq4_search=str(config.iq4_search),
    )
    added = fold_overrides(config, layers, folds)
    if added:
        config.prepend_overrides(added)
        layers = plan_layers(model, config, skip)
    return folds, layers


def _importance(model: nn.Module, config: HfQuantConfig, layers: list[LayerPlan]) -> str:
    """The config's `importance` for this load: "auto" is "bos_activations" where a layer is stored in a block format
    (whose search takes an importance) and the model has foldable blocks and a BOS token (`bos_token_id`), else
    "weights"; the other values as given (FoldStream warns where "bos_activations" cannot act)."""
    importance = str(config.importance)
    if importance != "auto":
        return importance
    blocks = any(plan.format is not None and plan.format.block is not None for plan in layers)
    return "bos_activations" if blocks and find_blocks(model) and bos_token_id(model) is not None else "weights"


def stored_entry(config: HfQuantConfig, plan: LayerPlan) -> dict | None:
    """The complete `module_overrides` entry stating the stored format of the quantized layer `plan`, or None when
    that format is the config's own fields (or `plan` stays in float): {"format", "method"} for a block format (a
    fallback type, say), {["format": "int",] "bits", "group_size", "symmetric", "method"} for the integer format.

    The entry's group size is the asked one (`config.layer_settings`) when the layer stores that one, None when the
    layer is per-channel (one group of in_features, e.g. 576, which is no valid group size), else the group it
    stores: 64 for a layer of 576 inputs asked for 128, which does not divide them.
    """
    fmt = plan.format
    if fmt is None:
        return None
    if fmt.block is not None:
        same = fmt.block == config.format and fmt.method == config.method
        return None if same else {"format": fmt.block, "method": fmt.method.value}
    asked = config.layer_settings(plan.name).group_size
    if fmt.group_size == asked:
        group_size = asked
    else:
        group_size = None if fmt.group_size == plan.in_features else fmt.group_size
    entry = {"bits": fmt.bits, "group_size": group_size, "symmetric": fmt.symmetric, "method": fmt.method.value}
    if config.format != "int":
        return {"format": "int"} | entry
    own = {"bits": config.bits, "group_size": config.group_size, "symmetric": config.symmetric}
    same = all(entry[k] == v for k, v in own.items()) and fmt.method == config.method
    return None if same else entry


def record_stored_formats(
    model: nn.Module, config: HfQuantConfig, skip: list[str], layers: list[LayerPlan]
) -> list[LayerPlan]:
    """Write into `config.module_overrides` the stored format of every quantized layer of `layers` that differs from
    the config's own fields (`stored_entry`), by its full name, so that `config.json` names the format each layer is
    stored in: a group that fell back because the asked one does not divide in_features, and the data-free rule's and
    the folds' entries completed to the whole format. An existing entry of that exact name is replaced in place; the
    others go first (the first matching pattern wins). Called when quantizing, after every other decision on the
    layers' formats; a reload only reads the entries.

    Returns the layers planned again from the config written, which give every layer the same format (should an
    entry select a longer name too, as a whole-component suffix of it, that layer gets an exact entry of its own).

    Raises:
        RuntimeError: no entries rebuild the same formats (a bug; the config is then left as it was).
    """
    wanted = {plan.name: plan for plan in layers if plan.format is not None}
    entries = {name: entry for name, plan in wanted.items() if (entry := stored_entry(config, plan)) is not None}
    original = config.module_overrides
    overrides = {**original, **{name: entry for name, entry in entries.items() if name in original}}
    config.module_overrides = {**{n: e for n, e in entries.items() if n not in original}, **overrides}
    for _ in range(len(wanted) + 1):
        replanned = plan_layers(model, config, skip)
        wrong = [p.name for p in replanned if p.name in wanted and p.format != wanted[p.name].format]
        if not wrong:
            return replanned
        exact = {name: entries.get(name) or _whole_entry(wanted[name]) for name in wrong}
        config.module_overrides = {**exact, **{p: s for p, s in config.module_overrides.items() if p not in exact}}
    config.module_overrides = original
    raise RuntimeError(f"hfquant: no module_overrides rebuild the stored formats of {wrong[:5]}")


def _whole_entry(plan: LayerPlan) -> dict:
    """The complete entry of `plan`'s stored format, also when it is the config's own (see `stored_entry`)."""
    fmt = plan.format
    if fmt.block is not None:
        return {"format": fmt.block, "method": fmt.method.value}
    group_size = None if fmt.group_size == plan.in_features else fmt.group_size
    entry = {"bits": fmt.bits, "group_size": group_size, "symmetric": fmt.symmetric, "method": fmt.method.value}
    return {"format": "int"} | entry


def plan_quantized_experts(model: nn.Module, config: HfQuantConfig, skip: Iterable[str]) -> list[ExpertsPlan]:
    """The plans of the fused MoE experts modules of `model` to quantize; each one kept in float is logged (at INFO
    for `skip`, else a WARNING naming why: only (experts, out, in) weights without biases are quantized)."""
    quantized = []
    for plan in plan_experts(model, config.bits, config.group_size, skip):
        if plan.reason == "modules_to_not_convert":
            logger.info("hfquant keeps experts %s in float: modules_to_not_convert", plan.name)
        elif plan.reason:
            logger.warning(
                "hfquant keeps the MoE experts %s in float (%s): only (experts, out, in) weights without biases "
                "are quantized; list them in modules_to_not_convert to silence this warning",
                plan.name,
                plan.reason,
            )
        else:
            quantized.append(plan)
    return quantized


def plan_norm_casts(model: nn.Module, config: HfQuantConfig, compute: torch.dtype) -> dict[str, torch.dtype]:
    """Norm -> its storage dtype when `config.norm_dtype` differs from `compute` (none are listed for "auto");
    `modules_to_not_convert` norms stay as they are."""
    name = config.norm_dtype
    if name == "auto" or torch_dtype(name) == compute:
        return {}
    return {
        norm: torch_dtype(name)
        for norm in find_norms(model)
        if not matches_module(norm, config.modules_to_not_convert)
    }


def _name_block_tables(config: HfQuantConfig, embeddings: EmbeddingPlan) -> None:
    """Give each embedding / output embedding stored in a block format (`lm_head="q6_k"`, or its q8_0 fallback) an
    exact-name `module_overrides` entry with that format, unless one names it already: what a GGUF import writes, so
    config.json says which block type each table holds (`checkpoint.schema.block_layers` reads the entries)."""
    tables = {name: fmt for name, fmt in embeddings.formats.items() if fmt.block is not None}
    if embeddings.head is not None and embeddings.head.format.block is not None:
        tables[embeddings.head.name] = embeddings.head.format
    entries = {name: {"format": fmt.block} for name, fmt in tables.items() if name not in config.module_overrides}
    if entries:
        config.prepend_overrides(entries)


def plan_load(
    model: nn.Module,
    config: HfQuantConfig,
    compute: torch.dtype,
    skip: list[str],
    layers: list[LayerPlan],
    folds: Mapping[str, Transform],
) -> LoadPlan:
    """The `LoadPlan` of the meta-device `model`: `skip` and `layers` (from `quantizer.plan_model`), `folds`, and what
    `plan_embeddings`, `plan_quantized_experts` and `plan_norm_casts` decide; the model is not changed.

    Raises:
        ValueError: `lm_head` and `embedding_dtype` ask two different formats for one tied tensor.
    """
    embeddings: EmbeddingPlan = plan_embeddings(model, config, compute)
    _name_block_tables(config, embeddings)
    head = [embeddings.head] if embeddings.head is not None else []
    swapped = {plan.name for plan in head} | {target for target, _ in embeddings.ties}
    norms = plan_norm_casts(model, config, compute)
    return LoadPlan(
        compute_dtype=compute,
        skip=skip,
        layers=[plan for plan in layers if plan.name not in swapped] + head,
        embeddings=embeddings.formats,
        ties=embeddings.ties,
        experts=plan_quantized_experts(model, config, skip),
        casts={**embeddings.casts, **norms},
        adapters={**embeddings.adapters, **{norm: (dtype, True) for norm, dtype in norms.items()}},
        folds=folds,
    )


def apply_plan(model: nn.Module, plan: LoadPlan, config: HfQuantConfig) -> int:
    """Swap the planned modules of the meta-device `model` for empty hfquant modules and cast the planned float
    modules (the experts stored with `config.bits` and `config.symmetric`). Returns the modules swapped."""
    replaced = replace_embeddings(model, plan.embeddings, plan.ties, plan.compute_dtype)
    replaced += replace_with_quant_linear(model, plan.layers, plan.compute_dtype)
    for experts in plan.experts:
        replace_with_quant_experts(model, experts, config.bits, config.symmetric, plan.compute_dtype)
    for name, dtype in plan.casts.items():
        cast_float_params(model.get_submodule(name), dtype)
    return replaced + len(plan.experts)


def install_adapters(model: nn.Module, adapters: dict[str, tuple[torch.dtype, bool]], dtype: torch.dtype) -> None:
    """After loading: make each module of `adapters` (module -> (storage dtype, cast its float inputs)) whose float
    parameters are not in `dtype` compute in its storage dtype and return `dtype` (`install_dtype_adapter`)."""
    for name, (storage, cast_inputs) in adapters.items():
        module = model.get_submodule(name)
        if any(p.dtype != dtype for p in module.parameters(recurse=False) if p.is_floating_point()):
            install_dtype_adapter(module, storage, dtype, cast_inputs)
