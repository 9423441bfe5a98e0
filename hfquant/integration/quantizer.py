"""The transformers glue: the only module that touches `HfQuantizer` hooks (transformers 5.x).

Loading flow (`from_pretrained(path, quantization_config=HfQuantConfig(...))`):
  1. `_process_model_before_weight_loading` builds the `LoadPlan` (`hfquant.integration.load_plan`) on the meta-device
     skeleton and applies it: Linear/Conv1D layers become empty `QuantLinear`s (shapes of the stored tensors known
     from the config), except lm_head, tied weights and `modules_to_not_convert`; with `embedding_dtype` int8/int4
     embeddings become `QuantEmbedding`s, with `lm_head` int8/int4 the output embedding becomes a `QuantLinear` (a
     tied one reads the input embedding's tensors), fused 3-D MoE expert weights become `QuantExperts`, and float
     embeddings / norms get their configured dtype.
  2. For each checkpoint tensor of a quantized module (`x.weight`, or a merged `experts.gate_up_proj`),
     `param_needs_quantization` says yes, and transformers calls `HfQuantQuantize.convert` with that one float tensor
     just read from the file (after its own merge ops for experts); it returns the quantized buffers
     (`hfquant.integration.quantize_weights`), records the key or the failure in the `LoadReport`, and the float
     tensor is dropped before the next one is read.
  3. `_process_model_after_weight_loading`: the report's failures are raised by name; tied modules get the input
     embedding's tensors, each layer picks its kernel and repacks for it, a tied embedding shares the lm_head's kernel
     tensor (`hfquant.integration.embeddings`), and modules stored in another float dtype get hooks casting their
     output back to the compute dtype; the `nn.Linear` layers left in float become `FloatLinear`s
     (`hfquant.nn.float_linear`: a single bfloat16 row on CPU skips oneDNN's slow GEMV), the RMSNorms of known
     classes compute a single bfloat16 row in one C call (`hfquant.nn.row_norm`), and a "sdpa" model not given an
     `attn_implementation` by name attends one query row in one C call (`hfquant.nn.row_attention`).
Reloading a saved checkpoint (`config.json` has `quantization_config`) skips step 2: the stored tensors load as
they are, with their stored dtypes.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import ConversionOps
from transformers.integrations.accelerate import offload_weight
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from hfquant.checkpoint.files import PLACEHOLDER_METADATA
from hfquant.checkpoint.saving import attach_staged_save
from hfquant.checkpoint.streaming import PageReleaser, mapped_checkpoint_ranges, release_range, trim_heap
from hfquant.config import QUANT_METHOD, HfQuantConfig
from hfquant.core.dtypes import dtype_name, torch_dtype
from hfquant.core.folding import Transform
from hfquant.core.huge_pages import Spares
from hfquant.integration import checks
from hfquant.integration.config_type import register_model_type, restore_base_model_type
from hfquant.integration.conversions import expert_scale_conversions, keep_expert_scale_conversions
from hfquant.integration.counting import count_quantized_weights
from hfquant.integration.decode_activations import apply_decode_activations
from hfquant.integration.dequantize import dequantize_model
from hfquant.integration.embeddings import share_tied_kernels, tie_buffers
from hfquant.integration.folding import FoldStream, find_blocks
from hfquant.integration.load_plan import (
    LoadPlan,
    apply_plan,
    install_adapters,
    plan_checkpoint_folds,
    plan_load,
    record_stored_formats,
)
from hfquant.integration.load_report import LoadReport
from hfquant.integration.quantize_weights import (
    GroupRows,
    quantize_on_load,
    requantize_disk_offloaded,
    stored_allocations,
)
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import EXPERT_PROJECTIONS, QuantExperts
from hfquant.nn.float_linear import use_float_linear
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import LayerPlan, plan_layers, restore_kernel_buffers
from hfquant.nn.row_attention import use_row_attention
from hfquant.nn.row_decode import use_row_decode
from hfquant.nn.row_norm import use_row_rms_norms
from hfquant.ops import block_layout
from hfquant.ops.vml_dispatch import resolve_vml_dispatch

__all__ = ["HfQuantQuantizer", "HfQuantQuantize", "plan_model", "register"]

logger = logging.getLogger(__name__)

_STORED_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_col_scale") + tuple(
    f"{name}{suffix}" for name in EXPERT_PROJECTIONS for suffix in ("_scale", "_zero_point")
)


def plan_model(model, config: HfQuantConfig, quantizing: bool = False) -> tuple[list[str], list[LayerPlan]]:
    """Skip list and per-layer plan for a (meta-device) transformers model, as quantize-on-load applies them.

    The skip list is transformers' default (tied weights, output embedding, last module, `_keep_in_fp32_modules`)
    plus `config.modules_to_not_convert`. When `quantizing` (a float checkpoint, not a reload), the data-free rule of
    `config.mixed_precision` is first written into `config.module_overrides` for the layers to quantize. `hfquant
    convert` uses the same function so both paths agree.
    """
    default_skips = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    skip = sorted(set(default_skips) | set(config.modules_to_not_convert))
    plans = plan_layers(model, config, skip)
    if quantizing:
        layers = {plan.name: (plan.in_features, plan.out_features) for plan in plans if plan.format is not None}
        added = config.apply_mixed_precision(
            list(layers), shapes=layers, overhead=_column_scale_bits(model, config, layers)
        )
        if added:
            logger.info("hfquant mixed_precision='auto': %d layer(s) get their own format: %s", len(added), added)
            plans = plan_layers(model, config, skip)
    return skip, plans


def _column_scale_bits(model, config: HfQuantConfig, layers: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Bits per weight each layer of `layers` ({name: (in_features, out_features)}) will store beside its codes as a
    SINQ column scale (bfloat16, one per input column: 16 / out_features), for a bits budget to count: every layer with
    `method="sinq"` unless the model folds the scales (`fold_column_scales` on a `find_blocks` model, whose block-format
    layers are then all stored with RTN: `fold_overrides`)."""
    if config.method != "sinq" or (config.fold_column_scales and find_blocks(model)):
        return {}
    return {name: 16.0 / out_features for name, (_, out_features) in layers.items()}


