"""FloatLinear: the float layers hfquant keeps take ATen's GEMV for one bfloat16 row, with nn.Linear's accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfquant.nn.float_linear import (
    FloatLinear,
    one_row_linear,
    restore_nn_linear,
    takes_one_row_path,
    use_float_linear,
)
from hfquant.ops import choice, gemv, machine, native
from hfquant.ops.gemv import RowKernel


def _within_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """|y - exact| <= half a bfloat16 step of |exact| (2^-8 relative) + float32 summation error (K * 2^-24 * sum|x w|
    + |b|), the exact x @ weight.T + bias computed in float64."""
    exact = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    bound = 2.0**-8 * exact.abs() + x.shape[-1] * 2.0**-24 * magnitude
    return bool(((y.double() - exact).abs() <= bound).all())


@pytest.fixture(autouse=True)
def aten_gemv_unless_asked(monkeypatch):
    """The tests below check ATen's one-row path: no shape takes hfquant's bf16 GEMV unless a test lists it."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "aten")  # read when use_float_linear plans a layer


@pytest.fixture
def layer():
    torch.manual_seed(0)
    return nn.Linear(576, 4096, bias=True).to(torch.bfloat16)


@pytest.mark.parametrize(
    "shape, dtype, expected",
    [
        ((576,), torch.bfloat16, True),
        ((1, 576), torch.bfloat16, True),
        ((1, 1, 576), torch.bfloat16, True),
        ((2, 576), torch.bfloat16, False),  # oneDNN's GEMM is as fast at 2 rows, faster from 4
        ((1, 4, 576), torch.bfloat16, False),
        ((1, 576), torch.float16, False),  # oneDNN float16 already reads at memory speed
        ((1, 576), torch.float32, False),
    ],
)
def test_one_row_path_only_for_a_single_bfloat16_row(layer, shape, dtype, expected):
    x = torch.zeros(shape, dtype=dtype)
    assert takes_one_row_path(x, layer.weight.to(dtype)) is expected


def test_one_row_path_not_taken_where_onednn_is_off(layer):
    x = torch.zeros((1, 576), dtype=torch.bfloat16)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not takes_one_row_path(x, layer.weight)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_float_linear_matches_nn_linear_within_one_rounding(layer, rows):
    torch.manual_seed(1)
    x = torch.randn((1, rows, 576), dtype=torch.bfloat16)
    expected = layer(x)
    use_float_linear(nn.Sequential(layer))
    assert type(layer) is FloatLinear
    y = layer(x)
    assert y.shape == expected.shape and y.dtype == torch.bfloat16
    assert _within_rounding(y, x, layer.weight, layer.bias)
    if rows > 1 and machine.gemm_dtype(torch.bfloat16, "cpu") != torch.bfloat16:
        return  # float32 GEMM against nn.Linear's bfloat16 loop: other sum orders, near-cancelling sums differ more
    # both paths are one float32 sum rounded once: any difference is one bfloat16 step, and rare
    step = 2.0**-7 * expected.float().abs().clamp_min(2.0**-126)
    assert bool(((y.float() - expected.float()).abs() <= step).all())
    assert (y != expected).float().mean().item() < 0.01
    if rows > 1:
        assert torch.equal(y, expected)  # several rows keep the default path


def test_one_row_linear_error_bound_without_bias():
    torch.manual_seed(2)
    weight = torch.randn((49152, 576), dtype=torch.bfloat16)
    x = torch.randn((1, 576), dtype=torch.bfloat16)
    assert _within_rounding(one_row_linear(x, weight), x, weight)


