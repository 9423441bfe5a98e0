"""torch.compile: QuantLinear traces with fullgraph=True (no graph break) and gives the eager result."""

from __future__ import annotations

import pytest
import torch

from hfquant.core.format import StoredFormat
from hfquant.ops import kernels
from hfquant.ops.kernels import Kernel
from hfquant.nn.linear import QuantLinear
from hfquant.integration.quantizer import HfQuantQuantizer
from hfquant.config import HfQuantConfig


@pytest.mark.parametrize(
    "bits,group_size,symmetric,kernel",
    [(8, 512, True, Kernel.INT8PACK_MM), (4, 128, False, Kernel.INT4PACK_MM_CPU), (8, 128, True, Kernel.DEQUANT)],
)
@pytest.mark.parametrize("rows", [3, 130], ids=["decode", "prefill"])  # 130 >= kernels.GEMM_MIN_ROWS: chunked GEMM
def test_quant_linear_compiles_without_graph_breaks(bits, group_size, symmetric, kernel, rows):
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