class HfQuantQuantize(ConversionOps):
    """Conversion op run by transformers on one float weight tensor as it streams in: float -> stored tensors
    (`quantize_weights.quantize_on_load`), recorded in the quantizer's `LoadReport`. It holds the quantizer, as
    transformers' quantizers' ops do, to read its plan (the folds) and config (`clipping`, `iq4_search`)."""

    def __init__(self, hf_quantizer: HfQuantQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model=None, **kwargs) -> dict[str, torch.Tensor]:
        folds, report = self.hf_quantizer.plan.folds, self.hf_quantizer.report
        clipping = self.hf_quantizer.quantization_config.clipping
        iq4_search = self.hf_quantizer.quantization_config.iq4_search
        result: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, _ = get_module_from_name(model, key)
            try:
                fold = folds.get(key.rpartition(".")[0])
                threads = _rtn_threads(folds)
                stored = quantize_on_load(module, key, tensor, fold, clipping, threads, report.rows, iq4_search)
                if stored is None:
                    result[key] = tensor
                    continue
                result.update(stored[0])
                if stored[1]:
                    report.quantized_keys.add(key)
                    _consume_source(report.pages, tensor, stored[0].values())
            except ValueError as error:
                # transformers would swallow this into a generic RuntimeError: remember it, raise it by name
                # once loading is over (`LoadReport.raise_failures`).
                report.failed[key] = str(error)
            except MemoryError:  # the same, raised as a MemoryError saying what to do
                report.out_of_memory.append(key)
            # a view (of the checkpoint's map, as transformers reads a tensor of the load's dtype) frees no heap memory
            nbytes, copied = tensor.numel() * tensor.element_size(), tensor._base is None
            del tensor, value
            report.pages.read(nbytes, copied)
        return result


