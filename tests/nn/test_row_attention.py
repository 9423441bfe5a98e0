"""One-query-row attention (`hfquant.nn.row_attention`, `csrc/attention_cpu.c`): within float32 summation error and
the bfloat16 roundings of the probabilities and the output of a float64 reference, only for one bfloat16 query row
without mask or with a static cache's prefix mask, and switched on and off through the config's
`_attn_implementation`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hfquant.nn import decode_cache, row_attention
from hfquant.nn.row_attention import ATTENTION_NAME, restore_row_attention, row_attention_forward, use_row_attention
from hfquant.ops import torch_ops

pytestmark = pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")


def _qkv(heads: int, kv_heads: int, tokens: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 1, heads, dim, generator=generator) * 3).to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    v = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("tokens", [1, 5, 80, 700])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 64), (16, 4, 128), (8, 2, 72)])
def test_kernel_is_within_one_rounding_of_the_exact_attention(tokens, heads, kv_heads, dim):
    q, k, v = _qkv(heads, kv_heads, tokens, dim, seed=tokens + heads)
    scale = dim**-0.5
    got = torch.ops.hfquant_cpu.attention_row(q, k, v, scale)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale, enable_gqa=True)
    exact = exact.transpose(1, 2)
    flash = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2)
    assert got.shape == (1, 1, heads, dim) and got.dtype == torch.bfloat16
    # the output's bfloat16 rounding (2^-8 relative), the probabilities' (2^-9 relative each, as the flash kernel
    # rounds them: at most 2^-9 * sum_t p_t |v_t|) and float32 sums over dim and tokens (|v| < 6 here)
    weighted = F.scaled_dot_product_attention(q.double(), k.double(), v.double().abs(), scale=scale, enable_gqa=True)
    bound = 2.0**-8 * exact.abs() + 2.0**-9 * weighted.transpose(1, 2) + (dim + tokens) * 2.0**-23 * 6
    assert ((got.double() - exact).abs() <= bound).all()
    assert (got.double() - exact).abs().mean() <= (flash.double() - exact).abs().mean() * 1.05


def test_operator_refuses_what_it_cannot_compute():
    q, k, v = _qkv(9, 3, 4, 64)
    with pytest.raises(RuntimeError, match="query"):
        torch.ops.hfquant_cpu.attention_row(q.expand(2, -1, -1, -1), k, v, 0.125)
    with pytest.raises(RuntimeError, match="refused"):
        torch.ops.hfquant_cpu.attention_row(q[:, :8], k, v, 0.125)  # 8 heads over 3 kv heads


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("tokens", [1, 7, 80, 700])
@pytest.mark.parametrize("kept", ["prefix", "all"])
def test_the_masked_operator_reads_only_the_prefix_the_mask_allows(tokens, kept):
    """A static cache's decode-step mask (the first positions True, the rest False): the kernel's bytes over that
    prefix alone, whatever the cache holds after it."""
    q, k, v = _qkv(16, 4, 1024, 64, seed=tokens)
    mask = torch.zeros(1, 1, 1, 1024, dtype=torch.bool)
    mask[..., :tokens] = True
    if kept == "all":
        k, v, mask = k[:, :, :tokens], v[:, :, :tokens], mask[..., :tokens]
    expected = torch.ops.hfquant_cpu.attention_row(q, k[:, :, :tokens], v[:, :, :tokens], 0.125)
    assert torch.equal(torch.ops.hfquant_cpu.attention_row_masked(q, k, v, 0.125, mask), expected)
    assert torch.equal(torch.ops.hfquant_cpu.attention_row_masked(q, k, v, 0.125, mask.expand(1, 1, 1, -1)), expected)


@pytest.mark.parametrize("case", ["padding", "gaps", "none"])
def test_the_masked_operator_gives_any_other_mask_to_pytorch(case):
    """Masks that are not a prefix (left padding, gaps, nothing before a True) go to PyTorch's SDPA with the mask."""
    q, k, v = _qkv(9, 3, 40, 64)
    mask = torch.zeros(1, 1, 1, 40, dtype=torch.bool)
    mask[..., {"padding": slice(3, 30), "gaps": slice(0, 30, 2), "none": slice(39, 40)}[case]] = True
    got = torch.ops.hfquant_cpu.attention_row_masked(q, k, v, 0.125, mask)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
    assert torch.equal(got, expected)


def test_the_masked_operator_refuses_other_masks():
    q, k, v = _qkv(9, 3, 8, 64)
    for mask in (torch.ones(1, 1, 1, 7, dtype=torch.bool), torch.zeros(1, 1, 1, 8), torch.ones(1, 1, 2, 8).bool()):
        with pytest.raises(RuntimeError, match="mask"):
            torch.ops.hfquant_cpu.attention_row_masked(q, k, v, 0.125, mask)


@pytest.mark.parametrize("case", ["float mask", "two rows", "float32", "batch"])
def test_everything_but_one_row_unmasked_or_prefix_masked_is_transformers_sdpa(case, monkeypatch):
    monkeypatch.setattr(row_attention, "_ATTENTION_ROW", torch.ops.hfquant_cpu.attention_row.default)
    monkeypatch.setattr(row_attention, "_ATTENTION_ROW_MASKED", torch.ops.hfquant_cpu.attention_row_masked.default)
    q, k, v = _qkv(9, 3, 6, 64)
    mask = None
    if case == "float mask":  # eager attention's additive kind
        mask = torch.zeros(1, 1, 1, 6, dtype=torch.bfloat16)
    elif case == "two rows":
        q = torch.cat([q, q], dim=2)
    elif case == "float32":
        q, k, v = q.float(), k.float(), v.float()
    else:
        q, k, v = (t.expand(2, -1, -1, -1) for t in (q, k, v))
    expected, _ = sdpa_attention_forward(_Attention(), q, k, v, mask, scaling=0.125)
    got, _ = row_attention_forward(_Attention(), q, k, v, mask, scaling=0.125)
    assert torch.equal(got, expected)


