"""`HfQuantConfig(fold_column_scales=True)` on a transformers model: which modules fold, and the plan from the checkpoint.

The math is `hfquant.core.folding`; this module knows the decoder blocks of the Llama family (Llama, Mistral, Qwen2,
Qwen3: pre-norm RMSNorm blocks with `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`) and reads one block's
float weights at a time from the checkpoint, before the streaming load, to compute its column scales:

    transforms = plan_folds(model, plans, read)       # {module name: Transform}, small vectors only
    # then, while the checkpoint streams in, each listed tensor is transformed before it is quantized (or stored,
    # for the norms and biases): `HfQuantQuantize.convert`.

Within a block, a fold is made only when every matrix it changes is quantized by hfquant (a layer kept in float would
not pass through the quantizer's op): v_proj -> o_proj, up_proj -> down_proj, input_layernorm -> q/k/v and
post_attention_layernorm -> gate/up. Other architectures, and layers outside such blocks, are quantized as the config
says (their method: RTN, or SINQ with a stored column scale).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from transformers.utils.logging import is_progress_bar_enabled, tqdm

from hfquant.checkpoint.files import open_safetensors, read_headers, read_tensor
from hfquant.checkpoint.streaming import release_checkpoint_pages
from hfquant.core import folding, sinq
from hfquant.core.folding import Transform
from hfquant.core.format import Method
from hfquant.core.scratch import Scratch
from hfquant.integration.conversions import model_key_map
from hfquant.ops import balance

__all__ = ["FOLDABLE_MODEL_TYPES", "Block", "find_blocks", "plan_folds", "fold_overrides", "checkpoint_reader"]

logger = logging.getLogger(__name__)

FOLDABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""`config.model_type`s whose decoder blocks `find_blocks` folds: pre-norm blocks whose norms compute
normalize(x) * weight (no offset such as Gemma's 1 + weight) and whose attention output mixes `v_proj`'s rows per head."""


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
    model: nn.Module, plans: Iterable, read: Callable[[str], torch.Tensor], progress: bool | None = None
) -> dict[str, Transform]:
    """The fold of every foldable block of `model`, computed from its float weights.

    Args:
        model: the (meta-device) transformers model, before its layers are replaced.
        plans: the `LayerPlan`s of its Linear layers (`plan.format` None: kept in float, so not folded).
        read: model tensor name (`model.layers.0.self_attn.q_proj.weight`) -> its float tensor from the checkpoint;
            KeyError when the checkpoint lacks it.
        progress: a tqdm bar over the blocks; None follows transformers' switch
            (`transformers.utils.logging.disable_progress_bar`).
    Returns:
        {module name: `Transform`} for the norms and Linear layers the folds change (empty when nothing folds).
    A block whose folds read a missing tensor or a weight holding NaN/Inf is left unfolded (a warning names it): the
    load's own checks then refuse it naming the tensor and the fix.

    Raises:
        ValueError: the head counts do not fit the projections (naming the module).
    """
    blocks = find_blocks(model)
    if not blocks:
        logger.info(
            "hfquant: no foldable decoder block in %s (fold_column_scales acts on %s): nothing folded",
            type(model).__name__,
            ", ".join(FOLDABLE_MODEL_TYPES),
        )
        return {}
    formats = {plan.name: plan.format for plan in plans}
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    transforms: dict[str, Transform] = {}

    def tile(*names: str) -> int:
        width = model.get_submodule(names[0]).in_features
        return folding.tile_size(width, [formats[n].group_size for n in names])

    scratch = Scratch()  # one set of weight-sized temporaries for the whole pass (`hfquant.core.scratch`)
    with _on_cpu_in_float32():  # from_pretrained prepares the model under the meta device and the load dtype
        for block in tqdm(
            blocks,
            desc="hfquant: SINQ column scales (Sinkhorn on each layer's float weights)",
            unit="layer",
            disable=_progress_disabled(progress),
        ):
            try:
                transforms.update(_fold_block(block, read, tile, formats, num_heads, num_kv_heads, scratch))
            except (KeyError, sinq.NonFiniteWeightError) as error:
                # Left unfolded, its layers go through the load's own checks, which name the tensor and the fix.
                reason = error.args[0] if error.args else error
                logger.warning(
                    "hfquant: the column scales of %s are not folded: %s",
                    block.attention_norm.rpartition(".")[0],
                    reason,
                )
            release_checkpoint_pages(keep_cached=True)  # out of this process, kept for the streaming load
    scratch.clear()
    logger.info("hfquant: column scales folded in %d block(s), %d module(s) changed", len(blocks), len(transforms))
    return transforms


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


def _fold_block(
    block: Block, read, tile, formats, num_heads: int, num_kv_heads: int, scratch: Scratch | None = None
) -> dict[str, Transform]:
    """The folds of one block (see `plan_folds`): {module name: Transform}, merged where two folds change one module.

    Raises:
        KeyError: the checkpoint lacks a tensor the block's folds read.
        sinq.NonFiniteWeightError: a weight the folds read holds NaN or Inf.
        ValueError: the head counts do not fit the projections.
    """
    transforms: dict[str, Transform] = {}

    def add(name: str, transform: Transform) -> None:
        transforms[name] = transforms[name].merged(transform) if name in transforms else transform

    quantized = {name for name in block if formats.get(name) is not None}
    v_rows = up_rows = None
    if {block.v, block.o} <= quantized:
        o_scale = balance.column_scale([read(block.o + ".weight")], tile(block.o), scratch=scratch)
        try:
            v_rows, o_scale = folding.share_across_heads(o_scale, num_heads, num_kv_heads)
        except ValueError as error:
            raise ValueError(f"cannot fold the column scales of {block.o}: {error}") from None
        add(block.o, Transform(col_scale=o_scale))
        add(block.v, Transform(row_scale=v_rows))
    if {block.q, block.k, block.v} <= quantized:
        # v's rows carry o_proj's fold; only the statistics read them scaled (`hfquant.ops.balance`): the stored layer
        # is rescaled exactly, in float32, when it is quantized
        scale = balance.column_scale(
            [read(block.q + ".weight"), read(block.k + ".weight"), read(block.v + ".weight")],
            tile(block.q, block.k, block.v),
            [None, None, v_rows],
            scratch=scratch,
        )
        norm, scale = folding.fold_into_norm(read(block.attention_norm + ".weight"), scale)
        add(block.attention_norm, norm)
        for name in (block.q, block.k, block.v):
            add(name, Transform(col_scale=scale))
    if {block.up, block.down} <= quantized:
        up_rows = balance.column_scale([read(block.down + ".weight")], tile(block.down), scratch=scratch)
        add(block.down, Transform(col_scale=up_rows))
        add(block.up, Transform(row_scale=up_rows))
    if {block.gate, block.up} <= quantized:
        scale = balance.column_scale(
            [read(block.gate + ".weight"), read(block.up + ".weight")],
            tile(block.gate, block.up),
            [None, up_rows],
            scratch=scratch,
        )
        norm, scale = folding.fold_into_norm(read(block.mlp_norm + ".weight"), scale)
        add(block.mlp_norm, norm)
        for name in (block.gate, block.up):
            add(name, Transform(col_scale=scale))
    return transforms


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
