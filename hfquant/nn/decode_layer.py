"""A whole decoder layer's eager one-token decode step in one operator call: for a Llama-family layer whose seven
projections are block formats (the 4-bit default IQ4_XS / IQ4_NL, bits=3.5's HQ3_R and k-quants, imported GGUF
types), `hfquant_cpu.decode_layer_row` (csrc/torch_ops.cpp) runs the input RMSNorm, the q/k/v group's block GEMV,
the rotary embedding, cache write and attention, o_proj, the residual add and post-attention RMSNorm, the gate/up
group's GEMV, SiLU * up, down_proj and the last residual add: the C functions `hfquant.nn.row_decode`'s forwards call
one operator at a time, in the same order on the same bytes, so the output row is theirs bit for bit.

Why: on SmolLM2-135M (30 layers, 4-bit default, one thread, Zen 3) the eager decode step took 20.6 ms of CPU, the C
kernels about half; the rest was Python around them: about ten module and operator calls a layer, each paying
nn.Module's call checks or the dispatcher's argument parsing, and the decode group's and the layer's per-call
checks (py-spy: 78.8% of the step in `RowDecodeLayer.forward`, kernels 40%; issue #32, docs/performance.md,
nineteenth session). Here a layer's step is one operator call with its weights, types and sizes given as one
argument list built once per layer (`LayerCall`), and a few checks per step.

What is checked per step (`LayerCall.step`), and what is trusted to the cached argument list:
- Checked every step, as the forwards it stands for check them: the input row (one contiguous bfloat16 CPU row of
  the hidden size, no gradient to record: `row_decode._one_row`, by the caller), no attention mask, no attention
  weights asked for, the position embeddings (head_dim contiguous bfloat16 values each), the cache (a plain dynamic
  cache's layer with room for one more position: `decode_cache.takes_row_cache`, `step_buffers`), no global hooks, no
  norm weight requiring a gradient while grad mode is on, the norm weights bfloat16 (a `.data` swap changes a
  Parameter's dtype without replacing it).
- Checked every step by identity against what the list was built from (`LayerCall.holds`, a few C-level `map`s):
  each submodule in its parent's `_modules` (a LoRA adapter, peft or `hfquant.peft`, replaces the projection; a
  dequantized model has `nn.Linear`s there); each projection's bound GEMV `_row` (a new closure whenever its plan is
  set: `prepare_kernel`, `decode_activations`, `load_state_dict`, `_apply` / `.to()`, unpickling), its `weight` buffer
  (an offloading hook swaps it; a group dissolved and built again gives its members new views), its `bias` (None), its
  `_fused` group and that group's `_parts`; each norm's `weight` Parameter and `variance_epsilon`; the attention's
  `training` flag, `head_dim`, `scaling`, `layer_idx`, its `sliding_window` and the config's (`sliding_window`,
  `_attn_implementation_internal`: `set_attn_implementation` or `attn_implementation="sdpa"`); `_compiled_call_impl`
  and an instance `forward` (an offloading hook) of the eleven modules the layer calls; the four modules' classes
  (`restore_rms_norms`, `restore_row_decode`); and that their hook dicts are empty (`register_forward_hook` and the
  like add to these dicts, which nn.Module never replaces).
- Trusted to the list (read when it is built, none of them changes while the objects above stay the same): the
  projections' GGUF types and widths (fixed by the plan their `_row` was bound for), the norms' and attention's
  sizes, the group's members and order. When any identity check fails the list is built again (or found
  ineligible, and that is cached the same way, so a layer that does not qualify costs one identity check a step).

Layers that do not qualify keep `row_decode`'s path unchanged: other projections (int4, int8, float), a bias, hooks,
a mask (batches with padding), sliding windows, other caches (static, quantized, offloaded), gradients, training mode.

Compiled graphs (`hfquant.compile_decoding`: transformers' static cache, torch.compile): `graph_step`, called while
the graph is traced, puts one `hfquant_cpu.decode_layer_static` call in it per qualifying layer: the same C body over
the static cache layer's buffers, the position read at run time from the layer's `cumulative_length` tensor (and
advanced by the operator, as `StaticLayer.update` advances it), the step's bool mask read as the graph's attention
reads it (`attention_row_masked`: its true prefix, positions 0..position at batch 1 without padding, where the output
is `decode_layer_row`'s bit for bit; any other pattern PyTorch's SDPA with the mask). Eligibility is `_arguments`'
rules and `LayerCall.step`'s checks, decided once per graph; prefill, batches, other masks and caches keep the traced
forwards. Why: the compiled step of SmolLM2-135M was slower than eager (0.75x vs 0.78x llama.cpp on the Zen 3, issue
#32): inductor's code around the GEMV operators and its Python wrapper cost more than eager's one call per layer.

The list lives in the layer's `__dict__` (`KEY`), not pickled or deep-copied (`row_decode._reduce_as_base` drops it:
a copy's projections bind new GEMVs) and dropped by `row_decode.restore_row_decode`.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from hfquant.nn import decode_cache, row_attention
from hfquant.nn.row_norm import RowRMSNorm
from hfquant.ops import block_layout
from hfquant.ops.gemv import RowKernel

__all__ = ["KEY", "LayerCall", "step", "graph_step", "sliding_window"]

KEY = "_hfquant_layer_call"
"""The layer's `__dict__` entry holding its `LayerCall`."""

PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
"""The projections a layer's step reads, by parent."""

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_DECODE_LAYER_ROW = None
"""`torch.ops.hfquant_cpu.decode_layer_row.default`, set by `row_decode.use_row_decode` (None: never the one call)."""

_DECODE_LAYER_STATIC = None
"""`torch.ops.hfquant_cpu.decode_layer_static.default` (compiled graphs over a static cache), set with
`_DECODE_LAYER_ROW`."""


def sliding_window(module: nn.Module):
    """The attention's sliding window (Qwen2: the module's; Mistral: the config's; Llama: none)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def _global_hooks() -> bool:
    return bool(
        _module_hooks._global_forward_hooks
        or _module_hooks._global_forward_pre_hooks
        or _module_hooks._global_backward_hooks
        or _module_hooks._global_backward_pre_hooks
    )


class LayerCall:
    """A decoder layer's cached argument list for `hfquant_cpu.decode_layer_row` (`args`; None when the layer does not
    qualify) and what it was built from (see the module docstring)."""

    __slots__ = (
        "args",
        "_dicts",
        "_keys",
        "_expected",
        "_hook_dicts",
        "_typed",
        "_types",
        "_norm_weights",
        "_layer_idx",
        "_kv_heads",
        "_head_dim",
    )

    def __init__(self, layer: nn.Module):
        self.args = None
        checks: list[tuple[dict, str, object]] = []
        modules = _modules_of(layer, checks)
        self._dicts = tuple(d for d, _, _ in checks)
        self._keys = tuple(k for _, k, _ in checks)
        self._expected = tuple(v for _, _, v in checks)
        self._hook_dicts = tuple(getattr(m, name) for m in modules.values() for name in _HOOK_DICTS)
        typed = tuple(
            modules.get(name) for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
        )
        self._typed, self._types = typed, tuple(map(type, typed))
        self._norm_weights = ()
        self.args = _arguments(layer, modules)
        if self.args is not None:
            attn = modules["self_attn"]
            self._norm_weights = (self.args[0][0], self.args[0][1])
            self._layer_idx, self._head_dim = attn.layer_idx, attn.head_dim
            self._kv_heads = modules["k_proj"].out_features // attn.head_dim

    def holds(self) -> bool:
        """Whether every object the list was built from is still in place (identity; hooks are checked by `step`)."""
        return (
            all(map(operator.is_, map(dict.get, self._dicts, self._keys), self._expected))
            and tuple(map(type, self._typed)) == self._types
        )

    def step(self, hidden_states: torch.Tensor, position_embeddings, cache, kwargs) -> torch.Tensor | None:
        """The layer's output row for one decode row `hidden_states` (checked by the caller: `row_decode._one_row`,
        contiguous), or None where a per-step check fails (the caller takes the forwards' path; nothing written)."""
        input_weight, post_weight = self._norm_weights
        if (
            position_embeddings is None
            or kwargs.get("output_attentions", False)
            or _global_hooks()
            or any(map(len, self._hook_dicts))
            or input_weight.dtype is not torch.bfloat16
            or post_weight.dtype is not torch.bfloat16
            or (torch.is_grad_enabled() and (input_weight.requires_grad or post_weight.requires_grad))
        ):
            return None
        cos, sin = position_embeddings
        head_dim = self._head_dim
        if not (
            cos.dtype is torch.bfloat16
            and sin.dtype is torch.bfloat16
            and cos.numel() == head_dim
            and sin.numel() == head_dim
            and cos.is_contiguous()
            and sin.is_contiguous()
            and decode_cache.takes_row_cache(cache, self._layer_idx)
        ):
            return None
        buffers = decode_cache.step_buffers(cache, self._layer_idx, self._kv_heads, head_dim, hidden_states)
        if buffers is None:
            return None
        cache_layer, key_buffer, value_buffer, position = buffers
        weights, ints, floats = self.args
        output = _DECODE_LAYER_ROW(hidden_states, cos, sin, key_buffer, value_buffer, position, weights, ints, floats)
        decode_cache.wrote(cache_layer, position)
        return output


def step(layer: nn.Module, hidden_states: torch.Tensor, position_embeddings, cache, kwargs) -> torch.Tensor | None:
    """`layer`'s decode step in one operator call (`LayerCall.step`), its argument list built or rebuilt when needed;
    None where the layer does not qualify or a per-step check fails."""
    if _DECODE_LAYER_ROW is None:
        return None
    call = layer.__dict__.get(KEY)
    if call is None or not call.holds():
        call = layer.__dict__[KEY] = LayerCall(layer)
    if call.args is None:
        return None
    return call.step(hidden_states, position_embeddings, cache, kwargs)


def graph_step(
    layer: nn.Module, hidden_states: torch.Tensor, attention_mask, position_embeddings, cache, kwargs
) -> torch.Tensor | None:
    """While torch.compile traces a decode step (`hfquant.compile_decoding`): `layer`'s step as one
    `hfquant_cpu.decode_layer_static` call in the graph over its static cache layer (`decode_cache.static_buffers`),
    or None where it does not qualify (the caller traces the forwards). Decided at trace time by `_arguments`, the
    eager op's rules, and the per-step checks of `LayerCall.step` that a graph fixes (dtypes, shapes, hooks, grad
    mode); the input one bfloat16 CPU row (1, 1, hidden): prefill and batches keep the forwards; the mask None or the
    static cache's bool (1, 1, 1, capacity) mask, read by the operator at run time (its true prefix, as the graph's
    attention reads it: `row_attention`). Nothing is cached on the layer: the graph is the cache, and
    `compile_decoding`'s per-call check (`module_state`) compiles again when a module changes. Of the layer's tensors
    only those the call reads are read here (the norms', o_proj's and down_proj's weights, the groups' `_parts`, the
    cache's): each tensor read while tracing is a guard checked at every step (`_views_in_place`)."""
    if _DECODE_LAYER_STATIC is None or _global_hooks() or kwargs.get("output_attentions", False):
        return None
    hidden = getattr(layer, "hidden_size", None)
    if not (
        hidden_states.dtype == torch.bfloat16
        and hidden_states.device.type == "cpu"
        and hidden_states.dim() == 3
        and hidden_states.numel() == hidden
        and not (torch.is_grad_enabled() and hidden_states.requires_grad)
        and position_embeddings is not None
    ):
        return None
    modules = _modules_of(layer)
    if any(len(getattr(module, name)) for module in modules.values() for name in _HOOK_DICTS):
        return None
    arguments = _arguments(layer, modules)
    if arguments is None:
        return None
    weights, ints, floats = arguments
    if torch.is_grad_enabled() and (weights[0].requires_grad or weights[1].requires_grad):
        return None
    attn = modules["self_attn"]
    head_dim = attn.head_dim
    buffers = decode_cache.static_buffers(cache, attn.layer_idx, modules["k_proj"].out_features // head_dim, head_dim)
    cos, sin = position_embeddings
    if buffers is None or not (
        cos.dtype == sin.dtype == torch.bfloat16 and cos.numel() == head_dim and sin.numel() == head_dim
    ):
        return None
    keys, values, length = buffers
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.device.type == "cpu"
        and tuple(attention_mask.shape) == (1, 1, 1, keys.shape[2])
    ):
        return None
    return _DECODE_LAYER_STATIC(
        hidden_states.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        keys,
        values,
        length,
        attention_mask,
        weights,
        ints,
        floats,
    )


def _modules_of(layer: nn.Module, checks: list | None = None) -> dict[str, nn.Module]:
    """The modules a layer's step calls, by name (the layer's four children and the projections, those present),
    appending to `checks` the (dict, key, object) identities the list depends on (see the module docstring). Without
    `checks` (`graph_step`, while a graph is traced) nothing else is read: a projection's `weight` read here would be
    a tensor guard of the graph though the graph does not use it (a group member's)."""
    found: dict[str, nn.Module] = {}
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
        child = layer._modules.get(name)
        if child is not None:
            found[name] = child
        if checks is not None:
            checks.append((layer._modules, name, child))
    for parent_name, names in PROJECTIONS:
        parent = found.get(parent_name)
        if parent is None:
            continue
        for name in names:
            child = parent._modules.get(name)
            if child is not None:
                found[name] = child
            if checks is not None:
                checks.append((parent._modules, name, child))
    if checks is not None:
        _identities(found, checks)
    return found


def _identities(found: dict[str, nn.Module], checks: list) -> None:
    """Appends to `checks` the identities of `LayerCall`'s list held in the modules `found` (see the module
    docstring)."""
    for name, module in found.items():
        state = module.__dict__
        keys = ["_compiled_call_impl", "forward"]
        if name.endswith("_proj"):
            keys += ["_row", "_fused"]
            checks.append((module._buffers, "weight", module._buffers.get("weight")))
            checks.append((module._parameters, "bias", module._parameters.get("bias")))
            group = state.get("_fused")
            if group is not None:
                checks.append((group.__dict__, "_parts", group.__dict__.get("_parts")))
        elif name.endswith("layernorm"):
            keys += ["variance_epsilon"]
            checks.append((module._parameters, "weight", module._parameters.get("weight")))
        elif name == "self_attn":
            keys += ["training", "head_dim", "scaling", "layer_idx", "sliding_window"]
            config = state.get("config")
            if config is not None:
                for key in ("_attn_implementation_internal", "sliding_window"):
                    checks.append((config.__dict__, key, config.__dict__.get(key)))
        checks.extend((state, key, state.get(key)) for key in keys)


def _arguments(layer: nn.Module, modules: dict[str, nn.Module]):
    """(weights, ints, floats) of `hfquant_cpu.decode_layer_row` for the layer, or None when it does not qualify:
    every projection a `QuantLinear`-like layer bound to the block GEMV (`_row`, `RowKernel.BLOCK_GEMV`) on the CPU
    without a bias, q/k/v and gate/up each exactly one built decode group (gate and up of one width), o_proj and
    down_proj outside any, both norms `RowRMSNorm`s with bfloat16 CPU weights of the hidden size, the attention in
    eval mode, hfquant's, without a sliding window and with a head size the kernel takes."""
    if _DECODE_LAYER_ROW is None or len(modules) != 11:
        return None
    if any(m._compiled_call_impl is not None or "forward" in m.__dict__ for m in modules.values()):
        return None  # a compiled call or an instance forward (offloading) runs more than the module's forward
    attn, norms = modules["self_attn"], (modules["input_layernorm"], modules["post_attention_layernorm"])
    hidden = getattr(layer, "hidden_size", None)
    if (
        attn.training
        or attn.config._attn_implementation != row_attention.ATTENTION_NAME
        or sliding_window(attn) is not None
        or not isinstance(getattr(attn, "head_dim", None), int)
        or attn.head_dim > row_attention.MAX_HEAD_SIZE
        or not all(_row_norm(norm, hidden) for norm in norms)
    ):
        return None
    projections = [modules[name] for _, names in PROJECTIONS for name in names]
    if not all(_block_row(projection) for projection in projections):
        return None
    q, k, v, o, gate, up, down = projections
    qkv, gate_up = _group_parts(q, k, v), _group_parts(gate, up)
    if qkv is None or gate_up is None or gate.out_features != up.out_features:
        return None
    if o._fused is not None or down._fused is not None:
        return None
    if not (_block_weight(o._buffers.get("weight")) and _block_weight(down._buffers.get("weight"))):
        return None
    if not (
        q.in_features == gate.in_features == hidden == o.out_features == down.out_features
        and o.in_features == attn.config.num_attention_heads * attn.head_dim
        and down.in_features == gate.out_features
        and q.out_features == attn.config.num_attention_heads * attn.head_dim
        and k.out_features == v.out_features
        and k.out_features % attn.head_dim == 0
    ):
        return None
    weights = [norms[0]._parameters["weight"], norms[1]._parameters["weight"], o._buffers["weight"]]
    weights += [down._buffers["weight"], *qkv[0], *gate_up[0]]
    ints = [len(qkv[0]), len(gate_up[0]), _ggml_type(o), _ggml_type(down), *qkv[1], *gate_up[1]]
    floats = [float(norms[0].variance_epsilon), float(norms[1].variance_epsilon), float(attn.scaling)]
    return weights, ints, floats


def _row_norm(norm: nn.Module, hidden) -> bool:
    """Whether `norm` runs `RowRMSNorm`'s kernel on a decode row: its class swapped, a bfloat16 CPU weight of the
    hidden size."""
    weight = norm._parameters.get("weight")
    return (
        isinstance(norm, RowRMSNorm)
        and weight is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 1
        and weight.shape[0] == hidden
        and weight.is_contiguous()
        and isinstance(getattr(norm, "variance_epsilon", None), float)
    )


def _block_row(layer: nn.Module) -> bool:
    """Whether a decode row's call of `layer` is its bound block GEMV alone (`QuantLinear.forward`'s first branch):
    `_row` bound for `RowKernel.BLOCK_GEMV`, no bias. Its weight is not read here: the caller checks the weights the
    call reads (`_block_weight`: o_proj's and down_proj's own, a group's `_parts`), so that a graph traced through
    this has tensor guards on those alone (`graph_step`)."""
    plan = getattr(layer, "plan", None)
    return (
        layer.__dict__.get("_row") is not None
        and plan is not None
        and plan.row is RowKernel.BLOCK_GEMV
        and bool(plan.block)
        and layer._parameters.get("bias") is None
    )


def _block_weight(weight) -> bool:
    """Whether `weight` is what the block GEMV reads: a contiguous uint8 CPU tensor."""
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype == torch.uint8
        and weight.device.type == "cpu"
        and weight.is_contiguous()
    )


