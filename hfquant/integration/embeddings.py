"""Embeddings and the output embedding under hfquant's quantizer: which are quantized, cast or tied, and the ties kept.

`embedding_dtype` stores every `nn.Embedding` in a float dtype or as a `QuantEmbedding`; `lm_head` stores the output
embedding in float or as a `QuantLinear`. A `module_overrides` entry naming an embedding or the output embedding by
its full name with a block `format` ({"model.embed_tokens": {"format": "q8_0"}}, what a GGUF import records for its
token_embd / output tensors) stores that table in llama.cpp's blocks instead, whatever the two fields say. A lm_head
tied to the input embedding is one tensor with it: quantized if either asks, stored once, read by both (the ties are
hfquant's, not transformers', once the tensors are buffers).

    plan = plan_embeddings(model, config, compute)                 # decided on the meta model, nothing changed
    replace_embeddings(model, plan.formats, plan.ties, compute)   # the swaps; transformers forgets these ties
    ... the weights load ...
    tie_buffers(model, plan.ties)                                  # each tied module gets its source's tensors
    share_tied_kernels(model, plan.ties)                           # once lm_head picked its kernel: one tensor
    tie_float_weights(model, plan.ties)                            # after dequantize(): one float tensor again
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from hfquant.config import HfQuantConfig, matches_module
from hfquant.core import blocks
from hfquant.core.dtypes import torch_dtype
from hfquant.core.format import Method, StoredFormat
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import (
    QUANTIZED_STORAGE,
    LayerPlan,
    block_format,
    embedding_kind,
    output_embedding,
    quantized_format,
    replace_tied_quant_linear,
    replace_with_quant_embedding,
)

__all__ = [
    "EmbeddingPlan",
    "plan_embeddings",
    "replace_embeddings",
    "tied_modules",
    "embedding_storage",
    "tie_buffers",
    "share_tied_kernels",
    "tie_float_weights",
    "output_embeddings",
    "module_name",
    "block_override",
]

logger = logging.getLogger(__name__)

_TENSOR_NAMES = ("weight", "weight_scale", "weight_zero_point")


class EmbeddingPlan(NamedTuple):
    """What happens to the embeddings and the output embedding of one model.

    Attributes:
        formats: embedding -> its stored format, for each embedding that becomes a `QuantEmbedding` holding its tensors.
        casts: float embedding -> the dtype it is stored in (other than the compute dtype).
        adapters: module -> (storage dtype, cast its float inputs): modules whose output is cast back to the compute
            dtype after loading (cast embeddings, their tied copies, a lm_head tied to a cast embedding).
        ties: (module reading the tensors, module holding them): tied copies of a quantized embedding (which become
            `QuantEmbedding`s with non-persistent tensors) and a lm_head tied to one (a `QuantLinear` likewise).
        head: the plan of an untied lm_head stored as a `QuantLinear`, else None.
    """

    formats: dict[str, StoredFormat]
    casts: dict[str, torch.dtype]
    adapters: dict[str, tuple[torch.dtype, bool]]
    ties: list[tuple[str, str]]
    head: LayerPlan | None


def tied_modules(model: nn.Module) -> dict[str, str]:
    """Module reading a tied weight -> module holding it, from transformers' `all_tied_weights_keys` (weights only)."""
    tied_params = dict(getattr(model, "all_tied_weights_keys", None) or {})
    return {
        t.removesuffix(".weight"): s.removesuffix(".weight")
        for t, s in tied_params.items()
        if t.endswith(".weight") and s.endswith(".weight")
    }


def block_override(config: HfQuantConfig, name: str) -> str | None:
    """The block format ("q8_0") that a `module_overrides` entry naming the embedding / output embedding `name`
    exactly asks for, else None (patterns select Linear layers only: an embedding follows `embedding_dtype`)."""
    entry = config.module_overrides.get(name)
    fmt = None if entry is None else entry.get("format")
    return str(fmt) if fmt is not None and str(fmt) in blocks.LAYOUTS else None


def _quantized(storage: str | None) -> bool:
    """Whether a storage ("int8", "q8_0", "bfloat16", "auto", ...) is a quantized tensor."""
    return storage is not None and (storage in QUANTIZED_STORAGE or storage in blocks.LAYOUTS)


def _storage_format(storage: str, config: HfQuantConfig, in_features: int) -> StoredFormat | None:
    """The stored format of a table stored as `storage` ("int8"/"int4", or a block format) whose rows have
    `in_features` values: a block format whose blocks do not divide them takes its fallback type (`lm_head="q6_k"`
    on rows of 576: q8_0); None when it has no group size / no block size divides them."""
    if storage in blocks.LAYOUTS:
        return block_format(storage, in_features, Method.RTN)[0]  # the layers' rule, fallback included
    return quantized_format(storage, config, in_features)


