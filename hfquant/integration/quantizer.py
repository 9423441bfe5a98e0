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
from typing import Any

import torch
from torch import nn
from transformers.core_model_loading import ConversionOps
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import get_module_from_name

from hfquant.config import HfQuantConfig
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import EXPERT_PROJECTIONS, QuantExperts, quantize_experts_tensor
from hfquant.nn.float_linear import restore_nn_linear, use_float_linear
from hfquant.nn.linear import QuantLinear, quantize_to_buffers
from hfquant.nn.norms import find_norms, install_dtype_adapter
from hfquant.nn.replace import (
    QUANTIZED_STORAGE,
    LayerPlan,
    cast_float_params,
    dtype_name,
    embedding_kind,
    matches_module,
    plan_experts,
    plan_layers,
    quantized_format,
    replace_tied_quant_linear,
    replace_with_quant_embedding,
    replace_with_quant_experts,
    replace_with_quant_linear,
    restore_kernel_buffers,
    torch_dtype,
)
from hfquant.core.format import StoredFormat
from hfquant.checkpoint.streaming import release_checkpoint_pages, trim_heap

__all__ = ["HfQuantQuantizer", "HfQuantQuantize", "plan_model"]

logger = logging.getLogger(__name__)

_STORED_SUFFIXES = (".weight_scale", ".weight_zero_point") + tuple(
    f"{name}{suffix}" for name in EXPERT_PROJECTIONS for suffix in ("_scale", "_zero_point")
)
_TENSOR_NAMES = ("weight", "weight_scale", "weight_zero_point")


def plan_model(model, config: HfQuantConfig) -> tuple[list[str], list[LayerPlan]]:
    """Skip list and per-layer plan for a (meta-device) transformers model, as quantize-on-load applies them.

    The skip list is transformers' default (tied weights, output embedding, last module, `_keep_in_fp32_modules`)
    plus `config.modules_to_not_convert`. `hfquant convert` uses the same function so both paths agree.
    """
    default_skips = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    skip = sorted(set(default_skips) | set(config.modules_to_not_convert))
    return skip, plan_layers(model, config.bits, config.group_size, skip)


@torch.no_grad()
def _float_layer(module: QuantLinear, dtype: torch.dtype) -> nn.Module:
    """The float layer a `QuantLinear` replaced: `nn.Linear`, or GPT-2's `Conv1D` (weight stored (in, out))."""
    weight = module.dequantize(dtype)
    if getattr(module, "transposed_source", False):
        from transformers.pytorch_utils import Conv1D

        layer = Conv1D(module.out_features, module.in_features).to(device=weight.device, dtype=dtype)
        layer.weight.copy_(weight.t())
        if module.bias is None:
            layer.bias = None
    else:
        layer = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype, device=weight.device
        )
        layer.weight.copy_(weight)
    if module.bias is not None:
        layer.bias.copy_(module.bias)
    layer.requires_grad_(False)
    return layer


class HfQuantQuantize(ConversionOps):
    """Conversion op run by transformers on one float weight tensor as it streams in: float -> stored buffers."""

    def __init__(self, hf_quantizer: "HfQuantQuantizer"):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model=None, **kwargs) -> dict[str, torch.Tensor]:
        result: dict[str, torch.Tensor] = {}
        for key, value in input_dict.items():
            tensor = value[0] if isinstance(value, list) else value
            module, tensor_name = get_module_from_name(model, key)
            try:
                if isinstance(module, (QuantLinear, QuantEmbedding)) and tensor_name == "weight":
                    if getattr(module, "transposed_source", False):
                        tensor = tensor.t()
                    prefix = key[: -len("weight")]
                    buffers = quantize_to_buffers(tensor, module.format)
                    result.update({prefix + name: buffer for name, buffer in buffers.items()})
                elif isinstance(module, QuantExperts) and tensor_name in module.shapes:
                    buffers = quantize_experts_tensor(tensor, module.formats[tensor_name])
                    result.update({key + suffix: buffer for suffix, buffer in buffers.items()})
                else:
                    result[key] = tensor
                    continue
            except ValueError as error:
                # transformers would swallow this into a generic RuntimeError: remember it, raise it by name
                # once loading is over (`_process_model_after_weight_loading`).
                self.hf_quantizer.failed_tensors[key] = str(error)
            del tensor, value
            release_checkpoint_pages()
        return result


