"""Fast tests of hfquant.evaluation on a tiny random Llama (no checkpoint needed)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TOKENIZER_VOCAB, tiny_model, tiny_tokenizer

from hfquant.evaluation import (
    DEFAULT_REFERENCE_CHARS,
    decode_perplexity,
    decode_tokens_per_second,
    generate_answer,
    perplexity,
    reference_text,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_tied", seed=0, **TOKENIZER_VOCAB)


def _ids(tok, text):
    return tok(text, return_tensors="pt")["input_ids"]


def _hf_loss(model, ids):
    """Mean next-token NLL of ``ids`` (1, n) computed by transformers itself."""
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.double().item()


# ---------------------------------------------------------------- reference_text


def test_reference_text_is_deterministic_english():
    a = reference_text()
    b = reference_text()
    assert a == b
    assert len(a) == DEFAULT_REFERENCE_CHARS
    assert a.strip()
    # English prose from the Python reference, not noise.
    for word in (" the ", " statement", " is "):
        assert word in a


def test_reference_text_slices_one_corpus():
    whole = reference_text(3000)
    assert reference_text(1000) == whole[:1000]
    assert reference_text(1000, offset=2000) == whole[2000:]


@pytest.mark.parametrize(
    "kwargs", [{"n_chars": 0}, {"n_chars": -5}, {"n_chars": 10, "offset": -1}, {"n_chars": 10**9}]
)
def test_reference_text_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        reference_text(**kwargs)


# ---------------------------------------------------------------- perplexity


def test_perplexity_single_window_equals_exp_of_hf_loss(model, tok):
    text = reference_text(300)
    ids = _ids(tok, text)
    assert ids.shape[1] == 300  # byte tokenizer, ASCII text
    expected = math.exp(_hf_loss(model, ids))
    got = perplexity(model, tok, text, max_length=512, stride=512)
    assert got == pytest.approx(expected, rel=1e-5)
    # A random 257-token model is close to uniform.
    assert 100 < got < 1000


def test_perplexity_non_overlapping_windows(model, tok):
    text = reference_text(250)
    ids = _ids(tok, text)
    # Windows [0,100), [100,200), [200,250): each scores all but its first token.
    nll, count = 0.0, 0
    for start in range(0, 250, 100):
        chunk = ids[:, start : start + 100]
        n = chunk.shape[1] - 1
        nll += _hf_loss(model, chunk) * n
        count += n
    got = perplexity(model, tok, text, max_length=100, stride=100)
    assert count == 247
    assert got == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_perplexity_overlapping_windows_scores_each_token_once(model, tok):
    text = reference_text(200)
    ids = _ids(tok, text)[0]
    # max_length=100, stride=50: windows [0,100) scores 1..99, [50,150) scores 100..149,
    # [100,200) scores 150..199. Compute each token's NLL from its own window's logits.
    with torch.no_grad():

        def nlls(begin, end, first):
            logits = model(input_ids=ids[begin:end].unsqueeze(0)).logits[0].double()
            logp = torch.log_softmax(logits, dim=-1)
            return [-logp[t - begin - 1, ids[t]].item() for t in range(first, end)]

        all_nll = nlls(0, 100, 1) + nlls(50, 150, 100) + nlls(100, 200, 150)
    assert len(all_nll) == 199
    expected = math.exp(sum(all_nll) / len(all_nll))
    assert perplexity(model, tok, text, max_length=100, stride=50) == pytest.approx(expected, rel=1e-5)


def test_perplexity_max_tokens_truncates(model, tok):
    text = reference_text(400)
    assert perplexity(model, tok, text, max_tokens=150) == pytest.approx(perplexity(model, tok, text[:150]), rel=1e-6)


def test_perplexity_is_deterministic_and_restores_mode(model, tok):
    text = reference_text(300)
    model.train()
    try:
        a = perplexity(model, tok, text, max_length=128, stride=64)
        assert model.training
    finally:
        model.eval()
    b = perplexity(model, tok, text, max_length=128, stride=64)
    assert a == b


def test_every_measurement_resolves_mkls_vml_kernels_before_the_model_runs(model, tok, monkeypatch):
    """A model loaded without hfquant's quantizer (a bf16 baseline) gets its first forward's `cos` and `exp` from the
    kernels of every later one (`hfquant.ops.vml_dispatch`, tested in tests/ops/test_vml_dispatch.py)."""
    import hfquant.evaluation

    class Stop(Exception):
        pass

    calls = []

    def forward(*args, **kwargs):
        calls.append("forward")
        raise Stop

    monkeypatch.setattr(hfquant.evaluation, "resolve_vml_dispatch", lambda: calls.append("resolved"))
    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(Stop):
        perplexity(model, tok, reference_text(300), max_length=128, stride=64)
    assert calls == ["resolved", "forward"]


def test_perplexity_lower_for_a_model_that_learned_the_text(tok):
    """Sanity check of direction: a few SGD steps on the text must lower perplexity."""
    m = tiny_model("llama_tied", seed=1, **TOKENIZER_VOCAB)
    text = reference_text(200)
    ids = _ids(tok, text)
    before = perplexity(m, tok, text)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    m.train()
    for _ in range(30):
        opt.zero_grad()
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    m.eval()
    after = perplexity(m, tok, text)
    assert after < before / 5


def test_perplexity_bfloat16_model(tok):
    m = tiny_model("llama_tied", seed=0, dtype=torch.bfloat16, **TOKENIZER_VOCAB)
    ppl = perplexity(m, tok, reference_text(300))
    assert math.isfinite(ppl) and ppl > 1


@pytest.mark.parametrize("bf16_gemm", [True, False])
def test_perplexity_of_a_bfloat16_model_without_a_bf16_gemm(tok, monkeypatch, bf16_gemm):
    """Where the CPU has no bfloat16 GEMM the plain Linear layers multiply in float32 during the evaluation only: the
    same perplexity up to summation order, and the model's classes are restored after."""
    from hfquant.nn.float_linear import FloatLinear
    from hfquant.ops import machine

    m = tiny_model("llama_tied", seed=0, dtype=torch.bfloat16, **TOKENIZER_VOCAB)
    expected = perplexity(m, tok, reference_text(300))
    monkeypatch.setitem(machine._HALF_GEMM, torch.bfloat16, bf16_gemm)
    seen = []
    real = FloatLinear.forward
    monkeypatch.setattr(FloatLinear, "forward", lambda self, x: seen.append(x.shape) or real(self, x))
    assert perplexity(m, tok, reference_text(300)) == pytest.approx(expected, rel=1e-2)
    assert bool(seen) != bf16_gemm
    assert all(type(module) is not FloatLinear for module in m.modules())


