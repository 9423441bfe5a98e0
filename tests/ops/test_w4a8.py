"""W4A8 decode (HfQuantConfig(decode_activations="int8"), csrc/int4_intdot_cpu.c): the GEMV computes the formula its
source states (x quantized to int8 per block of 32 in both terms: x_hat @ w.T) to float32 accuracy, stays within
its error bound of the float product, refuses what it cannot do by name, reaches the layers of a loaded model for
single rows only, compiles without a graph break, and is saved and reloaded with the config."""

from __future__ import annotations

import pytest
import torch
from helpers import run_python
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig, QuantLinear
from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.ops import gemv, kernels, native, torch_ops

needs_a8 = pytest.mark.skipif(
    not gemv.native_int4_a8_works(), reason="the W4A8 GEMV needs a C compiler and AVX512-VNNI or AVX2"
)


def _machine_block_n() -> int:
    """The row block of the W4A8 GEMV on this CPU: 64 with AVX512-VNNI, else 32 (AVX2)."""
    return 64 if native.int4_a8_supported(64) else 32


def _layer(n: int, k: int, group: int, symmetric: bool = False, seed: int = 0, block_n: int | None = None):
    """Weights in PyTorch's int4 CPU layout with `block_n`-row blocks (64: AVX-512 CPUs, 32: AVX2 CPUs), built here
    whatever this CPU's own layout is (default: the block this CPU's W4A8 GEMV runs, `_machine_block_n`)."""
    block_n = block_n or _machine_block_n()
    generator = torch.Generator().manual_seed(seed)
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 4, group, symmetric)
    weight = packing.CpuInt4Layout(block_n, True).pack(q.q)
    scale_zero = packing.scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16)
    x = (torch.randn((1, k), generator=generator) * torch.rand((1, k), generator=generator) * 4).to(torch.bfloat16)
    return q, weight, scale_zero, x


