"""Tests of hfquant.nn.linear.QuantLinear: accuracy against the float layer, stored layout, state-dict round-trips."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import cosine_similarity

from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.nn.linear import QuantLinear, quantize_to_buffers
from hfquant.ops import kernels

# (bits, group_size, symmetric, in_features, out_features): at least one layer for each kernel picked on CPU.
FORMATS = [
    (8, 256, True, 256, 64),  # int8pack_mm
    (8, 64, False, 256, 48),  # dequant
    (4, 32, False, 256, 64),  # int4pack_mm_cpu
    (4, 64, True, 256, 80),  # int4pack_mm_cpu, symmetric
    (4, 128, False, 256, 8),  # dequant (N not a multiple of 16)
    (4, 256, False, 256, 32),  # per-channel int4 at K=256 (group 256 is still a kernel group size)
]
FORMAT_IDS = [f"int{b}-g{g}-{'sym' if s else 'asym'}-K{k}-N{n}" for b, g, s, k, n in FORMATS]

# Minimum SNR in dB of the layer output against the float layer, Gaussian weights and inputs. Uniform rounding adds
# noise of variance step**2 / 12 per weight; with step = max|w| / 127 (int8, max|w| ~ 3 sigma over 256 inputs) that
# is ~43 dB, with step = range / 15 (int4, range ~ 4 to 5.6 sigma) it is 19 to 22 dB (observed: 42-45 and 19-21 dB).
# The thresholds leave 4-7 dB for bfloat16 rounding and seed-to-seed spread.
MIN_SNR_DB = {8: 35.0, 4: 15.0}


def _snr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    reference, approximation = reference.double(), approximation.double()
    return 10 * math.log10(reference.pow(2).sum().item() / (reference - approximation).pow(2).sum().item())


def _float_layer(in_features: int, out_features: int, seed: int, dtype=torch.float32, bias=True, device="cpu"):
    """Random weight and bias, drawn on the CPU (the same values on every device), then moved to `device`."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((out_features, in_features), generator=generator).to(device, dtype)
    b = torch.randn((out_features,), generator=generator).to(device, dtype) if bias else None
    return weight, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_forward_is_close_to_the_float_layer(fmt, dtype, device):
    bits, group, symmetric, k, n = fmt
    weight, bias = _float_layer(k, n, seed=k + n, dtype=dtype, device=device)
    layer = QuantLinear.from_float(weight, bias, StoredFormat(bits, group, symmetric))
    x = torch.randn((3, 5, k), generator=torch.Generator().manual_seed(1)).to(device, dtype)
    reference = F.linear(x.double(), weight.double(), bias.double())
    for stage in ("stored layout", "kernel layout"):
        if stage == "kernel layout":
            layer.prepare_kernel()
        y = layer(x)
        assert y.dtype == dtype and y.shape == (3, 5, n) and y.device.type == device
        snr = _snr_db(reference, y)
        assert snr > MIN_SNR_DB[bits], (stage, layer.kernel, snr)
        cosine = cosine_similarity(reference, y)
        assert cosine > 1 - 10 ** (-MIN_SNR_DB[bits] / 10)  # 1 - cos ~ noise/signal / 2 for small noise


def test_buffers_have_the_documented_dtypes_and_shapes():
    layout = {
        (8, True): ((64, 96), torch.int8),
        (8, False): ((64, 96), torch.uint8),
        (4, True): ((64, 48), torch.uint8),
        (4, False): ((64, 48), torch.uint8),
    }
    for (bits, symmetric), (weight_shape, weight_dtype) in layout.items():
        for bias in (True, False):
            layer = QuantLinear(96, 64, StoredFormat(bits, 32, symmetric), bias=bias, dtype=torch.float16)
            state = layer.state_dict()
            expected = (
                {"weight", "weight_scale"}
                | ({"bias"} if bias else set())
                | (set() if symmetric else {"weight_zero_point"})
            )
            assert set(state) == expected
            assert state["weight"].shape == weight_shape and state["weight"].dtype == weight_dtype
            assert state["weight_scale"].shape == (64, 3) and state["weight_scale"].dtype == torch.bfloat16
            if not symmetric:
                assert state["weight_zero_point"].shape == (64, 3)
                assert state["weight_zero_point"].dtype == torch.uint8
            else:
                assert layer.weight_zero_point is None
            if bias:
                assert state["bias"].shape == (64,) and state["bias"].dtype == torch.float16
            assert "scale_zero" not in state  # the kernel-side tensor is not persistent


