"""Compiled decoding without compile code: `compile_decoding(model)` sets the model's generation config so that
`model.generate(...)` runs its decode steps through `torch.compile` with a static cache, on CPU too.

transformers compiles the decode step by itself when the generation config asks for a static cache, but on CPU only
when its `CompileConfig` carries transformers' own `_compile_all_devices` switch; this module is the one place
hfquant sets it. The first `generate` call compiles (seconds to a minute, docs/performance.md); later calls reuse the
graph while the static cache keeps its length (`max_cache_len` fixes it for every call up to that length).
"""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["compile_decoding", "keep_tensor_guards"]

logger = logging.getLogger(__name__)

_ATTENTIONS = ("auto", "eager", "sdpa")


def keep_tensor_guards(guard_entries) -> list[bool]:
    """A `torch.compile` `guard_filter_fn`: keep every guard not sourced inside an nn.Module, and of those inside one
    only the tensor guards (TENSOR_MATCH: dtype, device, shape, strides of each parameter and buffer); drop the
    guards on module attributes (their ids, types, Python values such as `training`, hook dicts). Why: with a
    quantized model's hundreds of modules those are most of a compiled decode step's guard checks, about 1 ms of
    SmolLM2-135M's 9 ms step on one thread (docs/performance.md, issue #32, fourteenth session). Unsafe as torch's own
    `torch.compiler.skip_guard_on_all_nn_modules_unsafe` (which drops the tensor guards too): a module attribute
    changed after the first compiled call is not noticed."""
    return [
        not entry.orig_guard.source.is_unspecialized_nn_module() or entry.guard_type == "TENSOR_MATCH"
        for entry in guard_entries
    ]


def compile_decoding(
    model: nn.Module, max_cache_len: int | None = None, attention: str | None = "auto", module_guards: bool = True
) -> nn.Module:
    """Make `model.generate` decode through `torch.compile`: `model.generation_config` gets
    `cache_implementation="static"` and `CompileConfig(fullgraph=True, mode="default")` with compiling on every
    device (CPU included); the prefill still runs eagerly.

    Args:
        model: a transformers generative model (has `generation_config`), quantized by hfquant or not.
        max_cache_len: the static cache's length for every call (prompt plus new tokens up to it reuse one compiled
            graph); None sizes it per call, and a call needing a longer cache than any before compiles again.
        attention: the attention implementation to switch the model to: "auto" (hfquant's one-row kernel,
            `hfquant.nn.row_attention`, where hfquant's operators load: in the graph it reads only the cache positions
            written so far, where inductor's code for "eager" attention reads the whole static cache every step;
            otherwise "eager"), "eager" (inductor fuses it into the decode step, faster than PyTorch's CPU SDPA kernel
            at one query row), "sdpa", or None to keep the model's.
        module_guards: False drops the compiled step's guards on module attributes (`keep_tensor_guards`; the
            tensors' guards stay): about 1 ms less per SmolLM2 step, for a model whose modules do not change after
            the first compiled `generate` (no `dequantize`, no adapters, no `train()` between calls; call
            `torch._dynamo.reset()` after such a change).
    Returns:
        `model`, changed in place.
    Raises:
        TypeError: `model` has no `generation_config` (not a generative transformers model).
        ValueError: `max_cache_len` is not a positive int, or `attention` is not None, "auto", "eager" or "sdpa".
    """
    from transformers import CompileConfig

    config = getattr(model, "generation_config", None)
    if config is None:
        raise TypeError(f"compile_decoding needs a transformers generative model, got {type(model).__name__}")
    if max_cache_len is not None and (
        isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
    ):
        raise ValueError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
    if attention is not None and attention not in _ATTENTIONS:
        raise ValueError(f"attention must be None or one of {list(_ATTENTIONS)}, got {attention!r}")
    if attention == "auto":
        from hfquant.nn.row_attention import available_attention

        attention = available_attention() or "eager"
    if attention is not None and getattr(model.config, "_attn_implementation", None) != attention:
        model.set_attn_implementation(attention)
    if module_guards:
        compile_config = CompileConfig(fullgraph=True, mode="default")
    else:  # torch.compile takes options or a mode, not both: no mode is the default mode
        compile_config = CompileConfig(fullgraph=True, mode=None, options={"guard_filter_fn": keep_tensor_guards})
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only without it
    config.cache_implementation = "static"
    config.compile_config = compile_config
    if max_cache_len is not None:
        config.max_cache_len = max_cache_len
    logger.info(
        "compiled decoding: static cache%s, %s attention; the first generate call compiles",
        "" if max_cache_len is None else f" of {max_cache_len} positions",
        getattr(model.config, "_attn_implementation", "the model's"),
    )
    return model
