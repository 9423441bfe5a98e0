"""One-token decode forwards for Llama-family layers: the attention, MLP and decoder-layer modules of known
transformers classes compute a batch-1, one-token, bfloat16 CPU decode step with hfquant's row kernels
(`csrc/decode_rows_cpu.c`) in place of transformers' small torch ops; everything else runs transformers' forward.

Why: at batch-1 decode the step's arithmetic outside the GEMVs is tiny, but each torch op pays a dispatch and an
allocation, and inside a step the weight stream evicts the caches between layers (each small op costs 3-13x its hot
time there): on the 1.2B random Llama the eager step's non-GEMV work was 5-6 ms of 26-28 (16 layers), on
SmolLM2-135M (30 layers) more than half of the step (docs/performance.md, issue #32, thirteenth session).

What each forward does on a decode step (one row: hidden_states (1, 1, hidden) bfloat16 on CPU; grad off or nothing
requiring it; not while torch.compile traces, where inductor fuses these ops itself):
- attention (`ROW_ATTENTION_CLASSES`): q/k/v from their fused group's one GEMV (`DecodeGroup.row`, the bytes
  each layer's call gives; each layer called in turn where they are not one plain group); then, on a plain dynamic
  cache without a mask, the rotary embedding, the cache write and the attention in one call
  (`decode_cache.decode_attention`: the layer's keys and values in a buffer with room to grow, no `torch.cat`);
  otherwise the rotary embedding of q and k in one call (`hfquant_cpu.rotary_row`: transformers'
  `apply_rotary_pos_emb` bit for bit), the cache's own `update` (transformers' code, unchanged), then the row
  attention kernel (`row_attention`: without a mask its operator, else `row_attention_forward`); then o_proj. Only
  while the model's attention is hfquant's (`row_attention.ATTENTION_NAME`, set by `use_row_attention`) and the
  module is in eval mode: a model given `attn_implementation` at load ("sdpa", "eager", ...) keeps transformers'
  forward, so does a layer with a sliding window.
- MLP (`ROW_MLP_CLASSES`, act_fn SiLU): gate and up from their group's GEMV (as q/k/v), then SiLU(gate) * up in one
  call (`hfquant_cpu.silu_mul_halves_row` on the group's unsplit row, else `silu_mul_row` on the two: torch's
  bfloat16 arithmetic, its exp not reproduced: about one output in 10^4 differs by one bfloat16 step), then
  down_proj.
- decoder layer (`ROW_LAYER_CLASSES`): where every projection is a block format bound to the block GEMV, in decode
  groups, without hooks, on a plain dynamic cache without a mask, the whole step in one operator call
  (`hfquant.nn.decode_layer`: the kernels below in C, in the same order, bit for bit; its argument list cached on the
  layer and checked by identity each step; while torch.compile traces over a static cache, one
  `hfquant_cpu.decode_layer_static` call in the graph: `decode_layer.graph_step`); else the residual add after
  attention and the post-attention RMSNorm in one call (`hfquant_cpu.add_rms_norm_row`: bit for bit), when that norm
  has hfquant's row kernel (`row_norm.RowRMSNorm`) and no hooks, around the attention and MLP forwards.
- the list of decoder layers (an `nn.ModuleList` holding them, `RowDecodeLayers`): the model's forward slices it every
  step (`self.layers[: config.num_hidden_layers]`), and nn.ModuleList builds the slice through `add_module`'s checks,
  one layer at a time (100-200 us for SmolLM2's 30 layers on the machine of docs/performance.md's fourteenth
  session); its slice is the same new `nn.ModuleList` (the same layers under the same names "0", "1", ...), filled
  at once.
Submodules without hooks (their own or global ones) are called through their `forward`, skipping nn.Module's call
machinery (a few microseconds a call, about ten calls a layer); a module with hooks is called as usual.

How it is installed: as `row_norm` does, the class of each module is swapped in place for a subclass with the forward
above (`use_row_decode`; `restore_row_decode` swaps back): parameters, state dict, hooks and `save_pretrained` see no
change. A pickled module (`torch.save(model)`, `copy.deepcopy`) is rebuilt with the decode forward and its
projections' decode groups where hfquant's operators load, else as its own transformers class (`_restore`). hfquant's
quantizer installs it after loading with the row attention; `model.dequantize()` restores the classes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules import module as _module_hooks

from hfquant.nn import decode_cache, decode_layer, row_attention
from hfquant.nn.fused import link_decode_groups
from hfquant.nn.linear import QuantLinear
from hfquant.nn.row_norm import RowRMSNorm
from hfquant.ops import torch_ops

__all__ = [
    "ROW_ATTENTION_CLASSES",
    "ROW_MLP_CLASSES",
    "ROW_LAYER_CLASSES",
    "RowDecodeAttention",
    "RowDecodeMLP",
    "RowDecodeLayer",
    "RowDecodeLayers",
    "use_row_decode",
    "restore_row_decode",
]

ROW_ATTENTION_CLASSES = frozenset({"LlamaAttention", "MistralAttention", "Qwen2Attention"})
"""transformers classes (5.24) whose forward is LlamaAttention's (read in their source; Mistral and Qwen2 add a
sliding window, which keeps their forward), with `head_dim`, `layer_idx`, `scaling` and q/k/v/o projections."""

ROW_MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP"})
"""transformers classes whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`."""

ROW_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
"""transformers classes whose forward is LlamaDecoderLayer's (pre-norm, two residual adds)."""

_ROTARY_ROW = None
_SILU_MUL_ROW = None
_SILU_MUL_HALVES_ROW = None
_ADD_RMS_NORM_ROW = None
"""The `torch.ops.hfquant_cpu` operators' `.default`, set by `_operators` (looked up once)."""


def _operators() -> bool:
    """Whether hfquant's operators are loaded (`torch_ops.loaded()`); the forwards' operators set when they are."""
    global _ROTARY_ROW, _SILU_MUL_ROW, _SILU_MUL_HALVES_ROW, _ADD_RMS_NORM_ROW
    if not torch_ops.loaded():
        return False
    _ROTARY_ROW = torch.ops.hfquant_cpu.rotary_row.default
    _SILU_MUL_ROW = torch.ops.hfquant_cpu.silu_mul_row.default
    _SILU_MUL_HALVES_ROW = torch.ops.hfquant_cpu.silu_mul_halves_row.default
    _ADD_RMS_NORM_ROW = torch.ops.hfquant_cpu.add_rms_norm_row.default
    decode_layer._DECODE_LAYER_ROW = torch.ops.hfquant_cpu.decode_layer_row.default
    decode_layer._DECODE_LAYER_STATIC = torch.ops.hfquant_cpu.decode_layer_static.default
    return True


def _one_row(hidden_states: torch.Tensor, size: int) -> bool:
    """Whether `hidden_states` is a decode step's one bfloat16 CPU row of `size` values, outside torch.compile and
    with nothing to record for autograd."""
    return (
        not torch.compiler.is_compiling()
        and hidden_states.dtype == torch.bfloat16
        and hidden_states.numel() == size
        and hidden_states.dim() == 3
        and hidden_states.device.type == "cpu"
        and not (torch.is_grad_enabled() and hidden_states.requires_grad)
    )


class RowDecodeAttention:
    """Mixin placed before an attention class of `ROW_ATTENTION_CLASSES` (see the module docstring)."""

    _windowed = True  # the class may have a sliding window (LlamaAttention has none: `_row_class` sets False)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if not (
            self.config._attn_implementation == row_attention.ATTENTION_NAME
            and not self.training
            and _one_row(hidden_states, hidden_states.shape[-1])
            and position_embeddings is not None
            and position_embeddings[0].dtype == torch.bfloat16
            and position_embeddings[0].numel() == self.head_dim
            and position_embeddings[0].is_contiguous()
            and position_embeddings[1].is_contiguous()
            and not (self._windowed and decode_layer.sliding_window(self) is not None)
        ):
            return super().forward(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                **kwargs,
            )
        return self._decode_step(hidden_states, position_embeddings, attention_mask, cache, kwargs)

    def _decode_step(self, hidden_states, position_embeddings, attention_mask, cache, kwargs):
        head_dim = self.head_dim
        modules = self._modules  # not through nn.Module.__getattr__, about a microsecond a lookup
        projections = modules["q_proj"], modules["k_proj"], modules["v_proj"]
        cos, sin = position_embeddings
        group = _group(hidden_states, *projections)
        row = None if group is None else group.row(hidden_states)
        if row is not None:
            output = self._cached_step(row, cos, sin, attention_mask, cache, kwargs)
            if output is not None:
                return _call(modules["o_proj"], output), None
            qkv = row.split_with_sizes(group.sizes, -1)
        else:
            qkv = tuple(projection(hidden_states) for projection in projections)
        query, key, value = qkv
        value = value.view(1, 1, -1, head_dim).transpose(1, 2)
        if query.requires_grad or key.requires_grad or not (query.is_contiguous() and key.is_contiguous()):
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            query, key = apply_rotary_pos_emb(
                query.view(1, 1, -1, head_dim).transpose(1, 2), key.view(1, 1, -1, head_dim).transpose(1, 2), cos, sin
            )
        else:
            query, key = _ROTARY_ROW(query, key, cos, sin, head_dim)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        if attention_mask is None and _plain_kv(key, value) and not kwargs.get("output_attentions", False):
            output = row_attention._ATTENTION_ROW(query, key, value, self.scaling)  # row_attention_forward's call
        else:
            output, _ = row_attention.row_attention_forward(
                self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
            )
        return _call(modules["o_proj"], output.view(1, 1, -1)), None

    def _cached_step(self, qkv, cos, sin, attention_mask, cache, kwargs):
        """The rotary embedding, cache write and attention in one call (`decode_cache.decode_attention`) of the q/k/v
        group's one output row `qkv` when the cache is a plain dynamic one, there is no mask and no attention weights
        are asked for; else None."""
        if (
            attention_mask is not None
            or kwargs.get("output_attentions", False)
            or not decode_cache.takes_row_cache(cache, self.layer_idx)
            or qkv.requires_grad
            or not qkv.is_contiguous()
            or self.head_dim > row_attention.MAX_HEAD_SIZE
        ):
            return None
        kv_heads = self._modules["k_proj"].out_features // self.head_dim
        return decode_cache.decode_attention(
            cache, self.layer_idx, qkv, cos, sin, kv_heads, self.head_dim, self.scaling
        )

    def __reduce_ex__(self, protocol: int):
        return _reduce_as_base(self, protocol)

    def __setstate__(self, state):
        _restore(self, state)


class RowDecodeMLP:
    """Mixin placed before an MLP class of `ROW_MLP_CLASSES` (see the module docstring)."""

    def forward(self, x):
        if not _one_row(x, self.hidden_size):
            return super().forward(x)
        modules = self._modules
        gate_proj, up_proj = modules["gate_proj"], modules["up_proj"]
        group = _group(x, gate_proj, up_proj)
        row = None if group is None else group.row(x)
        if row is not None and row.is_contiguous() and group.sizes[0] == group.sizes[1]:
            return _call(modules["down_proj"], _SILU_MUL_HALVES_ROW(row))  # (1, 1, intermediate): no split, no view
        gate, up = (gate_proj(x), up_proj(x)) if row is None else row.split_with_sizes(group.sizes, -1)
        if (
            gate.requires_grad
            or up.requires_grad
            or gate.shape != up.shape
            or gate.stride(-1) != 1
            or up.stride(-1) != 1
        ):
            y = self.down_proj(self.act_fn(gate) * up)
        else:
            y = _call(modules["down_proj"], _SILU_MUL_ROW(gate, up))
        return y if y.dim() == x.dim() else y.view(x.shape)  # the group's products are (1, N) rows

    def __reduce_ex__(self, protocol: int):
        return _reduce_as_base(self, protocol)

    def __setstate__(self, state):
        _restore(self, state)


class RowDecodeLayer:
    """Mixin placed before a decoder layer class of `ROW_LAYER_CLASSES` (see the module docstring)."""

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        if torch.compiler.is_compiling():
            output = decode_layer.graph_step(self, hidden_states, attention_mask, position_embeddings, cache, kwargs)
            if output is not None:
                return output
        one_row = _one_row(hidden_states, self.hidden_size) and hidden_states.is_contiguous()
        if one_row and attention_mask is None and decode_layer._DECODE_LAYER_ROW is not None:
            output = decode_layer.step(self, hidden_states, position_embeddings, cache, kwargs)
            if output is not None:
                return output
        modules = self._modules
        norm = modules["post_attention_layernorm"]
        if not (one_row and _plain_row_norm(norm)):
            return super().forward(
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        residual = hidden_states
        hidden_states = _call(modules["input_layernorm"], hidden_states)
        hidden_states, _ = _call_keywords(
            modules["self_attn"],
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if hidden_states.requires_grad or not hidden_states.is_contiguous() or hidden_states.shape != residual.shape:
            residual = residual + hidden_states
            hidden_states = norm(residual)
        else:
            weight = norm._parameters["weight"]
            residual, hidden_states = _ADD_RMS_NORM_ROW(residual, hidden_states, weight, norm.variance_epsilon)
        return residual + _call(modules["mlp"], hidden_states)

    def __reduce_ex__(self, protocol: int):
        return _reduce_as_base(self, protocol)

    def __setstate__(self, state):
        _restore(self, state)


class RowDecodeLayers(nn.ModuleList):
    """The `nn.ModuleList` of a model's decoder layers, its slices made without `add_module`'s per-layer checks (see
    the module docstring): a slice is a new plain `nn.ModuleList` of the same layers named "0", "1", ..., as
    nn.ModuleList's own; with global module registration hooks (`register_module_module_registration_hook`) it is
    nn.ModuleList's slice, hooks called."""

    def __getitem__(self, idx):
        if not isinstance(idx, slice) or _module_hooks._global_module_registration_hooks:
            return super().__getitem__(idx)
        layers = list(self._modules.values())[idx]
        sliced = nn.ModuleList()
        sliced._modules.update({str(i): layer for i, layer in enumerate(layers)})
        return sliced


def _layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The plain `nn.ModuleList`s of `model` holding decoder layers of `ROW_LAYER_CLASSES` only."""
    return [
        module
        for module in model.modules()
        if type(module) is nn.ModuleList
        and len(module) > 0
        and all(type(layer).__name__ in ROW_LAYER_CLASSES for layer in module._modules.values())
    ]


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` does more than its `forward`: hooks of its own or global ones (nn.Module's
    `_call_impl` runs them) or a compiled call (`module.compile()`); a forward replaced on the instance (offloading
    hooks) is called either way."""
    return bool(
        module._compiled_call_impl is not None
        or module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _module_hooks._global_forward_hooks
        or _module_hooks._global_forward_pre_hooks
        or _module_hooks._global_backward_hooks
        or _module_hooks._global_backward_pre_hooks
    )


def _call(module: nn.Module, x: torch.Tensor):
    """`module(x)`, without nn.Module's call machinery where it has nothing to run (`_hooked`): its forward."""
    return module(x) if _hooked(module) else module.forward(x)


