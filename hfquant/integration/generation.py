"""Compiled decoding without compile code: `compile_decoding(model)` sets the model's generation config so that
`model.generate(...)` runs its decode steps through `torch.compile` with a static cache, on CPU too.

transformers compiles the decode step by itself when the generation config asks for a static cache, but on CPU only
when its `CompileConfig` carries transformers' own `_compile_all_devices` switch; this module is the one place
hfquant sets it. The first `generate` call compiles (seconds to a minute, docs/performance.md); later calls reuse the
graph while the static cache keeps its length (`max_cache_len` fixes it for every call up to that length).
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

__all__ = ["compile_decoding", "keep_input_guards", "keep_tensor_guards", "module_state"]

logger = logging.getLogger(__name__)

_ATTENTIONS = ("auto", "eager", "sdpa")


def keep_tensor_guards(guard_entries) -> list[bool]:
    """A `torch.compile` `guard_filter_fn`: keep every guard not sourced inside an nn.Module, and of those inside one
    only the tensor guards (TENSOR_MATCH: dtype, device, shape, strides of each parameter and buffer); drop the
    guards on module attributes (their ids, types, Python values such as `training`, hook dicts). Why: with a
    quantized model's hundreds of modules those are most of a compiled decode step's guard checks, about 1 ms of
    SmolLM2-135M's 9 ms step on one thread (docs/performance.md, issue #32, fourteenth session). Unsafe as torch's own
    `torch.compiler.skip_guard_on_all_nn_modules_unsafe` (which drops the tensor guards too): a module attribute
    changed after the first compiled call is not noticed. `compile_decoding`'s filter until `keep_input_guards`."""
    return [
        not entry.orig_guard.source.is_unspecialized_nn_module() or entry.guard_type == "TENSOR_MATCH"
        for entry in guard_entries
    ]


def keep_input_guards(guard_entries) -> list[bool]:
    """A `torch.compile` `guard_filter_fn`: keep every guard not sourced inside an nn.Module (the step's inputs, its
    cache's tensors and objects, globals) and drop those inside one, its tensors' guards too (as torch's
    `torch.compiler.skip_guard_on_all_nn_modules_unsafe`). `compile_decoding`'s default: the module tensors' guards
    `keep_tensor_guards` keeps were 184 of a compiled SmolLM2 step's 277 tensor guards (six weights a layer; the
    cache's three a layer are inputs, kept), each a dtype / shape / strides check and five attribute look-ups at
    every step; what they saw, an in-place change of a weight's dtype, device, shape, strides, offset or
    `requires_grad` (a `.data` swap keeps the tensor), `module_state` records instead, checked once per `generate`
    call (docs/performance.md, twenty-first session). Not seen: such a change inside one `generate` call."""
    return [not entry.orig_guard.source.is_unspecialized_nn_module() for entry in guard_entries]


_NOT_STATE = frozenset({"_compiled_call", "_last_compile_config", "_cache", "get_compiled_call"})
"""Model attributes that are not module state: transformers' compiled call and its config, the static cache it keeps
between `generate` calls, and the per-call check `compile_decoding` installs."""

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


def _identity(value) -> object:
    """The identity `module_state` records of one object: its id with a weak reference to it, or the object itself
    where it takes none. An id alone can be reused: an attribute deleted, its object freed, and a new object of the
    same size assigned would often get the same id, and a snapshot of ids would call the modules unchanged. Two
    identities are equal only for the same live object (ids differ, or a dead reference compares unequal to a live
    one); the weak reference keeps nothing alive (a module swapped out by `dequantize` is freed as before)."""
    if type(value).__weakrefoffset__:
        return (id(value), weakref.ref(value))
    return (id(value), value)  # ints, strings, tuples...: held, so that their id stays theirs while the snapshot lives


def _item_state(value) -> object:
    """`_identity`, for a tensor with what a compiled graph's tensor guard checks of it: dtype, device, layout, shape,
    strides, storage offset and `requires_grad` (a `.data` swap or `requires_grad_` changes these in place, the
    identity kept)."""
    if not isinstance(value, torch.Tensor):
        return _identity(value)
    if value.layout is not torch.strided:
        return (_identity(value), value.dtype, value.device, value.layout, value.shape, value.requires_grad)
    return (
        _identity(value),
        value.dtype,
        value.device,
        value.shape,
        value.stride(),
        value.storage_offset(),
        value.requires_grad,
    )


