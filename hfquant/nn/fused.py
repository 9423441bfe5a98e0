"""Fused decode groups: the projections of a block that read the same input in the same int4 format or in block formats
(q/k/v, gate/up) run one GEMV per decode step instead of one each, reading `x` once, without changing the model's
classes.

Why: at batch-1 decode each `QuantLinear` call is a few microseconds of kernel on a small model, and each GEMV pays
its own dispatch, its own OpenMP region and its own output allocation (docs/performance.md). One GEMV over the
concatenated rows costs about one of these.

How, without patching transformers' attention / MLP classes: `link_decode_groups` (called by
`replace.replace_with_quant_linear` on the skeleton) makes the sibling `QuantLinear`s of one parent (`SIBLINGS`)
members of one `DecodeGroup`. Once every member's kernel is prepared with the same eager GEMV (`QuantLinear._row`;
same kernel, call, input width, group size and block type, bfloat16 (scale, zero) pairs for int4, no SINQ column
scale; block types and sizes may differ: `DecodeGroup._build_mixed`), the group builds its
compute tensors: the members' runtime weights concatenated along the output rows (the CPU int4 layout is blocked by
output rows, so the concatenation is the layout of the stacked weight) and each member's `weight` buffer replaced by its
rows of it, a view (no second copy of the codes); the (scale, zero) pairs concatenated (a new tensor: 1/16 of the
codes' bytes at group 128; each member keeps its own for its per-layer path). A block format's weight is (N, row
bytes) row-major, its scales inside the blocks: the concatenation is the stacked weight and there is no (scale, zero)
tensor. The stored layout is untouched: `state_dict()` converts each member's rows back as before (a block member's
rows are copied out of the group's tensor, which a save must not share). Prepared together (`DecodeGroup.prepare`, as a load does),
members whose plans will bind the same GEMV on the CPU are repacked straight into their rows of the group's tensor, so
that `build` finds them there and copies nothing; a group dissolved and built again reuses the tensor its members' rows
are still in (#28: concatenating after each member's own repack wrote every code byte twice, and again each time a load
re-planned a member for its decode activations).

At a decode step, whichever member is called first with an input `x` (one contiguous bfloat16 row, eager, no
gradient) runs the group's GEMV and keeps (x, its version counter, the outputs split as views); each sibling called
with that same tensor, unmodified, takes its view (under `torch.inference_mode` tensors keep no version counter:
there the same tensor object is taken as the same input). Every output row is computed by the same kernel in the same order as
in the member's own GEMV (the int4 GEMVs sum each output in one thread, in a fixed order; the block GEMV quantizes
the row to int8 the same way whatever N, then sums each output in one thread), so the fused outputs equal
the unfused ones bit for bit. In torch.compile graphs a block group whose layers call the dispatcher operators puts one
`hfquant_cpu.block_gemv_group` call in the graph for its members (`DecodeGroup.graph_product`), and an int4 group whose
members' plans call their GEMV operator in graphs too puts one call of that operator over the group's rows (the eager
group's bytes). Anything else takes each layer's own path: inputs requiring gradients, several rows, a member called
with another tensor. A group whose members keep being called with different inputs (its computed rows left unused
`MAX_MISSES` times) stops fusing; so does one whose member's weight was swapped
(offloading hooks) or re-planned (`QuantLinear.plan`, `prepare_kernel`, `load_state_dict`, `.to()`), until its members
are prepared again. A pickled or deep-copied layer leaves its group; where its parent is one of `row_decode`'s
attention / MLP classes the copied parent links its copied projections in a new group (`row_decode._restore`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from torch import nn

from hfquant.core import huge_pages
from hfquant.ops import block_layout, native
from hfquant.ops.gemv import INT4_ROWS, RowCall, RowKernel, int4_row

__all__ = ["SIBLINGS", "MAX_MISSES", "DecodeGroup", "link_decode_groups"]

logger = logging.getLogger(__name__)

SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Child names of one parent module that transformers' attention / MLP classes call with the same input tensor
(Llama, Mistral, Qwen, Gemma, SmolLM, ... and Mixtral-style `w1` / `w3`)."""

MAX_MISSES = 8
"""How many times a group may compute rows that its siblings never take (they were called with other inputs) before it
stops fusing."""


