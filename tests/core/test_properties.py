"""Property-based tests (hypothesis) over random shapes, group sizes, bits, symmetry and dtypes, odd and tiny shapes
included: the RTN error bound, pack/unpack identity, and save/load identity of QuantLinear through safetensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load, save

from hfquant import QuantLinear
from hfquant.core.format import StoredFormat
from hfquant.core.packing import pack_int4, unpack_int4
from hfquant.core.rtn import dequantize_weight, effective_group_size, quantize_weight

# Deterministic in CI (derandomize, no example database written into the checkout), no per-example deadline (the
# first call of a kernel may be slow).
SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)

# The bound stated in hfquant.core.rtn: |w - w_hat| <= scale / 2, "up to float32 rounding of the division". w / scale and
# (q - z) * scale are each rounded once in float32: relative error 2**-24 of values no larger than max|w| + scale;
# 1e-6 is 16x that. Subnormal float32 results are rounded to an absolute 2**-149, which the last term covers.
FP32_SLACK = 1e-6
SUBNORMAL = 2.0**-148

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOAT_WIDTH = {"float32": 32, "bfloat16": 32, "float16": 16}
KINDS = ("normal", "positive", "negative", "outliers", "zeros", "constant", "sparse", "one_nonzero")


def _assert_half_step(weight: torch.Tensor, bits: int, group: int, symmetric: bool) -> None:
    n, k = weight.shape
    qt = quantize_weight(weight, bits, group, symmetric)
    assert qt.q.shape == (n, k) and qt.scale.shape == (n, k // group)
    assert bool(torch.isfinite(qt.scale).all()) and bool((qt.scale > 0).all())
    w_hat = dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric)
    exact = weight.float()
    scale = qt.scale.float().repeat_interleave(group, dim=1)
    bound = scale / 2 * (1 + FP32_SLACK) + FP32_SLACK * exact.abs() + SUBNORMAL
    error = (exact - w_hat).abs()
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        f"element {divmod(worst, k)}: w={exact.flatten()[worst].item()!r} w_hat={w_hat.flatten()[worst].item()!r} "
        f"scale={scale.flatten()[worst].item()!r}"
    )
    if bool((exact == 0).all()):
        assert bool((w_hat == 0).all())  # an all-zero weight dequantizes to exact zeros (scale 1, no NaN)


@st.composite
def layer_shapes(draw, bits: int | None = None):
    """(bits, rows, in_features, group) with in_features a multiple of the group, or per-channel with any K."""
    bits = bits if bits is not None else draw(st.sampled_from([8, 4]))
    rows = draw(st.integers(1, 7))
    group = draw(st.sampled_from([32, 64, 128, None]))
    if group is None:
        k = draw(st.integers(1, 97))
        if bits == 4:
            k += k % 2  # 4-bit codes are packed two per byte
        group = k
    else:
        k = group * draw(st.integers(1, 3))
    return bits, rows, k, group


def _make_weight(kind: str, rows: int, k: int, seed: int, exponent: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn((rows, k), generator=generator)
    if kind == "positive":
        base = base.abs() + 0.25
    elif kind == "negative":
        base = -(base.abs() + 0.25)
    elif kind == "outliers":
        base[:, :: max(1, k // 5)] *= 50
    elif kind == "zeros":
        base.zero_()
    elif kind == "constant":
        base.fill_(float(base[0, 0]))
    elif kind == "sparse":
        base *= torch.rand((rows, k), generator=generator) < 0.1
    elif kind == "one_nonzero":
        value = float(base[0, 0])
        base.zero_()
        base[-1, -1] = value
    return (base * 2.0**exponent).to(dtype)


@SETTINGS
@given(
    shape=layer_shapes(),
    symmetric=st.booleans(),
    dtype=st.sampled_from(sorted(DTYPES)),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
    exponent=st.integers(-40, 40),
)
def test_dequantized_error_is_at_most_half_a_step(shape, symmetric, dtype, kind, seed, exponent):
    bits, rows, k, group = shape
    if dtype == "float16":
        exponent = max(-8, min(exponent, 8))  # stay inside the float16 range (2**-14 .. 65504) with room for outliers
    weight = _make_weight(kind, rows, k, seed, exponent, DTYPES[dtype])
    _assert_half_step(weight, bits, group, symmetric)


@SETTINGS
@given(data=st.data(), bits=st.sampled_from([8, 4]), symmetric=st.booleans(), dtype=st.sampled_from(sorted(DTYPES)))
def test_half_step_bound_on_hypothesis_chosen_values(data, bits, symmetric, dtype):
    """Tiny layers whose every element hypothesis picks: subnormals, signed zeros, huge and equal values."""
    rows = data.draw(st.integers(1, 2), label="rows")
    group = data.draw(st.sampled_from([32, None]), label="group")
    k = 32 if group == 32 else data.draw(st.integers(1, 12), label="k")
    if bits == 4 and k % 2:
        k += 1
    limit = 65504.0 if dtype == "float16" else 2.0**100
    values = data.draw(
        st.lists(
            st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=FLOAT_WIDTH[dtype]),
            min_size=rows * k,
            max_size=rows * k,
        ),
        label="values",
    )
    weight = torch.tensor(values, dtype=torch.float32).reshape(rows, k).to(DTYPES[dtype])
    _assert_half_step(weight, bits, k if group is None else group, symmetric)


@SETTINGS
@given(rows=st.integers(0, 9), half=st.integers(0, 40), seed=st.integers(0, 2**32 - 1), transpose=st.booleans())
def test_pack_unpack_identity(rows, half, seed, transpose):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 2 * half), dtype=torch.uint8, generator=generator)
    if transpose and rows and half:  # a non-contiguous input must pack the same way
        codes = codes.t().contiguous().t()
    packed = pack_int4(codes).contiguous()  # (unpacking a non-contiguous tensor: test_unpack_non_contiguous below)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, half)
    assert torch.equal(unpack_int4(packed), codes)
    # every byte value is a valid pair of codes: pack(unpack(bytes)) == bytes
    raw = torch.randint(0, 256, (rows, half), dtype=torch.uint8, generator=generator)
    assert torch.equal(pack_int4(unpack_int4(raw)), raw)


def test_unpack_non_contiguous():
    codes = torch.randint(0, 16, (4, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(codes)
    assert torch.equal(unpack_int4(packed.t().contiguous().t()), codes)


@SETTINGS
@given(
    shape=layer_shapes(),
    symmetric=st.booleans(),
    dtype=st.sampled_from(sorted(DTYPES)),
    bias=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    prepare=st.booleans(),
)
def test_save_load_identity(shape, symmetric, dtype, bias, seed, prepare):
    """QuantLinear -> state_dict -> safetensors bytes -> load_state_dict gives the same stored tensors and outputs,
    whether or not the kernel layout was prepared before saving."""
    bits, rows, k, group = shape
    torch_dtype = DTYPES[dtype]
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((rows, k), generator=generator).to(torch_dtype)
    bias_tensor = torch.randn(rows, generator=generator).to(torch_dtype) if bias else None
    layer = QuantLinear.from_float(weight, bias_tensor, StoredFormat(bits, group, symmetric))
    stored = {name: t.clone() for name, t in layer.state_dict().items()}
    if prepare:
        layer.prepare_kernel(torch_dtype)
    blob = save(layer.state_dict())
    assert blob == save(stored)  # the kernel layout never reaches a file
    loaded = load(blob)
    again = QuantLinear(k, rows, StoredFormat(bits, group, symmetric), bias=bias, dtype=torch_dtype)
    again.load_state_dict(loaded)
    for name, tensor in stored.items():
        assert again.state_dict()[name].dtype == tensor.dtype
        assert torch.equal(again.state_dict()[name], tensor), name
    assert torch.equal(again.dequantize(torch.float32), layer.dequantize(torch.float32))
    x = torch.randn((3, k), generator=generator).to(torch_dtype)
    layer.prepare_kernel(torch_dtype)
    again.prepare_kernel(torch_dtype)
    assert torch.equal(again(x), layer(x))


@SETTINGS
@given(
    k=st.integers(1, 4096), group=st.sampled_from([32, 64, 128, 256, 512, 1024, None]), bits=st.sampled_from([8, 4])
)
def test_effective_group_size_divides_or_keeps_float(k, group, bits):
    effective = effective_group_size(k, group, bits)
    if effective is None:
        assert (bits == 4 and k % 2) or (group is not None and (k & -k) < 32)
        with pytest.raises(ValueError):
            QuantLinear(k, 4, StoredFormat(bits, group if group is not None else k, True)) if (
                bits == 4 and k % 2
            ) else (quantize_weight(torch.zeros(1, k), bits, group, True))
        return
    assert k % effective == 0
    assert (
        effective == k
        if group is None
        else (effective == group or (math.log2(effective).is_integer() and effective >= 32))
    )