def _value_state(value, configs: dict) -> object:
    """What `module_state` records of one module attribute: a dict (hooks, parameters, buffers, submodules) its keys
    and the states (`_item_state`: identities, a tensor's metadata too) of its values, a list or tuple the states of
    its items, a transformers config (`PretrainedConfig`) the identities of its attributes (recorded once per config
    in `configs`), anything else its state."""
    if isinstance(value, dict):
        return tuple((key, _item_state(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_item_state(item) for item in value)
    if type(value).__name__.endswith("Config") and hasattr(value, "to_dict") and id(value) not in configs:
        configs[id(value)] = (_identity(value), tuple((key, _identity(item)) for key, item in vars(value).items()))
    return _item_state(value)


def module_state(model: nn.Module) -> tuple:
    """A snapshot of what a compiled step's module guards check, to compare between `generate` calls: for every
    module of `model` its identity (`_identity`: an id that cannot be reused while the snapshot lives), class,
    `training` and each attribute's identity (`_value_state`: hooks, parameters, buffers and submodules by key and
    identity, other values by identity, its transformers config's attributes by identity), and
    torch's global module hooks. Equal snapshots: no module was swapped, retyped (`dequantize`, class swaps),
    switched to training, hooked (adapters, offloading) or given another attribute object since, and no parameter,
    buffer or tensor attribute changed its dtype, device, shape, strides, offset or `requires_grad` in place (what
    the tensor guards `keep_input_guards` drops checked); values changed inside a non-config object are not seen (a
    decode group's `_parts` change only with its members' weights, which are seen). About 5 ms of CPU for
    SmolLM2-135M's 397 modules (docs/performance.md, sixteenth session), once per `generate` call; the garbage
    collector is paused while it is taken."""
    collecting = gc.isenabled()
    gc.disable()  # thousands of tuples holding weak references: the collections they trigger cost 2-4x the snapshot
    try:
        configs: dict = {}
        state = [tuple(tuple(getattr(_module_hooks, name, {})) for name in _GLOBAL_HOOKS)]
        for module in model.modules():
            attributes = tuple(
                (key, _value_state(value, configs)) for key, value in vars(module).items() if key not in _NOT_STATE
            )
            state.append((_identity(module), type(module), attributes))
        state.append(tuple(configs.items()))
        return tuple(state)
    finally:
        if collecting:
            gc.enable()


class _CheckedCompiledCall:
    """Stands in for the model's `get_compiled_call` (transformers' `generate` asks it once a call for the compiled
    forward) when `compile_decoding(module_guards=False)` dropped the step's module guards: compares `module_state`
    with the state at the last call and, where it differs (or the compile config does), compiles the forward anew
    with `torch.compile(isolate_recompiles=True)`, whose cache entries are its own: a new compiled forward never runs
    a graph traced before the change (without isolation every compiled callable of `model.__call__` shares the same
    entries, whose remaining guards pass). The previous graphs stay in torch's cache until `torch._dynamo.reset()`."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.state = None
        self.config = None

    def __call__(self, compile_config):
        model = self.model
        state = module_state(model)
        compiled = model.__dict__.get("_compiled_call")
        if compiled is None or state != self.state or compile_config != self.config:
            if self.state is not None and state != self.state:
                logger.info("compiled decoding: the model's modules changed since the last generate: compiling again")
            compiled = torch.compile(model.__call__, **compile_config.to_dict(), isolate_recompiles=True)
            model._compiled_call, model._last_compile_config = compiled, compile_config
            self.state, self.config = state, compile_config
        return compiled


def compile_decoding(
    model: nn.Module, max_cache_len: int | None = None, attention: str | None = "auto", module_guards: bool = False
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
        module_guards: False (the default) drops the compiled step's guards on module attributes and tensors
            (`keep_input_guards`; the inputs' and the cache's guards stay): about 1 ms less per SmolLM2 step for the
            attributes (docs/performance.md, issue #32), about as much again for the weights (twenty-first session).
            Instead each `generate` call compares the model's modules with the last call's (`module_state`: modules
            swapped or retyped as by `dequantize`, `train()`, hooks, adapters, attributes rebound, a tensor's dtype,
            shape or strides changed in place) and compiles again where they changed. Not seen: a change inside one
            `generate` call (from a streamer or stopping criterion), or a plain value changed inside a non-config
            object a module holds; True keeps torch's own guards, checked at every step.
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
    model.__dict__.pop("get_compiled_call", None)
    if module_guards:
        compile_config = CompileConfig(fullgraph=True, mode="default")
    else:  # torch.compile takes options or a mode, not both: no mode is the default mode
        compile_config = CompileConfig(fullgraph=True, mode=None, options={"guard_filter_fn": keep_input_guards})
        model.get_compiled_call = _CheckedCompiledCall(model)  # an instance attribute: the per-call check
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
