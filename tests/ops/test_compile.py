"""torch.compile: QuantLinear traces with fullgraph=True (no graph break) and gives the eager result."""

from __future__ import annotations

import pytest
import torch

from hfquant.config import HfQuantConfig
from hfquant.core.format import StoredFormat
from hfquant.integration.quantizer import HfQuantQuantizer
from hfquant.nn.linear import QuantLinear
from hfquant.nn.row_attention import ATTENTION_NAME
from hfquant.ops import kernels
from hfquant.ops.kernels import Kernel


@pytest.mark.parametrize(
    "bits,group_size,symmetric,kernel",
    [(8, 512, True, Kernel.INT8PACK_MM), (4, 128, False, Kernel.INT4PACK_MM_CPU), (8, 128, True, Kernel.DEQUANT)],
)
# 1 row: hfquant's GEMV where it works (forced: HFQUANT_KERNEL_CHOICE=native); 130 >= kernels.GEMM_MIN_ROWS: chunked GEMM
@pytest.mark.parametrize("rows", [1, 3, 130], ids=["one-row", "decode", "prefill"])
def test_quant_linear_compiles_without_graph_breaks(bits, group_size, symmetric, kernel, rows, monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # read when the layer is planned
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn((256, 512), generator=generator) * 0.02).to(torch.bfloat16)
    layer = QuantLinear.from_float(weight, None, StoredFormat(bits, group_size, symmetric))
    assert layer.prepare_kernel(torch.bfloat16) == kernel
    x = torch.randn((rows, 512), generator=generator).to(torch.bfloat16)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        # The compiled graph calls the same aten ops on the same tensors: identical output (the chunked path's
        # elementwise dequantization is generated code there, rounded the same way to within one bfloat16 step).
        expected, got = layer(x), compiled(x)
        if rows < min(kernels.GEMM_MIN_ROWS.values()):
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())


def test_quantizer_reports_itself_compileable():
    assert HfQuantQuantizer(HfQuantConfig(bits=4), pre_quantized=False).is_compileable


def test_generate_with_a_static_cache_compiles_the_quantized_model_and_gives_the_eager_tokens(float_checkpoint):
    """The transformers way to compile decoding: `generate(cache_implementation="static", compile_config=...)`. On CPU
    transformers compiles only when the config asks for every device (`_compile_all_devices`, which
    `hfquant.compile_decoding` sets: the test below). SDPA attention here; eager attention (the README's fast path)
    compiles the same way in the test below, which switches the model to it."""
    attention = "sdpa"
    from transformers import AutoModelForCausalLM, CompileConfig

    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama", torch.bfloat16),
        quantization_config=HfQuantConfig(bits=4, group_size=32),
        dtype=torch.bfloat16,
        device_map="cpu",
        attn_implementation=attention,
    )
    assert any(getattr(m, "kernel", None) == Kernel.INT4PACK_MM_CPU for m in model.modules())
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, **settings, disable_compile=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = model.generate(ids, **settings, compile_config=config)
    assert getattr(model, "_compiled_call", None) is not None  # generate did compile the forward
    assert torch.equal(compiled, eager)


