#!/usr/bin/env python
"""Exact orthogonal rotations (QuaRot / SpinQuant style, data-free) before hfquant's quantizers: a probe (issue #30).

The rotated checkpoints are plain models (no online Hadamard), written to a temporary folder and measured exactly as
`scripts/accuracy.py` measures its rows (its functions: same text, 512-token windows, same sentences):

- R1 (Llama family): every RMSNorm weight g folded into the columns of the linears after it (the norms become ones),
  then the residual stream rotated by an orthogonal Q (576 x 576 on SmolLM2): W <- (W diag(g)) Q for q/k/v/gate/up and
  the lm_head, W <- Q^T W for o/down, embedding rows E <- E Q. The tied lm_head is untied (the final norm's weight
  folds into it, not into the embedding): one more float vocab x hidden matrix in the file.
  `kron`: random signs times (a random orthogonal 9 x 9 kron the Hadamard 64); `bdiag`: random signs times the
  block-diagonal Hadamard 64; `eye`: no rotation (the norm fold and untied head alone).
- R2: per-head rotation (random-signed Hadamard of head_dim) of the value projection's rows (and bias) and of the
  output projection's matching columns (Llama's v_proj / o_proj, every query head of a group reading its key/value
  head's rotation; BERT's attention.self.value / attention.output.dense). MiniLM, a post-LN BERT, takes R2 only.

The rotation is computed in float64 and stored in bfloat16 (SmolLM2, as its source) or float32 (MiniLM, as its source);
`--check-float` first measures the rotated float32 model's perplexity against the source's.

    python scripts/rotation_probe.py --variants r1kron-r2 --configs int4-default,hq3_0-auto
    python scripts/rotation_probe.py --variants orig,r2 --configs int4-default --minilm

Measured on SmolLM2-135M and MiniLM: docs/performance.md (no variant beat the unrotated rows).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accuracy  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from benchmarks.example_model import build_example_model  # noqa: E402

CONFIGS = {
    "int4-default": dict(bits=4),
    "int4-default-rtn": dict(bits=4, method="rtn"),
    "hq3_0-auto": dict(bits=3.5),
    "hq3_0-auto-rtn": dict(bits=3.5, method="rtn"),
}
"""`HfQuantConfig` fields of each row: the 4-bit default with SINQ (folded) and with RTN, the 3.5-bit budget."""
VARIANTS = {"orig": (None, False), "r2": (None, True), "eye": ("eye", False)}
VARIANTS |= {f"r1{k}": (k, False) for k in ("kron", "bdiag")} | {f"r1{k}-r2": (k, True) for k in ("kron", "bdiag")}
"""Variant name -> (R1 kind or None, whether R2 is applied)."""


def hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix (n, n), float64; n a power of 2."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    if h.shape[0] != n:
        raise ValueError(f"hadamard needs a power of 2, got n={n}")
    return h / math.sqrt(n)


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal (n, n), float64."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


def signs(n: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(torch.float64)


def r1_matrix(kind: str, n: int, gen: torch.Generator, block: int = 64) -> torch.Tensor:
    """The residual-stream rotation (n, n), float64 (`kind`: kron, bdiag or eye; see the module docstring)."""
    if kind == "eye":
        return torch.eye(n, dtype=torch.float64)
    if kind == "kron":
        q = torch.kron(random_orthogonal(n // block, gen), hadamard(block))
    elif kind == "bdiag":
        q = torch.block_diag(*[hadamard(block)] * (n // block))
    else:
        raise ValueError(f"unknown R1 kind {kind!r}; use kron, bdiag or eye")
    return signs(n, gen)[:, None] * q


def rotate_llama(sd: dict, cfg: dict, r1: str | None, r2: bool, seed: int = 0) -> dict:
    """The state dict `sd` of a Llama checkpoint (config dict `cfg`) rotated, float64, lm_head untied."""
    gen = torch.Generator().manual_seed(seed)
    sd = {k: v.double() for k, v in sd.items()}
    sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"].clone())
    if r1:
        q = r1_matrix(r1, cfg["hidden_size"], gen)
        sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] @ q
        groups = (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.o_proj"),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
        )
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            for norm, inputs, output in groups:
                g = sd[p + norm + ".weight"]
                for name in inputs:
                    sd[p + name + ".weight"] = (sd[p + name + ".weight"] * g) @ q
                sd[p + norm + ".weight"] = torch.ones_like(g)
                sd[p + output + ".weight"] = q.T @ sd[p + output + ".weight"]
        g = sd["model.norm.weight"]
        sd["lm_head.weight"] = (sd["lm_head.weight"] * g) @ q
        sd["model.norm.weight"] = torch.ones_like(g)
    if r2:
        h = signs(cfg["head_dim"], gen)[:, None] * hadamard(cfg["head_dim"])
        rows = torch.block_diag(*[h] * cfg["num_key_value_heads"])
        columns = torch.block_diag(*[h] * cfg["num_attention_heads"])  # query head j reads kv head j // group
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}.self_attn."
            sd[p + "v_proj.weight"] = rows.T @ sd[p + "v_proj.weight"]
            sd[p + "o_proj.weight"] = sd[p + "o_proj.weight"] @ columns
    return sd


def rotate_bert_r2(sd: dict, cfg: dict, seed: int = 0) -> dict:
    """A BERT state dict with R2 on every layer (value rows and bias, attention.output.dense columns)."""
    gen = torch.Generator().manual_seed(seed)
    heads = cfg["num_attention_heads"]
    d = cfg["hidden_size"] // heads
    hb = torch.block_diag(*[signs(d, gen)[:, None] * hadamard(d)] * heads)
    sd = dict(sd)
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}.attention."
        for key in (p + "self.value.weight", p + "self.value.bias"):
            sd[key] = (hb.T @ sd[key].double()).to(sd[key].dtype)
        key = p + "output.dense.weight"
        sd[key] = (sd[key].double() @ hb).to(sd[key].dtype)
    return sd


def write_checkpoint(source: Path, folder: Path, sd: dict, dtype: torch.dtype, config: dict) -> Path:
    """`folder` with `source`'s config / tokenizer files, `config` as config.json and `sd` in `dtype`."""
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def rotated_smollm2(source: Path, folder: Path, variant: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    r1, r2 = VARIANTS[variant]
    cfg = json.loads((source / "config.json").read_text())
    sd = {}
    for shard in source.glob("*.safetensors"):
        sd.update(load_file(str(shard)))
    sd = rotate_llama(sd, cfg, r1, r2)
    return write_checkpoint(source, folder, sd, dtype, cfg | {"tie_word_embeddings": False})


def rotated_minilm(source: Path, folder: Path) -> Path:
    cfg = json.loads((source / "config.json").read_text())
    return write_checkpoint(
        source, folder, rotate_bert_r2(load_file(str(source / "model.safetensors")), cfg), torch.float32, cfg
    )


def float_perplexity(folder: Path, text: str, dtype: torch.dtype) -> float:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu").eval()
    return accuracy.perplexity(model, tokenizer, text, max_length=512, stride=512)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="r1kron-r2", help=f"comma-separated, from {list(VARIANTS)}")
    parser.add_argument("--configs", default="int4-default", help=f"comma-separated, from {list(CONFIGS)}")
    parser.add_argument("--minilm", action="store_true", help="also MiniLM (orig: unrotated, else R2 only)")
    parser.add_argument("--check-float", action="store_true", help="float32 perplexity, source and rotated")
    args = parser.parse_args(argv)
    variants, configs = args.variants.split(","), args.configs.split(",")
    unknown = sorted(set(variants) - set(VARIANTS)) + sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown variants or configs {unknown}; use {list(VARIANTS)} and {list(CONFIGS)}")
    torch.manual_seed(0)
    text = accuracy.reference_text(accuracy.TEXT_CHARS)
    source = build_example_model()
    base = float_perplexity(source, text, torch.bfloat16)
    encoder = accuracy.minilm_folder() if args.minilm else None
    batch = accuracy.sentences(text, accuracy.SENTENCES)
    reference = accuracy.minilm(encoder, None, batch, None)["vectors"] if encoder else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rotated_encoder = rotated_minilm(encoder, Path(tmp) / "minilm-r2") if encoder else None
        for variant in variants:
            folder = source if variant == "orig" else rotated_smollm2(source, Path(tmp) / variant, variant)
            if args.check_float and variant != "orig":
                f32 = rotated_smollm2(source, Path(tmp) / f"{variant}-f32", variant, torch.float32)
                rotated, plain = (
                    float_perplexity(f32, text, torch.float32),
                    float_perplexity(source, text, torch.float32),
                )
                print(
                    f"{variant}: float32 perplexity {rotated:.4f} against {plain:.4f} unrotated "
                    f"({rotated / plain - 1:+.1e} relative; {rotated / base - 1:+.1e} to bf16)",
                    flush=True,
                )
                shutil.rmtree(f32)
            for name in configs:
                row = accuracy.smollm2(folder, CONFIGS[name], text, decode=False)
                if encoder:
                    row.update(
                        accuracy.minilm(
                            encoder if variant == "orig" else rotated_encoder, CONFIGS[name], batch, reference
                        )
                    )
                rows.append((variant, name, row))
                print(f"{variant} {name}: {row}", file=sys.stderr, flush=True)
            if variant != "orig":
                shutil.rmtree(folder)
    print(f"\nSmolLM2 bf16 perplexity {base:.3f}\n")
    print("| variant | config | SmolLM2 ppl | ratio to bf16 | MiniLM cos | bits/weight |")
    print("|---|---|---:|---:|---:|---:|")
    for variant, name, row in rows:
        cos = f"{row['cos']:.4f}" if "cos" in row else "-"
        print(f"| {variant} | {name} | {row['ppl']:.3f} | {row['ppl'] / base:.3f} | {cos} | {row['bpw']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
