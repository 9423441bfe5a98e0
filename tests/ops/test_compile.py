"""torch.compile: QuantLinear traces with fullgraph=True (no graph break) and gives the eager result."""

from __future__ import annotations

import pytest
import torch

from hfquant.config import HfQuantConfig
from hfquant.core.format import StoredFormat
from hfquant.integration.quantizer import HfQuantQuantizer
from hfquant.nn.linear import QuantLinear
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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])  # eager: the README's fast path
def test_generate_with_a_static_cache_compiles_the_quantized_model_and_gives_the_eager_tokens(
    float_checkpoint, attention
):
    """The transformers way to compile decoding: `generate(cache_implementation="static", compile_config=...)`. On CPU
    transformers compiles only when the config asks for every device (`_compile_all_devices`, README)."""
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