def test_one_row_call_runs_with_onednn_off_and_restores_the_flag(layer, monkeypatch):
    seen = []
    real_linear = F.linear

    def recording_linear(*args, **kwargs):
        seen.append(torch.backends.mkldnn.enabled)
        return real_linear(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    use_float_linear(nn.Sequential(layer))
    layer(torch.randn((1, 576), dtype=torch.bfloat16))
    layer(torch.randn((2, 576), dtype=torch.bfloat16))
    assert seen == [False, True]
    assert torch.backends.mkldnn.enabled


def test_flag_restored_when_the_call_raises(layer):
    use_float_linear(nn.Sequential(layer))
    with pytest.raises(RuntimeError):
        layer(torch.randn((1, 575), dtype=torch.bfloat16))
    assert torch.backends.mkldnn.enabled


def test_user_setting_kept_where_onednn_is_off(layer):
    use_float_linear(nn.Sequential(layer))
    with torch.backends.mkldnn.flags(enabled=False):
        layer(torch.randn((1, 576), dtype=torch.bfloat16))
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled


def test_gradients_equal_nn_linear(layer):
    torch.manual_seed(3)
    x = torch.randn((1, 576), dtype=torch.bfloat16)
    reference = nn.Linear(576, 4096, dtype=torch.bfloat16)
    reference.load_state_dict(layer.state_dict())
    use_float_linear(nn.Sequential(layer))
    layer(x).float().sum().backward()
    reference(x).float().sum().backward()
    assert torch.equal(layer.weight.grad, reference.weight.grad)
    assert torch.equal(layer.bias.grad, reference.bias.grad)


def test_compiles_without_graph_breaks_and_matches_eager(layer):
    model = nn.Sequential(layer)
    use_float_linear(model)
    x1 = torch.randn((1, 1, 576), dtype=torch.bfloat16)
    x4 = torch.randn((1, 4, 576), dtype=torch.bfloat16)
    with torch.no_grad():
        eager1, eager4 = model(x1), model(x4)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x1), eager1)  # the custom op runs the same GEMV
        torch._dynamo.reset()
        compiled4 = torch.compile(model, fullgraph=True, dynamic=False)
        assert torch.allclose(compiled4(x4).float(), eager4.float(), rtol=2**-7, atol=1e-3)


def test_swap_touches_only_plain_linear_and_round_trips():
    class OwnLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), OwnLinear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.ReLU())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_float_linear(model) == 2
    assert [type(m).__name__ for m in model.modules()][1:] == [
        "FloatLinear",
        "OwnLinear",
        "Sequential",
        "FloatLinear",
        "ReLU",
    ]
    assert model.state_dict().keys() == state.keys()
    assert restore_nn_linear(model) == 2
    assert [type(m) for m in model.modules()].count(nn.Linear) == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


needs_bf16_gemv = pytest.mark.skipif(
    not gemv.native_bf16_works(), reason="no native bf16 GEMV here (neither AVX512-BF16 nor AVX2)"
)


@needs_bf16_gemv
@pytest.mark.parametrize(
    "n, k, with_bias", [(49152, 576, False), (4096, 576, True), (96, 2048, True), (64, 32, False)]
)
def test_native_bf16_gemv_within_one_rounding_of_float64(n, k, with_bias):
    """vdpbf16ps sums bfloat16 products in float32 lanes, rounded once to bfloat16: the same bound as ATen's GEMV."""
    generator = torch.Generator().manual_seed(n + k)
    weight = torch.randn((n, k), generator=generator).to(torch.bfloat16)
    bias = torch.randn((n,), generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    assert _within_rounding(native.bf16_gemv(x, weight, bias), x, weight, bias)


@needs_bf16_gemv
def test_native_bf16_gemv_refuses_k_not_a_multiple_of_32():
    with pytest.raises(RuntimeError, match="K % 32"):
        native.bf16_gemv(torch.zeros((1, 48), dtype=torch.bfloat16), torch.zeros((8, 48), dtype=torch.bfloat16))


@needs_bf16_gemv
def test_one_row_of_a_shape_timed_faster_runs_the_native_gemv(layer, monkeypatch):
    """A layer planned with hfquant's GEMV (`row_kernel`, here as HFQUANT_KERNEL_CHOICE=native plans it) runs it
    (F.linear is not called), in eager and through the compiled op's Python body; two rows still go to F.linear."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    calls = []
    real_linear = F.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or real_linear(*a, **k))
    use_float_linear(nn.Sequential(layer))
    assert layer.row_kernel is RowKernel.BF16_GEMV
    x = torch.randn((1, 576), dtype=torch.bfloat16)
    y = layer(x)
    assert calls == [] and torch.equal(y, native.bf16_gemv(x, layer.weight, layer.bias))
    assert _within_rounding(y, x, layer.weight, layer.bias)
    layer(torch.randn((2, 576), dtype=torch.bfloat16))
    assert calls == [1]


def test_use_float_linear_asks_the_kernel_choice_for_bfloat16_layers_only(monkeypatch):
    asked = []
    monkeypatch.setattr(gemv, "native_bf16_works", lambda: True)
    monkeypatch.setattr(choice, "bf16_row_uses_native", lambda n, k: asked.append((n, k)) or False)
    model = nn.Sequential(nn.Linear(64, 32).to(torch.bfloat16), nn.Linear(32, 64).float())
    assert use_float_linear(model) == 2
    assert asked == [(32, 64)]  # the float32 layer keeps the default path and is not timed
    assert [layer.row_kernel for layer in model] == [RowKernel.ATEN, RowKernel.ATEN]
    restore_nn_linear(model)
    assert "row_kernel" not in model[0].__dict__
