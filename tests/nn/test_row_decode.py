"""One-token decode forwards (`hfquant.nn.row_decode`, `csrc/decode_rows_cpu.c`): the rotary row and the fused
residual add + RMSNorm equal transformers' ops bit for bit; the SwiGLU product is within one bfloat16 rounding of each
of its two roundings of a float64 reference (as torch's own) and differs from torch's in few outputs, by one step; a
quantized Llama decodes with them to the same tokens, prefill unchanged, and only in batch-1 one-token eager steps
with hfquant's attention."""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import tiny_model
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from hfquant.nn import decode_cache, decode_layer, row_decode
from hfquant.nn.row_attention import ATTENTION_NAME
from hfquant.nn.row_decode import (
    RowDecodeAttention,
    RowDecodeLayer,
    RowDecodeLayers,
    RowDecodeMLP,
    restore_row_decode,
    use_row_decode,
)
from hfquant.ops import torch_ops

pytestmark = pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _rotary_table(position: int, dim: int):
    inverse = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.tensor([[float(position)]])[..., None] * inverse
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 8, 64), (4, 2, 128), (2, 1, 6)])
def test_the_rotary_row_is_transformers_apply_rotary_pos_emb_bit_for_bit(heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(heads + dim)
    for position in (0, 1, 37, 1000, 100_000):
        qkv = (torch.randn(1, 1, (heads + 2 * kv_heads) * dim, generator=generator) * 4).to(torch.bfloat16)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)  # the fused GEMV's views
        cos, sin = _rotary_table(position, dim)
        expected_q, expected_k = apply_rotary_pos_emb(
            q.view(1, 1, heads, dim).transpose(1, 2), k.view(1, 1, kv_heads, dim).transpose(1, 2), cos, sin
        )
        got_q, got_k = torch.ops.hfquant_cpu.rotary_row(q, k, cos, sin, dim)
        assert got_q.shape == (1, heads, 1, dim) and got_k.shape == (1, kv_heads, 1, dim)
        assert torch.equal(_bits(got_q), _bits(expected_q)) and torch.equal(_bits(got_k), _bits(expected_k))