def _call_keywords(module: nn.Module, **kwargs):
    """`module(**kwargs)`, as `_call`."""
    return module(**kwargs) if _hooked(module) else module.forward(**kwargs)


def _group(x: torch.Tensor, *layers: nn.Module):
    """The fused group (`DecodeGroup`) whose one GEMV gives the outputs of `layers` for the decode row `x`, when they
    are exactly its members, in order, and calling each would run only its forward's fused path (no hooks, no bias, x
    one contiguous row of their input width); else None (the caller calls each layer). Its `row(x)` is the members'
    outputs one after the other (or None: the group dissolved), `sizes` their widths."""
    group = getattr(layers[0], "_fused", None)
    if group is None or group.members != list(layers) or x.requires_grad or not x.is_contiguous():
        return None
    for layer in layers:
        if _hooked(layer) or "forward" in layer.__dict__ or layer._parameters.get("bias") is not None:
            return None
    if x.numel() != layers[0].in_features:
        return None
    return group


def _plain_kv(key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the cache's key and value take `attention_row` as they are (`row_attention_forward`'s stride test)."""
    return (
        key.dtype == torch.bfloat16
        and key.stride(3) == 1
        and value.stride(3) == 1
        and value.stride(1) == key.stride(1)
        and value.stride(2) == key.stride(2)
        and key.shape[3] <= row_attention.MAX_HEAD_SIZE
    )


def _plain_row_norm(norm: nn.Module) -> bool:
    """Whether `norm` runs `RowRMSNorm`'s kernel when called (its class swapped, a bfloat16 CPU weight) and calling
    it is only its forward (no hooks of its own or global ones: `_hooked`; no forward replaced by an offloading hook):
    the fused add + norm may stand in. The weight is read from `_parameters` (`norm.weight` goes through
    nn.Module.__getattr__, about a microsecond a read: this check took 7 us, now under 2)."""
    if not isinstance(norm, RowRMSNorm) or _hooked(norm) or "forward" in norm.__dict__:
        return False
    weight = norm._parameters.get("weight")
    return (
        weight is not None
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and not (torch.is_grad_enabled() and weight.requires_grad)
        and weight.is_contiguous()
    )


def _reduce_as_base(module: nn.Module, protocol: int):
    """Pickled (`torch.save(model)`, `copy.deepcopy`) as `_rebuild` of the mixin and the module's own transformers
    class: the subclass is made at run time and has no importable name; `_restore` decides the copy's class."""
    _, _, *rest = super(type(module).__bases__[0], module).__reduce_ex__(protocol)
    if rest and isinstance(rest[0], dict) and decode_layer.KEY in rest[0]:
        # a layer's cached call (`decode_layer`) holds its projections' bound GEMVs: the copy builds its own
        rest[0] = {key: value for key, value in rest[0].items() if key != decode_layer.KEY}
    return (_rebuild, type(module).__bases__, *rest)