def _consume_source(pages: PageReleaser, source: torch.Tensor, stored) -> None:
    """Unmap the checkpoint pages of a weight just quantized (`PageReleaser.consume`) when `source` is a contiguous
    view of the checkpoint's map (transformers reads a tensor of the load's dtype so) that none of its `stored` tensors
    shares: nothing reads those bytes again. A copy (cast to the load's dtype) is left to the periodic release."""
    if source._base is None or not source.is_contiguous() or source.device.type != "cpu":
        return
    start = source.data_ptr()
    end = start + source.numel() * source.element_size()
    for tensor in stored:
        if tensor.device.type == "cpu" and tensor.numel():
            storage = tensor.untyped_storage()
            if storage.data_ptr() < end and start < storage.data_ptr() + storage.nbytes():
                return
    pages.consume(start, end - start)


def _rtn_threads(folds) -> int | None:
    """The C RTN's threads for the next weight: one fewer than torch's while a fold worker folds beside the load
    (`FoldStream.worker_busy`: it balances at one thread), else None (torch's count). At torch's two threads on two
    cores, the RTN's second thread and the worker took turns on one core, and the main thread waited for (or OpenMP
    spun on) that thread at every row chunk (docs/performance.md, issue #32, ninth session)."""
    if not getattr(folds, "worker_busy", False):
        return None
    return max(1, torch.get_num_threads() - 1)