def _stated_formula(q, scale_zero: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """y of the W4A8 GEMV as csrc/int4_intdot_cpu.c states it, in float64 from the kernel's own bfloat16 (scale, zero)."""
    codes = q.q.double()  # (N, K), 0..15
    n, k = codes.shape
    x64 = x.double().reshape(-1)
    blocks = x64.reshape(-1, 32)
    top = blocks.abs().amax(dim=1, keepdim=True)
    # float32 divisions as the kernel's (127.0 / tensor would multiply by a rounded reciprocal: another rounding)
    to_int = torch.full_like(top.float(), 127.0) / top.float()
    xq = torch.where(top > 0, torch.round(blocks.float() * to_int).double(), torch.zeros_like(blocks))
    xs = (top.float() / torch.full_like(top.float(), 127.0)).double()  # the kernel's float32 block scale
    dots = (codes.reshape(n, -1, 32) * xq.reshape(1, -1, 32)).sum(dim=2) * xs.reshape(1, -1)  # (N, K / 32)
    dots = dots.reshape(n, k // group, group // 32).sum(dim=2)  # (N, G)
    scale = scale_zero[..., 0].double().t()  # (N, G)
    offset = scale_zero[..., 1].double().t() - 8 * scale
    group_sums = (xq.sum(dim=1) * xs.reshape(-1)).reshape(-1, group // 32).sum(dim=1)  # (G,): quantized x
    return (scale * dots + offset * group_sums).sum(dim=1)


needs_avx2_a8 = pytest.mark.skipif(not native.int4_a8_supported(32), reason="needs AVX2, FMA and a C compiler")


@pytest.mark.parametrize(
    "n, k, group, symmetric, block_n",
    [
        (64, 64, 32, False, 64),
        (192, 576, 64, False, 64),
        (1536, 576, 64, True, 64),
        (576, 1536, 128, False, 64),
        (128, 4096, 256, True, 64),
        (32, 64, 32, False, 32),
        (96, 576, 64, True, 32),
        (576, 1536, 128, False, 32),
    ],
)
def test_the_gemv_computes_the_formula_of_its_source(n, k, group, symmetric, block_n):
    """Against the stated formula in float64: the kernel sums in float32 and rounds once to bfloat16, so each output
    is within 2^-8 of its magnitude (the rounding) plus 1e-5 of the largest (float32 sums). A row put back in the
    wrong place, a lost block scale or another rounding of x would be off by far more. block_n 32 is the AVX2 kernel
    on the AVX2 layout (it runs on any CPU with AVX2: this one too)."""
    if not native.int4_a8_supported(block_n):
        pytest.skip(f"the W4A8 GEMV for {block_n}-row blocks does not run on this CPU")
    q, weight, scale_zero, x = _layer(n, k, group, symmetric, block_n=block_n)
    y = native.int4_gemv_a8(x, weight, scale_zero, group, block_n).double().reshape(-1)
    expected = _stated_formula(q, scale_zero, x, group)
    tolerance = expected.abs() * 2.0**-8 + 1e-5 * expected.abs().max()
    assert ((y - expected).abs() <= tolerance).all(), ((y - expected).abs() - tolerance).max()


@needs_a8
@pytest.mark.parametrize("n, k, group", [(256, 512, 32), (576, 1536, 64), (2048, 2048, 128)])
def test_the_gemv_stays_within_its_error_bound_of_the_float_product(n, k, group):
    """Each output within sum_k |w[n, k]| * max|x| / 254 (the int8 rounding of the inputs, `native.int4_gemv_a8`)
    plus 2^-8 of |y| (bfloat16 output) of x @ w.T in float64."""
    q, weight, scale_zero, x = _layer(n, k, group)
    w = rtn.dequantize_weight(q.q, q.scale, q.zero_point, 4, False, dtype=torch.float64)
    reference = (x.double() @ w.t()).reshape(-1)
    y = native.int4_gemv_a8(x, weight, scale_zero, group, _machine_block_n()).double().reshape(-1)
    bound = w.abs().sum(dim=1) * x.double().abs().max() / 254 + reference.abs() * 2.0**-8
    assert ((y - reference).abs() <= bound).all()


@needs_a8
def test_the_operator_gives_the_ctypes_bits_and_names_what_it_refuses():
    q, weight, scale_zero, x = _layer(192, 576, 64)
    block_n = _machine_block_n()
    if torch_ops.loaded():
        assert torch.equal(
            torch.ops.hfquant_cpu.int4_gemv_a8(x, weight, scale_zero, 64, block_n),
            native.int4_gemv_a8(x, weight, scale_zero, 64, block_n),
        )
    q16, weight16, scale_zero16, x16 = _layer(128, 64, 16)
    with pytest.raises(RuntimeError, match="group_size=16.*multiple of 32"):
        torch_ops.int4_gemv_a8(x16, weight16, scale_zero16, 16)
    with pytest.raises(RuntimeError, match="group_size=16.*multiple of 32"):
        native.int4_gemv_a8(x16, weight16, scale_zero16, 16)
    with pytest.raises(RuntimeError, match="block_n=48"):
        native.int4_gemv_a8(x, weight, scale_zero, 64, 48)


def test_the_config_names_a_bad_value_and_round_trips():
    with pytest.raises(ValueError, match=r"decode_activations='int4'.*'float', 'int8'"):
        HfQuantConfig(decode_activations="int4")
    config = HfQuantConfig(bits=4, decode_activations="int8")
    assert HfQuantConfig.from_dict(config.to_dict()).decode_activations == "int8"
    legacy = config.to_dict()
    del legacy["decode_activations"]  # a config.json written before the field existed
    assert HfQuantConfig.from_dict(legacy).decode_activations == "float"


def _row_layer(int8_activations: bool) -> tuple[QuantLinear, torch.Tensor]:
    layer = QuantLinear.from_float(
        torch.randn((192, 576), generator=torch.Generator().manual_seed(4)), None, StoredFormat(4, 64, False)
    )
    layer.prepare_kernel(torch.bfloat16)
    layer.decode_activations = "int8" if int8_activations else "float"
    return layer, torch.randn((1, 576), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)


@needs_a8
def test_a_layer_asking_int8_activations_runs_w4a8_for_one_row_only():
    layer, row = _row_layer(True)
    assert layer.kernel == kernels.Kernel.INT4PACK_MM_CPU
    sz = layer.scale_zero
    assert torch.equal(layer(row), native.int4_gemv_a8(row, layer.weight, sz, 64, _machine_block_n()))
    rows = torch.randn((3, 576), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    plain, _ = _row_layer(False)
    assert torch.equal(layer(rows), plain(rows))  # several rows (prefill): unchanged
    assert not torch.equal(plain(row), layer(row))  # the float layer does not quantize its activations


@needs_a8
def test_a_compiled_w4a8_layer_has_no_graph_break_and_matches_eager():
    layer, row = _row_layer(True)
    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)(row)
    torch._dynamo.reset()
    assert any("int4_gemv_a8" in target for target in targets), targets
    assert torch.equal(compiled, layer(row))


@needs_a8
def test_a_model_loads_saves_and_reloads_with_int8_decode_activations(float_checkpoint, tmp_path):
    config = HfQuantConfig(bits=4, group_size=32, method="rtn", mixed_precision="none", decode_activations="int8")
    model = AutoModelForCausalLM.from_pretrained(
        float_checkpoint("llama"), quantization_config=config, dtype=torch.bfloat16
    )
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.decode_activations == "int8" for m in layers)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert reloaded.config.quantization_config.decode_activations == "int8"
    assert all(m.decode_activations == "int8" for m in reloaded.modules() if isinstance(m, QuantLinear))
    ids = torch.tensor([[5, 17, 42]])
    with torch.inference_mode():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert torch.equal(
            reloaded.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0), expected
        )


def test_a_machine_without_the_w4a8_gemv_says_so_and_decodes_with_float_activations(
    float_checkpoint, monkeypatch, caplog
):
    from hfquant.integration import decode_activations

    monkeypatch.setattr(gemv, "native_int4_a8_works", lambda: False)  # read when the layers are planned
    config = HfQuantConfig(bits=4, group_size=32, method="rtn", mixed_precision="none", decode_activations="int8")
    with caplog.at_level("WARNING", logger=decode_activations.__name__):
        model = AutoModelForCausalLM.from_pretrained(
            float_checkpoint("llama"), quantization_config=config, dtype=torch.bfloat16
        )
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not any(m.kernel == kernels.Kernel.INT4PACK_MM_CPU for m in layers):
        pytest.skip("the CPU int4 kernel does not serve this model here")
    assert "decode_activations='int8' asks for W4A8 decoding" in caplog.text
    row = torch.randn((1, 1, layers[0].in_features), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    as_float = QuantLinear.forward(layers[0], row)
    layers[0].decode_activations = "float"
    assert torch.equal(as_float, layers[0](row))


@needs_avx2_a8
def test_with_pytorch_at_avx2_a_layer_decodes_with_the_avx2_gemvs(float_checkpoint):
    """ATEN_CPU_CAPABILITY=avx2 makes PyTorch pack int4 weights in 32-row blocks, as on a CPU without AVX-512: there
    hfquant's AVX-512 GEMV is off; one row runs the AVX2 GEMV (bfloat16 activations, where chosen: forced here), and
    with int8 activations asked the AVX2 W4A8 GEMV (same bits as calling them); a tiny Llama generates with it."""
    code = """
        import torch
        from transformers import AutoModelForCausalLM
        from hfquant import HfQuantConfig, QuantLinear
        from hfquant.core.format import StoredFormat
        from hfquant.ops import gemv, kernels, native
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        layer = QuantLinear.from_float(torch.randn((96, 576), generator=torch.Generator().manual_seed(4)), None,
                                       StoredFormat(4, 64, False))
        layer.prepare_kernel(torch.bfloat16)
        assert layer.kernel == kernels.Kernel.INT4PACK_MM_CPU and not gemv.native_int4_works()
        assert layer.plan.cpu_int4_block == 32 and kernels.int8_decode_activations_available()
        row = torch.randn((1, 576), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        aten = torch.ops.aten._weight_int4pack_mm_for_cpu(row, layer.weight, 64, layer.scale_zero)
        # HFQUANT_KERNEL_CHOICE=native: the row goes to hfquant's AVX2 GEMV, within bfloat16 rounding of aten's
        assert layer.plan.row is layer.plan.compiled_row is gemv.RowKernel.INT4_GEMV_AVX2
        plain = layer(row)
        assert torch.equal(plain, native.int4_gemv_avx2(row, layer.weight, layer.scale_zero, 64))
        assert torch.allclose(plain.float(), aten.float(), rtol=0.01, atol=0.01 * aten.float().abs().max().item())
        layer.decode_activations = "int8"
        assert torch.equal(layer(row), native.int4_gemv_a8(row, layer.weight, layer.scale_zero, 64, 32))
        assert not torch.equal(layer(row), aten)
        config = HfQuantConfig(bits=4, group_size=32, method="rtn", mixed_precision="none", decode_activations="int8")
        model = AutoModelForCausalLM.from_pretrained(PATH, quantization_config=config, dtype=torch.bfloat16)
        with torch.inference_mode():
            out = model.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 7)
        print("ok")
    """
    result = run_python(
        code.replace("PATH", repr(str(float_checkpoint("llama")))),
        ATEN_CPU_CAPABILITY="avx2",
        HFQUANT_KERNEL_CHOICE="native",
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@needs_avx2_a8
@pytest.mark.parametrize("n, k, group", [(32, 64, 32), (96, 576, 64), (576, 1536, 128), (128, 4096, 256)])
def test_the_avx2_gemv_keeps_bfloat16_accuracy(n, k, group):
    """The AVX2 GEMV (bfloat16 activations; x enters as int16 per block of 32) against x @ w.T in float64, on the
    32-row layout: each output within 2^-8 of |y| (its bfloat16 rounding) plus sum_k |w| * max|x| / 65534 (the int16
    rounding of the inputs) plus 1e-5 of the largest output (float32 sums)."""
    q, weight, scale_zero, x = _layer(n, k, group, block_n=32)
    w = rtn.dequantize_weight(q.q, q.scale, q.zero_point, 4, False, dtype=torch.float64)
    reference = (x.double() @ w.t()).reshape(-1)
    y = native.int4_gemv_avx2(x, weight, scale_zero, group).double().reshape(-1)
    bound = reference.abs() * 2.0**-8 + w.abs().sum(dim=1) * x.double().abs().max() / 65534
    assert ((y - reference).abs() <= bound + 1e-5 * reference.abs().max()).all()