def test_a_prefix_mask_goes_to_the_masked_kernel(monkeypatch):
    monkeypatch.setattr(row_attention, "_ATTENTION_ROW", torch.ops.hfquant_cpu.attention_row.default)
    monkeypatch.setattr(row_attention, "_ATTENTION_ROW_MASKED", torch.ops.hfquant_cpu.attention_row_masked.default)
    q, k, v = _qkv(9, 3, 32, 64)
    mask = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
    mask[..., :11] = True
    got, _ = row_attention_forward(_Attention(), q, k, v, mask, scaling=0.125)
    assert torch.equal(got, torch.ops.hfquant_cpu.attention_row(q, k[:, :, :11], v[:, :, :11], 0.125))


def test_the_switch_changes_only_the_config_and_decode_steps():
    model = tiny_model("llama", dtype=torch.bfloat16, attn_implementation="sdpa")
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        prefill = model(input_ids=ids, use_cache=True)
        step = model(input_ids=ids[:, :1], cache=prefill.past_key_values, use_cache=True).logits
        assert use_row_attention(model) and model.config._attn_implementation == ATTENTION_NAME
        assert "attn_implementation" not in model.config.to_json_string()
        again = model(input_ids=ids, use_cache=True)
        row = model(input_ids=ids[:, :1], cache=again.past_key_values, use_cache=True).logits
    assert torch.equal(again.logits, prefill.logits)  # the prefill keeps sdpa
    assert torch.allclose(row.float(), step.float(), atol=0.05) and row.argmax() == step.argmax()
    assert restore_row_attention(model) and model.config._attn_implementation == "sdpa"
    assert not restore_row_attention(model)


def test_an_eager_model_is_left_alone():
    model = tiny_model("llama", dtype=torch.bfloat16, attn_implementation="eager")
    assert not use_row_attention(model) and model.config._attn_implementation == "eager"


def _quantized(folder, **kwargs):
    from transformers import AutoModelForCausalLM

    from hfquant import HfQuantConfig

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=HfQuantConfig(bits=4, group_size=32), dtype=torch.bfloat16, **kwargs
    )


def test_a_quantized_model_gets_the_kernel_and_saves_the_same_config(tmp_path):
    """On by default for a "sdpa" model hfquant quantizes or reloads: config.json as saved with "sdpa" (the field is
    not written), the reloaded model gets it too, and `dequantize` gives "sdpa" back."""
    import json

    from transformers import AutoModelForCausalLM

    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    model = _quantized(tmp_path / "float")
    assert model.config._attn_implementation == ATTENTION_NAME
    model.save_pretrained(tmp_path / "with")
    assert restore_row_attention(model)
    model.save_pretrained(tmp_path / "without")
    with_kernel, without = (json.loads((tmp_path / name / "config.json").read_text()) for name in ("with", "without"))
    assert with_kernel == without and ATTENTION_NAME not in json.dumps(with_kernel)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "with", dtype=torch.bfloat16)
    assert reloaded.config._attn_implementation == ATTENTION_NAME
    reloaded.dequantize()
    assert reloaded.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("asked", ["sdpa", "eager"])
def test_an_attention_asked_for_by_name_is_kept(tmp_path, asked):
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    assert _quantized(tmp_path / "float", attn_implementation=asked).config._attn_implementation == asked


def test_the_default_decodes_as_sdpa_within_a_bfloat16_step(tmp_path, monkeypatch):
    """Greedy decoding of the quantized model with and without the kernel: the prefill's logits equal, the decode
    steps' logits within a few bfloat16 steps (the attention outputs differ by at most one step each) while the
    tokens are the same, and the kernel runs every decode step of every layer."""
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(tmp_path / "float")
    model = _quantized(tmp_path / "float")
    calls = []
    kernel = row_attention._ATTENTION_ROW
    monkeypatch.setattr(row_attention, "_ATTENTION_ROW", lambda *args: calls.append(1) or kernel(*args))
    cached = torch.ops.hfquant_cpu.decode_attention_row.default  # the decode step's own cache: kernel in one call
    monkeypatch.setattr(decode_cache, "_DECODE_ATTENTION_ROW", lambda *args: calls.append(1) or cached(*args))
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name in (ATTENTION_NAME, "sdpa"):
        model.config._attn_implementation = name
        with torch.no_grad():
            runs[name] = model.generate(
                ids, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
    ours, sdpa = runs[ATTENTION_NAME], runs["sdpa"]
    assert len(calls) == 7 * model.config.num_hidden_layers
    assert torch.equal(ours.logits[0], sdpa.logits[0])
    same = int((ours.sequences[0] == sdpa.sequences[0]).cumprod(0).sum()) - ids.shape[1]  # tokens alike so far
    for a, b in zip(ours.logits[1 : same + 1], sdpa.logits[1 : same + 1], strict=True):
        assert torch.allclose(a.float(), b.float(), atol=0.1, rtol=2**-6)