class HfQuantQuantizer(HfQuantizer):
    """Quantizer for `quant_method="hfquant"`: RTN int8/int4 weight-only, quantized on load or reloaded.

    It works on a copy of the config it is given: a resolved `compute_dtype` is written into that copy (and so into
    `config.json`), never into the caller's object. Besides the config and `pre_quantized` (transformers'), it keeps
    two values: `plan`, the `LoadPlan` its pre-load hook builds (what is skipped, the layer formats, folds, ties and
    dtype adapters), and `report`, the `LoadReport` its weight op fills (keys quantized, failures, out of memory, the
    `GroupRows` it writes decode groups' codes into).

    Args:
        quantization_config: the `HfQuantConfig`.
        folds: `fold_column_scales` folds already computed from this checkpoint with this config (`hfquant convert`'s
            workers): the pre-load hook then does not read the checkpoint again to plan them.
        **kwargs: transformers' (`pre_quantized`).
    """

    requires_calibration = False
    quantization_config: HfQuantConfig
    loaded_model_hooks: tuple[Callable[[nn.Module], None], ...] = (attach_staged_save, apply_decode_activations)
    """Called with every loaded model, its kernels ready: `attach_staged_save` (save_pretrained over a checkpoint swaps
    folders), `apply_decode_activations` (the config's `decode_activations`); `import hfquant` adds `attach_model_card`
    (push_to_hub sends hfquant's card): the integration layer never imports the Hub or the cards."""

    def __init__(self, quantization_config: HfQuantConfig, folds: dict[str, Transform] | None = None, **kwargs):
        super().__init__(copy.deepcopy(quantization_config), **kwargs)
        self.plan = LoadPlan(folds=dict(folds or {}))  # replaced by the pre-load hook's
        self.report = LoadReport()  # replaced by one sized for the checkpoint in the pre-load hook
        self.attention_requested = False  # set by update_attn_implementation

    # -- environment -------------------------------------------------------------------------------------------

    def validate_environment(self, *args, **kwargs):
        self.quantization_config.validate()
        resolve_vml_dispatch()  # before the model's first forward: logits alike in every process

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        compute = self.quantization_config.compute_dtype
        if compute == "auto":
            return dtype
        if dtype is not None and dtype != torch_dtype(compute):
            logger.info("hfquant: compute_dtype=%r replaces dtype=%s", compute, dtype_name(dtype))
        return torch_dtype(compute)

    def update_attn_implementation(self, config):
        """transformers' hook before the model is built: whether `attn_implementation` was passed to
        `from_pretrained` (then it is kept as asked, "sdpa" included); otherwise a model that gets "sdpa" takes
        hfquant's one-query-row attention after loading (`hfquant.nn.row_attention`)."""
        self.attention_requested = getattr(config, "_attn_implementation", None) is not None
        return config

    # -- before loading -----------------------------------------------------------------------------------------

    def _process_model_before_weight_loading(
        self, model, dtype=None, checkpoint_files=None, device_map=None, **kwargs
    ):
        restore_base_model_type(model.config)  # a marked config.json parsed by the model's own config class
        config = self.quantization_config
        compute = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        files = list(checkpoint_files or [])
        self.plan = self._plan(model, compute, files, device_map)
        replaced = apply_plan(model, self.plan, config)
        if self.plan.adapters and config.compute_dtype == "auto":
            # transformers writes config.dtype from the first float parameter, which may now be an embedding or a
            # norm in its own dtype: record the compute dtype so that a reload restores every dtype
            config.compute_dtype = dtype_name(compute)
        if self.pre_quantized and files:
            # A stored tensor of the wrong dtype or shape would be re-initialized at random or loaded as garbage by
            # transformers: compare the shard headers with the skeleton first and raise a ValueError naming it.
            checks.check_stored_tensors(model, files, get_model_conversion_mapping(model, None, self))
        elif files:
            checks.read_single_copies(files)  # headers only: a tensor stored twice is refused
        # quantizing on load, the releases run beside it (the second core is otherwise idle but for the folds)
        pages = PageReleaser.for_files([str(f) for f in files], background=not self.pre_quantized)
        on_cpu = not self.pre_quantized and _on_cpu(device_map)
        self.report = LoadReport(pages, rows=GroupRows() if on_cpu else None)
        if on_cpu and files:  # the quantized weights' maps made resident beside the load (`huge_pages.Spares`)
            self.report.spares = Spares.start(_spare_bytes(files), first=_one_off_stored_bytes(model, self.plan))
        if isinstance(self.plan.folds, FoldStream):
            self.plan.folds.fold_first()  # on this core, the spares' first maps on the other
        if replaced == 0:
            logger.warning("hfquant found no Linear or Conv1D layer to quantize in %s", type(model).__name__)
        return model

    def _plan(self, model, compute: torch.dtype, files: list, device_map) -> LoadPlan:
        """The `LoadPlan` of the meta-device `model`: the skip list and layer formats (`plan_model`), the folds
        (given to the constructor, or read from the checkpoint `files` when `fold_column_scales` asks), then the
        embeddings, lm_head, ties, experts and norms (`plan_load`). The model is not changed; when quantizing, the
        config copy gets the `module_overrides` that mixed precision and folding decide, and an entry for each layer
        stored in another format than the config's fields (`record_stored_formats`)."""
        config = self.quantization_config
        skip, layers = plan_model(model, config, quantizing=not self.pre_quantized)
        folds = self.plan.folds
        if config.fold_column_scales and not self.pre_quantized and not folds:
            folds, layers = plan_checkpoint_folds(model, config, skip, layers, files, device_map)
        if not self.pre_quantized:
            layers = record_stored_formats(model, config, skip, layers)
        return plan_load(model, config, compute, skip, layers, folds)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        if param_name.rpartition(".")[0] in self.plan.folds:  # rescaled on its way in (a norm, a bias, a weight)
            return True
        module, tensor_name = get_module_from_name(model, param_name)
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            return tensor_name == "weight"
        return isinstance(module, QuantExperts) and tensor_name in module.shapes

    def get_quantize_ops(self):
        return HfQuantQuantize(self)

    def get_new_dtype(self, converter, param, dtype):
        # Stored scales keep their stored dtype whatever `dtype` the user loads the model in: it is part of the
        # format, and saving must give back exactly the bytes that were loaded.
        targets = getattr(converter, "target_patterns", None) or []
        if any(str(target).endswith(_STORED_SUFFIXES) for target in targets):
            return None
        return super().get_new_dtype(converter, param, dtype)

    def update_weight_conversions(self, weight_conversions, model):
        """Add, for each model converter that merges per-expert weights into a `QuantExperts` tensor, copies that
        merge (on load) and split (on save) its scales and zero points the same way (`expert_scale_conversions`)."""
        updated = super().update_weight_conversions(weight_conversions, model)
        return updated + expert_scale_conversions(updated, model)

    # -- after loading ------------------------------------------------------------------------------------------

    def _process_model_after_weight_loading(self, model, **kwargs):
        close = getattr(self.plan.folds, "close", None)
        if close is not None:  # a FoldStream: its worker thread and checkpoint files
            close()
        if self.report.spares is not None:
            self.report.spares.close()
            self.report.spares = None  # its lock and queue: the model (`hf_quantizer`) must stay deep-copyable
        self.report.raise_failures()
        if self.pre_quantized:
            checks.check_reloaded_values(model)
        else:
            self.report.raise_missing(checks.weights_to_quantize(model))
        dtype = self.plan.compute_dtype or (model.dtype if model.dtype.is_floating_point else None)
        count_quantized_weights(model)  # num_parameters() counts the quantized weights, stored as buffers
        tie_buffers(model, self.plan.ties)
        counts = _prepare_kernels(model, dtype, self._own_weights())
        if self.report.rows is not None:
            self.report.rows.clear()
        share_tied_kernels(model, self.plan.ties)
        install_adapters(model, self.plan.adapters, dtype)
        keep_expert_scale_conversions(model)
        # the float lm_head is the largest weight an int4 model reads per decoded token: single rows skip oneDNN
        counts["float"] = use_float_linear(model)
        # one-row RMSNorms in one C call (eager decode): the class's own forward bit for bit, swapped back on dequantize
        counts["rms_norm_row"] = use_row_rms_norms(model)
        # one-query-row attention in one C call (eager decode) where "sdpa" was not asked for by name; undone by
        # dequantize and restore_row_attention, never saved (transformers does not write the field)
        counts["attention_row"] = not self.attention_requested and use_row_attention(model)
        # one-token decode forwards of Llama-family attention / MLP / decoder layers (rotary, SwiGLU, add + norm in one
        # C call each); they act only while the row attention above is the model's; undone by dequantize
        counts["decode_rows"] = use_row_decode(model)
        if not self.pre_quantized:
            config = self.quantization_config
            requantize_disk_offloaded(
                model,
                self.plan.folds,
                config.clipping,
                self.plan.compute_dtype,
                offload_weight,
                config.iq4_search,
                changed=lambda key: self.param_needs_quantization(model, key),
            )
        checks.warn_offloaded_buffers(model)
        logger.info("hfquant kernels: %s", counts)
        self.report.pages.flush()
        for hook in self.loaded_model_hooks:
            hook(model)
        return model

    def _own_weights(self) -> set[str]:
        """The layers whose stored weight this load quantized and nothing else reads (not tied): their kernels may
        repack it in place. None when reloading (the weights are views of the checkpoint's files)."""
        if self.pre_quantized:
            return set()
        tied = {name for pair in self.plan.ties for name in pair}
        quantized = {key[: -len(".weight")] for key in self.report.quantized_keys if key.endswith(".weight")}
        return quantized - tied

    def get_state_dict_and_metadata(self, model):
        """transformers' `save_pretrained` hook: the model's own state dict, and shard metadata carrying the
        placeholder checkpoint id that the staged save replaces by the save's id (`stamp_checkpoint_ids`), so that a
        reader can tell the shards of two saves apart (`checks.check_stored_tensors`)."""
        return None, dict(PLACEHOLDER_METADATA)

    def _dequantize(self, model, dtype=None):
        return dequantize_model(model, dtype, self.plan.ties)

    # -- capabilities -------------------------------------------------------------------------------------------

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        """peft LoRA adapters train over the frozen quantized layers (input gradients: `hfquant.ops.autograd`)."""
        return True

    @property
    def is_compileable(self) -> bool:
        """`QuantLinear.forward` traces without graph breaks (tests/test_compile.py checks fullgraph=True)."""
        return True