def test_the_rotary_row_refuses_what_it_cannot_compute():
    q, k = torch.zeros(1, 1, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    cos, sin = _rotary_table(3, 32)
    with pytest.raises(RuntimeError, match="head_dim"):
        torch.ops.hfquant_cpu.rotary_row(q, k, cos, sin, 31)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.hfquant_cpu.rotary_row(q.float(), k, cos, sin, 32)


@pytest.mark.parametrize("n", [1, 7, 64, 1536, 8192 + 9])
def test_the_swiglu_product_is_within_its_two_roundings_of_float64(n):
    """out = bf16(bf16(silu(g)) * u): against float64 silu(g) * u, at most one rounding of the SiLU (half a bfloat16
    unit, at most 2^-8 of it, times |u|) and one of the product (2^-8 of it), plus exp's float32 error (a few 2^-24,
    relative) and, for g < -88, SiLU's underflow (below 2^-120); torch's own output obeys the same bound; where
    the two differ (g >= -88) it is by one bfloat16 step, in few outputs."""
    generator = torch.Generator().manual_seed(n)
    differing = 0
    for scale in (0.01, 1.0, 4.0, 30.0):
        gate_up = (torch.randn(1, 1, 2 * n, generator=generator) * scale).to(torch.bfloat16)
        gate, up = gate_up.split([n, n], -1)  # the fused gate/up GEMV's views
        got = torch.ops.hfquant_cpu.silu_mul_row(gate, up)
        g, u = gate.double(), up.double()
        silu = g * torch.sigmoid(g)
        exact = silu * u
        bound = 2.0**-8 * silu.abs() * u.abs() * (1 + 2.0**-8) + 2.0**-8 * exact.abs() + 2.0**-20 * exact.abs()
        bound += 2.0**-120 * u.abs()  # exp(-g) overflows float32 for g < -88.7 (torch's too): |silu| < 2^-120 there
        torch_out = torch.nn.functional.silu(gate) * up
        assert got.shape == gate.shape and got.is_contiguous()
        assert ((got.double() - exact).abs() <= bound).all()
        assert ((torch_out.double() - exact).abs() <= bound).all()  # the bound is torch's too
        steps = (_bits(got).int() - _bits(torch_out).int()).abs()[gate >= -88]
        assert steps.max() <= 1
        differing += int((steps > 0).sum())
    assert differing <= max(1, 4 * n // 1000)


@pytest.mark.parametrize("n", [1, 7, 1536, 8192 + 9])
def test_the_swiglu_of_an_unsplit_gate_up_row_is_the_product_of_its_halves(n):
    """`silu_mul_halves_row` of a fused gate/up GEMV's row equals `silu_mul_row` of its two halves bit for bit."""
    gate_up = (torch.randn(1, 2 * n, generator=torch.Generator().manual_seed(n)) * 6).to(torch.bfloat16)
    gate, up = gate_up.split([n, n], -1)
    got = torch.ops.hfquant_cpu.silu_mul_halves_row(gate_up)
    assert got.shape == (1, 1, n)
    assert torch.equal(_bits(got), _bits(torch.ops.hfquant_cpu.silu_mul_row(gate, up)).view(1, 1, n))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.hfquant_cpu.silu_mul_halves_row(gate_up[:, :-1] if n > 0 else gate_up)


def test_the_swiglu_product_at_the_ends_of_exp():
    gate = torch.tensor([-200.0, -100.0, -87.5, -20.0, -0.0, 0.0, 20.0, 87.5, 100.0, 3e38]).to(torch.bfloat16)
    up = torch.ones_like(gate)
    got = torch.ops.hfquant_cpu.silu_mul_row(gate, up)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.equal(got[3:], expected[3:])
    assert (_bits(got[2]) - _bits(expected[2])).abs() <= 1  # exp(87.5) is finite
    assert torch.equal(_bits(got[:2]), _bits(-torch.zeros(2, dtype=torch.bfloat16)))  # torch's: -0 or below 2^-120


@pytest.mark.parametrize("n", [64, 576, 2048 + 8])
def test_the_add_rms_norm_row_is_the_sum_and_llama_rms_norm_bit_for_bit(n):
    generator = torch.Generator().manual_seed(n)
    norm = LlamaRMSNorm(n, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(n, generator=generator).to(torch.bfloat16)
    for scale in (1e-3, 1.0, 50.0):
        residual = (torch.randn(1, 1, n, generator=generator) * scale).to(torch.bfloat16)
        hidden = (torch.randn(1, 1, n, generator=generator) * scale).to(torch.bfloat16)
        with torch.no_grad():
            expected_sum = residual + hidden
            expected = norm(expected_sum)
        got_sum, got = torch.ops.hfquant_cpu.add_rms_norm_row(residual, hidden, norm.weight, norm.variance_epsilon)
        assert torch.equal(_bits(got_sum), _bits(expected_sum)) and torch.equal(_bits(got), _bits(expected))


def _quantized(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    from hfquant import HfQuantConfig

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=HfQuantConfig(), dtype=torch.bfloat16, **kwargs
    )


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True
        )


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("row_decode") / "float"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def test_a_quantized_llama_decodes_the_same_tokens_with_the_row_forwards(llama_folder, monkeypatch):
    """The default 4-bit model with and without the decode forwards: prefill logits equal, decode logits within a
    few bfloat16 steps (only the SwiGLU's exp differs, in a few outputs in 10^4), the same greedy tokens, and every
    decode step of every layer runs the three kernels (the layer's one call, `decode_layer`, turned off: it runs the
    same kernels in C, tests/nn/test_decode_layer.py)."""
    model = _quantized(llama_folder)
    monkeypatch.setattr(decode_layer, "_DECODE_LAYER_ROW", None)  # after the load, which sets it
    layers = model.config.num_hidden_layers
    assert model.config._attn_implementation == ATTENTION_NAME
    assert isinstance(model.model.layers[0], RowDecodeLayer) and isinstance(model.model.layers[0].mlp, RowDecodeMLP)
    assert isinstance(model.model.layers[0].self_attn, RowDecodeAttention)
    calls = {"rotary": 0, "swiglu": 0, "add_norm": 0, "cached": 0}
    decode_cache._DECODE_ATTENTION_ROW = torch.ops.hfquant_cpu.decode_attention_row.default
    for module, name, key in (
        (row_decode, "_ROTARY_ROW", "rotary"),
        (row_decode, "_SILU_MUL_ROW", "swiglu"),
        (row_decode, "_SILU_MUL_HALVES_ROW", "swiglu"),
        (row_decode, "_ADD_RMS_NORM_ROW", "add_norm"),
        (decode_cache, "_DECODE_ATTENTION_ROW", "cached"),
    ):
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, k=kernel, key=key: calls.__setitem__(key, calls[key] + 1) or k(*a)
        )
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    ours = _generate(model, ids)
    # 10 tokens, 9 decode steps; the rotary embedding is inside the cached attention's call (decode_cache)
    assert calls == {"rotary": 0, "swiglu": 9 * layers, "add_norm": 9 * layers, "cached": 9 * layers}
    assert restore_row_decode(model) == 3 * layers
    theirs = _generate(model, ids)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.logits[0], theirs.logits[0])  # prefill: transformers' forward
    for a, b in zip(ours.logits[1:], theirs.logits[1:], strict=True):
        assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=2**-6)


