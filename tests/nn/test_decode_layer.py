"""A block-format decoder layer's decode step in one operator call (`hfquant.nn.decode_layer`,
`hfquant_cpu.decode_layer_row`): greedy tokens and logits equal `row_decode`'s forwards bit for bit over dozens of
steps (one block type, mixed types in a group, bits=3.5); every change the cached argument list depends on makes the
layer fall back to those forwards or rebuild the list, with their outputs; masks, batches and other attentions keep
the forwards; copies and pickles do not carry the list. Compiled decoding (`decode_layer_static` in the graph, over
a static cache) gives the eager layer call's outputs."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from helpers import tiny_model
from torch import nn

from hfquant.nn import decode_layer
from hfquant.ops import torch_ops
from hfquant.ops.gemv import RowKernel

pytestmark = pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")

STEPS = 32
"""Decode steps of the bit-for-bit comparisons (a prefill, then these)."""

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
"""A tiny Llama whose rows take the 256-weight block types too."""

MIXED = dict(format="iq4_nl", module_overrides={"v_proj": {"format": "q5_k"}, "up_proj": {"format": "q4_k"}})
"""q/k/v of IQ4_NL and Q5_K in one group, gate/up of IQ4_NL and Q4_K in one group."""


def _quantized(folder, **config):
    from transformers import AutoModelForCausalLM

    from hfquant import HfQuantConfig

    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=HfQuantConfig(**config), dtype=torch.bfloat16
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode_layer") / "float"
    tiny_model("llama", dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode_layer_wide") / "float"
    tiny_model("llama", dtype=torch.bfloat16, **WIDE).save_pretrained(path)
    return path


def _ids(batch: int = 1, length: int = 7, seed: int = 2) -> torch.Tensor:
    return torch.randint(3, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, steps: int = STEPS, **kwargs):
    with torch.no_grad():
        return model.generate(
            ids,
            max_new_tokens=steps + 1,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )


def _counted(monkeypatch) -> list[int]:
    """Count the layer operator's calls (set after a load, which sets the operator)."""
    op, calls = decode_layer._DECODE_LAYER_ROW, [0]
    assert op is not None
    monkeypatch.setattr(decode_layer, "_DECODE_LAYER_ROW", lambda *a: calls.__setitem__(0, calls[0] + 1) or op(*a))
    return calls


def _forwards(model, ids, monkeypatch, steps: int = STEPS, **kwargs):
    """`row_decode`'s forwards alone: the layer operator off."""
    with monkeypatch.context() as patch:
        patch.setattr(decode_layer, "_DECODE_LAYER_ROW", None)
        return _generate(model, ids, steps, **kwargs)


def _same(ours, theirs) -> None:
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.logits) == len(theirs.logits)
    for a, b in zip(ours.logits, theirs.logits, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def _block_layers(model) -> list:
    return [m for name, m in model.named_modules() if name.startswith("model.layers.") and hasattr(m, "plan")]


@pytest.mark.parametrize("case", ["default", "mixed", "bits_3_5"])
def test_the_layer_call_gives_the_forwards_tokens_and_logits_bit_for_bit(folder, wide_folder, monkeypatch, case):
    """The 4-bit default (IQ4_NL rows of 64), mixed block types in one group (IQ4_NL + Q5_K q/k/v, IQ4_NL + Q4_K
    gate/up), bits=3.5 (HQ3_R): every decode step of every layer is one call, and the tokens and logits are the
    forwards' over 32 steps."""
    config = {"default": {}, "mixed": MIXED, "bits_3_5": {"bits": 3.5}}[case]
    model = _quantized(wide_folder if case == "mixed" else folder, **config)
    layers = model.config.num_hidden_layers
    assert all(m.plan.row is RowKernel.BLOCK_GEMV for m in _block_layers(model))
    if case == "mixed":
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert attn.q_proj.plan.block != attn.v_proj.plan.block and mlp.gate_proj.plan.block != mlp.up_proj.plan.block
        assert attn.q_proj._fused is attn.v_proj._fused is not None
    calls = _counted(monkeypatch)
    ids = _ids()
    ours = _generate(model, ids)
    assert calls[0] == STEPS * layers
    _same(ours, _forwards(model, ids, monkeypatch))


def _check_fallback(model, monkeypatch, expected_calls: int, steps: int = 4, ids=None, **kwargs):
    """Decode `steps` steps with the layer operator counted: `expected_calls` calls, the forwards' outputs."""
    ids = _ids() if ids is None else ids
    calls = _counted(monkeypatch)
    ours = _generate(model, ids, steps, **kwargs)
    assert calls[0] == expected_calls
    _same(ours, _forwards(model, ids, monkeypatch, steps, **kwargs))
    return ours


def _warm(model) -> None:
    """One decode step, so that every layer holds its cached list."""
    _generate(model, _ids(), 1)
    assert all(decode_layer.KEY in layer.__dict__ for layer in model.model.layers)


def test_hooks_on_any_module_the_step_calls_fall_back(folder, monkeypatch):
    """A forward hook on o_proj, a pre-hook on the input norm, a hook on the MLP: that layer takes the forwards (the
    hook runs and changes the outputs as there); removed, the one call again."""
    model = _quantized(folder)
    _warm(model)
    layer = model.model.layers[1]
    for module, kind in ((layer.self_attn.o_proj, "forward"), (layer.input_layernorm, "pre"), (layer.mlp, "forward")):
        seen = []
        if kind == "pre":
            handle = module.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(1) or (args[0] * 2,))
        else:
            handle = module.register_forward_hook(lambda m, args, out, seen=seen: seen.append(1) or out * 2)
        _check_fallback(model, monkeypatch, expected_calls=4 * 1)  # layer 0 only: 4 steps
        assert len(seen) == 2 * 5  # ours, then the forwards': the prefill and 4 steps each
        handle.remove()
        _check_fallback(model, monkeypatch, expected_calls=4 * 2)