def test_constructor_rejects_shapes_it_cannot_store():
    with pytest.raises(ValueError, match="does not divide"):
        QuantLinear(96, 16, StoredFormat(4, 64, False))
    with pytest.raises(ValueError, match="group_size=0"):
        QuantLinear(96, 16, StoredFormat(8, 0, True))
    with pytest.raises(ValueError, match="even"):
        QuantLinear(33, 16, StoredFormat(4, 33, False))
    QuantLinear(33, 16, StoredFormat(8, 33, True))  # odd in_features are fine at 8 bits
    with pytest.raises(TypeError, match="StoredFormat"):
        QuantLinear(96, 16, 4, 32, False)  # the former (bits, group_size, symmetric) arguments


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_from_float_stores_the_rtn_result(fmt):
    bits, group, symmetric, k, n = fmt
    weight, bias = _float_layer(k, n, seed=3)
    layer = QuantLinear.from_float(weight, bias, StoredFormat(bits, group, symmetric))
    qt = rtn.quantize_weight(weight, bits, group, symmetric)
    expected_weight = packing.pack_int4(qt.q) if bits == 4 else qt.q
    assert torch.equal(layer.weight, expected_weight)
    assert torch.equal(layer.weight_scale, qt.scale)
    if symmetric:
        assert layer.weight_zero_point is None
    else:
        assert torch.equal(layer.weight_zero_point, qt.zero_point)
    assert torch.equal(layer.bias, bias) and not layer.bias.requires_grad


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_prepare_kernel_keeps_the_state_dict_bit_exact(fmt, bias, device):
    bits, group, symmetric, k, n = fmt
    weight, b = _float_layer(k, n, seed=5, dtype=torch.bfloat16, bias=bias, device=device)
    layer = QuantLinear.from_float(weight, b, StoredFormat(bits, group, symmetric))
    before = {key: value.clone() for key, value in layer.state_dict().items()}
    kernel = layer.prepare_kernel()
    assert (
        kernel
        == layer.kernel
        == kernels.select_kernel(StoredFormat(bits, group, symmetric), in_features=k, out_features=n, device=device)
    )
    for attempt in range(2):  # prepare_kernel is idempotent
        after = layer.state_dict()
        assert set(after) == set(before)
        for key, value in before.items():
            assert after[key].dtype == value.dtype and after[key].shape == value.shape, key
            assert torch.equal(after[key], value), (key, kernel, attempt)
        layer.prepare_kernel()
        assert layer.kernel == kernel


def test_int4_kernel_layout_differs_from_the_stored_layout():
    """Guards the test above: for the CPU int4 kernel the live buffer really is reordered, so equality is not free."""
    weight, _ = _float_layer(256, 64, seed=6)
    layer = QuantLinear.from_float(weight, None, StoredFormat(4, 32, False))
    stored = layer.weight.clone()
    assert layer.prepare_kernel() == "int4pack_mm_cpu"
    assert not torch.equal(layer.weight.reshape(-1), stored.reshape(-1))
    assert torch.equal(layer.state_dict()["weight"], stored)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_load_state_dict_into_a_fresh_layer_gives_the_same_forward(fmt, dtype, device):
    bits, group, symmetric, k, n = fmt
    weight, bias = _float_layer(k, n, seed=7, dtype=dtype, device=device)
    original = QuantLinear.from_float(weight, bias, StoredFormat(bits, group, symmetric))
    original.prepare_kernel()
    state = original.state_dict()
    x = torch.randn((17, k), generator=torch.Generator().manual_seed(8)).to(device, dtype)
    expected = original(x)

    fresh = QuantLinear(k, n, StoredFormat(bits, group, symmetric), bias=True, dtype=dtype, device=device)
    fresh.load_state_dict(state)
    assert fresh.prepare_kernel() == original.kernel
    assert torch.equal(fresh(x), expected)

    on_meta = QuantLinear(k, n, StoredFormat(bits, group, symmetric), bias=True, dtype=dtype, device="meta")
    on_meta.load_state_dict(state, assign=True)
    on_meta.prepare_kernel()
    assert torch.equal(on_meta(x), expected)

    # Loading into a layer that already holds a kernel layout replaces it with the stored layout first.
    other_weight, other_bias = _float_layer(k, n, seed=9, dtype=dtype, device=device)
    prepared = QuantLinear.from_float(other_weight, other_bias, StoredFormat(bits, group, symmetric))
    prepared.prepare_kernel()
    prepared.load_state_dict(state)
    assert prepared.kernel == "dequant"
    for key, value in state.items():
        assert torch.equal(prepared.state_dict()[key], value), key
    prepared.prepare_kernel()
    assert torch.equal(prepared(x), expected)


