"""`HfQuantConfig(fold_column_scales=True)` on a transformers model: which modules fold, and the plan from the checkpoint.

The math is `hfquant.core.folding`; this module knows the decoder blocks of the Llama family (Llama, Mistral, Qwen2,
Qwen3: pre-norm RMSNorm blocks with `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`) and reads one block's
float weights at a time from the checkpoint, before the streaming load, to compute its column scales:

    transforms = plan_folds(model, plans, read)       # {module name: Transform}, small vectors only
    # then, while the checkpoint streams in, each listed tensor is transformed before it is quantized (or stored,
    # for the norms and biases): `HfQuantQuantize.convert`.

A load does not run that pass first: `FoldStream` folds block i + 1 on a worker thread while the load quantizes block i
(the same folds, docs/performance.md "The 4-bit default's load beside the fold").

Within a block, a fold is made only when every matrix it changes is quantized by hfquant (a layer kept in float would
not pass through the quantizer's op): v_proj -> o_proj, up_proj -> down_proj, input_layernorm -> q/k/v and
post_attention_layernorm -> gate/up. Other architectures, and layers outside such blocks, are quantized as the config
says (their method: RTN, or SINQ with a stored column scale).

Each of these four fold groups is refused where its consumers already round-trip unfolded and the fold would raise
that error (`_fold_lowers_error`): they are quantized in their stored format, and the errors compared in the original
(unfolded) weight space, sum over elements of (Q(W / c) * c - W)^2 against (Q(W) - W)^2, from the tensors the pre-pass
reads anyway. The producer's side (a norm, or rows of v_proj / up_proj multiplied by c) is not measured: every format
quantizes each row on its own, so a row factor scales its reconstruction alike (up to float16 / bfloat16 rounding of
the scales). A fold is a change of basis that usually spreads outliers out of the blocks (docs/performance.md); on
weights that already lie on the format's grid (a model dequantized from a GGUF file of that type) it moves them off it,
and the test leaves them where they are. (Refusing every fold that raises the weight error is no better rule: it
made SmolLM2's 4-bit default worse, docs/performance.md.) The layers of a group left unfolded get an empty `Transform` (no
vectors), so that they are stored with RTN like the folded ones (`fold_overrides`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils.logging import is_progress_bar_enabled, tqdm

from hfquant.checkpoint.files import open_safetensors, read_headers, read_tensor
from hfquant.checkpoint.streaming import (
    populate_range,
    release_checkpoint_pages,
    release_range,
    spare_mapping,
    trim_heap,
)
from hfquant.core import folding, packing, rtn, sinq
from hfquant.core.blocks import dequantize as block_dequantize
from hfquant.core.blocks import iq4
from hfquant.core.folding import Transform
from hfquant.core.format import Method, StoredFormat
from hfquant.core.scratch import Scratch
from hfquant.integration.bos_importance import BosForward
from hfquant.integration.conversions import model_key_map
from hfquant.nn.linear import quantize_to_buffers
from hfquant.ops import balance

__all__ = [
    "FOLDABLE_MODEL_TYPES",
    "Block",
    "find_blocks",
    "plan_folds",
    "FoldStream",
    "fold_overrides",
    "checkpoint_reader",
]

logger = logging.getLogger(__name__)

FOLDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""`config.model_type`s whose decoder blocks `find_blocks` folds: pre-norm blocks whose norms compute
normalize(x) * weight (no offset such as Gemma's 1 + weight) and whose attention output mixes `v_proj`'s rows per head."""

FOLD_AHEAD = 2
"""Blocks `FoldStream`'s worker folds beyond the one being loaded (queued in order): with one, the load waited whenever
one block's fold took longer than the previous block's quantization; with two the differences even out. The worker
maps one block at a time (released after its fold), so the peak RSS is as with one; the page cache holds the
blocks read ahead until the load reads them."""


class Block(NamedTuple):
    """Full module names of one decoder block's foldable modules."""

    attention_norm: str
    q: str
    k: str
    v: str
    o: str
    mlp_norm: str
    gate: str
    up: str
    down: str


def _has(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in names)