def _prepare_kernels(model: nn.Module, dtype: torch.dtype | None, own: set[str] = frozenset()) -> dict[str, int]:
    """After loading: each `QuantLinear` of `model` picks its kernel for `dtype` and repacks for it
    (`QuantLinear.prepare_kernel`), the members of a fused decode group together (`DecodeGroup.prepare`: repacked
    straight into the group's tensor); the layers named in `own` (weights nothing else reads) are repacked in place.
    Returns the number of layers per kernel."""
    counts: dict[str, int] = {}
    prepared: set[int] = set()
    maps = [(start, end) for start, end, _ in mapped_checkpoint_ranges()]
    owned = {id(module) for name, module in model.named_modules() if name in own}
    for module in model.modules():
        if not isinstance(module, QuantLinear) or id(module) in prepared:
            continue
        group = module._decode_group
        layers = [module] if group is None else group.members
        for layer in layers:
            restore_kernel_buffers(layer)
        sources = [(layer.weight.data_ptr(), layer.weight.nbytes) for layer in layers]
        in_place = all(id(layer) in owned for layer in layers)
        if group is None:
            chosen = [module.prepare_kernel(dtype, out=module._buffers["weight"] if in_place else None)]
        else:
            chosen = group.prepare(dtype, in_place=in_place)
        for layer, kernel, source in zip(layers, chosen, sources, strict=True):
            prepared.add(id(layer))
            counts[kernel] = counts.get(kernel, 0) + 1
            if layer.weight.data_ptr() != source[0]:
                _release_source(*source, maps)
    block_layout.release_staging()
    # Once, not per layer: the replaced stored-layout tensors must not stay resident, but a trim per layer hands back
    # the freed pages that the next layer's repack would have reused, and faults them in again (#28: a reload right
    # after `del model` took 0.6-1.0 s against 0.3 s).
    trim_heap()
    return counts


