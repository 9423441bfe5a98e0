"""A GGUF file loaded as a transformers model whose Linear layers keep the file's blocks (`load_gguf_model`).

The model is not built by a loader of its own: the file's tensors become the state dict of a pre-quantized hfquant
checkpoint and go through transformers' `from_pretrained` with `HfQuantQuantizer`, exactly as a saved hfquant
checkpoint reloads (docs/architecture.md, "Reload"):

1. The config is transformers' reading of the GGUF header (its config mapping, as `AutoConfig.from_pretrained(
   folder, gguf_file=...)` applies it), refused unless its model type is one of `GGUF_IMPORT_MODEL_TYPES`; the header
   is parsed once, by `gguf_import.read_gguf`, because transformers' reader of these architectures (gguf-py's)
   holds about 160 MiB of objects for SmolLM2's tokenizer arrays, more than the file.
2. The GGUF tensor names are mapped to the model's as transformers maps them (gguf-py's `TensorNameMap` over the
   meta-device model's state dict keys).
3. Every Linear layer's weight type decides its stored format (`gguf_import.quantization_config`): a block type that
   hfquant stores keeps it (the config's `format` or a `module_overrides` entry by name), F16/BF16/F32 stays float
   (`modules_to_not_convert`), any other type is refused by name. The config is set as the model config's
   `quantization_config`, so transformers creates the quantizer with `pre_quantized=True`, and `save_pretrained`
   writes a `config.json` that describes every layer as stored.
4. The token embedding and an untied output embedding in a block type hfquant stores keep it too
   (`gguf_table_plan`): an exact-name `module_overrides` entry makes the embedding a `QuantEmbedding` of the file's
   blocks (a lookup decodes only the gathered rows) and the output a `QuantLinear` of them; a tied output reads the
   embedding's very tensor through the block GEMV (`hfquant.integration.embeddings`). In another type they are
   decoded into the asked dtype.
5. The state dict holds the blocks read out of the file straight into their tensors (`os.preadv`; rows of a Llama
   q/k projection each read into its place in transformers' order, an exact reordering of whole rows) and the other
   tensors decoded into the asked dtype.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import nn

# transformers' GGUF reader's own tables (the module its from_pretrained(gguf_file=...) reads the header with)
from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hfquant.checkpoint import gguf_import
from hfquant.checkpoint.gguf_import import GgufTensor
from hfquant.checkpoint.streaming import trim_heap
from hfquant.core import blocks, huge_pages
from hfquant.core.dtypes import dtype_name
from hfquant.core.text import terminal_safe
from hfquant.integration.embeddings import output_embeddings
from hfquant.nn.fused import SIBLINGS
from hfquant.nn.replace import embedding_kind, output_embedding

gguf = gguf_import.gguf

__all__ = ["GGUF_IMPORT_MODEL_TYPES", "load_gguf_model", "gguf_layer_plan", "gguf_table_plan"]

logger = logging.getLogger(__name__)

GGUF_IMPORT_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
"""transformers model type of an importable GGUF -> the gguf-py architecture whose tensor names it uses."""
PERMUTED_MODEL_TYPES = ("llama", "mistral")
"""Model types whose GGUF q/k rows llama.cpp permuted (transformers' `LlamaTensorProcessor` undoes it)."""


def gguf_config_dict(metadata: dict, tensor_names) -> dict:
    """The config dict transformers builds from a GGUF header (`load_gguf_checkpoint(..., return_tensors=False)
    ["config"]` in transformers 5.x) for `metadata` (`gguf_import.GgufFile.metadata`) and the file's tensor names:
    the `general.architecture` ("llama"; "mistral" when `general.name` is "mistral", as transformers has it), the
    keys `GGUF_TO_TRANSFORMERS_MAPPING["config"]` renames, its defaults, `tie_word_embeddings` when there is no `output.weight`, and
    `vocab_size` from the token list when the header has none."""
    architecture = str(metadata.get("general.architecture", ""))
    updated = "mistral" if "llama" in architecture and metadata.get("general.name") == "mistral" else architecture
    config = {"tie_word_embeddings": "output.weight" not in set(tensor_names)}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(
        updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
    ).items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        renamed = GGUF_TO_TRANSFORMERS_MAPPING["config"].get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]
    return config


