"""The transformers glue: the only module that touches `HfQuantizer` hooks (transformers 5.x).

Loading flow (`from_pretrained(path, quantization_config=HfQuantConfig(...))`):
  1. `_process_model_before_weight_loading`: on the meta-device skeleton, Linear/Conv1D layers become empty
     `QuantLinear`s (shapes of the stored tensors known from the config), except lm_head, tied weights and
     `modules_to_not_convert`; with `embedding_dtype` int8/int4 embeddings become `QuantEmbedding`s, with `lm_head`
     int8/int4 the output embedding becomes a `QuantLinear` (a tied one reads the input embedding's tensors), fused
     3-D MoE expert weights become `QuantExperts`, and float embeddings / norms get their configured dtype.
  2. For each checkpoint tensor of a quantized module (`x.weight`, or a merged `experts.gate_up_proj`),
     `param_needs_quantization` says yes, and transformers calls `HfQuantQuantize.convert` with that one float tensor
     just read from the file (after its own merge ops for experts); it returns the quantized buffers, and the float
     tensor is dropped before the next one is read.
  3. `_process_model_after_weight_loading`: tied modules get the input embedding's tensors, each layer picks its
     kernel and repacks for it, a tied embedding shares the lm_head's kernel tensor, and modules stored in another
     float dtype get hooks casting their output back to the compute dtype; the `nn.Linear` layers left in float
     become `FloatLinear`s (`hfquant.nn.float_linear`: a single bfloat16 row on CPU skips oneDNN's slow GEMV).
Reloading a saved checkpoint (`config.json` has `quantization_config`) skips step 2: the stored tensors load as
they are, with their stored dtypes.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.integrations.accelerate import offload_weight
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from hfquant.checkpoint.files import PLACEHOLDER_METADATA, SAFETENSORS_DTYPES, open_safetensors, read_tensor
from hfquant.checkpoint.saving import attach_staged_save
from hfquant.checkpoint.schema import problem_text
from hfquant.checkpoint.streaming import PageReleaser, release_checkpoint_pages, trim_heap
from hfquant.config import QUANT_METHOD, HfQuantConfig, matches_module
from hfquant.core import folding
from hfquant.core.dtypes import dtype_name, torch_dtype
from hfquant.integration import checks
from hfquant.integration.config_type import register_model_type, restore_base_model_type
from hfquant.integration.counting import count_quantized_weights
from hfquant.integration.decode_activations import apply_decode_activations
from hfquant.integration.embeddings import module_name, output_embeddings, plan_embeddings_and_head
from hfquant.integration.folding import checkpoint_reader, fold_overrides, plan_folds
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import EXPERT_PROJECTIONS, QuantExperts, quantize_experts_tensor
from hfquant.nn.float_linear import restore_nn_linear, use_float_linear
from hfquant.nn.linear import QuantLinear, quantize_to_buffers
from hfquant.nn.norms import find_norms, install_dtype_adapter
from hfquant.nn.replace import (
    LayerPlan,
    cast_float_params,
    plan_experts,
    plan_layers,
    replace_with_quant_experts,
    replace_with_quant_linear,
    restore_kernel_buffers,
)

__all__ = ["HfQuantQuantizer", "HfQuantQuantize", "plan_model", "register"]

logger = logging.getLogger(__name__)

_STORED_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_col_scale") + tuple(
    f"{name}{suffix}" for name in EXPERT_PROJECTIONS for suffix in ("_scale", "_zero_point")
)
_TENSOR_NAMES = ("weight", "weight_scale", "weight_zero_point")


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
        added = config.apply_mixed_precision(plan.name for plan in plans if plan.format is not None)
        if added:
            logger.info("hfquant mixed_precision='auto': %d layer(s) get their own format: %s", len(added), added)
            plans = plan_layers(model, config, skip)
    return skip, plans


class HfQuantQuantize(ConversionOps):
    """Conversion op run by transformers on one float weight tensor as it streams in: float -> stored buffers."""

    def __init__(self, hf_quantizer: HfQuantQuantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model=None, **kwargs) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, tensor_name = get_module_from_name(model, key)
            fold = self.hf_quantizer.folds.get(key.rpartition(".")[0])
            try:
                if isinstance(module, (QuantLinear, QuantEmbedding)) and tensor_name == "weight":
                    if getattr(module, "transposed_source", False):
                        tensor = tensor.t()
                    prefix = key[: -len("weight")]
                    clipping = (
                        self.hf_quantizer.quantization_config.clipping if isinstance(module, QuantLinear) else "minmax"
                    )
                    buffers = quantize_to_buffers(tensor, module.format, clipping, fold)
                    result.update({prefix + name: buffer for name, buffer in buffers.items()})
                    self.hf_quantizer.quantized_keys.add(key)
                elif isinstance(module, QuantExperts) and tensor_name in module.shapes:
                    buffers = quantize_experts_tensor(tensor, module.formats[tensor_name])
                    result.update({key + suffix: buffer for suffix, buffer in buffers.items()})
                    self.hf_quantizer.quantized_keys.add(key)
                elif fold is not None:  # a norm weight or a bias that a fold rescales (fold_column_scales)
                    result[key] = folding.apply(tensor, fold).to(tensor.dtype)
                else:
                    result[key] = tensor
                    continue
            except ValueError as error:
                # transformers would swallow this into a generic RuntimeError: remember it, raise it by name
                # once loading is over (`_process_model_after_weight_loading`).
                self.hf_quantizer.failed_tensors[key] = str(error)
            except MemoryError:  # the same, raised as a MemoryError saying what to do
                self.hf_quantizer.out_of_memory.append(key)
            nbytes = tensor.numel() * tensor.element_size()
            del tensor, value
            self.hf_quantizer.page_releaser.read(nbytes)
        return result


class HfQuantQuantizer(HfQuantizer):
    """Quantizer for `quant_method="hfquant"`: RTN int8/int4 weight-only, quantized on load or reloaded.

    It works on a copy of the config it is given: a resolved `compute_dtype` is written into that copy (and so into
    `config.json`), never into the caller's object.
    """

    requires_calibration = False
    quantization_config: HfQuantConfig
    loaded_model_hooks: tuple[Callable[[nn.Module], None], ...] = (attach_staged_save, apply_decode_activations)
    """Called with every loaded model, its kernels ready: `attach_staged_save` (save_pretrained over a checkpoint swaps
    folders), `apply_decode_activations` (the config's `decode_activations`); `import hfquant` adds `attach_model_card`
    (push_to_hub sends hfquant's card): the integration layer never imports the Hub or the cards."""

    def __init__(self, quantization_config: HfQuantConfig, **kwargs):
        super().__init__(copy.deepcopy(quantization_config), **kwargs)
        self.layer_plans = []
        self.failed_tensors: dict[str, str] = {}  # checkpoint key -> why quantizing it failed
        self.out_of_memory: list[str] = []  # checkpoint keys whose quantization ran out of memory
        self.quantized_keys: set[str] = set()  # model keys of the float tensors quantized on load
        self.compute_dtype: torch.dtype | None = None
        self.ties: list[tuple[str, str]] = []  # (module reading the tensors, module holding them), after loading
        self.adapters: dict[str, tuple[torch.dtype, bool]] = {}  # module -> (storage dtype, cast its float inputs)
        self.expert_conversions: list[tuple[Any, Any]] = []  # (model's converter, our copy for scales / zero points)
        self.folds: dict[
            str, folding.Transform
        ] = {}  # module name -> its fold (fold_column_scales), set before loading
        self.page_releaser = PageReleaser()  # sized by the checkpoint in _process_model_before_weight_loading

    # -- environment -------------------------------------------------------------------------------------------

    def validate_environment(self, *args, **kwargs):
        self.quantization_config.validate()

    def update_dtype(self, dtype: torch.dtype | None) -> torch.dtype | None:
        compute = self.quantization_config.compute_dtype
        if compute == "auto":
            return dtype
        if dtype is not None and dtype != torch_dtype(compute):
            logger.info("hfquant: compute_dtype=%r replaces dtype=%s", compute, dtype_name(dtype))
        return torch_dtype(compute)

    # -- before loading -----------------------------------------------------------------------------------------

    def _process_model_before_weight_loading(self, model, dtype=None, **kwargs):
        restore_base_model_type(model.config)  # a marked config.json parsed by the model's own config class
        config = self.quantization_config
        compute = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        self.compute_dtype = compute
        self.modules_to_not_convert, self.layer_plans = plan_model(model, config, quantizing=not self.pre_quantized)
        if config.fold_column_scales and not self.pre_quantized and not self.folds:
            self._plan_folds(model, kwargs.get("checkpoint_files"), kwargs.get("device_map"))
        head = module_name(model, output_embeddings(model))
        replaced = plan_embeddings_and_head(model, config, compute, self.adapters, self.ties)
        if head is not None and not isinstance(model.get_submodule(head), nn.Linear):  # lm_head was planned above
            self.layer_plans = [plan for plan in self.layer_plans if plan.name != head]
        replaced += replace_with_quant_linear(model, self.layer_plans, compute)
        replaced += self._plan_experts(model, compute)
        self._plan_norms(model, compute)
        if self.adapters and config.compute_dtype == "auto":
            # transformers writes config.dtype from the first float parameter, which may now be an embedding or a
            # norm in its own dtype: record the compute dtype so that a reload restores every dtype
            config.compute_dtype = dtype_name(compute)
        if self.pre_quantized and kwargs.get("checkpoint_files"):
            # A stored tensor of the wrong dtype or shape would be re-initialized at random or loaded as garbage by
            # transformers: compare the shard headers with the skeleton first and raise a ValueError naming it.
            checks.check_stored_tensors(model, kwargs["checkpoint_files"], self)
        elif kwargs.get("checkpoint_files"):
            checks.read_single_copies(kwargs["checkpoint_files"])  # headers only: a tensor stored twice is refused
        self.page_releaser = PageReleaser.for_files([str(f) for f in kwargs.get("checkpoint_files") or []])
        if replaced == 0:
            logger.warning("hfquant found no Linear or Conv1D layer to quantize in %s", type(model).__name__)
        return model

    def _plan_folds(self, model, checkpoint_files, device_map) -> None:
        """`fold_column_scales`: read each decoder block's float weights once (`hfquant.integration.folding`), keep the
        transforms for the streaming load, and store the folded layers with RTN (entries put first in the config's
        `module_overrides`). Without a safetensors checkpoint (a GGUF file, a state dict) nothing is folded and a
        warning says so."""
        files = [str(f) for f in (checkpoint_files or [])]
        if not files or not all(f.endswith(".safetensors") for f in files):
            logger.warning(
                "hfquant: fold_column_scales needs a safetensors checkpoint to read before loading (got %s); "
                "the layers are quantized without folding",
                files or "no checkpoint files",
            )
            return
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError(
                "fold_column_scales does not support disk offload (device_map places modules on 'disk'): quantize with "
                "a device_map without 'disk' and save, or use fold_column_scales=False"
            )
        with checkpoint_reader(model, files, self) as read:
            self.folds = plan_folds(model, self.layer_plans, read)
        added = fold_overrides(self.quantization_config, self.layer_plans, self.folds)
        if added:
            self.quantization_config.prepend_overrides(added)
            self.layer_plans = plan_layers(model, self.quantization_config, self.modules_to_not_convert)

    def _plan_experts(self, model, compute: torch.dtype) -> int:
        config = self.quantization_config
        count = 0
        for plan in plan_experts(model, config.bits, config.group_size, self.modules_to_not_convert):
            if plan.reason == "modules_to_not_convert":
                logger.info("hfquant keeps experts %s in float: modules_to_not_convert", plan.name)
            elif plan.reason:
                logger.warning(
                    "hfquant keeps the MoE experts %s in float (%s): only (experts, out, in) weights without biases "
                    "are quantized; list them in modules_to_not_convert to silence this warning",
                    plan.name,
                    plan.reason,
                )
            else:
                replace_with_quant_experts(model, plan, config.bits, config.symmetric, compute)
                count += 1
        return count

    def _plan_norms(self, model, compute: torch.dtype) -> None:
        name = self.quantization_config.norm_dtype
        if name == "auto" or torch_dtype(name) == compute:
            return
        for norm in find_norms(model):
            if matches_module(norm, self.quantization_config.modules_to_not_convert):
                continue
            cast_float_params(model.get_submodule(norm), torch_dtype(name))
            self.adapters[norm] = (torch_dtype(name), True)

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        if self.pre_quantized:
            return False
        if param_name.rpartition(".")[0] in self.folds:  # rescaled on its way in (a norm, a bias, a weight)
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
        merge (on load) and split (on save) its scales and zero points the same way: on disk every expert keeps the
        layout of a quantized Linear (`experts.3.w1.weight`, `.weight_scale`, `.weight_zero_point`)."""
        updated = super().update_weight_conversions(weight_conversions, model)
        experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
        if not experts:
            return updated
        suffixes = ["_scale"] + ([] if experts[0].symmetric else ["_zero_point"])
        extra = []
        for converter in updated:
            if not isinstance(converter, WeightConverter):
                continue
            sources, targets = converter._original_source_patterns, converter._original_target_patterns
            if len(targets) != 1 or targets[0].rpartition(".")[2] not in EXPERT_PROJECTIONS:
                continue
            if not all(source.endswith(".weight") for source in sources):
                continue
            for suffix in suffixes:
                copied = converter.copy(
                    [source + suffix for source in sources],
                    [targets[0] + suffix],
                    operations=list(converter.operations),
                )
                self.expert_conversions.append((converter, copied))
                extra.append(copied)
        return updated + extra

    # -- after loading ------------------------------------------------------------------------------------------

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.out_of_memory:
            raise MemoryError(
                f"out of memory while quantizing {self.out_of_memory[0]} ({len(self.out_of_memory)} tensor(s)): free "
                "memory, place part of the model elsewhere (device_map='auto' with max_memory=...), or quantize file to "
                "file with `hfquant convert`, which holds one tensor at a time, and load its output"
            )
        if self.failed_tensors:
            key, message = next(iter(self.failed_tensors.items()))
            module = key.rsplit(".", 1)[0]
            raise ValueError(
                f"hfquant could not quantize {key}: {message} ({len(self.failed_tensors)} tensor(s) failed: "
                f"{sorted(self.failed_tensors)}). Fix those weights in the checkpoint, or keep the module in float "
                f"with HfQuantConfig(modules_to_not_convert=[{module!r}])."
            )
        if self.pre_quantized:
            # one NaN or zero scale would turn every logit NaN, silently: refuse the impossible values by name
            problems = checks.stored_value_problems(model)
            if problems:
                raise ValueError(problem_text(problems, what="holds impossible values"))
            # the shards' ids read before the weights must still be the files': else a convert --overwrite swapped
            # the folder meanwhile and the weights may mix two saves
            checks.confirm_checkpoint_unchanged(model)
        else:
            never = sorted(set(checks.weights_to_quantize(model)) - self.quantized_keys)
            if never:  # their buffers still hold the uninitialized memory they were allocated with
                more = f" and {len(never) - 1} more ({never})" if len(never) > 1 else ""
                raise ValueError(
                    f"the checkpoint has no tensor for {never[0]}{more}, so hfquant had nothing to quantize into that "
                    "layer (it would compute with uninitialized memory): use the complete float checkpoint, or keep "
                    f"the module in float with HfQuantConfig(modules_to_not_convert=[{never[0].rpartition('.')[0]!r}])"
                )
        dtype = self.compute_dtype or (model.dtype if model.dtype.is_floating_point else None)
        count_quantized_weights(model)  # num_parameters() counts the quantized weights, stored as buffers
        self._tie_buffers(model)
        counts: dict[str, int] = {}
        for module in model.modules():
            if isinstance(module, QuantLinear):
                restore_kernel_buffers(module)
                kernel = module.prepare_kernel(dtype)
                module.decode_activations = self.quantization_config.decode_activations
                counts[kernel] = counts.get(kernel, 0) + 1
                trim_heap()  # the replaced stored-layout tensor must not stay resident
        self._share_tied_kernels(model)
        for name, (storage, cast_inputs) in self.adapters.items():
            module = model.get_submodule(name)
            if any(p.dtype != dtype for p in module.parameters(recurse=False) if p.is_floating_point()):
                install_dtype_adapter(module, storage, dtype, cast_inputs)
        self._keep_expert_conversions(model)
        # the float lm_head is the largest weight an int4 model reads per decoded token: single rows skip oneDNN
        counts["float"] = use_float_linear(model)
        if not self.pre_quantized:
            self._requantize_disk_offloaded(model)
        checks.warn_offloaded_buffers(model)
        logger.info("hfquant kernels: %s", counts)
        self.page_releaser.flush()
        for hook in self.loaded_model_hooks:
            hook(model)
        return model

    def _tie_buffers(self, model) -> None:
        """Give each tied module (lm_head, T5's encoder/decoder embed_tokens) its source embedding's tensors."""
        for target_name, source_name in self.ties:
            target, source = model.get_submodule(target_name), model.get_submodule(source_name)
            device = target.weight_scale.device
            for name in _TENSOR_NAMES:
                value = getattr(source, name, None)
                if value is not None and value.device.type == "meta":  # source offloaded: read its stored tensor
                    value = source._hf_hook.weights_map[name]
                if value is not None:
                    setattr(target, name, value if value.device == device else value.to(device))

    def _share_tied_kernels(self, model) -> None:
        """After the tied lm_head picked its kernel, make the embedding read the very same tensor."""
        for target_name, source_name in self.ties:
            target, source = model.get_submodule(target_name), model.get_submodule(source_name)
            if isinstance(target, QuantLinear) and target.weight.device == source.weight.device:
                how = source.share_with(target)
                logger.info("hfquant: %s and %s share one tensor (%s)", source_name, target_name, how)
        for target_name, source_name in self.ties:
            target, source = model.get_submodule(target_name), model.get_submodule(source_name)
            if isinstance(target, QuantEmbedding) and target.weight.device == source.weight.device:
                for name in _TENSOR_NAMES:
                    setattr(target, name, getattr(source, name))
                target.set_kernel_owner(source._kernel_owner)

    def _requantize_disk_offloaded(self, model) -> None:
        """Write the quantized weight of every disk-offloaded `QuantLinear` / `QuantEmbedding` into the offload folder.

        transformers (5.x) points the disk offload index of a tensor that is only renamed on load at the checkpoint
        file itself and does not save what the quantization op returned for it: the offloaded layer would read the
        float weight back as int8. Each such weight is read again, one at a time, quantized as on load and saved with
        transformers' `offload_weight`; the index entry then names the quantized file (scales were saved on load).
        """
        for module in model.modules():
            hook = getattr(module, "_hf_hook", None)
            weights_map = getattr(hook, "weights_map", None)
            if not isinstance(module, (QuantLinear, QuantEmbedding)) or weights_map is None:
                continue
            loader, prefix = getattr(weights_map, "dataset", None), getattr(weights_map, "prefix", "")
            index = getattr(loader, "index", None) or {}
            entry = index.get(prefix + "weight")
            if entry is None or entry.get("safetensors_file") is None:
                continue
            path, name = entry["safetensors_file"], entry.get("weight_name", prefix + "weight")
            with open_safetensors(path) as handle:
                if not SAFETENSORS_DTYPES[handle.get_slice(name).get_dtype()].is_floating_point:
                    continue  # already the quantized tensor
                tensor = read_tensor(handle, path, name).to(self.compute_dtype or torch.float32)
            if getattr(module, "transposed_source", False):
                tensor = tensor.t()
            clipping = self.quantization_config.clipping if isinstance(module, QuantLinear) else "minmax"
            buffers = quantize_to_buffers(tensor, module.format, clipping, self.folds.get(prefix[:-1]))
            del tensor
            for buffer_name, buffer in buffers.items():
                offload_weight(buffer, prefix + buffer_name, loader.save_folder, index)
            release_checkpoint_pages()

    def _keep_expert_conversions(self, model) -> None:
        """Make `save_pretrained` split expert scales like the expert weights whenever the weights' merge was used."""
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            return
        for converter, copied in self.expert_conversions:
            if any(c is converter for c in conversions) and not any(c is copied for c in conversions):
                conversions.append(copied)

    def get_state_dict_and_metadata(self, model):
        """transformers' `save_pretrained` hook: the model's own state dict, and shard metadata carrying the
        placeholder checkpoint id that the staged save replaces by the save's id (`stamp_checkpoint_ids`), so that a
        reader can tell the shards of two saves apart (`checks.check_stored_tensors`)."""
        return None, dict(PLACEHOLDER_METADATA)

    def _dequantize(self, model, dtype=None):
        restore_nn_linear(model)
        if isinstance(dtype, str):  # transformers passes `model.config.dtype`, a string after save_pretrained
            try:
                dtype = torch_dtype(dtype)
            except ValueError:
                dtype = None
        for name, module in list(model.named_modules()):
            if isinstance(module, QuantLinear):
                target_dtype = dtype or module.compute_dtype or torch.float32
                new = module.dequantize_to_float(target_dtype)
            elif isinstance(module, QuantEmbedding):
                new = module.dequantize_to_float(dtype or module.compute_dtype)
            elif isinstance(module, QuantExperts):
                new = module.dequantize_to_float(dtype or module.compute_dtype or torch.float32)
            else:
                continue
            parent_name, _, child_name = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child_name, new)
        for target_name, source_name in self.ties:  # one float tensor again, as before quantization
            model.get_submodule(target_name).weight = model.get_submodule(source_name).weight
        return model

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