class _WrappedWeight(torch.Tensor):
    """A tensor subclass standing in for another library's quantized weight (torchao's `Int4OpaqueTensor`, which
    refuses `.to(dtype)`)."""


def test_a_layer_with_a_tensor_subclass_weight_keeps_its_class_during_an_evaluation(tok, monkeypatch):
    """Without a bfloat16 GEMM the evaluation makes plain Linear layers FloatLinear for its duration; a layer whose
    weight is a tensor subclass (torchao's quantized layers are plain Linears holding one) keeps its own forward."""
    from hfquant.nn.float_linear import FloatLinear
    from hfquant.ops import machine

    m = tiny_model("llama_tied", seed=0, dtype=torch.bfloat16, **TOKENIZER_VOCAB)
    wrapped = m.model.layers[0].mlp.down_proj
    wrapped.weight = torch.nn.Parameter(wrapped.weight.detach().as_subclass(_WrappedWeight), requires_grad=False)
    monkeypatch.setitem(machine._HALF_GEMM, torch.bfloat16, False)
    swapped = []
    real = FloatLinear.forward
    monkeypatch.setattr(FloatLinear, "forward", lambda self, x: swapped.append(self) or real(self, x))
    assert math.isfinite(perplexity(m, tok, reference_text(300)))
    assert swapped and all(module is not wrapped for module in swapped)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_length": 1}, {"stride": 0}, {"max_length": 64, "stride": 65}, {"max_tokens": 1}],
)
def test_perplexity_rejects_bad_windows(model, tok, kwargs):
    with pytest.raises(ValueError):
        perplexity(model, tok, reference_text(100), **kwargs)