def find_blocks(model: nn.Module) -> list[Block]:
    """The decoder blocks of `model` that can be folded (empty unless `config.model_type` is in
    `FOLDABLE_MODEL_TYPES`), found by structure: a module with `input_layernorm`, `post_attention_layernorm`,
    `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`, whose norms have a weight and no bias."""
    if getattr(model.config, "model_type", None) not in FOLDABLE_MODEL_TYPES:
        return []
    blocks = []
    for name, module in model.named_modules():
        if not (
            _has(module, "input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
            and _has(module.self_attn, "q_proj", "k_proj", "v_proj", "o_proj")
            and _has(module.mlp, "gate_proj", "up_proj", "down_proj")
        ):
            continue
        norms = (module.input_layernorm, module.post_attention_layernorm)
        if any(getattr(n, "weight", None) is None or getattr(n, "bias", None) is not None for n in norms):
            continue
        p = f"{name}." if name else ""
        blocks.append(
            Block(
                f"{p}input_layernorm",
                f"{p}self_attn.q_proj",
                f"{p}self_attn.k_proj",
                f"{p}self_attn.v_proj",
                f"{p}self_attn.o_proj",
                f"{p}post_attention_layernorm",
                f"{p}mlp.gate_proj",
                f"{p}mlp.up_proj",
                f"{p}mlp.down_proj",
            )
        )
    return blocks


def plan_folds(
    model: nn.Module,
    plans: Iterable,
    read: Callable[[str], torch.Tensor],
    progress: bool | None = None,
    clipping: str = "minmax",
    select: bool = True,
    importance: str = "weights",
    iq4_search: str = iq4.SEARCHES[0],
) -> dict[str, Transform]:
    """The fold of every foldable block of `model`, computed from its float weights.

    Args:
        model: the (meta-device) transformers model, before its layers are replaced.
        plans: the `LayerPlan`s of its Linear layers (`plan.format` None: kept in float, so not folded).
        read: model tensor name (`model.layers.0.self_attn.q_proj.weight`) -> its float tensor from the checkpoint;
            KeyError when the checkpoint lacks it.
        progress: a tqdm bar over the blocks; None follows transformers' switch
            (`transformers.utils.logging.disable_progress_bar`).
        clipping: the config's `clipping`, with which the error test quantizes (`rtn.CLIPPING`).
        select: refuse a fold group where its consumers already round-trip unfolded and the fold raises that error
            (`_fold_lowers_error`);
            False folds every group (the float-model identity tests).
        importance: the config's `importance`: "bos_activations" gives q/k/v and gate/up of block formats the BOS
            token's squared inputs as `Transform.importance` (`_Planner.weigh`), "weights" none.
        iq4_search: the config's `iq4_search`, with which the error test quantizes IQ4 layers (as the load does).
    Returns:
        {module name: `Transform`} for the norms and Linear layers the folds change, and an empty `Transform` for the
        Linear layers of a group the error test left unfolded (empty when no block folds).
    A block whose folds read a missing tensor or a weight holding NaN/Inf is left unfolded (a warning names it): the
    load's own checks then refuse it naming the tensor and the fix.

    Raises:
        ValueError: the head counts do not fit the projections (naming the module).
    """
    planner = _Planner(model, plans, read, clipping if select else None, importance=importance, iq4_search=iq4_search)
    if not planner.blocks:
        return {}
    transforms: dict[str, Transform] = {}
    with _on_cpu_in_float32():  # from_pretrained prepares the model under the meta device and the load dtype
        for block in tqdm(
            planner.blocks,
            desc="hfquant: SINQ column scales (Sinkhorn on each layer's float weights)",
            unit="layer",
            disable=_progress_disabled(progress),
        ):
            transforms.update(planner.fold(block) or {})
    planner.scratch.clear()
    _log_folds(len(planner.blocks), transforms)
    return transforms


IMPORTANCE_FLOOR = 1e-12
"""Least squared BOS input of a column in `_Planner.weigh` (before the fold's scale and the mean): SmolLM2's has exact
zeros, and a block whose columns all weighed nothing would leave its search nothing to minimise."""


class _Planner:
    """What `plan_folds` and `FoldStream` share: the foldable blocks of a model, and the folds of one block
    (`fold`). Everything read from the model is read here, at construction: the blocks are then folded without
    touching the model (which the load changes meanwhile)."""

    def __init__(
        self,
        model: nn.Module,
        plans: Iterable,
        read: Callable[[str], torch.Tensor],
        clipping: str | None,
        release: Callable[[], object] | None = None,
        importance: str = "weights",
        iq4_search: str = iq4.SEARCHES[0],
    ):
        # after each block: its pages out of this process (`MADV_PAGEOUT`: safe for any map; `FoldStream` passes
        # its own release of the ranges it read, kept in the page cache for the streaming load)
        self.release = release or release_checkpoint_pages
        self.blocks = find_blocks(model)
        self.bos: BosForward | None = None
        if not self.blocks:
            if importance == "bos_activations":
                logger.warning(
                    "hfquant: importance='bos_activations' acts in the fold pre-pass of %s blocks; %s has none: its "
                    "layers are searched with importance='weights'",
                    ", ".join(FOLDABLE_MODEL_TYPES),
                    type(model).__name__,
                )
            logger.info(
                "hfquant: no foldable decoder block in %s (fold_column_scales acts on %s): nothing folded",
                type(model).__name__,
                ", ".join(FOLDABLE_MODEL_TYPES),
            )
            return
        self.formats = {plan.name: plan.format for plan in plans}
        config = getattr(model.config, "get_text_config", lambda: model.config)()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.widths = {
            name: model.get_submodule(name).in_features
            for block in self.blocks
            for name in block
            if self.formats.get(name) is not None
        }
        self.read, self.clipping, self.iq4_search = read, clipping, iq4_search
        self.scratch = Scratch()  # one set of weight-sized temporaries for the whole pass (`hfquant.core.scratch`)
        if importance == "bos_activations":
            self.bos = BosForward(model, self.blocks, read)
        self.index = {block: i for i, block in enumerate(self.blocks)}

    def tile(self, *names: str) -> int:
        return folding.tile_size(self.widths[names[0]], [self.formats[n].group_size for n in names])

    def planned(self, block: Block) -> list[str]:
        """The module names `fold` can give a `Transform` in `block`, from the formats alone: every member of a
        group whose matrices are all quantized (a norm only gets one where its group is kept)."""
        groups = zip(_fold_groups(block), _foldable(block, self.formats), strict=True)
        return [name for (matrices, norms), folds in groups if folds for name in (*matrices, *norms)]

    def fold(self, block: Block, threads: int | None = None) -> dict[str, Transform] | None:
        """`_fold_block` of `block`, its checkpoint pages released after; None (a warning names the block) where it
        reads a missing tensor or a weight holding NaN/Inf: left unfolded, its layers go through the load's own checks,
        which name the tensor and the fix.

        Raises:
            ValueError: the head counts do not fit the projections (naming the module).
        """
        try:
            transforms = _fold_block(
                block,
                self.read,
                self.tile,
                self.formats,
                self.num_heads,
                self.num_kv_heads,
                self.scratch,
                self.clipping,
                threads,
                self.iq4_search,
            )
        except (KeyError, sinq.NonFiniteWeightError) as error:
            reason = error.args[0] if error.args else error
            logger.warning(
                "hfquant: the column scales of %s are not folded: %s", block.attention_norm.rpartition(".")[0], reason
            )
            return None
        else:
            return self.weigh(block, transforms)
        finally:
            self.release()

    def weigh(self, block: Block, transforms: dict[str, Transform]) -> dict[str, Transform]:
        """`transforms` with the BOS importance (`BosForward`) of q/k/v and gate/up where they are stored in a
        block format and their norm's fold is kept: each column's squared input of the layer as stored
        (x * col_scale, the fold dividing its columns; x^2 at least `IMPORTANCE_FLOOR`), divided by its mean. A group
        the error test refused (`_fold_lowers_error`: its weights already round-trip, as a model dequantized from a
        GGUF file of the format) keeps the format's own importance, the search the error test measured as giving
        its grid back (a BOS importance was not measured there; on a tiny IQ4_NL grid model both give it back,
        tests/integration/test_bos_importance.py). Unchanged without
        `importance="bos_activations"`; a missing tensor or a non-finite input stops it for the rest of the model (a
        warning says why)."""
        if self.bos is None:
            return transforms
        try:
            x1, x2 = self.bos.inputs(self.index[block])
        except KeyError as error:
            logger.warning("hfquant: importance='bos_activations' stops (the rest: 'weights'): %s", error.args[0])
            self.bos = None
            return transforms
        if not (x1.isfinite().all() and x2.isfinite().all()):
            logger.warning("hfquant: importance='bos_activations' stops at %s: a non-finite activation", block.q)
            self.bos = None
            return transforms
        for x, names in ((x1, (block.q, block.k, block.v)), (x2, (block.gate, block.up))):
            squared = x.square().clamp_min_(IMPORTANCE_FLOOR)  # a zero column: no block may weigh nothing
            for name in names:
                fmt = self.formats.get(name)
                if fmt is None or fmt.block is None or name not in transforms:
                    continue
                col_scale = transforms[name].col_scale
                if col_scale is None:  # its group refused by the error test: stored as it was (see `weigh`)
                    continue
                weight = squared * col_scale.float().square()
                transforms[name] = transforms[name]._replace(importance=weight / weight.mean())
        return transforms


def _log_folds(blocks: int, transforms: dict[str, Transform]) -> None:
    """The INFO line of `plan_folds`: blocks, modules changed, modules left unfolded by the error test."""
    changed = sum(1 for t in transforms.values() if t.row_scale is not None or t.col_scale is not None)
    logger.info(
        "hfquant: column scales folded in %d block(s), %d module(s) changed, %d left unfolded (their folds raised the "
        "weights' reconstruction error)",
        blocks,
        changed,
        len(transforms) - changed,
    )


def _progress_disabled(progress: bool | None) -> bool:
    return not is_progress_bar_enabled() if progress is None else not progress


@contextmanager
def _on_cpu_in_float32() -> Iterator[None]:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(default)


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `threads` while the context lasts (None: left as they are)."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fold_block(
    block: Block,
    read,
    tile,
    formats,
    num_heads: int,
    num_kv_heads: int,
    scratch: Scratch | None = None,
    clipping: str | None = "minmax",
    threads: int | None = None,
    iq4_search: str = iq4.SEARCHES[0],
) -> dict[str, Transform]:
    """The folds of one block (see `plan_folds`): {module name: Transform}, merged where two folds change one module.
    `clipping` None folds every group; else each group is kept only where `_fold_lowers_error` (quantizing with that
    clipping and `iq4_search`), the Linear layers of the others getting an empty `Transform`. `threads`: the C
    balancing's OpenMP threads (None: OpenMP's default; the result does not depend on it).

    Raises:
        KeyError: the checkpoint lacks a tensor the block's folds read.
        sinq.NonFiniteWeightError: a weight the folds read holds NaN or Inf.
        ValueError: the head counts do not fit the projections.
    """
    folds = _BlockFolds(read, tile, formats, scratch, clipping, threads, iq4_search)
    v_o, qkv, up_down, gate_up = _foldable(block, formats)
    v_rows = up_rows = None
    if v_o:

        def share_heads(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            try:
                return folding.share_across_heads(scale, num_heads, num_kv_heads)
            except ValueError as error:
                raise ValueError(f"cannot fold the column scales of {block.o}: {error}") from None

        v_rows = folds.into_rows(block.v, block.o, share_heads)
    if qkv:
        # v's rows carry o_proj's fold; only the statistics read them scaled (`hfquant.ops.balance`): the stored layer
        # is rescaled exactly, in float32, when it is quantized
        folds.into_norm(block.attention_norm, (block.q, block.k, block.v), (None, None, v_rows))
    if up_down:
        up_rows = folds.into_rows(block.up, block.down)
    if gate_up:
        folds.into_norm(block.mlp_norm, (block.gate, block.up), (None, up_rows))
    return folds.transforms


def _fold_groups(block: Block) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """(the matrices, the norm) of each fold group of `block`, in the order `_fold_block` folds them: v -> o_proj,
    input_layernorm -> q/k/v, up -> down_proj, post_attention_layernorm -> gate/up."""
    return (
        ((block.v, block.o), ()),
        ((block.q, block.k, block.v), (block.attention_norm,)),
        ((block.up, block.down), ()),
        ((block.gate, block.up), (block.mlp_norm,)),
    )


def _foldable(block: Block, formats) -> list[bool]:
    """For each of `_fold_groups(block)`: whether every matrix it changes is quantized by hfquant (a layer kept in
    float would not pass through the quantizer's op), the one rule deciding which groups are folded."""
    quantized = {name for name in block if formats.get(name) is not None}
    return [set(matrices) <= quantized for matrices, _ in _fold_groups(block)]


class _BlockFolds:
    """The transforms of one block's folds as `_fold_block` decides them, group by group: `into_rows` (a consumer's
    column scale into its producer's rows: v -> o_proj, up -> down_proj) and `into_norm` (the consumers' shared column
    scale into the norm before them). `clipping` None keeps every group, else `_fold_lowers_error` decides."""

    def __init__(
        self,
        read,
        tile,
        formats,
        scratch: Scratch | None,
        clipping: str | None,
        threads: int | None = None,
        iq4_search: str = iq4.SEARCHES[0],
    ):
        self.read, self.tile, self.formats, self.scratch, self.clipping = read, tile, formats, scratch, clipping
        self.iq4_search = iq4_search
        self.threads = threads  # the C balancing's (`hfquant.ops.balance.column_scale`)
        self.transforms: dict[str, Transform] = {}

    def add(self, name: str, transform: Transform) -> None:
        transforms = self.transforms
        transforms[name] = transforms[name].merged(transform) if name in transforms else transform

    def kept(
        self,
        consumers: list[tuple[str, torch.Tensor, torch.Tensor | None]],
        col_scale: torch.Tensor,
        input_scale: torch.Tensor | None = None,
    ) -> bool:
        """Whether the group whose consumers (name, weight, row scale an earlier fold gives it) divide their columns
        by `col_scale` is kept (`_fold_lowers_error`); its consumers are recorded unfolded (an empty Transform) when
        it is not."""
        if self.clipping is None or _fold_lowers_error(
            [(w, self.formats[n], rows) for n, w, rows in consumers],
            col_scale,
            self.clipping,
            input_scale,
            self.iq4_search,
        ):
            return True
        for name, _, _ in consumers:
            self.add(name, Transform())
        return False

    def into_rows(self, producer: str, consumer: str, share=None) -> torch.Tensor | None:
        """Fold `consumer`'s column scale into `producer`'s rows; `share` maps the scale to (producer's row scale,
        consumer's column scale) (o_proj's heads shared by grouped-query v). Returns the producer's row scale, None
        when the group is refused (the producer then gets an empty Transform too)."""
        weight = self.read(consumer + ".weight")
        col_scale = balance.column_scale([weight], self.tile(consumer), scratch=self.scratch, threads=self.threads)
        rows, col_scale = share(col_scale) if share else (col_scale, col_scale)
        if not self.kept([(consumer, weight, None)], col_scale):
            self.add(producer, Transform())
            return None
        self.add(consumer, Transform(col_scale=col_scale))
        self.add(producer, Transform(row_scale=rows))
        return rows

    def into_norm(self, norm_name: str, names: tuple[str, ...], row_scales: tuple) -> None:
        """Fold the column scale that `names` (whose rows carry `row_scales` from earlier folds, None for none) share
        into the norm `norm_name` before them."""
        weights = [self.read(name + ".weight") for name in names]
        scale = balance.column_scale(
            weights, self.tile(*names), list(row_scales), scratch=self.scratch, threads=self.threads
        )
        norm_weight = self.read(norm_name + ".weight")
        norm, scale = folding.fold_into_norm(norm_weight, scale)
        if self.kept(list(zip(names, weights, row_scales, strict=True)), scale, norm_weight.float().abs()):
            self.add(norm_name, norm)
            for name in names:
                self.add(name, Transform(col_scale=scale))


_ERROR_ROWS = 64
"""Rows of each consumer the error test quantizes (evenly spaced; all of them for a smaller matrix): rows are quantized
on their own in every format, so the sum over a sample of rows is an unbiased estimate of the whole matrix's, the
same rows both ways; it bounds the test's cost to a few rows' quantization per layer whatever the model's size."""


def _sampled_rows(weight: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the `_ERROR_ROWS` evenly spaced rows of `weight` (N, K), the same entries of the row scale `rows`)."""
    n = weight.shape[0]
    if n <= _ERROR_ROWS:
        return weight, rows
    index = torch.arange(_ERROR_ROWS) * n // _ERROR_ROWS
    return weight[index], None if rows is None else rows[index]


def _reconstruction_error(
    weight: torch.Tensor,
    fmt: StoredFormat,
    fold: Transform,
    clipping: str,
    input_scale: torch.Tensor | None,
    iq4_search: str = iq4.SEARCHES[0],
) -> float:
    """sum over (n, k) of ((W_hat - W)[n, k] * input_scale[k])^2 (input_scale None: 1) over the weight (N, K), where
    W_hat is what the layer stored in `fmt` with method RTN after `fold` multiplies it by: its dequantized rows divided
    by `fold.row_scale`, columns times `fold.col_scale` (the original weight space); IQ4 blocks by `iq4_search`, the
    load's. No importance: a layer whose group is refused is stored without one (`_Planner.weigh`), and a kept fold
    is kept untested unless its layers already round-trip (`_fold_lowers_error`)."""
    fmt = dataclasses.replace(fmt, method=Method.RTN)
    buffers = quantize_to_buffers(weight, fmt, clipping, fold, iq4_search=iq4_search)
    if fmt.block is not None:
        restored = block_dequantize(fmt.block, buffers["weight"])
    else:
        codes = packing.unpack_int4(buffers["weight"]) if fmt.bits == 4 else buffers["weight"]
        restored = rtn.dequantize_weight(
            codes, buffers["weight_scale"], buffers.get("weight_zero_point"), fmt.bits, fmt.symmetric
        )
    if fold.row_scale is not None:
        restored /= fold.row_scale.float()[:, None]
    if fold.col_scale is not None:
        restored *= fold.col_scale.float()
    restored -= weight.float()
    per_column = restored.square_().sum(0, dtype=torch.float64)
    if input_scale is not None:
        per_column *= input_scale.double().square()
    return float(per_column.sum())


_FIRST_ROWS = 8
"""Sampled rows whose error `_fold_lowers_error` measures first (see there)."""


def _first_rows(rows: torch.Tensor | None) -> torch.Tensor | None:
    return None if rows is None else rows[:_FIRST_ROWS]


EXACT_ENOUGH = 1e-5
"""Unfolded reconstruction error, as a fraction of the weights' (weighted) energy, at or below which a layer already
round-trips to about its checkpoint's own precision (bfloat16 rounding alone is about 1.3e-6): only there is a fold
tested against leaving the weights as they are (`_fold_lowers_error`)."""


def _fold_lowers_error(
    consumers: list[tuple[torch.Tensor, StoredFormat, torch.Tensor | None]],
    col_scale: torch.Tensor,
    clipping: str,
    input_scale: torch.Tensor | None = None,
    iq4_search: str = iq4.SEARCHES[0],
) -> bool:
    """Whether the fold that divides the columns of the consumers (weight (N_i, K), its stored format, the row scale
    an earlier fold gives it or None) by `col_scale` (K,) is kept.

    It is refused only where the consumers unfolded already round-trip (summed error in the original weight space,
    `_reconstruction_error` over `_sampled_rows`, at most `EXACT_ENOUGH` of their energy: weights dequantized from a
    file of this very format) and the fold raises that error. Elsewhere the fold is kept untested: measured on
    SmolLM2, refusing every fold that raises this weight error made the 4-bit default's perplexity 1.230x bf16
    against 1.147x folding everything (docs/performance.md): the weight error does not rank folds by accuracy.

    `input_scale` (K,), the typical size of each input column (a norm's weight: the consumers read normalize(x) * g),
    weighs each column's error as the layer's output feels it; None: columns alike. `iq4_search`: the config's, with
    which IQ4 layers are quantized here as on load."""
    sampled = [(*_sampled_rows(weight, rows), fmt) for weight, fmt, rows in consumers]
    scale = None if input_scale is None else input_scale.double().square()
    energy = 0.0
    for weight, _, _ in sampled:
        per_column = weight.float().square().sum(0, dtype=torch.float64)
        energy += float((per_column * scale).sum() if scale is not None else per_column.sum())
    # Rows are quantized on their own: the error of the first `_FIRST_ROWS` sampled rows is a part of the sum over all
    # of them (non-negative terms). Far enough above the bound (twice it: float64 rounding cannot close that) it decides
    # as the whole sum would, at an eighth of its cost; weights near their grid go on to the whole sum.
    few = sum(
        _reconstruction_error(
            w[:_FIRST_ROWS], fmt, Transform(_first_rows(rows), None), clipping, input_scale, iq4_search
        )
        for w, rows, fmt in sampled
    )
    if few > 2 * EXACT_ENOUGH * energy:
        return True
    unfolded = sum(
        _reconstruction_error(w, fmt, Transform(rows, None), clipping, input_scale, iq4_search)
        for w, rows, fmt in sampled
    )
    if unfolded > EXACT_ENOUGH * energy:
        return True
    folded = sum(
        _reconstruction_error(w, fmt, Transform(rows, col_scale), clipping, input_scale, iq4_search)
        for w, rows, fmt in sampled
    )
    return folded < unfolded


def fold_overrides(config, plans: Iterable, transforms: dict[str, Transform]) -> dict[str, dict]:
    """`module_overrides` entries that store the folded Linear layers with plain RTN (no stored column scale).

    A folded layer keeps its bits, group size, symmetry and block format (`config.layer_settings`) and gets
    `method="rtn"`; layers already planned with RTN need no entry. In a model that folds, a block-format layer the fold
    does not reach (its neighbour kept in float, say) gets RTN too: a stored column scale would make it a layer no
    GGUF reader runs, where its format promises llama.cpp's blocks. The caller puts the entries first, so that they win
    over any pattern."""
    added = {}
    for plan in plans:
        if plan.format is None or plan.format.method is Method.RTN:
            continue
        settings = config.layer_settings(plan.name)
        if plan.name not in transforms and not (transforms and settings.format != "int"):
            continue
        entry = {"bits": settings.bits, "group_size": settings.group_size, "symmetric": settings.symmetric}
        added[plan.name] = (
            entry | ({"format": settings.format} if settings.format != "int" else {}) | {"method": "rtn"}
        )
    return added


@contextmanager
def checkpoint_reader(model: nn.Module, files: Iterable[str | os.PathLike]) -> Iterator[Callable[[str], torch.Tensor]]:
    """A function reading one model tensor by its model name from the safetensors `files` of a checkpoint (the file
    names renamed as transformers renames them on load); the files stay open while the context lasts.

    Raises (from the function):
        KeyError: no file holds the tensor (naming it).
    """
    where: dict[str, Path] = {}
    for path in files:
        for key in read_headers(path):
            where.setdefault(key, Path(path))
    model_keys = model_key_map(model, list(where))
    source = {model_key: key for key, model_key in model_keys.items() if model_key is not None}
    handles: dict[Path, object] = {}

    def read(model_key: str) -> torch.Tensor:
        key = source.get(model_key)
        if key is None:
            raise KeyError(f"the checkpoint has no tensor for {model_key}, which the fold of its block reads")
        path = where[key]
        if path not in handles:
            handles[path] = open_safetensors(path)
        return read_tensor(handles[path], path, key)

    try:
        yield read
    finally:
        handles.clear()


class FoldStream(Mapping):
    """`plan_folds`'s folds, computed block by block beside the streaming load instead of in a pass before it.

    The pre-load hook folds the first block in its own thread (`fold_first`, so that a model whose head counts do not
    fit its projections is refused there, as by `plan_folds`); the first value read then queues blocks 1 ..
    `FOLD_AHEAD` on one worker thread,
    and reading any value of block i waits for block i (folding it in the caller's thread when nothing started it) and
    queues blocks i + 1 .. i + `FOLD_AHEAD`. So the worker folds the next blocks on the second core while the load
    quantizes this one, and at most `FOLD_AHEAD` blocks beyond the one being loaded are read ahead, one at a time (peak
    memory: one block's checkpoint pages more; the blocks read ahead stay in the page cache, out of the process).

    Membership (`name in stream`, `bool`) answers at once, from the formats: the names `_Planner.planned` lists, which
    the pre-load hook needs before any weight is read (`fold_overrides`, `param_needs_quantization`). `get` waits;
    it gives an empty `Transform` for the norm of a group the error test refused (its weight passes unchanged) and
    None for every module of a block whose fold read a missing or non-finite tensor (the load's checks name it; its
    Linear layers, planned before, are stored with RTN unfolded where `plan_folds` left them to the config's method).
    Iterating, `len` and pickling wait for every block (`resolved`); `close` (after the load) stops the worker and
    logs `plan_folds`'s INFO line.

    The worker thread folds only while the process's default dtype is float32 (transformers' weight loading; the
    pre-load hook runs under the load dtype): elsewhere the caller's thread folds, under float32.

    Args:
        model, plans, clipping, select, importance, iq4_search: as `plan_folds`.
        files: the checkpoint's safetensors files (`checkpoint_reader`), open until `close`.
    """

    def __init__(
        self,
        model: nn.Module,
        plans: Iterable,
        files: Iterable[str | os.PathLike],
        clipping: str = "minmax",
        select: bool = True,
        importance: str = "weights",
        iq4_search: str = iq4.SEARCHES[0],
    ):
        self._stack = ExitStack()
        self._read = self._stack.enter_context(checkpoint_reader(model, files))
        self._spared: list[tuple[int, int]] = []
        self._pages: list[tuple[int, int, tuple[int, int]]] = []  # (address, bytes, map) read since the last release
        self._stack.callback(self._unspare)
        self._planner = _Planner(
            model, list(plans), self._read_spared, clipping if select else None, self._release, importance, iq4_search
        )
        self._owner = {
            name: i for i, block in enumerate(self._planner.blocks) for name in self._planner.planned(block)
        }
        self._futures: dict[int, Future] = {}
        self._guard = threading.Lock()  # the futures
        self._folding = threading.Lock()  # one block at a time (the reader's handles, the scratch buffers)
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    def fold_first(self) -> None:
        """Fold the first block now, in the caller's thread (the pre-load hook, once the spares of the load's first
        tensors are being made beside it: `huge_pages.Spares`). The checkpoint files are closed when it raises.

        Raises:
            ValueError: the head counts do not fit the projections (naming the module).
        """
        if not self._planner.blocks:
            return
        try:
            self._future(0, background=False).result()
        except BaseException:
            self._stack.close()
            raise

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def __bool__(self) -> bool:
        return bool(self._owner)

    def get(self, name: str, default=None) -> Transform | None:
        """The `Transform` of module `name` (waiting for its block), or `default` when no fold plans one."""
        self._prefetch(1)
        index = self._owner.get(name)
        if index is None:
            return default
        self._prefetch(index + 1)
        transforms = self._future(index, background=False).result()
        if transforms is None:
            return default
        return transforms.get(name, Transform())

    @property
    def worker_busy(self) -> bool:
        """Whether the worker thread has blocks queued or left to fold: it then keeps one core busy (at one OpenMP
        thread), which the load's own C kernels leave to it (`HfQuantQuantize.convert`)."""
        if self._closed or self._executor is None:
            return False
        with self._guard:
            futures = list(self._futures.values())
        return len(futures) < len(self._planner.blocks) or not all(future.done() for future in futures)

    def __getitem__(self, name: str) -> Transform:
        transform = self.get(name)
        if transform is None:
            raise KeyError(name)
        return transform

    def __iter__(self) -> Iterator[str]:
        return iter(self.resolved())

    def __len__(self) -> int:
        return len(self.resolved())

    def __reduce__(self):
        return dict, (self.resolved(),)

    def resolved(self) -> dict[str, Transform]:
        """{module name: Transform} of every block, as `plan_folds` returns it (folding what is left; the checkpoint
        files are closed after, nothing more being read)."""
        transforms: dict[str, Transform] = {}
        for index in range(len(self._planner.blocks)):
            transforms.update(self._future(index, background=False).result() or {})
        self._stack.close()
        return transforms

    def close(self) -> None:
        """Stop the worker (after the block it folds), close the checkpoint files and log what was folded."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._stack.close()
        if self._planner.blocks:
            self._planner.scratch.clear()
            done = {}
            for future in self._futures.values():
                if future.done() and not future.cancelled() and future.exception() is None:
                    done.update(future.result() or {})
            _log_folds(len(self._planner.blocks), done)

    def __del__(self):
        # a stream never closed (a failed load): its maps must not stay spared, a later map could take their address
        if not getattr(self, "_closed", True):
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._stack.close()

    def _read_spared(self, name: str) -> torch.Tensor:
        """`checkpoint_reader`'s read, its file's map spared from the load's `MADV_PAGEOUT` (`spare_mapping`): the
        block read ahead stays in the page cache while it is balanced; `Planner.fold` unmaps it after."""
        tensor = self._read(name)
        address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        mapping = next(((start, end) for start, end in self._spared if start <= address < end), None)
        if mapping is None and nbytes:
            mapping = spare_mapping(address)
            if mapping is not None:
                self._spared.append(mapping)
        if mapping is not None:
            self._pages.append((address, nbytes, mapping))
            populate_range(
                address, nbytes, mapping
            )  # one call, not a fault per page range: the balancing reads it all
        return tensor

    def _release(self) -> None:
        """The pages of the tensors the block read, out of this process and kept in the page cache (only those:
        `release_checkpoint_pages` would walk every shard), and freed heap memory back to the system."""
        for address, nbytes, mapping in self._pages:
            release_range(address, nbytes, mapping)
        self._pages.clear()
        trim_heap()

    def _unspare(self) -> None:
        for start, _ in self._spared:
            spare_mapping(start, spared=False)
        self._spared.clear()

    def _prefetch(self, index: int) -> None:
        """Queue blocks `index` .. `index + FOLD_AHEAD - 1` on the worker thread (it folds them in order), each unless
        started, closed, or the default dtype is not float32 (which the worker cannot set: it is the process's)."""
        if self._closed or torch.get_default_dtype() != torch.float32:
            return
        for queued in range(index, min(index + FOLD_AHEAD, len(self._planner.blocks))):
            if queued not in self._futures:
                self._future(queued, background=True)

    def _future(self, index: int, background: bool) -> Future:
        with self._guard:
            future = self._futures.get(index)
            if future is not None:
                return future
            if background:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="hfquant-folds")
                future = self._futures[index] = self._executor.submit(self._fold, index, False)
                return future
            future = self._futures[index] = Future()
        try:
            future.set_result(self._fold(index, True))
        except BaseException as error:  # raised to every reader of the block, this one first
            future.set_exception(error)
        return future

    def _fold(self, index: int, here: bool) -> dict[str, Transform] | None:
        # One thread for the C balancing and, in the caller's thread, for torch's operations too: the worker's keeps
        # the other core for the load's search; the caller's (block 0, `fold_first` in the pre-load hook, beside only
        # the spares' thread) would spend more time waiting at the barriers of the block's many small parallel
        # regions (the error test's 64 sampled rows, a balancing pass of a few row blocks) than it saved: on the 1.2B
        # at load 9 block 0 took 0.34-0.37 CPU s and 1.5-1.9 s wall at two threads, 0.12-0.13 CPU s and 0.27-0.30 s
        # at one (docs/performance.md, issue #32, thirteenth session). The worker's thread needs no device context:
        # torch's default device and function modes are per thread, and a new thread's are the CPU and none (a
        # `torch.device("cpu")` there sent each of the fold's torch calls through its Python `__torch_function__`).
        place = _on_cpu_in_float32() if here else nullcontext()
        with self._folding, place, _torch_threads(1 if here else None):
            return self._planner.fold(self._planner.blocks[index], 1)