class HfQuantQuantizer(HfQuantizer):
    """Quantizer for `quant_method="hfquant"`: RTN int8/int4 weight-only, quantized on load or reloaded.

    It works on a copy of the config it is given: a resolved `compute_dtype` is written into that copy (and so into
    `config.json`), never into the caller's object.
    """

    requires_calibration = False
    quantization_config: HfQuantConfig

    def __init__(self, quantization_config: HfQuantConfig, **kwargs):
        super().__init__(copy.deepcopy(quantization_config), **kwargs)
        self.layer_plans = []
        self.failed_tensors: dict[str, str] = {}  # checkpoint key -> why quantizing it failed
        self.compute_dtype: torch.dtype | None = None
        self.ties: list[tuple[str, str]] = []  # (module reading the tensors, module holding them), after loading
        self.adapters: dict[str, tuple[torch.dtype, bool]] = {}  # module -> (storage dtype, cast its float inputs)
        self.expert_conversions: list[tuple[Any, Any]] = []  # (model's converter, our copy for scales / zero points)

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
        config = self.quantization_config
        compute = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        self.compute_dtype = compute
        self.modules_to_not_convert, self.layer_plans = plan_model(model, config)
        head = _module_name(model, _output_embeddings(model))
        replaced = self._plan_embeddings_and_head(model, compute)
        if head is not None and not isinstance(model.get_submodule(head), nn.Linear):  # lm_head was planned above
            self.layer_plans = [plan for plan in self.layer_plans if plan.name != head]
        replaced += replace_with_quant_linear(model, self.layer_plans, config.bits, config.symmetric, compute)
        replaced += self._plan_experts(model, compute)
        self._plan_norms(model, compute)
        if self.adapters and config.compute_dtype == "auto":
            # transformers writes config.dtype from the first float parameter, which may now be an embedding or a
            # norm in its own dtype: record the compute dtype so that a reload restores every dtype
            config.compute_dtype = dtype_name(compute)
        if self.pre_quantized and kwargs.get("checkpoint_files"):
            # A stored tensor of the wrong dtype or shape would be re-initialized at random or loaded as garbage by
            # transformers: compare the shard headers with the skeleton first and raise a ValueError naming it.
            from hfquant.commands.verify import check_checkpoint_files

            check_checkpoint_files(model, kwargs["checkpoint_files"], self)
        if replaced == 0:
            logger.warning("hfquant found no Linear or Conv1D layer to quantize in %s", type(model).__name__)
        return model

    def _plan_embeddings_and_head(self, model, compute: torch.dtype) -> int:
        """Embeddings (`embedding_dtype`) and the output embedding (`lm_head`); returns the modules quantized."""
        config = self.quantization_config
        user_skip = config.modules_to_not_convert
        modules = dict(model.named_modules())
        tied_params = dict(getattr(model, "all_tied_weights_keys", None) or {})
        tied = {
            t.removesuffix(".weight"): s.removesuffix(".weight")
            for t, s in tied_params.items() if t.endswith(".weight") and s.endswith(".weight")
        }
        head = _module_name(model, _output_embeddings(model))
        embeddings = [
            name for name, module in modules.items()
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
                    logger.info("hfquant keeps embedding %s in float: embedding_dim=%d has no group size",
                                name, module.embedding_dim)
                    continue
                replace_with_quant_embedding(model, name, fmt, compute)
                quantized[name] = fmt
                count += 1
            elif kind != "auto" and torch_dtype(kind) != compute:
                cast_float_params(module, torch_dtype(kind))
                self.adapters[name] = (torch_dtype(kind), False)
        for target, source in tied.items():
            if source in quantized and target != head and embedding_kind(modules.get(target)) is not None:
                replace_with_quant_embedding(model, target, quantized[source], compute, persistent=False)
                self.ties.append((target, source))
            elif source in self.adapters and target != head and target in modules:
                self.adapters[target] = self.adapters[source]

        if head is not None and head_source in quantized:
            replace_tied_quant_linear(model, head, quantized[head_source], compute)
            self.ties.append((head, head_source))
            count += 1
        elif head is not None and head_source in self.adapters:
            self.adapters[head] = (self.adapters[head_source][0], True)
        elif head is not None and head_source is None and head_format and not matches_module(head, user_skip):
            module = modules[head]
            fmt = quantized_format(head_format, config, module.in_features)
            if fmt is None:
                logger.info("hfquant keeps %s in float: in_features=%d has no group size", head, module.in_features)
            else:
                plan = LayerPlan(head, module.in_features, module.out_features, fmt.group_size, "", False)
                count += replace_with_quant_linear(model, [plan], fmt.bits, fmt.symmetric, compute)
        # transformers must not tie (nor mark as initialized) what now lives in buffers: the ties are ours
        tied_now = {target for target, _ in self.ties}
        if tied_now and hasattr(model, "all_tied_weights_keys"):
            model.all_tied_weights_keys = {
                t: s for t, s in model.all_tied_weights_keys.items() if t.rpartition(".")[0] not in tied_now
            }
        return count

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
                    plan.name, plan.reason,
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
        from transformers.core_model_loading import WeightConverter

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
        if self.failed_tensors:
            key, message = next(iter(self.failed_tensors.items()))
            module = key.rsplit(".", 1)[0]
            raise ValueError(
                f"hfquant could not quantize {key}: {message} ({len(self.failed_tensors)} tensor(s) failed: "
                f"{sorted(self.failed_tensors)}). Fix those weights in the checkpoint, or keep the module in float "
                f"with HfQuantConfig(modules_to_not_convert=[{module!r}])."
            )
        dtype = self.compute_dtype or (model.dtype if model.dtype.is_floating_point else None)
        self._tie_buffers(model)
        counts: dict[str, int] = {}
        for module in model.modules():
            if isinstance(module, QuantLinear):
                restore_kernel_buffers(module)
                kernel = module.prepare_kernel(dtype)
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
        _warn_offloaded_buffers(model)
        logger.info("hfquant kernels: %s", counts)
        release_checkpoint_pages()
        from hfquant.commands.hub import attach_model_card  # push_to_hub writes hfquant's model card, not transformers' generic one

        attach_model_card(model)
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
        from safetensors import safe_open
        from transformers.integrations.accelerate import offload_weight

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
            with safe_open(entry["safetensors_file"], framework="pt") as handle:
                name = entry.get("weight_name", prefix + "weight")
                if not handle.get_slice(name).get_dtype().startswith(("F", "BF")):
                    continue  # already the quantized tensor
                tensor = handle.get_tensor(name).to(self.compute_dtype or torch.float32)
            if getattr(module, "transposed_source", False):
                tensor = tensor.t()
            buffers = quantize_to_buffers(tensor, module.format)
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

    def _dequantize(self, model, dtype=None):
        restore_nn_linear(model)
        if isinstance(dtype, str):  # transformers passes `model.config.dtype`, a string after save_pretrained
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                dtype = None
        for name, module in list(model.named_modules()):
            if isinstance(module, QuantLinear):
                target_dtype = dtype or module.compute_dtype or torch.float32
                new = _float_layer(module, target_dtype)
            elif isinstance(module, QuantEmbedding):
                new = _float_embedding(module, dtype or module.compute_dtype)
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
        return False

    @property
    def is_compileable(self) -> bool:
        """`QuantLinear.forward` traces without graph breaks (tests/test_compile.py checks fullgraph=True)."""
        return True


def _output_embeddings(model):
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if isinstance(head, nn.Linear) else None


def _module_name(model, module) -> str | None:
    if module is None:
        return None
    return next((name for name, m in model.named_modules() if m is module), None)


@torch.no_grad()
def _float_embedding(module: QuantEmbedding, dtype: torch.dtype) -> nn.Embedding:
    """The float embedding a `QuantEmbedding` replaced (same class: a scaled word embedding stays one)."""
    weight = module.dequantize(dtype)
    layer = module.source
    if layer is None:
        layer = nn.Embedding(module.num_embeddings, module.embedding_dim, module.padding_idx, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if module.embed_scale is not None and isinstance(layer._buffers.get("embed_scale"), torch.Tensor):
        layer.embed_scale = torch.tensor(module.embed_scale, device=weight.device)
    return layer


def _warn_offloaded_buffers(model) -> None:
    """Quantized tensors are buffers: accelerate leaves them in RAM unless `offload_buffers=True` is passed."""
    device_map = getattr(model, "hf_device_map", None) or {}
    on_disk = [name for name, device in device_map.items() if device == "disk"]
    for name in on_disk:
        module = model.get_submodule(name) if name else model
        resident = [
            f"{m_name}.{n}" if m_name else n
            for m_name, m in module.named_modules()
            for n, b in m._buffers.items()
            if b is not None and b.device.type != "meta" and not b.is_floating_point()
            and n not in m._non_persistent_buffers_set
        ]
        if resident:
            logger.warning(
                "hfquant: %s is offloaded to disk but its quantized tensors (%s, ...) stay in RAM; pass "
                "offload_buffers=True to from_pretrained to offload them too", name or "the model", resident[0],
            )
            return