def test_perplexity_rejects_too_short_text(model, tok):
    with pytest.raises(ValueError):
        perplexity(model, tok, "a")


# ---------------------------------------------------------------- generation


def test_decode_perplexity_equals_the_whole_window_loss(model, tok):
    """Fed one token at a time through the KV cache, a float32 model scores what one forward pass over the window
    scores: exp of transformers' own mean loss, to float32 accumulation (1e-4)."""
    text = reference_text(120)
    ids = _ids(tok, text)
    got = decode_perplexity(model, tok, text, max_tokens=ids.shape[1])
    assert got == pytest.approx(math.exp(_hf_loss(model, ids)), rel=1e-4)
    assert decode_perplexity(model, tok, text, max_tokens=40) == pytest.approx(
        math.exp(_hf_loss(model, ids[:, :40])), rel=1e-4
    )


def test_decode_perplexity_rejects_bad_arguments(model, tok):
    with pytest.raises(ValueError, match="max_tokens must be >= 2, got 1"):
        decode_perplexity(model, tok, "some text", max_tokens=1)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        decode_perplexity(model, tok, "a")


def test_decode_tokens_per_second_positive(model, tok):
    rate = decode_tokens_per_second(model, tok, "The quick brown fox", new_tokens=8, repeats=2)
    assert math.isfinite(rate) and rate > 0


def test_decode_tokens_per_second_generates_exactly_new_tokens(model, tok, monkeypatch):
    # Force EOS to be the greedy choice: the measurement must still generate every token.
    lengths = []
    real_generate = model.generate

    def spy(*args, **kwargs):
        out = real_generate(*args, **kwargs)
        lengths.append(out.shape[1] - kwargs["input_ids"].shape[1])
        return out

    monkeypatch.setattr(model, "generate", spy)

    def eos_always_wins(module, inputs, output):
        output = output.clone()
        output[..., 256] += 1e4
        return output

    handle = model.lm_head.register_forward_hook(eos_always_wins)
    try:
        assert generate_answer(model, tok, "Hi", max_new_tokens=5) == ""  # stops at EOS at once
        lengths.clear()
        decode_tokens_per_second(model, tok, "Hi", new_tokens=6, repeats=2, warmup=False)
    finally:
        handle.remove()
    assert lengths == [6, 6]


@pytest.mark.parametrize("kwargs", [{"new_tokens": 1}, {"repeats": 0}])
def test_decode_tokens_per_second_rejects_bad_arguments(model, tok, kwargs):
    with pytest.raises(ValueError):
        decode_tokens_per_second(model, tok, "Hi", **kwargs)


def test_generate_answer_is_greedy_and_returns_only_new_text(model, tok):
    a = generate_answer(model, tok, "What is the capital of France?", max_new_tokens=12)
    b = generate_answer(model, tok, "What is the capital of France?", max_new_tokens=12)
    assert isinstance(a, str)
    assert a == b
    # Byte tokenizer: at most 12 new bytes, and the prompt is not echoed.
    assert len(a.encode("utf-8", errors="replace")) <= 12 * 3
    assert "capital of France" not in a


def test_generate_answer_uses_chat_template(model):
    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    seen = []
    real_generate = model.generate

    def spy(*args, **kwargs):
        seen.append(tok.decode(kwargs["input_ids"][0]))
        return real_generate(*args, **kwargs)

    model.generate = spy
    try:
        generate_answer(model, tok, "Q?", max_new_tokens=3)
    finally:
        del model.generate
    assert seen == ["<<Q?>>A:"]


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({"bits": 8}, "hfquant int8"),
        ({"bits": 4, "format": "int"}, "hfquant int4"),
        ({"bits": 4}, "hfquant iq4_xs"),
        ({"bits": 3.5}, "hfquant hq3_r"),
        ({"format": "q4_k"}, "hfquant q4_k"),
    ],
)
def test_a_measured_row_names_the_stored_format(fields, kind):
    """The label `hfquant eval` prints and the model card repeats: the 4-bit default is IQ4_XS, not int4."""
    from hfquant import HfQuantConfig
    from hfquant.evaluation import _kind

    assert _kind(HfQuantConfig(**fields).to_dict(), "bfloat16") == kind
    assert _kind(None, "bfloat16") == "bfloat16"