def _rebuild(mixin: type, base: type) -> nn.Module:
    """The empty module a pickled row-decode module is rebuilt into; its state (`_restore`) decides its class."""
    return object.__new__(_row_class(mixin, base))


def _restore(module: nn.Module, state: dict) -> None:
    """Set an unpickled row-decode module's `state`; it keeps the decode forward where hfquant's operators load (a
    pickle may be loaded in another process), and its sibling projections share a decode group again (`fused`:
    `QuantLinear` does not pickle its group, whose members' parent this is). Else it is its class's own."""
    nn.Module.__setstate__(module, state)
    if not _operators():
        module.__class__ = type(module).__bases__[1]
    elif isinstance(module, (RowDecodeAttention, RowDecodeMLP)):
        link_decode_groups(module, QuantLinear)


_MIXINS = (
    (ROW_ATTENTION_CLASSES, RowDecodeAttention),
    (ROW_MLP_CLASSES, RowDecodeMLP),
    (ROW_LAYER_CLASSES, RowDecodeLayer),
)


@functools.cache
def _row_class(mixin: type, base: type) -> type:
    """The subclass of `base` with `mixin`'s forward, one per class (cached, so `type()` is stable)."""
    namespace = {"__module__": base.__module__}
    if mixin is RowDecodeAttention:
        namespace["_windowed"] = base.__name__ != "LlamaAttention"
    return type(base.__name__, (mixin, base), namespace)