def _gguf_config(path: Path, metadata: dict, tensor_names):
    """transformers' config of the GGUF file `path` (`gguf_config_dict` of its header).

    Raises:
        ValueError: a model type hfquant does not import.
    """
    values = gguf_config_dict(metadata, tensor_names)
    model_type = values.get("model_type")
    if model_type not in GGUF_IMPORT_MODEL_TYPES:
        raise ValueError(
            f"{path}: GGUF model type {terminal_safe(str(model_type))!r} is not imported by hfquant; allowed: "
            f"{sorted(GGUF_IMPORT_MODEL_TYPES)} (transformers' from_pretrained(gguf_file=...) dequantizes others)"
        )
    config = CONFIG_MAPPING[model_type].from_dict(values)
    config.name_or_path = str(path.parent)  # as AutoConfig.from_pretrained(folder, gguf_file=...) names it
    return config


def _name_map(model: nn.Module, model_type: str) -> dict[str, str]:
    """{GGUF tensor name: the model's state dict key}, from gguf-py's name table as transformers builds it."""
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == GGUF_IMPORT_MODEL_TYPES[model_type])
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    mapping = {}
    for key in model.state_dict():
        module, _, suffix = key.rpartition(".")
        gguf_name = names.get_name(module)
        if gguf_name is not None:
            mapping[f"{gguf_name}.{suffix}"] = key
    return mapping


def gguf_layer_plan(model: nn.Module, tensors: dict[str, GgufTensor], names: dict[str, str]) -> dict[str, str | None]:
    """{Linear layer name: its block format, or None to keep it in float} for the meta-device `model`, from the types
    of the GGUF `tensors` (`names`: GGUF name -> state dict key). The output embedding is not listed (kept in float).

    Raises:
        ValueError: a Linear weight in a type hfquant stores no layout for (named, with the allowed types).
    """
    by_key = {key: tensors[name] for name, key in names.items() if name in tensors}
    output = output_embedding(model)
    plan = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is output:
            continue
        tensor = by_key.get(f"{name}.weight")
        if tensor is None:
            continue
        block = gguf_import.block_name(tensor)
        if block is None and tensor.ggml_type not in gguf_import.FLOAT_TYPES:
            allowed = sorted(gguf_import.FLOAT_TYPES.values()) + [n.upper() for n in gguf_import.blocks.LAYOUTS]
            raise ValueError(
                f"{terminal_safe(tensor.name)} ({name}) is stored as GGUF type {tensor.type_name}, which hfquant has "
                f"no kernel for; allowed: {allowed}"
            )
        plan[name] = block
    return plan


def gguf_table_plan(model: nn.Module, tensors: dict[str, GgufTensor], names: dict[str, str]) -> dict[str, str]:
    """{module name: block format} of the embeddings and the (untied) output embedding of the meta-device `model`
    whose GGUF tensor is in a block type hfquant stores and whose rows are whole blocks: they keep the file's blocks.
    Tables in any other type are not listed (decoded into float)."""
    by_key = {key: tensors[name] for name, key in names.items() if name in tensors}
    output = output_embeddings(model)
    tables = {}
    for name, module in model.named_modules():
        if embedding_kind(module) is None and (output is None or module is not output):
            continue
        tensor = by_key.get(f"{name}.weight")
        block = None if tensor is None or len(tensor.shape) != 2 else gguf_import.block_name(tensor)
        if block is not None and gguf_import.blocks.LAYOUTS[block].divides(tensor.shape[1]):
            tables[name] = block
    return tables


def _row_order(key: str, config, model_type: str) -> torch.Tensor | None:
    """The order undoing llama.cpp's row permutation of a Llama q/k tensor `key` (weight or bias), else None."""
    if model_type not in PERMUTED_MODEL_TYPES:
        return None
    module = key.rpartition(".")[0]
    if module.endswith("self_attn.q_proj"):
        heads = config.num_attention_heads
    elif module.endswith("self_attn.k_proj"):
        heads = config.num_key_value_heads or config.num_attention_heads
    else:
        return None
    rows = (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) * heads
    return gguf_import.llama_row_order(rows, heads)


def _state_dict(
    tensors: dict[str, GgufTensor],
    names: dict[str, str],
    plan: dict[str, str | None],
    config,
    dtype: torch.dtype,
    fd: int | None = None,
) -> dict[str, torch.Tensor]:
    """The model's state dict from the GGUF tensors: block weights of the layers and tables `plan` keeps quantized
    read from the file `fd` into place (`gguf_import.stored_blocks`), everything else in `dtype`
    (`gguf_import.float_tensor`, read from `fd` too)."""
    state = {}
    rows_of = _sibling_rows(tensors, names, plan)
    for gguf_name, tensor in tensors.items():
        key = names.get(gguf_name)
        if key is None:
            logger.info("hfquant GGUF import: %s has no place in the model; not read", terminal_safe(gguf_name))
            continue
        order = _row_order(key, config, config.model_type)
        layer = key.rpartition(".")[0]
        if key.endswith(".weight") and plan.get(layer) is not None:
            state[key] = gguf_import.stored_blocks(tensor, order, fd, out=rows_of.get(key))
        else:
            state[key] = gguf_import.float_tensor(tensor, dtype, order, fd)
    return state