def _int4_llama_and_its_eager_tokens(float_checkpoint):
    """(model, ids, settings, eager): the small Llama quantized to int4 at groups of 32, a prompt, greedy settings
    of 6 new tokens, and the tokens an uncompiled generate with a static cache gives."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama", torch.bfloat16),
        quantization_config=HfQuantConfig(bits=4, group_size=32),
        dtype=torch.bfloat16,
        device_map="cpu",
    )
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    eager = model.generate(ids, **settings, cache_implementation="static", disable_compile=True)
    return model, ids, settings, eager


def test_compile_decoding_makes_generate_compile_and_give_the_eager_tokens(float_checkpoint):
    """`hfquant.compile_decoding(model)`: the same compiled `generate` as the test above, with no compile code; a
    second call of another length within `max_cache_len` reuses the graph (no recompile)."""
    from hfquant import compile_decoding

    model, ids, settings, eager = _int4_llama_and_its_eager_tokens(float_checkpoint)
    eager_longer = model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, disable_compile=True)
    assert (
        model.generation_config.compile_config is None
        or not model.generation_config.compile_config._compile_all_devices
    )
    torch._dynamo.reset()
    assert compile_decoding(model, max_cache_len=32) is model
    assert model.config._attn_implementation == ATTENTION_NAME  # hfquant's one-row kernel in the graph
    assert model.generation_config.cache_implementation == "static"
    compiled = model.generate(ids, **settings)
    assert getattr(model, "_compiled_call", None) is not None  # generate did compile the forward
    assert torch.equal(compiled, eager)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.profiler.profile() as profile:
        assert torch.equal(model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False), eager_longer)
    # every layer's attention of the 8 compiled decode steps is the masked one-row kernel (over the written prefix)
    calls = [e.count for e in profile.key_averages() if e.key == "hfquant_cpu::attention_row_masked"]
    assert calls == [8 * model.config.num_hidden_layers]


def test_compile_decoding_without_module_guards_gives_the_eager_tokens(float_checkpoint):
    """`compile_decoding(model, module_guards=False)`: the compile config carries `keep_input_guards` (and no mode:
    torch takes one or the other), generate compiles and gives the eager tokens."""
    from hfquant import compile_decoding
    from hfquant.integration.generation import keep_input_guards

    model, ids, settings, eager = _int4_llama_and_its_eager_tokens(float_checkpoint)
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32, module_guards=False)
    config = model.generation_config.compile_config
    assert config.options == {"guard_filter_fn": keep_input_guards} and config.mode is None and config.fullgraph
    assert torch.equal(model.generate(ids, **settings), eager)
    assert getattr(model, "_compiled_call", None) is not None
    torch._dynamo.reset()


def test_compile_decoding_compiles_again_when_the_modules_change(float_checkpoint):
    """The default (module guards dropped): a hook added after the first compiled `generate` (the step's graph does
    not check the hook dicts) is seen by the next call, which compiles again (`module_state` differs) and gives the
    hooked model's eager tokens; removing it gives the first tokens again; an unchanged model reuses the graph. Without
    the per-call check the graph of the unhooked model would run (`test_module_state_sees_...` below)."""
    from hfquant import compile_decoding

    model, ids, settings, eager = _int4_llama_and_its_eager_tokens(float_checkpoint)
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32)
    assert torch.equal(model.generate(ids, **settings), eager)
    first = model._compiled_call
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(model.generate(ids, **settings), eager)
    assert model._compiled_call is first

    def favour_token_3(module, inputs, output):
        output = output.clone()
        output[..., 3] += 1e4  # every greedy token becomes 3
        return output

    handle = model.lm_head.register_forward_hook(favour_token_3)
    hooked_eager = model.generate(ids, **settings, disable_compile=True)
    assert (hooked_eager[0, ids.shape[1] :] == 3).all() and not torch.equal(hooked_eager, eager)
    assert torch.equal(model.generate(ids, **settings), hooked_eager)
    assert model._compiled_call is not first
    handle.remove()
    assert torch.equal(model.generate(ids, **settings), eager)
    torch._dynamo.reset()


def test_compile_decoding_compiles_again_when_a_weight_changes_in_place(float_checkpoint):
    """The default drops the weights' tensor guards (`keep_input_guards`): the final norm's weight given other strides
    in place after the first compiled `generate` (a `.data` swap to a strided view of the same values; the graph
    read it with stride 1) is seen by the next call (`module_state` records each tensor's strides), which compiles
    again and gives the eager tokens; without that the old graph would read every other value of the new storage."""
    from hfquant import compile_decoding

    model, ids, settings, eager = _int4_llama_and_its_eager_tokens(float_checkpoint)
    torch._dynamo.reset()
    compile_decoding(model, max_cache_len=32)
    assert torch.equal(model.generate(ids, **settings), eager)
    first = model._compiled_call
    weight = model.model.norm.weight
    spread = torch.full((2 * weight.numel(),), 1e4, dtype=weight.dtype)
    spread[::2] = weight.data
    weight.data = spread[::2]
    assert weight.stride() == (2,)
    assert torch.equal(model.generate(ids, **settings), eager)
    assert model._compiled_call is not first
    torch._dynamo.reset()


def test_module_state_sees_hooks_training_retyping_and_rebinding(float_checkpoint):
    from hfquant.integration.generation import module_state

    model, *_ = _int4_llama_and_its_eager_tokens(float_checkpoint)
    state = module_state(model)
    assert module_state(model) == state
    layer = model.model.layers[0]
    handle = layer.mlp.register_forward_pre_hook(lambda module, args: None)
    assert module_state(model) != state
    handle.remove()
    assert module_state(model) == state
    model.train()
    assert module_state(model) != state
    model.eval()
    assert module_state(model) == state
    model.config._attn_implementation_new = "x"  # a config attribute added
    assert module_state(model) != state
    del model.config._attn_implementation_new
    original = layer.self_attn.o_proj
    layer.self_attn.o_proj = torch.nn.Identity()
    assert module_state(model) != state
    layer.self_attn.o_proj = original
    assert module_state(model) == state
    weight = layer.input_layernorm.weight
    stored = weight.data
    weight.data = stored.float()  # the same Parameter, another dtype
    assert module_state(model) != state
    weight.data = stored
    assert module_state(model) == state
    weight.requires_grad_(not weight.requires_grad)
    assert module_state(model) != state
    weight.requires_grad_(not weight.requires_grad)
    assert module_state(model) == state
    model.dequantize()
    assert module_state(model) != state


def test_module_state_sees_a_value_replaced_by_one_at_the_freed_id(float_checkpoint):
    """An attribute's value freed and a new value created at its address (CPython's float free list hands the freed
    block to the next float): a snapshot of ids alone would call the model unchanged and reuse a graph traced with the
    old value baked in; `module_state` must see the change."""
    from hfquant.integration.generation import module_state

    model, *_ = _int4_llama_and_its_eager_tokens(float_checkpoint)
    layer = model.model.layers[0]
    layer.mlp.act_fn = torch.nn.LeakyReLU(float("0.125"))
    state = module_state(model)
    address = id(layer.mlp.act_fn.negative_slope)
    layer.mlp.act_fn.negative_slope = None  # the old float freed, the attribute keeping its place
    layer.mlp.act_fn.negative_slope = float("0.375")
    freed_and_reused = id(layer.mlp.act_fn.negative_slope) == address
    assert module_state(model) != state
    assert not freed_and_reused  # the snapshot holds the old value, so its address cannot be taken


def test_module_state_keeps_no_module_alive(float_checkpoint):
    import gc
    import weakref

    from hfquant.integration.generation import module_state

    model, *_ = _int4_llama_and_its_eager_tokens(float_checkpoint)
    layer = model.model.layers[0]
    layer.mlp.act_fn = torch.nn.SiLU()
    swapped_out = weakref.ref(layer.mlp.act_fn)
    state = module_state(model)
    layer.mlp.act_fn = torch.nn.GELU()
    gc.collect()
    assert swapped_out() is None
    assert module_state(model) != state


def test_the_guard_filters_drop_the_module_guards_they_name():
    from types import SimpleNamespace

    from hfquant.integration.generation import keep_input_guards, keep_tensor_guards

    def entry(in_module: bool, guard_type: str):
        source = SimpleNamespace(is_unspecialized_nn_module=lambda: in_module)
        return SimpleNamespace(orig_guard=SimpleNamespace(source=source), guard_type=guard_type)

    entries = [entry(False, "ID_MATCH"), entry(True, "TENSOR_MATCH"), entry(True, "ID_MATCH"), entry(True, "EQUALS")]
    assert keep_tensor_guards(entries) == [True, True, False, False]
    entries.append(entry(False, "TENSOR_MATCH"))
    assert keep_input_guards(entries) == [True, False, False, False, True]


@pytest.mark.parametrize(
    "kwargs,error",
    [
        (dict(max_cache_len=0), "max_cache_len must be a positive int or None, got 0"),
        (dict(max_cache_len=True), "max_cache_len must be a positive int or None, got True"),
        (dict(attention="flash"), "attention must be None or one of \\['auto', 'eager', 'sdpa'\\], got 'flash'"),
    ],
)
def test_compile_decoding_refuses_bad_arguments(kwargs, error):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hfquant import compile_decoding

    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=64,
        )
    )
    with pytest.raises(ValueError, match=error):
        compile_decoding(model, **kwargs)
    with pytest.raises(TypeError, match="compile_decoding needs a transformers generative model, got Linear"):
        compile_decoding(torch.nn.Linear(2, 2))
