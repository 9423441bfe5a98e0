"""Embeddings and the output embedding under hfquant's quantizer: which are quantized, cast or tied, on the meta model.

`embedding_dtype` stores every `nn.Embedding` in a float dtype or as a `QuantEmbedding`; `lm_head` stores the output
embedding in float or as a `QuantLinear`. A lm_head tied to the input embedding is one tensor with it: quantized if
either field asks, stored once, read by both (the ties are hfquant's, not transformers', once the tensors are buffers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hfquant.config import HfQuantConfig, matches_module
from hfquant.core.dtypes import torch_dtype
from hfquant.core.format import StoredFormat
from hfquant.nn.replace import (
    QUANTIZED_STORAGE,
    LayerPlan,
    cast_float_params,
    embedding_kind,
    quantized_format,
    replace_tied_quant_linear,
    replace_with_quant_embedding,
    replace_with_quant_linear,
)

__all__ = ["plan_embeddings_and_head", "output_embeddings", "module_name"]

logger = logging.getLogger(__name__)


def plan_embeddings_and_head(
    model: nn.Module,
    config: HfQuantConfig,
    compute: torch.dtype,
    adapters: dict[str, tuple[torch.dtype, bool]],
    ties: list[tuple[str, str]],
) -> int:
    """Swap the embeddings (`embedding_dtype`) and the output embedding (`lm_head`) of the meta-device `model`.

    Quantized embeddings become `QuantEmbedding`s, a quantized untied lm_head a `QuantLinear`, a lm_head tied to a
    quantized embedding a `QuantLinear` reading that embedding's tensors; float embeddings stored in another dtype
    are cast. Records in `adapters` (module -> (storage dtype, cast its float inputs)) the modules whose output must
    be cast back to `compute`, and in `ties` the (module reading the tensors, module holding them) pairs; removes
    those pairs from transformers' own `all_tied_weights_keys`. Returns the modules quantized.

    Raises:
        ValueError: `lm_head` and `embedding_dtype` ask two different formats for one tied tensor.
    """
    user_skip = config.modules_to_not_convert
    modules = dict(model.named_modules())
    tied_params = dict(getattr(model, "all_tied_weights_keys", None) or {})
    tied = {
        t.removesuffix(".weight"): s.removesuffix(".weight")
        for t, s in tied_params.items()
        if t.endswith(".weight") and s.endswith(".weight")
    }
    head = module_name(model, output_embeddings(model))
    embeddings = [
        name
        for name, module in modules.items()
        if embedding_kind(module) is not None and not matches_module(name, user_skip)
    ]
    # storage of each embedding that holds its own tensor; tied copies follow their source
    storage = {name: config.embedding_dtype for name in embeddings if name not in tied}
    head_format = None if config.lm_head == "keep" else config.lm_head
    head_source = tied.get(head) if head is not None else None
    if head_source is not None and head_source in storage:
        asked = config.embedding_dtype
        if head_format is not None and asked != "auto" and asked != head_format:
            raise ValueError(
                f"lm_head={config.lm_head!r} and embedding_dtype={asked!r} conflict: {head} is tied to "
                f"{head_source}, so they are one tensor; give both the same int8/int4 value, or untie them "
                "(config tie_word_embeddings=False) to store them differently."
            )
        if asked not in QUANTIZED_STORAGE and head_format is not None:
            storage[head_source] = head_format
            logger.info("hfquant: %s is tied to %s, which is stored as %s with it", head, head_source, head_format)
        elif asked in QUANTIZED_STORAGE:
            logger.info("hfquant: %s is tied to %s and reads its %s tensor", head, head_source, asked)
    elif head_source is not None and head_format is not None:
        logger.warning("hfquant keeps %s in float: it is tied to %s, which is not quantized", head, head_source)

    count = 0
    quantized: dict[str, StoredFormat] = {}
    for name, kind in storage.items():
        module = modules[name]
        if kind in QUANTIZED_STORAGE:
            fmt = quantized_format(kind, config, module.embedding_dim)
            if fmt is None:
                logger.info(
                    "hfquant keeps embedding %s in float: embedding_dim=%d has no group size",
                    name,
                    module.embedding_dim,
                )
                continue
            replace_with_quant_embedding(model, name, fmt, compute)
            quantized[name] = fmt
            count += 1
        elif kind != "auto" and torch_dtype(kind) != compute:
            cast_float_params(module, torch_dtype(kind))
            adapters[name] = (torch_dtype(kind), False)
    for target, source in tied.items():
        if source in quantized and target != head and embedding_kind(modules.get(target)) is not None:
            replace_with_quant_embedding(model, target, quantized[source], compute, persistent=False)
            ties.append((target, source))
        elif source in adapters and target != head and target in modules:
            adapters[target] = adapters[source]

    if head is not None and head_source in quantized:
        replace_tied_quant_linear(model, head, quantized[head_source], compute)
        ties.append((head, head_source))
        count += 1
    elif head is not None and head_source in adapters:
        adapters[head] = (adapters[head_source][0], True)
    elif head is not None and head_source is None and head_format and not matches_module(head, user_skip):
        module = modules[head]
        fmt = quantized_format(head_format, config, module.in_features)
        if fmt is None:
            logger.info("hfquant keeps %s in float: in_features=%d has no group size", head, module.in_features)
        else:
            plan = LayerPlan(head, module.in_features, module.out_features, fmt, "", False)
            count += replace_with_quant_linear(model, [plan], compute)
    # transformers must not tie (nor mark as initialized) what now lives in buffers: the ties are ours
    tied_now = {target for target, _ in ties}
    if tied_now and hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {
            t: s for t, s in model.all_tied_weights_keys.items() if t.rpartition(".")[0] not in tied_now
        }
    return count


def output_embeddings(model: nn.Module) -> nn.Linear | None:
    """The model's output embedding (lm_head) when it is an `nn.Linear`, else None."""
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Linear) else None


def module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    """The dotted name of `module` in `model`, or None."""
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)
