"""The decode step's own cache (`hfquant.nn.decode_cache`, `hfquant_cpu.decode_attention_row`): one call gives the
rotary row, the cache write and the row attention bit for bit; `generate` with it gives the same tokens, logits and
cache contents as transformers' `DynamicLayer.update` (the same kernels otherwise), across buffer growth, a user's
cache, a crop, a copy and beam search."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hfquant.nn import decode_cache
from hfquant.nn.decode_cache import RowDynamicLayer
from hfquant.ops import torch_ops

pytestmark = pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 128), (2, 1, 6)])
def test_one_call_is_the_rotary_row_the_concatenation_and_the_row_attention(heads, kv_heads, dim):
    """Against `rotary_row`, `torch.cat` of the cache and `attention_row`, bit for bit, at several positions of a
    buffer with room to spare; the buffer's positions after the step are untouched."""
    generator = torch.Generator().manual_seed(heads * dim)
    capacity = 40
    key_buffer = torch.randn(1, kv_heads, capacity, dim, generator=generator).to(torch.bfloat16)
    value_buffer = torch.randn(1, kv_heads, capacity, dim, generator=generator).to(torch.bfloat16)
    for position in (0, 1, 17, capacity - 1):
        qkv = torch.randn(1, 1, (heads + 2 * kv_heads) * dim, generator=generator).to(torch.bfloat16)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)  # the fused GEMV's row, split
        angle = torch.linspace(0, position, dim)
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        past_keys, past_values = key_buffer[:, :, :position].clone(), value_buffer[:, :, :position].clone()
        after = key_buffer[:, :, position + 1 :].clone()
        q_rot, k_rot = torch.ops.hfquant_cpu.rotary_row(q, k, cos, sin, dim)
        keys = torch.cat([past_keys, k_rot], dim=2)
        values = torch.cat([past_values, v.view(1, 1, kv_heads, dim).transpose(1, 2)], dim=2)
        expected = torch.ops.hfquant_cpu.attention_row(q_rot, keys, values, dim**-0.5)
        got = torch.ops.hfquant_cpu.decode_attention_row(qkv, cos, sin, key_buffer, value_buffer, position, dim**-0.5)
        assert got.shape == (1, 1, heads * dim) and torch.equal(_bits(got), _bits(expected).view(1, 1, -1))
        assert torch.equal(_bits(key_buffer[:, :, : position + 1]), _bits(keys))
        assert torch.equal(_bits(value_buffer[:, :, : position + 1]), _bits(values))
        assert torch.equal(_bits(key_buffer[:, :, position + 1 :]), _bits(after))


def test_the_call_refuses_a_full_buffer_and_mismatched_caches():
    qkv = torch.zeros(1, 1, 256, dtype=torch.bfloat16)  # 2 query heads, 1 key / value head of 64
    cos = sin = torch.zeros(64, dtype=torch.bfloat16)
    keys, values = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16), torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    assert torch.ops.hfquant_cpu.decode_attention_row(qkv, cos, sin, keys, values, 3, 0.125).shape == (1, 1, 128)
    with pytest.raises(RuntimeError, match="room at position 4"):
        torch.ops.hfquant_cpu.decode_attention_row(qkv, cos, sin, keys, values, 4, 0.125)
    with pytest.raises(RuntimeError, match="one shape"):
        torch.ops.hfquant_cpu.decode_attention_row(qkv, cos, sin, keys, values[:, :, :3], 1, 0.125)
    with pytest.raises(RuntimeError, match="whole heads"):
        torch.ops.hfquant_cpu.decode_attention_row(qkv[..., :200], cos, sin, keys, values, 1, 0.125)


def _quantized(folder):
    from transformers import AutoModelForCausalLM

    from hfquant import HfQuantConfig

    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=HfQuantConfig(), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("decode_cache") / "float"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(folder)
    return _quantized(folder)


def _generate(model, ids, **kwargs):
    with torch.no_grad():
        return model.generate(ids, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)


def _same(ours, theirs):
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        assert torch.equal(a, b)


def _transformers_update(monkeypatch):
    """Make the row forwards take transformers' `DynamicLayer.update` (the rotary kernel, `torch.cat`, the row
    attention: the path before the decode cache)."""
    monkeypatch.setattr(decode_cache, "takes_row_cache", lambda cache, layer_idx: False)


def test_generate_gives_the_tokens_logits_and_cache_of_transformers_update(model, monkeypatch):
    """80 new tokens (the buffers grow once, at 7 + 64 positions), the user's DynamicCache afterwards: same tokens,
    logits bit for bit, cache contents bit for bit, the layers now `RowDynamicLayer`."""
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(5))
    ours_cache = DynamicCache(config=model.config)
    ours = _generate(model, ids, max_new_tokens=80, min_new_tokens=80, cache=ours_cache)
    assert all(type(layer) is RowDynamicLayer for layer in ours_cache.layers)
    with monkeypatch.context() as patch:
        _transformers_update(patch)
        theirs_cache = DynamicCache(config=model.config)
        theirs = _generate(model, ids, max_new_tokens=80, min_new_tokens=80, cache=theirs_cache)
    assert all(type(layer) is DynamicLayer for layer in theirs_cache.layers)
    _same(ours, theirs)
    assert ours_cache.get_seq_length() == theirs_cache.get_seq_length() == 86
    for a, b in zip(ours_cache.layers, theirs_cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape and torch.equal(_bits(a.keys), _bits(b.keys))
        assert torch.equal(_bits(a.values), _bits(b.values))
        assert a.__dict__["_keys"][0].shape[2] > 86  # a buffer with room, grown from 71


def test_a_view_read_before_a_step_keeps_its_values_and_a_crop_then_more_steps_match(model, monkeypatch):
    ids = torch.randint(3, 256, (1, 5), generator=torch.Generator().manual_seed(6))
    caches, results = [], []
    for reference in (False, True):
        with monkeypatch.context() as patch:
            if reference:
                _transformers_update(patch)
            cache = DynamicCache(config=model.config)
            first = _generate(model, ids, max_new_tokens=6, cache=cache)
            before = cache.layers[0].keys
            kept = before.clone()
            cache.crop(-3)  # drop the last 3 positions: the next steps overwrite them (a new buffer for ours)
            more = _generate(model, first.sequences[:, :-3], max_new_tokens=6, cache=cache)
            assert torch.equal(_bits(before), _bits(kept))
            caches.append(cache)
            results.append(more)
    _same(*results)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(_bits(a.keys), _bits(b.keys)) and torch.equal(_bits(a.values), _bits(b.values))


def test_a_copied_cache_and_beam_search_match_transformers_update(model, monkeypatch):
    ids = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(7))
    cache = DynamicCache(config=model.config)
    first = _generate(model, ids, max_new_tokens=3, cache=cache)
    copied = copy.deepcopy(cache)
    assert type(copied.layers[0]) is RowDynamicLayer and torch.equal(copied.layers[0].keys, cache.layers[0].keys)
    ours = _generate(model, first.sequences, max_new_tokens=4, cache=copied)
    beams = _generate(model, ids, max_new_tokens=5, num_beams=2)
    with monkeypatch.context() as patch:
        _transformers_update(patch)  # the copy's RowDynamicLayer through transformers' update: its properties
        theirs = _generate(model, first.sequences, max_new_tokens=4, cache=copy.deepcopy(cache))
        beams_theirs = _generate(model, ids, max_new_tokens=5, num_beams=2)
    _same(ours, theirs)
    assert torch.equal(beams.sequences, beams_theirs.sequences)