def _stored_as(storage: str, width: int) -> str:
    """The storage a table of rows of `width` values gets when asked for `storage`: a block format whose blocks do
    not divide its rows takes its fallback type (`block_format`: q6_k on rows of 576 is q8_0, which a saved config
    records for the tied table while `lm_head` keeps "q6_k"), anything else is itself."""
    if storage not in blocks.LAYOUTS:
        return storage
    fmt = block_format(storage, width, Method.RTN)[0]
    return storage if fmt is None else fmt.block


def _head_format(config: HfQuantConfig, head: str | None) -> str | None:
    """The quantized storage asked for the output embedding `head`: its block override, else `lm_head` unless
    "keep"."""
    override = None if head is None else block_override(config, head)
    return override if override is not None else None if config.lm_head == "keep" else str(config.lm_head)


def embedding_storage(
    model: nn.Module, config: HfQuantConfig, tied: dict[str, str], head: str | None
) -> dict[str, str]:
    """The storage ("auto", a float dtype name, "int8"/"int4", a block format) of each embedding holding its own
    tensor: its block override (`block_override`), else the config's `embedding_dtype`, or the lm_head's format for an
    embedding the lm_head is tied to when only the lm_head asks for one. Tied copies (`tied`) follow their source and
    are not listed; `modules_to_not_convert` ones stay as they are.

    Raises:
        ValueError: the lm_head and the embedding ask two different formats for one tied tensor.
    """
    storage = {
        name: block_override(config, name) or str(config.embedding_dtype)
        for name, module in model.named_modules()
        if embedding_kind(module) is not None
        and not matches_module(name, config.modules_to_not_convert)
        and name not in tied
    }
    head_format = _head_format(config, head)
    head_source = tied.get(head) if head is not None else None
    if head_source is not None and head_source in storage:
        asked = storage[head_source]
        width = model.get_submodule(head_source).embedding_dim
        if head_format is not None and asked != "auto" and _stored_as(asked, width) != _stored_as(head_format, width):
            raise ValueError(
                f"lm_head={head_format!r} and embedding_dtype={asked!r} conflict: {head} is tied to "
                f"{head_source}, so they are one tensor; give both the same int8/int4 value, or untie them "
                "(config tie_word_embeddings=False) to store them differently."
            )
        if not _quantized(asked) and head_format is not None:
            storage[head_source] = head_format
            logger.info("hfquant: %s is tied to %s, which is stored as %s with it", head, head_source, head_format)
        elif _quantized(asked):
            logger.info("hfquant: %s is tied to %s and reads its %s tensor", head, head_source, asked)
    elif head_source is not None and head_format is not None:
        logger.warning("hfquant keeps %s in float: it is tied to %s, which is not quantized", head, head_source)
    return storage


def _stored_formats(
    model: nn.Module, config: HfQuantConfig, compute: torch.dtype, storage: dict[str, str]
) -> tuple[dict[str, StoredFormat], dict[str, torch.dtype]]:
    """(quantized embedding -> format, float embedding -> its dtype other than `compute`) for `storage`; an embedding
    whose width has no group size stays in float (logged)."""
    formats, casts = {}, {}
    for name, kind in storage.items():
        module = model.get_submodule(name)
        if _quantized(kind):
            fmt = _storage_format(kind, config, module.embedding_dim)
            if fmt is None:
                logger.info(
                    "hfquant keeps embedding %s in float: embedding_dim=%d has no group size (block size)",
                    name,
                    module.embedding_dim,
                )
            else:
                formats[name] = fmt
        elif kind != "auto" and torch_dtype(kind) != compute:
            casts[name] = torch_dtype(kind)
    return formats, casts


def _untied_head(model: nn.Module, head: str, config: HfQuantConfig) -> LayerPlan | None:
    """The plan of the untied output embedding `head` when `lm_head` asks to quantize it, else None."""
    head_format = _head_format(config, head)
    if not head_format or matches_module(head, config.modules_to_not_convert):
        return None
    module = model.get_submodule(head)
    fmt = _storage_format(head_format, config, module.in_features)
    if fmt is None:
        logger.info(
            "hfquant keeps %s in float: in_features=%d has no group size (block size)", head, module.in_features
        )
        return None
    return LayerPlan(head, module.in_features, module.out_features, fmt, "", False)


