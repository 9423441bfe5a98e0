"""Tests of hfquant.core.format.StoredFormat: the one definition of a quantized weight's stored tensors, and the
modules and quantization that follow it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hfquant.core import rtn
from hfquant.core.format import Method, StoredFormat
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.experts import QuantExperts, quantize_experts_tensor
from hfquant.nn.linear import QuantLinear, quantize_to_buffers

# (format, rows, in_features) -> {name: (dtype, shape)}, written out by hand from docs/format.md
SPECS = [
    (
        StoredFormat(8, 64, True),
        (48,),
        128,
        {"weight": (torch.int8, (48, 128)), "weight_scale": (torch.bfloat16, (48, 2))},
    ),
    (
        StoredFormat(8, 128, False),
        (48,),
        128,
        {
            "weight": (torch.uint8, (48, 128)),
            "weight_scale": (torch.bfloat16, (48, 1)),
            "weight_zero_point": (torch.uint8, (48, 1)),
        },
    ),
    (
        StoredFormat(4, 32, True),
        (48,),
        128,
        {"weight": (torch.uint8, (48, 64)), "weight_scale": (torch.bfloat16, (48, 4))},
    ),
    (
        StoredFormat(4, 32, False),
        (3, 48),
        128,
        {
            "weight": (torch.uint8, (3, 48, 64)),
            "weight_scale": (torch.bfloat16, (3, 48, 4)),
            "weight_zero_point": (torch.uint8, (3, 48, 4)),
        },
    ),
]
SPEC_IDS = ["int8-sym", "int8-asym", "int4-sym", "int4-asym-experts"]


@pytest.mark.parametrize("fmt, rows, k, expected", SPECS, ids=SPEC_IDS)
def test_tensor_specs_and_empty_follow_the_documented_layout(fmt, rows, k, expected):
    assert fmt.tensor_specs(rows, k) == expected
    assert fmt.tensor_names() == tuple(expected)
    empty = fmt.empty(rows, k, "meta")
    assert {name: (t.dtype, tuple(t.shape)) for name, t in empty.items()} == expected
    assert all(t.device.type == "meta" for t in empty.values())


@pytest.mark.parametrize("fmt, rows, k, expected", SPECS, ids=SPEC_IDS)
def test_modules_and_quantization_store_exactly_the_specified_tensors(fmt, rows, k, expected):
    weight = torch.randn((*rows, k), generator=torch.Generator().manual_seed(0))
    if len(rows) == 1:
        n = rows[0]
        for buffers in (
            quantize_to_buffers(weight, fmt),
            QuantLinear(k, n, fmt, bias=False).state_dict(),
            QuantLinear.from_float(weight, None, fmt).state_dict(),
            QuantEmbedding(n, k, fmt).state_dict(),
            QuantEmbedding.from_float(weight, fmt).state_dict(),
        ):
            assert {name: (t.dtype, tuple(t.shape)) for name, t in buffers.items()} == expected
        layer = QuantLinear(k, n, fmt)
        assert layer.format is fmt and (layer.bits, layer.group_size, layer.symmetric) == (
            fmt.bits,
            fmt.group_size,
            fmt.symmetric,
        )
        assert f"bits={fmt.bits}, group_size={fmt.group_size}, symmetric={fmt.symmetric}" in repr(layer)
    else:
        stored = quantize_experts_tensor(weight, fmt)
        assert {"weight" + suffix: (t.dtype, tuple(t.shape)) for suffix, t in stored.items()} == expected
        source = nn.Module()
        source.act_fn = nn.SiLU()
        experts = QuantExperts(source, {"down_proj": (*rows, k)}, {"down_proj": fmt})
        state = {
            name.replace("down_proj", "weight"): (t.dtype, tuple(t.shape)) for name, t in experts.state_dict().items()
        }
        assert state == expected
        assert experts.stored_names() == [name.replace("weight", "down_proj") for name in expected]
        assert (experts.bits, experts.symmetric, experts.group_sizes) == (fmt.bits, fmt.symmetric, {"down_proj": 32})


def test_worked_example_of_the_docstring():
    """4 bits, asymmetric, one group: [-0.3, 0.0, 0.45, 0.1] -> scale 0.05, zero point 6, bytes [0x60, 0x8F]."""
    fmt = StoredFormat(4, 4, False)
    stored = quantize_to_buffers(torch.tensor([[-0.3, 0.0, 0.45, 0.1]]), fmt)
    assert stored["weight"].tolist() == [[0x60, 0x8F]]
    assert stored["weight_zero_point"].tolist() == [[6]]
    scale = stored["weight_scale"].float().item()
    assert 0.05 <= scale < 0.0501  # rounded up to the next bfloat16 value
    codes = torch.tensor([[0, 6, 15, 8]], dtype=torch.uint8)
    assert rtn.dequantize_weight(codes, stored["weight_scale"], stored["weight_zero_point"], 4, False)[
        0, 0
    ].item() == (pytest.approx(-0.3, rel=1e-3))


def test_describe_and_value_semantics():
    fmt = StoredFormat(4, 32, False)
    assert fmt.describe() == "4-bit, group size 32, asymmetric"
    assert StoredFormat(8, 2048, True).describe() == "8-bit, group size 2048, symmetric"
    assert fmt == StoredFormat(4, 32, False, "rtn") and hash(fmt) == hash(StoredFormat(4, 32, False))
    assert fmt.method is Method.RTN and str(fmt.method) == "rtn"
    assert fmt != StoredFormat(4, 32, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.bits = 8


@pytest.mark.parametrize(
    "args, error, words",
    [
        ((3, 32, True), ValueError, ["bits=3", "[8, 4]"]),
        ((16, 32, True), ValueError, ["bits=16", "[8, 4]"]),
        ((4, 0, False), ValueError, ["group_size=0", "positive"]),
        ((4, -32, False), ValueError, ["group_size=-32", "positive"]),
        ((4, 32, False, "gptq"), ValueError, ["method='gptq'", "['rtn', 'sinq']"]),
        (("4", 32, False), TypeError, ["bits", "'4'"]),
        ((4, None, False), TypeError, ["group_size", "None", "in_features"]),
        ((4, 32, None), TypeError, ["symmetric", "None"]),
    ],
    ids=["bits-3", "bits-16", "group-0", "group-negative", "method", "bits-str", "group-none", "symmetric-none"],
)
def test_impossible_values_are_refused_naming_the_value_and_what_is_allowed(args, error, words):
    with pytest.raises(error) as info:
        StoredFormat(*args)
    assert all(word in str(info.value) for word in words), str(info.value)


def test_shapes_a_format_cannot_store_are_refused():
    with pytest.raises(ValueError, match="group_size=32 does not divide in_features=48"):
        StoredFormat(8, 32, True).tensor_specs((4,), 48)
    with pytest.raises(ValueError, match="even in_features, got 33"):
        StoredFormat(4, 33, False).tensor_specs((4,), 33)
    with pytest.raises(TypeError, match="StoredFormat"):
        quantize_to_buffers(torch.zeros(4, 64), 4)