def test_global_hooks_and_an_instance_forward_fall_back(folder, monkeypatch):
    """A global forward hook sees every projection, as through the forwards; a forward replaced on the instance (as an
    offloading hook does) runs."""
    model = _quantized(folder)
    _warm(model)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: seen.append(m) and None)
    try:
        _check_fallback(model, monkeypatch, expected_calls=0, steps=2)
    finally:
        handle.remove()
    assert model.model.layers[0].self_attn.q_proj in seen
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.forward = lambda x, forward=o_proj.forward: forward(x) * 2
    _check_fallback(model, monkeypatch, expected_calls=2 * 1, steps=2)
    del o_proj.forward
    _check_fallback(model, monkeypatch, expected_calls=2 * 2, steps=2)


def test_a_swapped_weight_or_norm_rebuilds_the_list(folder, monkeypatch):
    """o_proj's weight buffer swapped (as an offloading hook does) and a norm's weight replaced: the list is built
    again over the new tensors, and the outputs are the forwards' with them."""
    model = _quantized(folder)
    _warm(model)
    first, second = model.model.layers
    before = first.__dict__[decode_layer.KEY]
    first.self_attn.o_proj._buffers["weight"] = second.self_attn.o_proj._buffers["weight"].clone()
    _check_fallback(model, monkeypatch, expected_calls=4 * 2)
    after = first.__dict__[decode_layer.KEY]
    assert after is not before and after.args[0][2] is first.self_attn.o_proj._buffers["weight"]
    first.post_attention_layernorm.weight = nn.Parameter(first.post_attention_layernorm.weight * 2, False)
    _check_fallback(model, monkeypatch, expected_calls=4 * 2)
    assert first.__dict__[decode_layer.KEY].args[0][1] is first.post_attention_layernorm.weight


def test_a_new_plan_or_to_rebuilds_the_list(folder, monkeypatch):
    """o_proj planned again for another block type of the same size (its GEMV bound again): the list is rebuilt with
    that type, the forwards' outputs; `model.to()` (every projection's GEMV bound again, the groups rebuilt over new views): the list is rebuilt."""
    model = _quantized(folder)
    _warm(model)
    o_proj = model.model.layers[0].self_attn.o_proj
    planned = o_proj.plan
    assert planned.block == "iq4_nl"
    o_proj.plan = dataclasses.replace(planned, block="q4_0", block_rows=1)  # 18 bytes per 32 weights: other values
    _check_fallback(model, monkeypatch, expected_calls=4 * 2)  # rebuilt with the plan's type
    o_proj.plan = planned
    before = model.model.layers[1].__dict__[decode_layer.KEY]
    model.to(torch.bfloat16)
    _check_fallback(model, monkeypatch, expected_calls=4 * 2)
    assert model.model.layers[1].__dict__[decode_layer.KEY] is not before


def test_a_dissolved_group_falls_back_and_a_rebuilt_one_is_taken_again(folder, monkeypatch):
    model = _quantized(folder)
    _warm(model)
    group = model.model.layers[0].mlp.gate_proj._fused
    group.dissolve()
    _check_fallback(model, monkeypatch, expected_calls=4 * 1)
    assert group.build()
    _check_fallback(model, monkeypatch, expected_calls=4 * 2)