class DecodeGroup:
    """Sibling `QuantLinear`s (`members`, in `SIBLINGS` order) that compute their one-row decode products as one GEMV
    once built (see the module docstring).

    Attributes:
        members: the layers.
        weight: (sum N_i, K / 2) uint8 runtime int4 weight, or (sum N_i, row bytes) uint8 blocks, whose row slices
            are the members' `weight` buffers, or None while the group is not built.
        scale_zero: (K / group, sum N_i, 2) bfloat16 for int4, or None (a block format, or not built).
        sizes: (N_i, ...) the members' output widths.
    """

    def __init__(self, members: list[nn.Module]):
        self.members = list(members)
        self.sizes = tuple(member.out_features for member in self.members)
        self.weight = None
        self.scale_zero = None
        self.misses = 0
        self._preparing = False  # `prepare` is preparing the members: build once they all are
        self._row = None
        self._views: tuple = ()
        self._cache = None  # (x, x._version, outputs, [members yet to take theirs])
        self.in_graphs = False  # the members' GEMV is a dispatcher operator in graphs too: one call for the group
        self._graph_call: tuple = ()  # (the GEMV `RowKernel`, group size, K) of that call, fixed when built
        self._parts: tuple = ()  # the block weights of the group's C call: (weight,), or each member's (mixed types)
        self._types: tuple = ()  # their GGUF type numbers
        self._traced = None  # while a graph is traced: (x, outputs) of the member called first (`graph_product`)

    def build(self) -> bool:
        """Concatenate the members' runtime tensors into the group's, if every member is prepared with the same
        eager GEMV (`QuantLinear._row` and its plan) on CPU and the group is not built yet; returns whether the
        group computes its members' rows now. Weights that are already the consecutive rows of one tensor (repacked
        there by `prepare`, or left so by `dissolve`) are not copied: that tensor becomes the group's. Block formats
        of different types (a Q4_K_M file's Q4_K q/k and Q6_K v, an IQ4_NL file's IQ4_NL q/k and Q5_K v) are not
        concatenated (their rows differ in bytes): the group's one C call takes each member's weight
        (`native.block_gemv_group`), the weights kept as consecutive byte ranges of one tensor (`_build_mixed`)."""
        if self._views:
            return True
        if self.misses > MAX_MISSES or self._preparing:
            return False
        first = self.members[0]
        keys = [_row_key(member) for member in self.members]
        if keys[0] is None or any(key is None for key in keys):
            return False
        weights = [member._buffers["weight"] for member in self.members]
        if any(weight.device.type != "cpu" or not weight.is_contiguous() for weight in weights):
            return False
        plan = first.plan
        if any(key != keys[0] for key in keys[1:]):
            if not _mixed_blocks(keys):
                return False
            return self._build_mixed(weights)
        with torch.no_grad():
            weight = _rows_of_one_tensor(weights, self.sizes)  # repacked there by `prepare`, or a dissolved group's
            if weight is None:  # the group's own tensor: on huge pages, as a decode step streams it
                rows = (sum(self.sizes), *weights[0].shape[1:])
                weight = torch.cat(weights, out=huge_pages.empty(rows, dtype=weights[0].dtype))
            scale_zero = None  # a block format's GEMV reads the blocks' own scales
            if first._buffers["scale_zero"] is not None:
                scale_zero = torch.cat([member._buffers["scale_zero"] for member in self.members], dim=1)
        views = weight.split(self.sizes)
        for member, view in zip(self.members, views, strict=True):
            member._buffers["weight"] = view  # the member's rows of the group's tensor: no second copy of the codes
            member._fused = self
        self.weight, self.scale_zero, self._row, self._views = weight, scale_zero, first._row, views
        self._graph_call = (plan.row, plan.group_size, plan.in_features)
        if plan.block:
            self._parts, self._types = (weight,), (block_layout.kernel_type(plan.block, plan.block_rows),)
            self.in_graphs = plan.row_call is RowCall.OPERATOR
        else:  # int4: graphs call the members' own GEMV operator once over the group's rows, where that is theirs
            self.in_graphs = (
                plan.compiled_row is plan.row
                and plan.row in INT4_ROWS
                and plan.compiled_row_call is RowCall.OPERATOR
                and plan.row_call is RowCall.OPERATOR
            )
        return True

    def _build_mixed(self, weights: list[torch.Tensor]) -> bool:
        """`build` for block members of different types: one C call over their own weights, as consecutive byte
        ranges of one tensor (`_bytes_of_one_tensor`)."""
        plan = self.members[0].plan
        parts = _bytes_of_one_tensor(weights)
        for member, part in zip(self.members, parts, strict=True):
            member._buffers["weight"] = part
        types = tuple(block_layout.kernel_type(member.plan.block, member.plan.block_rows) for member in self.members)
        in_features = plan.in_features
        if plan.row_call is RowCall.OPERATOR:
            op = torch.ops.hfquant_cpu.block_gemv_group.default
        else:
            op = native.block_gemv_group
        part_list, type_list = list(parts), list(types)

        def group_row(x: torch.Tensor, weight, scale_zero) -> torch.Tensor:
            return op(x, part_list, in_features, type_list)

        for member in self.members:
            member._fused = self
        self.weight, self.scale_zero, self._row, self._views = None, None, group_row, parts
        self._parts, self._types = parts, types
        self._graph_call = (plan.row, plan.group_size, plan.in_features)
        self.in_graphs = plan.row_call is RowCall.OPERATOR
        return True

    def prepare(self, dtype: torch.dtype | None = None, in_place: bool = False) -> list:
        """Prepare every member's kernel for the activation `dtype` (`QuantLinear.prepare_kernel`), then build the
        group; returns the members' kernels.

        When the members' plans (`QuantLinear.planned_row`) bind the same eager int4 GEMV and their weights are on
        the CPU, each member's runtime weight is repacked straight into its rows of one new (sum N_i, K / 2) uint8
        tensor, which becomes the group's `weight`: each code byte is written once. With `in_place`, stored weights
        that already are the consecutive rows of one tensor (as quantize-on-load stores a group's members) are
        repacked where they are instead, without a second tensor: only for weights nothing else reads (a load's own).
        Otherwise each member prepares its own (block formats always: their runtime weight is the stored one), and
        `build` concatenates them if they can share a GEMV after all (not copying rows already in one tensor)."""
        self.dissolve()
        views = self._rows(dtype, in_place) or (None,) * len(self.members)
        self._preparing = True
        try:
            kernels = [
                member.prepare_kernel(dtype, out=view) for member, view in zip(self.members, views, strict=True)
            ]
        finally:
            self._preparing = False
        self.build()
        return kernels

    def _rows(self, dtype: torch.dtype | None, in_place: bool = False) -> tuple | None:
        """The members' row views of a new (sum N_i, K / 2) uint8 tensor for `prepare` to repack them into, when
        every member's weight is on the CPU and its plan binds the same int4 GEMV, or with `in_place` their own
        weights when these are the consecutive rows of one tensor; else None."""
        keys = set()
        for member in self.members:
            planned = member.planned_row(dtype)
            if planned is None or not planned[1] or member._buffers["weight"].device.type != "cpu":
                return None
            if planned[0].block:  # a block format's runtime weight is its stored one, interleaved in place where the
                # load owns it (`block_layout`): `build` concatenates them (no copy when they are rows of one tensor)
                return tuple(m._buffers["weight"] for m in self.members) if in_place else None
            keys.add(_plan_key(planned[0], torch.uint8))
        if len(keys) != 1:
            return None
        weights = [member._buffers["weight"] for member in self.members]
        if in_place and _rows_of_one_tensor(weights, self.sizes) is not None:
            return tuple(weights)
        return huge_pages.empty((sum(self.sizes), self.members[0].in_features // 2), dtype=torch.uint8).split(
            self.sizes
        )

    def dissolve(self) -> None:
        """Stop computing the members' rows together; each layer keeps its weight (a view of the group's rows until
        it is prepared or loaded again) and runs its own GEMV."""
        for member in self.members:
            member._fused = None
        self.weight = self.scale_zero = self._row = self._cache = self._traced = None
        self._views = self._parts = self._types = self._graph_call = ()
        self.in_graphs = False

    def product(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output (x's leading dimensions, N_index) bfloat16 for one contiguous bfloat16 row `x`: a
        view of the group's GEMV of `x`, computed by the first member called with this tensor. None when the group
        has stopped fusing (the caller runs the member's own GEMV)."""
        cache = self._cache
        version = -1 if x.is_inference() else x._version  # inference tensors keep no version counter
        if cache is not None and cache[0] is x and cache[1] == version:
            left = cache[3]
            left[0] -= 1
            if left[0] <= 0:
                self._cache = None
            return cache[2][index]
        if cache is not None and cache[3][0] > 0:
            self.misses += 1
            if self.misses > MAX_MISSES:
                logger.info("hfquant stops fusing %s: their inputs differ", [m.out_features for m in self.members])
                self.dissolve()
                return None
        if not self._views_hold():
            return None
        y = self._row(x, self.weight, self.scale_zero)
        dims = x.dim()
        if dims != 2:
            y = y.view(1, 1, -1) if dims == 3 else y.view(*x.shape[:-1], -1)
        outputs = y.split_with_sizes(self.sizes, -1)
        self._cache = (x, version, outputs, [len(self.members) - 1])
        return outputs[index]

    def _views_hold(self) -> bool:
        """Whether every member's weight is still its view of the group's rows; else (swapped by an offloading hook,
        or re-planned) the group dissolves."""
        for layer, view in zip(self.members, self._views, strict=True):
            if layer._buffers["weight"] is not view:
                self.dissolve()
                return False
        return True

    def row(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every member's output at once for one contiguous bfloat16 decode row `x` (1, 1, K): the group's GEMV of
        `x`, (1, sum of `sizes`) bfloat16, the members' outputs one after the other (`split_with_sizes(sizes, -1)`
        gives each member the same bytes as `product`); None when the group is not built or a member's weight was
        swapped or re-planned (the group dissolves, as in `product`). For callers that would call every member with
        `x` in turn and know that the members' calls are their forward alone (no hooks, no bias: `row_decode`);
        keeps nothing."""
        if not self._views or not self._views_hold():
            return None
        return self._row(x, self.weight, self.scale_zero)

    def graph_product(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """`product` while torch.compile traces a graph (`in_graphs`: a group whose layers call a dispatcher operator
        in graphs): the member called first (index 0) puts one call in the graph for all members (a block group's
        `hfquant_cpu.block_gemv_group`; an int4 group's GEMV operator, `gemv.int4_row`, over `weight` and
        `scale_zero`) and keeps (x, the outputs split as views) until the last member takes its view; each sibling
        called with that same traced tensor takes its view. The same bytes as each member's own operator call (see
        `product`). None for a member called with another tensor, or before the first: the caller runs its own
        operator.

        The kept pair is a Python attribute the trace mutates and, once the last member has taken its view, sets back
        to None: the graph returns nothing more (a group whose members are not all called in one graph keeps its last
        pair until the next call, which replaces it)."""
        if index == 0:
            row, group_size, in_features = self._graph_call
            if self._parts:
                y = torch.ops.hfquant_cpu.block_gemv_group(
                    x.contiguous(), list(self._parts), in_features, list(self._types)
                )
            else:
                y = int4_row(row, RowCall.OPERATOR, x.contiguous(), self.weight, self.scale_zero, group_size)
            outputs = y.view(*x.shape[:-1], -1).split_with_sizes(self.sizes, -1)
            self._traced = (x, outputs)
            return outputs[0]
        traced = self._traced
        if traced is None or traced[0] is not x:
            return None
        if index == len(self.members) - 1:
            self._traced = None
        return traced[1][index]


def _mixed_blocks(keys: list[RowKey]) -> bool:
    """Whether layers of these `_row_key`s may share one `native.block_gemv_group` call though their keys differ: the
    block GEMV of up to 8 block formats with the same call and K, differing in the block type and size alone (the C
    call quantizes x once per activation block size its weights need)."""
    first = keys[0]._replace(block=None, group_size=None)
    if first.row is not RowKernel.BLOCK_GEMV or len(keys) > 8:
        return False
    return all(key.block and key._replace(block=None, group_size=None) == first for key in keys)


def _row_key(layer: nn.Module):
    """What must match for layers to share a GEMV: the bound eager kernel, its call, K, the group size and the block
    type; None when the layer has no such kernel."""
    if layer._row is None:
        return None
    return _plan_key(layer.plan, layer._buffers["weight"].dtype)


def _bytes_of_one_tensor(weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The block weights (each (N_i, row bytes_i) uint8, contiguous, on the CPU) as consecutive byte ranges of one
    uint8 tensor on huge pages where one of them is smaller than a huge page (a reloaded file's members are tensors
    of their own, each under 2 MiB on the 1.2B and so on 4 KiB pages, `huge_pages.empty`): copies into a new tensor,
    their bytes unchanged. Weights already in one tensor so (quantize-on-load writes a group's members so,
    `quantize_weights.GroupRows`), or each at least a huge page (on huge pages already), stay where they are."""
    storage = weights[0].untyped_storage().data_ptr()
    if all(w.nbytes >= huge_pages.HUGE_PAGE for w in weights) or (
        all(w.untyped_storage().data_ptr() == storage for w in weights)
        and all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(weights[:-1], weights[1:], strict=True))
    ):
        return tuple(weights)
    sizes = [w.nbytes for w in weights]
    tensor = huge_pages.empty((sum(sizes),), dtype=torch.uint8)
    parts, start = [], 0
    for weight, size in zip(weights, sizes, strict=True):
        parts.append(tensor[start : start + size].view(weight.shape).copy_(weight))
        start += size
    return tuple(parts)


def _rows_of_one_tensor(weights: list[torch.Tensor], sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The contiguous tensor of sum(sizes) rows whose consecutive row slices the contiguous `weights` are, in order
    (the tensor `DecodeGroup.prepare` repacked them into, or a dissolved group's): their concatenation, without a
    copy. None when they are not."""
    base = weights[0]._base
    if base is None or not base.is_contiguous() or base.shape[0] != sum(sizes) or base.dtype != weights[0].dtype:
        return None
    row_bytes = base[0].numel() * base.element_size()
    start = 0
    for weight, rows in zip(weights, sizes, strict=True):
        if (
            weight._base is not base
            or weight.shape != (rows, *base.shape[1:])
            or weight.data_ptr() != base.data_ptr() + start * row_bytes
        ):
            return None
        start += rows
    return base


class RowKey(NamedTuple):
    """What must match for layers to share a GEMV (`_row_key`): the plan's bound kernels, K, group size and block
    type, and the runtime weight dtype."""

    kernel: object
    row: object
    row_call: object
    in_features: int
    group_size: int | None
    block: object
    weight_dtype: torch.dtype


def _plan_key(plan, weight_dtype: torch.dtype) -> RowKey:
    """`_row_key` of a layer with this plan and runtime weight dtype, its GEMV bound."""
    block = (plan.block, plan.block_rows) if plan.block else ""  # concatenated rows share one layout too
    return RowKey(plan.kernel, plan.row, plan.row_call, plan.in_features, plan.group_size, block, weight_dtype)


def _group_format(fmt):
    """What sibling layers share to be linked in one group: their stored format, or for a block format its method
    (block types of any size share the C call, `DecodeGroup._build_mixed`)."""
    if fmt.block is None:
        return fmt
    return ("blocks", fmt.method)


def link_decode_groups(model: nn.Module, layer_type: type) -> int:
    """Make the sibling `layer_type` (`QuantLinear`) children of each module of `model` named as in `SIBLINGS` that
    share a stored format (block formats: a method, `_group_format`) and input width members of one
    `DecodeGroup` (at least two; built once their kernels are prepared alike). Returns the number of groups."""
    groups = 0
    for parent in model.modules():
        children = parent._modules
        for names in SIBLINGS:
            by_format: dict = {}
            for name in names:
                member = children.get(name)
                if isinstance(member, layer_type) and member._decode_group is None:
                    by_format.setdefault((_group_format(member.format), member.in_features), []).append(member)
            for members in by_format.values():
                if len(members) < 2:
                    continue
                group = DecodeGroup(members)
                for index, member in enumerate(members):
                    member._decode_group = group
                    member._fused_index = index
                group.build()
                groups += 1
    return groups