def _sibling_rows(
    tensors: dict[str, GgufTensor], names: dict[str, str], plan: dict[str, str | None]
) -> dict[str, torch.Tensor]:
    """{state key: its rows of one new uint8 tensor} for the weights of sibling projections (`fused.SIBLINGS`: q/k/v,
    gate/up) stored in the same block type with the same input width, consecutive in `SIBLINGS` order: the tensor a
    fused decode group computes from (`DecodeGroup.build` takes weights that are already one tensor's rows without
    copying them). Read into separate tensors, the group's concatenation was a second copy of these layers for as
    long as `from_pretrained` held the state dict (peak RSS 1.5x the file)."""
    blocks_of = {}
    for gguf_name, tensor in tensors.items():
        key = names.get(gguf_name)
        if key is not None and key.endswith(".weight") and plan.get(key.rpartition(".")[0]) is not None:
            blocks_of[key] = tensor
    rows_of = {}
    parents = {key.rpartition(".")[0].rpartition(".")[0] for key in blocks_of}
    for parent in parents:
        for siblings in SIBLINGS:
            alike: dict[tuple, list] = {}  # a Q4_K_M file's Q6_K v_proj is not in its Q4_K q/k's group
            for key in (f"{parent}.{child}.weight" for child in siblings):
                if key in blocks_of:
                    tensor = blocks_of[key]
                    alike.setdefault((tensor.type_name, tensor.shape[1]), []).append((key, tensor))
            for members in alike.values():
                if len(members) > 1:
                    rows_of.update(_rows_of_one_tensor(members))
    return rows_of


def _rows_of_one_tensor(members: list[tuple[str, GgufTensor]]) -> dict[str, torch.Tensor]:
    """{key: its rows of one new (sum of rows, row bytes) uint8 tensor} for block tensors of one type and width."""
    first = members[0][1]
    row_bytes = blocks.LAYOUTS[gguf_import.block_name(first)].row_bytes(first.shape[1])
    sizes = [tensor.shape[0] for _, tensor in members]
    views = huge_pages.empty((sum(sizes), row_bytes), dtype=torch.uint8).split(sizes)
    return {key: view for (key, _), view in zip(members, views, strict=True)}


def load_gguf_model(path: Path, dtype: torch.dtype = torch.bfloat16, **from_pretrained_kwargs) -> nn.Module:
    """The causal LM of the GGUF file `path`, its Linear layers in the file's block formats on hfquant's layers.

    Args:
        path: a local GGUF file of a model type in `GGUF_IMPORT_MODEL_TYPES`.
        dtype: the float dtype of the norms, float layers, embeddings not in a block type, and the activations.
        **from_pretrained_kwargs: passed to transformers' `from_pretrained` (device_map, attn_implementation, ...).
    Returns:
        The model (eval mode); `model.config.quantization_config` describes every layer as stored.
    Raises:
        ValueError: another model type, a Linear weight in a type without an hfquant layout (named), or a file
            gguf-py cannot read.
    """
    for key in ("quantization_config", "state_dict", "gguf_file", "config"):
        if key in from_pretrained_kwargs:
            raise ValueError(f"from_gguf sets {key} itself; remove {key}= from the call")
    metadata, tensors = gguf_import.read_gguf(path)
    config = _gguf_config(path, metadata, tensors)
    del metadata
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        # a copy: building a model writes its attention ("sdpa") into the config, which the quantizer would then take
        # for an `attn_implementation` asked by name and keep PyTorch's attention instead of the one-row kernel
        skeleton = model_class(copy.deepcopy(config))
    names = _name_map(skeleton, config.model_type)
    plan = gguf_layer_plan(skeleton, tensors, names)
    tables = gguf_table_plan(skeleton, tensors, names)
    del skeleton
    quantization = gguf_import.quantization_config(plan, dtype_name(dtype), tables)
    with open(path, "rb") as handle:
        state = _state_dict(tensors, names, {**plan, **tables}, config, dtype, handle.fileno())
    del tensors  # the file's mapping closes with the last view
    trim_heap()
    if quantization is not None:
        config.quantization_config = quantization.to_dict()
    return model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype, **from_pretrained_kwargs)