def plan_embeddings(model: nn.Module, config: HfQuantConfig, compute: torch.dtype) -> EmbeddingPlan:
    """The `EmbeddingPlan` of the meta-device `model` for `embedding_dtype` and `lm_head`; the model is not changed.

    Raises:
        ValueError: `lm_head` and `embedding_dtype` ask two different formats for one tied tensor.
    """
    tied = tied_modules(model)
    head = module_name(model, output_embeddings(model))
    formats, casts = _stored_formats(model, config, compute, embedding_storage(model, config, tied, head))
    adapters = {name: (dtype, False) for name, dtype in casts.items()}
    modules = dict(model.named_modules())
    ties = []
    for target, source in tied.items():
        if source in formats and target != head and embedding_kind(modules.get(target)) is not None:
            ties.append((target, source))
        elif source in adapters and target != head and target in modules:
            adapters[target] = adapters[source]
    head_plan = None
    if head is not None and tied.get(head) in formats:
        ties.append((head, tied[head]))
    elif head is not None and tied.get(head) in adapters:
        adapters[head] = (adapters[tied[head]][0], True)
    elif head is not None and head not in tied:
        head_plan = _untied_head(model, head, config)
    return EmbeddingPlan(formats, casts, adapters, ties, head_plan)


def replace_embeddings(
    model: nn.Module, formats: dict[str, StoredFormat], ties: list[tuple[str, str]], compute: torch.dtype
) -> int:
    """Swap the quantized embeddings (`formats`) and the tied modules (`ties`) of the meta-device `model` for empty
    `QuantEmbedding`s / a `QuantLinear` lm_head, and take those ties out of transformers' `all_tied_weights_keys`
    (transformers must not tie, nor mark as initialized, what now lives in buffers: the ties are hfquant's). The
    untied lm_head and the casts are not done here (`EmbeddingPlan.head`, `.casts`). Returns the modules swapped."""
    for name, fmt in formats.items():
        replace_with_quant_embedding(model, name, fmt, compute)
    for target, source in ties:
        if isinstance(model.get_submodule(target), nn.Linear):  # the output embedding
            replace_tied_quant_linear(model, target, formats[source], compute)
        else:
            replace_with_quant_embedding(model, target, formats[source], compute, persistent=False)
    tied_now = {target for target, _ in ties}
    if tied_now and hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {
            t: s for t, s in model.all_tied_weights_keys.items() if t.rpartition(".")[0] not in tied_now
        }
    return len(formats) + len(ties)


def tie_buffers(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """After loading, give each tied module (lm_head, T5's encoder/decoder embed_tokens) its source embedding's
    tensors, on the tied module's device (a source offloaded by accelerate is read from its stored tensor)."""
    for target_name, source_name in ties:
        target, source = model.get_submodule(target_name), model.get_submodule(source_name)
        device = target.weight.device
        for name in _TENSOR_NAMES:
            value = getattr(source, name, None)
            if value is not None and value.device.type == "meta":  # source offloaded: read its stored tensor
                value = source._hf_hook.weights_map[name]
            if value is not None:
                setattr(target, name, value if value.device == device else value.to(device))


def share_tied_kernels(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """After the tied lm_head picked its kernel, make the embedding read the very same tensor; tied embedding copies
    then read their source's tensors and kernel owner."""
    for target_name, source_name in ties:
        target, source = model.get_submodule(target_name), model.get_submodule(source_name)
        if isinstance(target, QuantLinear) and target.weight.device == source.weight.device:
            how = source.share_with(target)
            logger.info("hfquant: %s and %s share one tensor (%s)", source_name, target_name, how)
    for target_name, source_name in ties:
        target, source = model.get_submodule(target_name), model.get_submodule(source_name)
        if isinstance(target, QuantEmbedding) and target.weight.device == source.weight.device:
            for name in _TENSOR_NAMES:
                setattr(target, name, getattr(source, name, None))
            target.set_kernel_owner(source._kernel_owner)


def tie_float_weights(model: nn.Module, ties: list[tuple[str, str]]) -> None:
    """After dequantizing, make each tied module read its source's float weight: one tensor again, as before
    quantization."""
    for target_name, source_name in ties:
        model.get_submodule(target_name).weight = model.get_submodule(source_name).weight


def output_embeddings(model: nn.Module) -> nn.Linear | None:
    """The model's output embedding (lm_head) when it is an `nn.Linear` (one hfquant may still quantize or tie), else
    None; any module: `hfquant.nn.replace.output_embedding`."""
    head = output_embedding(model)
    return head if isinstance(head, nn.Linear) else None


def module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    """The dotted name of `module` in `model`, or None."""
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)