def _spare_bytes(files: list) -> int:
    """The bytes of spare weight maps a quantize-on-load may hold (`huge_pages.Spares`): 1/64 of the checkpoint
    `files`, within 32-256 MiB (one block's quantized weights at 4 bits: 32 MiB at the 1.2B benchmark model, 115 at the
    7.4B)."""
    total = sum(os.path.getsize(f) for f in map(str, files) if os.path.isfile(f))
    return min(256 * 2**20, max(32 * 2**20, total // 64))


def _one_off_stored_bytes(model: nn.Module, plan: LoadPlan) -> tuple[int, ...]:
    """The bytes of each stored tensor the load allocates once in a size of its own (an lm_head's weight, an
    embedding's; `stored_allocations`, which counts a decode group's weights as the one tensor `GroupRows` gives
    them), in the plan's order: `Spares` makes their maps first, while the pre-load hook folds the first block. It
    makes spares only of sizes asked for twice otherwise, and a fresh map's first write is slow where the host backs
    the guest's pages as they are touched: the 1.2B's int8 lm_head, the first tensor its load quantizes, took 0.35 s
    of which 0.05 s with its map written before (docs/performance.md, twenty-seventh session)."""
    names = [layer.name for layer in plan.layers if layer.format] + list(plan.embeddings)
    sizes = stored_allocations([model.get_submodule(name) for name in names])
    counts = collections.Counter(sizes)
    return tuple(size for size in sizes if counts[size] == 1)


def _on_cpu(device_map) -> bool:
    """Whether `device_map` (from_pretrained's, resolved) places every module on the CPU (None: no map)."""
    if device_map is None:
        return True
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    return all(str(value) == "cpu" for value in values)


def _release_source(address: int, nbytes: int, maps: list[tuple[int, int]]) -> None:
    """Unmap the pages of a stored weight that `prepare_kernel` replaced (repacked, or copied where unaligned), if it
    was a view of a mapped checkpoint file, keeping them in the page cache: a reload's weights are such views, and
    their pages stayed resident beside the copies until the load ended (2.2x a block checkpoint's size at the peak)."""
    mapping = next(((start, end) for start, end in maps if start <= address < end), None)
    if mapping is not None:
        release_range(address, nbytes, mapping)


def register() -> None:
    """Register `HfQuantConfig` and `HfQuantQuantizer` with transformers under `quant_method="hfquant"`, and
    `model_type="hfquant"` (saved checkpoints, `hfquant.checkpoint.model_type`) with `AutoConfig`; idempotent.

    Raises:
        ValueError: another package already registered a different class under "hfquant".
    """
    config_cls = AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD)
    if config_cls is None:
        register_quantization_config(QUANT_METHOD)(HfQuantConfig)
    elif config_cls is not HfQuantConfig:
        raise ValueError(f"quant_method {QUANT_METHOD!r} is already registered by {config_cls!r}")
    quantizer_cls = AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD)
    if quantizer_cls is None:
        register_quantizer(QUANT_METHOD)(HfQuantQuantizer)
    elif quantizer_cls is not HfQuantQuantizer:
        raise ValueError(f"quant_method {QUANT_METHOD!r} is already registered by {quantizer_cls!r}")
    register_model_type()
