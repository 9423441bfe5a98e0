"""embedding_dtype, norm_dtype, lm_head, compute_dtype: validation, config.json round trip, the dtypes a load gives and
a reload restores, norms found by class, and get_memory_footprint() of quantized models (GPT-2 size: slow)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cosine_similarity, input_ids, model_output, tiny_model
from torch import nn
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from benchmarks.memory import tensor_bytes
from hfquant import HfQuantConfig, QuantLinear
from hfquant.config import COMPUTE_DTYPES, EMBEDDING_DTYPES, LM_HEAD_POLICIES, NORM_DTYPES, validate_config_values
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.norms import find_norms, is_norm

NEW_FIELDS = {
    "embedding_dtype": EMBEDDING_DTYPES,
    "norm_dtype": NORM_DTYPES,
    "lm_head": LM_HEAD_POLICIES,
    "compute_dtype": COMPUTE_DTYPES,
}
INVALID = [
    ("embedding_dtype", "int2", ValueError),
    ("embedding_dtype", "fp16", ValueError),
    ("embedding_dtype", "Int8", ValueError),
    ("embedding_dtype", torch.float16, TypeError),
    ("embedding_dtype", None, TypeError),
    ("embedding_dtype", 8, TypeError),
    ("norm_dtype", "int8", ValueError),
    ("norm_dtype", "float64", ValueError),
    ("norm_dtype", True, TypeError),
    ("lm_head", "float16", ValueError),
    ("lm_head", "int2", ValueError),
    ("lm_head", False, TypeError),
    ("compute_dtype", "int8", ValueError),
    ("compute_dtype", "half", ValueError),
    ("compute_dtype", torch.float32, TypeError),
]


@pytest.mark.parametrize("field, value, error", INVALID, ids=[f"{f}={v!r}" for f, v, _ in INVALID])
def test_invalid_values_are_refused_naming_value_and_allowed_ones(field, value, error):
    for make in (
        lambda: HfQuantConfig(**{field: value}),
        lambda: HfQuantConfig.from_dict(HfQuantConfig().to_dict() | {field: value}),
    ):
        with pytest.raises(error) as info:
            make()
        assert type(info.value) is error
        assert repr(value) in str(info.value)
        assert all(repr(allowed) in str(info.value) for allowed in NEW_FIELDS[field])
    config = HfQuantConfig()
    setattr(config, field, value)
    with pytest.raises(error):
        config.validate()


def test_every_allowed_value_round_trips_through_config_json():
    for field, allowed in NEW_FIELDS.items():
        for value in allowed:
            config = HfQuantConfig(bits=8, **{field: value})
            data = json.loads(config.to_json_string())
            assert data[field] == value
            assert HfQuantConfig.from_dict(data) == config
            validate_config_values(8, None, True, [], 1, **{field: value})


def test_defaults_are_todays_behaviour_and_old_config_json_loads():
    config = HfQuantConfig()
    assert (config.embedding_dtype, config.norm_dtype, config.lm_head, config.compute_dtype) == (
        "auto",
        "auto",
        "int8",  # the 4-bit default's per-channel int8 lm_head (config.default_lm_head)
        "auto",
    )
    assert HfQuantConfig(bits=8).lm_head == "keep" and HfQuantConfig(embedding_dtype="int4").lm_head == "keep"
    old = {
        "quant_method": "hfquant",
        "format_version": 1,
        "bits": 4,
        "group_size": 128,
        "symmetric": False,
        "modules_to_not_convert": [],
    }
    # a config.json without method / mixed_precision / lm_head holds plain RTN and a float lm_head, whatever today's
    # defaults are
    legacy = HfQuantConfig.from_dict(old)
    assert legacy == HfQuantConfig(
        bits=4,
        group_size=128,
        symmetric=False,
        method="rtn",
        mixed_precision="none",
        lm_head="keep",
        iq4_search="thorough",  # what hfquant searched with before "fast" became the default
        importance="weights",
    )
    assert set(config.to_dict()) == set(old) | set(NEW_FIELDS) | {
        "method",
        "module_overrides",
        "mixed_precision",
        "fold_column_scales",
        "clipping",
        "decode_activations",
        "format",
        "iq4_search",
        "importance",
    }
    assert legacy.format == "int"
    assert (legacy.method, legacy.mixed_precision, legacy.module_overrides) == ("rtn", "none", {})
    assert (legacy.fold_column_scales, legacy.clipping, legacy.decode_activations) == (False, "minmax", "float")
    assert legacy.lm_head == "keep"


def test_defaults_leave_embeddings_norms_and_lm_head_in_the_load_dtype(float_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("gpt2"), quantization_config=HfQuantConfig(bits=8), dtype=torch.bfloat16, device_map="cpu"
    )
    for name in ("transformer.wte", "transformer.wpe", "transformer.ln_f", "transformer.h.0.ln_1", "lm_head"):
        module = model.get_submodule(name)
        assert not isinstance(module, (QuantEmbedding, QuantLinear)) and module.weight.dtype == torch.bfloat16
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert model.lm_head.weight is model.transformer.wte.weight


# -- norms by class ----------------------------------------------------------------------------------------------------


class MyRMSNorm(nn.Module):  # a family's own norm class: found by its class
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.layernorm = nn.Linear(4, 4)  # named like a norm, is not one
        self.scale = MyRMSNorm(4)  # a norm with an unremarkable name
        self.ln = nn.LayerNorm(4)
        self.gn = nn.GroupNorm(2, 4)
        self.no_affine = nn.LayerNorm(4, elementwise_affine=False)  # nothing to store


class LayerNormWrapper(nn.Module):  # name matches, but it is a composite module: not a norm itself
    def __init__(self):
        super().__init__()
        self.inner = nn.LayerNorm(4)


def test_norms_are_found_by_class_not_by_name():
    model = nn.ModuleDict({"block": Block(), "wrapper": LayerNormWrapper()})
    assert find_norms(model) == ["block.scale", "block.ln", "block.gn", "wrapper.inner"]
    assert not is_norm(model["block"].layernorm) and not is_norm(model["wrapper"])


# -- stored and compute dtypes -----------------------------------------------------------------------------------------

# Logits against the float32 model: float16 embeddings and norms round the residual stream's input and the norm
# weights to float16 (2^-11 relative); through two tiny blocks 1 - cos stays < 1e-4 (observed 2e-5 with int8 layers).
MIXED_COSINE_MIN = 0.9995


@pytest.mark.parametrize("arch", ["llama_tied", "gpt2"])
def test_float_embeddings_and_norms_keep_their_dtype_and_a_reload_restores_every_dtype(
    float_checkpoint, tmp_path, arch
):
    path = float_checkpoint(arch)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map="cpu")
    config = HfQuantConfig(bits=8, embedding_dtype="float16", norm_dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32, device_map="cpu"
    )
    norms = set(find_norms(model))
    embeddings = {name for name, m in model.named_modules() if isinstance(m, nn.Embedding)}
    assert norms and embeddings
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        expected = torch.float16 if module in embeddings else torch.bfloat16 if module in norms else torch.float32
        if module.endswith("lm_head"):
            expected = torch.float16  # tied to the embedding: one tensor
        assert param.dtype == expected, name
    ids = input_ids()
    logits = model_output(model, ids)
    assert logits.dtype == torch.float32  # the compute dtype, whatever the embeddings and norms are stored in
    assert cosine_similarity(logits, model_output(reference, ids)) >= MIXED_COSINE_MIN

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["compute_dtype"] == "float32"  # resolved: config.dtype now names the first parameter's dtype
    assert (saved["embedding_dtype"], saved["norm_dtype"]) == ("float16", "bfloat16")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert {n: p.dtype for n, p in reloaded.named_parameters()} == {n: p.dtype for n, p in model.named_parameters()}
    assert torch.equal(model_output(reloaded, ids), logits)


def test_float32_norms_in_a_bfloat16_model_compute_in_float32(float_checkpoint):
    path = float_checkpoint("llama")
    config = HfQuantConfig(bits=8, norm_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.bfloat16, device_map="cpu"
    )
    norm = model.model.layers[0].input_layernorm
    assert norm.weight.dtype == torch.float32
    seen = {}
    norm.register_forward_hook(lambda m, args, out: seen.update(input=args[0].dtype))
    logits = model_output(model, input_ids())
    assert seen["input"] == torch.float32  # the input was cast up to the norm's dtype ...
    assert logits.dtype == torch.bfloat16  # ... and the output back to the compute dtype


def test_folded_norms_keep_norm_dtype_and_the_folds_float32_values(tmp_path):
    """The 4-bit default folds SINQ's column scales into the norms on their way in: with norm_dtype="float32" the
    folded norm is float32, holding the fold's float32 values (was: bfloat16, the option ignored, and a disk-offloaded
    copy of it float32, so the two computed differently)."""
    source = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():  # norms of other weights than 1, whose products with the column scales need float32
        for name, parameter in source.named_parameters():
            if name.endswith("layernorm.weight"):
                parameter.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    source.save_pretrained(tmp_path / "src")
    config = HfQuantConfig(bits=4, norm_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=config, dtype=torch.bfloat16, device_map="cpu"
    )

    def norms(m):
        return {n: p for n, p in m.named_parameters() if n.endswith("layernorm.weight")}

    assert norms(model) and {w.dtype for w in norms(model).values()} == {torch.float32}
    assert any(not torch.equal(w, w.to(torch.bfloat16).float()) for w in norms(model).values())  # not rounded
    logits = model_output(model, input_ids())
    model.save_pretrained(tmp_path / "q")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert all(torch.equal(w, norms(reloaded)[n]) for n, w in norms(model).items())
    assert torch.equal(model_output(reloaded, input_ids()), logits)


def test_compute_dtype_replaces_the_load_dtype(float_checkpoint, tmp_path):
    path = float_checkpoint("llama")
    config = HfQuantConfig(bits=8, compute_dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.bfloat16, device_map="cpu"
    )
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model_output(model, input_ids()).dtype == torch.float32
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in reloaded.parameters()} == {torch.float32}


def test_tied_lm_head_and_embedding_asking_different_formats_is_an_error(float_checkpoint):
    config = HfQuantConfig(bits=8, embedding_dtype="int8", lm_head="int4")
    with pytest.raises(ValueError, match=r"lm_head='int4'.*embedding_dtype='int8'.*tied"):
        AutoModelForCausalLM.from_pretrained(float_checkpoint("llama_tied"), quantization_config=config)


# -- get_memory_footprint() ----------------------------------------------------------------------------------------------


def _expected_bytes(model) -> int:
    """Bytes the model must hold, computed from shapes and formats (not from the tensors themselves): float
    parameters at their dtype; per quantized layer/table N*K codes (N*K/2 at 4 bits), 2 bytes per scale, 1 per zero
    point, 2 per input feature for a SINQ layer's column scale, plus the CPU int4 kernel's (K/g, N, 2) scale/zero
    tensor; a table shared by a tied lm_head once."""
    total, seen = 0, set()
    for _name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            n, k = (
                (module.out_features, module.in_features)
                if isinstance(module, QuantLinear)
                else (module.num_embeddings, module.embedding_dim)
            )
            groups = k // module.group_size
            if id(module.weight) not in seen:
                seen.add(id(module.weight))
                total += n * k * module.bits // 8 + n * groups * (2 if module.symmetric else 3)
                if getattr(module, "weight_col_scale", None) is not None:
                    total += 2 * k
            if getattr(module, "kernel", None) == "int4pack_mm_cpu":
                total += groups * n * 2 * module.scale_zero.element_size()
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


FOOTPRINT_CONFIGS = {
    "int8": (torch.float16, dict(bits=8)),
    "int8-fp16-emb-norms-fp32-compute": (torch.float32, dict(bits=8, embedding_dtype="float16", norm_dtype="float16")),
    "int4-emb-int8": (torch.float16, dict(bits=4, group_size=32, embedding_dtype="int8")),
    "int4-emb-int4": (torch.float32, dict(bits=4, group_size=32, embedding_dtype="int4")),
}


@pytest.mark.parametrize("name", list(FOOTPRINT_CONFIGS))
def test_memory_footprint_counts_every_tensor_once(float_checkpoint, name):
    dtype, kwargs = FOOTPRINT_CONFIGS[name]
    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("gpt2"), quantization_config=HfQuantConfig(**kwargs), dtype=dtype, device_map="cpu"
    )
    footprint = model.get_memory_footprint()
    assert footprint == tensor_bytes(model) == _expected_bytes(model)


# GPT-2 small (124M parameters, random weights: the footprint does not depend on them). The figures are MiB
# measured with transformers 4, whose GPT-2 also held 12 causal-mask buffers of 1 MiB (bool 1024 x 1024), gone in
# transformers 5: bitsandbytes load_in_8bit + fp16 = 168.35 MiB - 12 MiB = 156.35 MiB here (its per-row fp32 scales,
# 0.32 MiB, are attributes that get_memory_footprint() does not see), fp16 = 237.35 MiB, fp32 = 474.70 MiB.
MIB = 2**20
BNB_INT8_FP16_MIB = 168.35
GPT2_MASK_BUFFERS_MIB = 12.0


@pytest.fixture(scope="module")
def gpt2_small(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to(torch.float16)
    path = tmp_path_factory.mktemp("gpt2-small")
    model.save_pretrained(path)
    return path, model.get_memory_footprint()


@pytest.mark.slow
def test_gpt2_small_footprint_below_bitsandbytes(gpt2_small):
    path, fp16 = gpt2_small
    results = {"fp32": 2 * fp16, "fp16": fp16}
    for name, dtype, kwargs in [
        ("int8, fp16 embeddings and norms", torch.float16, dict(bits=8)),
        ("int8 embeddings + int4 layers", torch.float16, dict(bits=4, format="int", embedding_dtype="int8")),
    ]:
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=HfQuantConfig(**kwargs), dtype=dtype, device_map="cpu"
        )
        results[name] = model.get_memory_footprint()
        assert results[name] == tensor_bytes(model) == _expected_bytes(model)
        del model
    print("\nGPT-2 small get_memory_footprint(): " + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in results.items()))
    bnb_here = (BNB_INT8_FP16_MIB - GPT2_MASK_BUFFERS_MIB) * MIB
    assert results["int8, fp16 embeddings and norms"] <= BNB_INT8_FP16_MIB * MIB
    assert results["int8, fp16 embeddings and norms"] <= bnb_here + 0.32 * MIB  # bnb's uncounted scales
    assert results["int8 embeddings + int4 layers"] <= 0.6 * bnb_here