def _ggml_type(layer: nn.Module) -> int:
    plan = layer.plan
    return block_layout.kernel_type(plan.block, plan.block_rows)


def _group_parts(*members: nn.Module):
    """(the weights, their GGUF types) of the one C call of the built decode group whose members are exactly
    `members`, in order (what `DecodeGroup.row` calls), or None: also None where a member's weight is no longer its
    view of the group's tensor (`_views_in_place`) or a part is not what the block GEMV reads."""
    group = members[0]._fused
    if group is None or group.members != list(members) or not group._parts:
        return None
    if any(member._fused is not group for member in members):
        return None
    if not _views_in_place(group) or not all(_block_weight(part) for part in group._parts):
        return None
    return list(group._parts), list(group._types)


@torch.compiler.assume_constant_result
def _views_in_place(group) -> bool:
    """Whether each member of the decode `group` still has its rows of the group's tensor as its `weight` (what
    `DecodeGroup._views_hold` checks before the group's C call computes the members' rows; an offloading hook or a
    re-plan replaces a member's weight). While a graph is traced (`graph_step`) torch.compile runs this as it is and
    keeps its answer as a constant of the graph: the members' weights it reads, which the graph does not read (it
    reads the group's `_parts`), get no tensor guards, five a layer checked at every compiled step
    (docs/performance.md, twenty-first session). A weight swapped after the trace is seen by `compile_decoding`'s
    per-call check (`module_state`: the identities in each module's `_buffers`), which compiles again; a tensor guard
    saw it only where the new weight's shape, dtype or strides differed. False for a group not built (no views)."""
    views = group._views
    return len(views) == len(group.members) and all(
        layer._buffers.get("weight") is view for layer, view in zip(group.members, views, strict=True)
    )