def _mixin(module: nn.Module):
    """The mixin `module` takes, or None (not a known class, already swapped, or an MLP whose act_fn is not SiLU)."""
    if isinstance(module, (RowDecodeAttention, RowDecodeMLP, RowDecodeLayer)):
        return None
    name = type(module).__name__
    for names, mixin in _MIXINS:
        if name in names:
            if mixin is RowDecodeMLP and type(getattr(module, "act_fn", None)).__name__ not in (
                "SiLUActivation",
                "SiLU",
            ):
                return None
            return mixin
    return None


def use_row_decode(model: nn.Module) -> int:
    """Give every attention, MLP and decoder layer of `model` of a known Llama-family class (`ROW_ATTENTION_CLASSES`,
    `ROW_MLP_CLASSES`, `ROW_LAYER_CLASSES`) the one-token decode forward (class swap in place: see the module
    docstring), and the lists holding those decoder layers their slicing (`RowDecodeLayers`). Nothing happens where
    hfquant's operators are unavailable (`torch_ops.loaded()`). Returns the number of attention, MLP and decoder
    layer modules changed."""
    candidates = [(module, mixin) for module in model.modules() if (mixin := _mixin(module)) is not None]
    if not candidates or not _operators():
        return 0
    for module, mixin in candidates:
        module.__class__ = _row_class(mixin, type(module))
    for layers in _layer_lists(model):
        layers.__class__ = RowDecodeLayers
    return len(candidates)


def restore_row_decode(model: nn.Module) -> int:
    """Inverse of `use_row_decode`: every module given the decode forward gets its own class back. Returns the
    count."""
    changed = 0
    for module in model.modules():
        if isinstance(module, (RowDecodeAttention, RowDecodeMLP, RowDecodeLayer)):
            module.__class__ = type(module).__bases__[1]
            module.__dict__.pop(decode_layer.KEY, None)
            changed += 1
        elif type(module) is RowDecodeLayers:
            module.__class__ = nn.ModuleList
    return changed