def test_everything_but_an_eager_one_token_step_is_transformers_forward(llama_folder, monkeypatch):
    """Prefill (batch 2, or several tokens) and a one-token step whose input requires a gradient run transformers'
    forwards: no row kernel is called."""
    model = _quantized(llama_folder)
    ids = torch.randint(3, 256, (2, 5), generator=torch.Generator().manual_seed(3))

    def refuse(*args):
        raise AssertionError("a row kernel ran")

    for name in ("_ROTARY_ROW", "_SILU_MUL_ROW", "_SILU_MUL_HALVES_ROW", "_ADD_RMS_NORM_ROW"):
        monkeypatch.setattr(row_decode, name, refuse)
    monkeypatch.setattr(decode_cache, "_DECODE_ATTENTION_ROW", refuse)
    with torch.no_grad():
        model(ids)
        model(ids[:1])
    embeds = model.get_input_embeddings()(ids[:1, :1]).detach().requires_grad_(True)
    model(inputs_embeds=embeds).logits.sum().backward()
    assert embeds.grad is not None


def test_other_attentions_keep_transformers_forward(llama_folder, monkeypatch):
    """A model loaded with `attn_implementation="sdpa"` keeps the class swap but never the rotary kernel (its attention
    is not hfquant's); `dequantize` restores every class; a pickled layer keeps the swap (its own transformers class
    where the operators do not load: tests/integration/test_pickling.py)."""
    model = _quantized(llama_folder, attn_implementation="sdpa")
    monkeypatch.setattr(row_decode, "_ROTARY_ROW", lambda *args: pytest.fail("the rotary kernel ran"))
    monkeypatch.setattr(decode_cache, "_DECODE_ATTENTION_ROW", lambda *args: pytest.fail("the cached step ran"))
    ids = torch.randint(3, 256, (1, 4), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    layer = pickle.loads(pickle.dumps(model.model.layers[0]))
    assert type(layer) is type(model.model.layers[0]) and isinstance(layer, RowDecodeLayer)
    assert type(layer).__bases__[1].__name__ == "LlamaDecoderLayer"
    model.dequantize()
    assert not any(isinstance(m, (RowDecodeAttention, RowDecodeMLP, RowDecodeLayer)) for m in model.modules())


def test_use_and_restore_are_inverse_and_leave_other_classes_alone():
    model = tiny_model("llama", dtype=torch.bfloat16)
    layers = model.config.num_hidden_layers
    assert use_row_decode(model) == 3 * layers and use_row_decode(model) == 0
    assert restore_row_decode(model) == 3 * layers and restore_row_decode(model) == 0
    assert use_row_decode(tiny_model("gpt2", dtype=torch.bfloat16)) == 0


def test_the_layer_list_slices_as_a_module_list():
    """`RowDecodeLayers`' slices hold the same layers under the same names as nn.ModuleList's, in a plain new
    nn.ModuleList; with a global module registration hook the hook sees every layer added (nn.ModuleList's own path);
    the list pickles as itself and `restore_row_decode` gives its class back."""
    from torch import nn

    model = tiny_model("llama", dtype=torch.bfloat16)
    use_row_decode(model)
    layers = model.model.layers
    assert type(layers) is RowDecodeLayers
    for idx in (slice(None, len(layers)), slice(1, None), slice(None, None, -1), slice(5, 9)):
        got, expected = layers[idx], nn.ModuleList.__getitem__(layers, idx)
        assert type(got) is nn.ModuleList and got is not layers
        assert list(got._modules.items()) == list(expected._modules.items())
    assert layers[0] is layers._modules["0"] and len(layers[:1]) == 1
    seen = []
    handle = nn.modules.module.register_module_module_registration_hook(lambda *args: seen.append(args[1]))
    try:
        assert list(layers[:2]._modules.keys()) == ["0", "1"] and seen == ["0", "1"]
    finally:
        handle.remove()
    assert type(pickle.loads(pickle.dumps(layers))) is RowDecodeLayers
    restore_row_decode(model)
    assert type(model.model.layers) is nn.ModuleList