def test_an_adapter_wrapping_a_projection_falls_back(folder, monkeypatch):
    """A projection replaced by a module wrapping it (as a LoRA adapter does): the forwards, through the adapter."""

    class Adapter(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, x):
            return self.base(x) * 1.5

    model = _quantized(folder)
    _warm(model)
    attn = model.model.layers[1].self_attn
    attn.q_proj = Adapter(attn.q_proj)
    _check_fallback(model, monkeypatch, expected_calls=4 * 1)


def test_training_mode_and_another_attention_fall_back(folder, monkeypatch):
    model = _quantized(folder)
    _warm(model)
    model.train()
    _check_fallback(model, monkeypatch, expected_calls=0, steps=2)
    model.eval()
    _check_fallback(model, monkeypatch, expected_calls=2 * 2, steps=2)
    model.set_attn_implementation("sdpa")
    _check_fallback(model, monkeypatch, expected_calls=0, steps=2)


def test_generate_with_a_mask_keeps_the_forwards(folder, monkeypatch):
    """Batch 2 with left padding, and batch 1 whose mask hides a position: no one call."""
    model = _quantized(folder)
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    _check_fallback(model, monkeypatch, expected_calls=0, steps=3, ids=ids, attention_mask=mask)
    _check_fallback(model, monkeypatch, expected_calls=0, steps=3, ids=ids[:1], attention_mask=mask[:1])


def test_copies_pickles_and_dequantize_drop_the_list(folder, monkeypatch):
    """A deep copy or a pickled layer holds no list (the copy's projections bind their own GEMVs); the copy builds its
    own (its projections in their groups again, it runs each layer as one call, with the original's outputs);
    `dequantize` drops the list with the classes."""
    model = _quantized(folder)
    _warm(model)
    layer = model.model.layers[0]
    assert decode_layer.KEY not in pickle.loads(pickle.dumps(layer)).__dict__
    twin = copy.deepcopy(model)
    assert all(decode_layer.KEY not in copied.__dict__ for copied in twin.model.layers)
    calls = _counted(monkeypatch)
    expected = _generate(model, _ids(), 4)
    original_calls = calls[0]
    _same(_generate(twin, _ids(), 4), expected)
    assert original_calls == 4 * 2 and calls[0] == 2 * original_calls  # two layers a step, in both models
    assert all(copied.__dict__[decode_layer.KEY].args is not None for copied in twin.model.layers)
    model.dequantize()
    assert all(decode_layer.KEY not in copied.__dict__ for copied in model.model.layers)


def _compiled_calls(model, ids, steps: int, **kwargs):
    """(outputs, the `hfquant_cpu.decode_layer_static` calls counted by the profiler) of a generate that must not
    compile (its graph traced before)."""
    with torch._dynamo.config.patch(error_on_recompile=True), torch.profiler.profile() as profile:
        outputs = _generate(model, ids, steps, **kwargs)
    calls = [e.count for e in profile.key_averages() if e.key == "hfquant_cpu::decode_layer_static"]
    return outputs, sum(calls)


def test_compiled_decoding_runs_each_layer_as_one_call_with_the_eager_layer_calls_outputs(folder, monkeypatch):
    """`compile_decoding` (fullgraph, static cache): every decode step of every layer is one `decode_layer_static`
    call in the graph, and tokens and logits equal the eager step's (`decode_layer_row` over a dynamic cache) bit for
    bit; a layer that no longer qualifies (a pre-hook on its MLP: the per-call check compiles again) keeps the traced
    forwards while the others keep their call, with the same outputs."""
    from hfquant import compile_decoding

    model = _quantized(folder)
    layers, ids, steps = model.config.num_hidden_layers, _ids(), 12
    calls = _counted(monkeypatch)
    eager = _generate(model, ids, steps)
    assert calls[0] == steps * layers
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32)
    _same(_generate(model, ids, steps), eager)  # compiles
    compiled, static_calls = _compiled_calls(model, ids, steps)
    assert static_calls == steps * layers
    _same(compiled, eager)
    handle = model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: None)
    _generate(model, ids, 1)  # compiles again: the modules changed
    hooked, static_calls = _compiled_calls(model, ids, steps)
    assert static_calls == steps * (layers - 1)
    assert torch.equal(hooked.sequences, eager.sequences)
    handle.remove()
    torch._dynamo.reset()