def test_a_state_dict_without_the_layers_tensors_keeps_its_kernel():
    """`load_state_dict(other, strict=False)` where `other` holds none of the layer's tensors (peft loading a LoRA
    adapter visits every module) keeps the prepared kernel and its layout: it used to drop every layer to the
    dequantize kernel, whose bfloat16 sums differ (issue #28: a reloaded adapter's logits 1.9 off)."""
    weight, bias = _float_layer(256, 64, seed=14, dtype=torch.bfloat16)
    layer = QuantLinear.from_float(weight, bias, StoredFormat(4, 32, False))
    assert layer.prepare_kernel(torch.bfloat16) == "int4pack_mm_cpu"
    parent = torch.nn.Module()
    parent.proj = layer
    kernel_layout, scale_zero = layer.weight.clone(), layer.scale_zero.clone()
    result = parent.load_state_dict({"adapter.weight": torch.zeros(2)}, strict=False)
    assert result.unexpected_keys == ["adapter.weight"] and "proj.weight" in result.missing_keys
    assert layer.kernel == "int4pack_mm_cpu"
    assert torch.equal(layer.weight, kernel_layout) and torch.equal(layer.scale_zero, scale_zero)
    # one of its tensors in the state dict: the stored layout is written, the kernel is to prepare again
    parent.load_state_dict({"proj.weight_scale": layer.weight_scale.clone()}, strict=False)
    assert layer.kernel == "dequant" and layer.scale_zero is None


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_dequantize_equals_rtn_dequantize_weight(fmt, device):
    bits, group, symmetric, k, n = fmt
    weight, _ = _float_layer(k, n, seed=10, device=device)
    layer = QuantLinear.from_float(weight, None, StoredFormat(bits, group, symmetric))
    qt = rtn.quantize_weight(weight, bits, group, symmetric)
    for dtype in (torch.float32, torch.bfloat16):
        expected = rtn.dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric, dtype)
        assert torch.equal(layer.dequantize(dtype), expected)
    layer.prepare_kernel()
    expected = rtn.dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric)
    assert torch.equal(layer.dequantize(), expected)
    # the error bound of rtn holds through the layer: half a step plus float32 slack (see test_rtn)
    step = qt.scale.float().repeat_interleave(group, dim=1)
    assert bool(((layer.dequantize() - weight).abs() <= step / 2 * (1 + 1e-6) + 1e-6 * weight.abs()).all())


def test_forward_on_a_layer_without_bias_is_the_dequantized_product(device):
    weight, _ = _float_layer(128, 32, seed=12, device=device)
    layer = QuantLinear.from_float(weight, None, StoredFormat(8, 64, False))  # "dequant" kernel
    layer.prepare_kernel()
    assert layer.bias is None
    x = torch.randn((4, 128), generator=torch.Generator().manual_seed(13)).to(device)
    assert torch.equal(layer(x), F.linear(x, layer.dequantize()))


@pytest.mark.parametrize("bits, symmetric", [(8, True), (8, False), (4, True), (4, False)])
# float16 is chunked on every path (a float32 copy per chunk); float32 only on torch's (the C pass takes it whole)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_to_buffers_chunking_does_not_change_results(monkeypatch, bits, symmetric, dtype):
    import hfquant.nn.linear as linear_module

    weight = torch.randn((45, 64), generator=torch.Generator().manual_seed(14)).to(dtype)
    whole = quantize_to_buffers(weight, StoredFormat(bits, 32, symmetric))
    monkeypatch.setattr(linear_module, "_CHUNK_BYTES", 4 * 64 * 4)  # 4 rows per step, the last one short
    chunked = quantize_to_buffers(weight, StoredFormat(bits, 32, symmetric))
    assert set(whole) == set(chunked) == {"weight", "weight_scale"} | (set() if symmetric else {"weight_zero_point"})
    for key in whole:
        assert torch.equal(whole[key], chunked[key]), key


def test_block_layer_with_stored_sinq_scales_searches_with_the_stored_scale_importance():
    """A SINQ block layer keeps its column scales beside it: its blocks are the search of w / c under
    `stored_scale_importance` (uniform for HQ3_0), not under the type's default, which a fold's layer keeps."""
    from hfquant.core import blocks, sinq
    from hfquant.core.blocks import importance
    from hfquant.core.folding import Transform

    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(8, 128, generator=generator) * torch.rand(8, 128, generator=generator).pow(4).mul(4).add(0.5)
    stored = quantize_to_buffers(weight, StoredFormat.of_block("hq3_0", "sinq"))
    scaled = weight.float() / sinq.column_scale(weight, 32)
    assert torch.equal(stored["weight_col_scale"].float(), sinq.column_scale(weight, 32).float())
    assert torch.equal(stored["weight"], blocks.quantize("hq3_0", scaled, torch.ones(128)))
    assert not torch.equal(stored["weight"], blocks.quantize("hq3_0", scaled))
    fold = Transform(col_scale=torch.rand(128, generator=generator) + 0.5)
    folded = quantize_to_buffers(weight, StoredFormat.of_block("hq3_0", "rtn"), fold=fold)
    assert torch.equal(folded["weight"], blocks.quantize("hq3_0", weight.float() / fold.col_scale))
    assert importance.RULES["hq3_0"] != importance.STORED_SCALE_RULES["hq3_0"]
