"""Plain helpers shared by the tests: tiny random models and tokenizer (offline, a few hundred KB each), their inputs
and outputs, and one measure of how close two outputs are. Fixtures live in conftest.py, which imports from here.

Test modules import them as

    from helpers import tiny_model
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

ARCHITECTURES = ("llama", "llama_tied", "gpt2", "bert")

TOKENIZER_VOCAB = dict(
    vocab_size=257, max_position_embeddings=1024, bos_token_id=None, eos_token_id=256, pad_token_id=256
)
"""Llama config overrides that match `tiny_tokenizer()`: its 257 ids (256 bytes, then <eos> = 256, also the padding
token), no BOS token, and positions for the long texts the evaluation tests score."""


LLAMA_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The Linear layers of one Llama decoder block, by their names inside `model.layers.N`."""


def tiny_config(arch: str, **overrides):
    """Config of a 2-layer model with hidden size 64 and a 256-token vocabulary; `overrides` replace any value."""
    if arch in ("llama", "llama_tied"):
        values = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=arch == "llama_tied",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        return LlamaConfig(**(values | overrides))
    if arch == "gpt2":  # Conv1D layers, lm_head tied to wte
        values = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
        return GPT2Config(**(values | overrides))
    if arch == "bert":  # encoder without an output embedding, Linear layers with bias
        values = dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
            pad_token_id=0,
        )
        return BertConfig(**(values | overrides))
    raise ValueError(arch)


def auto_class(arch: str):
    return AutoModel if arch == "bert" else AutoModelForCausalLM


MERGES_VOCAB = dict(TOKENIZER_VOCAB, vocab_size=258)
"""`TOKENIZER_VOCAB` for `tiny_tokenizer(merges=True)`: one more token."""


def tiny_model(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """Randomly initialised model of `tiny_config(arch, **overrides)` in `dtype`, eval mode.

    The weights depend only on the arguments: `torch.manual_seed(seed)` right before the model is built. With
    `**TOKENIZER_VOCAB` a Llama reads what `tiny_tokenizer()` writes.
    """
    torch.manual_seed(seed)
    return auto_class(arch).from_config(tiny_config(arch, **overrides)).to(dtype).eval()


def tiny_tokenizer(merges: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: one token per UTF-8 byte (256) plus ``<eos>`` (id 256); with `merges` also one BPE merge,
    "Ġ" + "t" -> "Ġt" (id 257; a model for it has `MERGES_VOCAB`), as llama.cpp needs a merge list in a GGUF file."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    pairs = []
    if merges:
        vocab["\u0120t"] = len(vocab)
        pairs = [("\u0120", "t")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def input_ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def model_output(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a causal LM, last hidden state of an encoder."""
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def decode_logits(model, length: int = 5, steps: int = 3) -> list[torch.Tensor]:
    """Logits of a prefill of `length` random tokens, then of `steps` one-token steps over the cache (batch 1: the
    one-row decode kernels' calls)."""
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        logits = [out.logits]
        for step in range(steps):
            out = model(input_ids=ids[:, step : step + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return logits


def cosine_similarity(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of the angle between `a` and `b`, each flattened to one float64 vector (any shapes of equal size)."""
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def run_python(code: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run `code` (dedented) in a fresh Python process with `env` added to this one's environment; output captured."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=timeout,
    )


def start_by_isa(code: str, settings, folder: Path, *args: str) -> dict[str, subprocess.Popen]:
    """{setting: a child Python running `code` (dedented) with `HFQUANT_ISA=setting` (csrc/isa_cpu.c reads it at load)
    and argv [*args, folder / f"{setting}.pt"]}, the repository and tests/ folders on its PYTHONPATH; all started at
    once, so the caller may compute while they run. `results_by_isa` collects them."""
    tests = Path(__file__).parent
    path = os.pathsep.join([str(tests.parent), str(tests), str(tests / "ops"), os.environ.get("PYTHONPATH", "")])
    return {
        setting: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), *args, str(folder / f"{setting}.pt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HFQUANT_ISA": setting, "PYTHONPATH": path},
        )
        for setting in settings
    }


def results_by_isa(children: dict[str, subprocess.Popen], folder: Path, timeout: float = 600) -> dict:
    """{setting: torch.load of what the child of `start_by_isa` saved}; asserts each child exited 0 (its stderr)."""
    results = {}
    for setting, child in children.items():
        _, err = child.communicate(timeout=timeout)
        assert child.returncode == 0, err[-3000:]
        results[setting] = torch.load(folder / f"{setting}.pt")
    return results


SHARD_SIZE = "20KB"
"""A shard size that splits a tiny test model into several shards."""


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every shard of `folder`; a name stored twice is an error."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                assert key not in tensors, f"{key} stored twice"
                tensors[key] = handle.get_tensor(key)
    return tensors


def record_row_kernels(monkeypatch) -> list:
    """The row kernels one-row products run with, in call order: through `gemv.row_product` or through the GEMV a
    prepared `QuantLinear` binds once (`gemv.row_function`). Install before `prepare_kernel`."""
    from hfquant.ops import gemv

    used = []
    real_product, real_function = gemv.row_product, gemv.row_function
    monkeypatch.setattr(gemv, "row_product", lambda *args: used.append(args[0]) or real_product(*args))

    def bound(row, call, *args):
        function = real_function(row, call, *args)
        if function is None:
            return None
        return lambda *args: used.append(row) or function(*args)

    monkeypatch.setattr(gemv, "row_function", bound)
    return used


def graph_ops(module: torch.nn.Module, x: torch.Tensor) -> tuple[tuple, list[str]]:
    """(the outputs of `module` compiled with fullgraph=True for x, the hfquant operators its graph calls)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    with torch.no_grad():
        compiled(x)
        outputs = compiled(x)
    ops = [str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"]
    torch._dynamo.reset()
    return outputs, [op for op in ops if op.startswith("hfquant")]