def test_compiled_layer_calls_guard_only_the_weights_they_read_and_a_swapped_member_weight_compiles_again(
    folder, monkeypatch
):
    """The compiled step's tensor guards on a layer's weights are on those its `decode_layer_static` call reads (the
    norms', o_proj's and down_proj's, the groups' `_parts`), not on the group members' own `weight` views: the
    members' weights are checked at trace time alone (`_views_in_place`). A member's weight swapped after compiling
    (as an offloading hook swaps it; the group then dissolves and the member runs its own GEMV) is still seen: the
    next call compiles again (`module_state`), that layer keeps the traced forwards, and the tokens are the eager
    ones."""
    from hfquant import compile_decoding
    from hfquant.integration import generation

    model = _quantized(folder)
    layers, ids, steps = model.config.num_hidden_layers, _ids(), 6
    eager = _generate(model, ids, steps)
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32)
    guarded: list[str] = []

    def recording(entries):
        keep = generation.keep_tensor_guards(entries)
        guarded.extend(
            e.name for e, kept in zip(entries, keep, strict=True) if kept and e.guard_type == "TENSOR_MATCH"
        )
        return keep

    monkeypatch.setitem(model.generation_config.compile_config.options, "guard_filter_fn", recording)
    _generate(model, ids, steps)  # compiles
    weights = [name for name in guarded if "_modules['layers']._modules['0']" in name]
    members = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert sum("_parts" in name for name in weights) == 2
    assert sum("_buffers['weight']" in name for name in weights) == 2  # o_proj's and down_proj's
    assert not [name for name in weights if any(f"['{member}']._buffers" in name for member in members)]
    k_proj = model.model.layers[0].self_attn.k_proj
    k_proj._buffers["weight"] = k_proj._buffers["weight"].clone()
    _generate(model, ids, 1)  # compiles again: the modules changed
    compiled, static_calls = _compiled_calls(model, ids, steps)
    assert static_calls == steps * (layers - 1)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch._dynamo.reset()


def test_compiled_decoding_with_a_padded_mask_reads_the_mask(folder):
    """Batch 1 whose mask hides a prompt position: the graph's layer calls read the mask (not a prefix: PyTorch's
    SDPA over the static cache with it, as the graph's attention did before), with the outputs of the same static
    cache decoded eagerly (the forwards, `attention_row_masked`) bit for bit."""
    from hfquant import compile_decoding

    model = _quantized(folder)
    layers, ids, steps = model.config.num_hidden_layers, _ids(1, 6), 6
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    # the eager reference over a static cache of the compiled one's length: SDPA's CPU kernel may split a longer
    # cache's keys into other blocks and sum in another order (it did on an Intel Xeon with AVX-512)
    settings = dict(attention_mask=mask, cache_implementation="static", max_cache_len=32)
    eager = _generate(model, ids, steps, disable_compile=True, **settings)
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32)
    _generate(model, ids, steps, attention_mask=mask)  # compiles
    compiled, static_calls = _compiled_calls(model, ids, steps, attention_mask=mask)
    assert static_calls == steps * layers
    _same(compiled, eager)
    torch._dynamo.reset()


def test_the_static_cache_call_is_the_layer_call_at_the_length_it_reads_and_advances(folder):
    """`decode_layer_static` on a static cache's buffers: the position read from `length` (then advanced by one),
    without a mask or with the step's prefix mask, gives `decode_layer_row`'s output and cache writes at that
    position bit for bit; a mask of another shape or a length of another dtype is refused."""
    model = _quantized(folder)
    _warm(model)
    layer = model.model.layers[1]
    weights, ints, floats = layer.__dict__[decode_layer.KEY].args
    attn = layer.self_attn
    kv_heads, head_dim, capacity, position = attn.k_proj.out_features // attn.head_dim, attn.head_dim, 16, 5
    generator = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    hidden, cos, sin = rand(1, 1, model.config.hidden_size), rand(1, 1, head_dim), rand(1, 1, head_dim)
    keys, values = rand(1, kv_heads, capacity, head_dim), rand(1, kv_heads, capacity, head_dim)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected = torch.ops.hfquant_cpu.decode_layer_row(
        hidden, cos, sin, expected_keys, expected_values, position, weights, ints, floats
    )
    prefix = torch.zeros(1, 1, 1, capacity, dtype=torch.bool)
    prefix[..., : position + 1] = True
    for mask in (None, prefix):
        ours_keys, ours_values, length = keys.clone(), values.clone(), torch.tensor(position)
        ours = torch.ops.hfquant_cpu.decode_layer_static(
            hidden, cos, sin, ours_keys, ours_values, length, mask, weights, ints, floats
        )
        assert int(length) == position + 1
        assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))
        assert torch.equal(ours_keys, expected_keys) and torch.equal(ours_values, expected_values)
    with pytest.raises(RuntimeError, match="bool CPU mask"):
        torch.ops.hfquant_cpu.decode_layer_static(
            hidden, cos, sin, keys, values, torch.tensor(position), prefix[..., :-1], weights, ints, floats
        )
    with pytest.raises(RuntimeError, match="one int64 CPU value"):
        torch.ops.hfquant_cpu.decode_layer_static(
            hidden, cos, sin, keys, values, torch.tensor(position, dtype=torch.int32), None, weights, ints, floats
        )
