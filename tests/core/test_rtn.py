"""Tests of hfquant.core.rtn: the half-step error bound, code ranges, special groups, group-size rule and chunking."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import rtn
from hfquant.core.rtn import dequantize_weight, effective_group_size, qrange, quantize_weight

SHAPES = [(n, k) for n in (1, 3, 33) for k in (32, 64, 96, 576)]
# Relative slack on top of half a step: w / scale and (q - z) * scale are each rounded once in float32
# (relative error 2**-24 ~ 6e-8 of values no larger than max|w| + scale); 1e-6 leaves a 10x margin.
FP32_SLACK = 1e-6


def _weights(n: int, k: int, seed: int) -> list[torch.Tensor]:
    """A Gaussian weight, one with outliers, and one whose rows are all positive (zero point at the range end)."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn((n, k), generator=generator)
    outliers = gaussian.clone()
    outliers[:, ::7] *= 20
    positive = torch.rand((n, k), generator=generator) * 3 + 0.5
    return [gaussian, outliers, positive, -positive]


def _per_element(t: torch.Tensor, k: int) -> torch.Tensor:
    """(N, G) per-group tensor -> (N, K) float32, each group value repeated over its columns."""
    return t.float().repeat_interleave(k // t.shape[1], dim=1)


def _check_codes(qt: rtn.QuantizedTensor, n: int, k: int, bits: int, symmetric: bool, group: int) -> None:
    expected_dtype = torch.int8 if (bits == 8 and symmetric) else torch.uint8
    assert qt.q.dtype == expected_dtype and qt.q.shape == (n, k)
    if bits == 8 and symmetric:
        lo, hi = -127, 127
    elif bits == 4 and symmetric:
        lo, hi = 1, 15  # signed value + 8
    else:
        lo, hi = 0, 2**bits - 1
    assert int(qt.q.min()) >= lo and int(qt.q.max()) <= hi
    assert qt.scale.dtype == torch.bfloat16 and qt.scale.shape == (n, k // group)
    assert bool((qt.scale > 0).all()) and bool(torch.isfinite(qt.scale).all())
    if symmetric:
        assert qt.zero_point is None
    else:
        assert qt.zero_point.dtype == torch.uint8 and qt.zero_point.shape == (n, k // group)
        assert int(qt.zero_point.max()) <= 2**bits - 1


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [32, 64, 128, None], ids=["g32", "g64", "g128", "per_channel"])
def test_error_is_at_most_half_a_step(bits, symmetric, group_size):
    for index, (n, k) in enumerate(SHAPES):
        group = effective_group_size(k, group_size, bits)
        assert group is not None and k % group == 0
        for weight in _weights(n, k, seed=index):
            qt = quantize_weight(weight, bits, group, symmetric)
            _check_codes(qt, n, k, bits, symmetric, group)
            w_hat = dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric)
            assert w_hat.dtype == torch.float32 and w_hat.shape == (n, k)
            scale = _per_element(qt.scale, k)
            bound = scale / 2 * (1 + FP32_SLACK) + FP32_SLACK * weight.abs()
            error = (weight - w_hat).abs()
            assert bool((error <= bound).all()), (n, k, group, float((error / scale).max()))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_scale_is_the_smallest_bfloat16_not_below_the_exact_step(bits, symmetric):
    weight = torch.randn((9, 128), generator=torch.Generator().manual_seed(3))
    qt = quantize_weight(weight, bits, 32, symmetric)
    groups = weight.reshape(9, 4, 32)
    qmin, qmax = qrange(bits, symmetric)
    if symmetric:
        exact = groups.abs().amax(-1) / qmax
    else:
        exact = (groups.amax(-1).clamp(min=0) - groups.amin(-1).clamp(max=0)) / (qmax - qmin)
    scale = qt.scale
    below = torch.nextafter(scale, torch.zeros_like(scale))
    assert bool((scale.float() >= exact).all())
    assert bool((below.float() < exact).all())


def test_asymmetric_worked_example_from_the_docstring():
    # w_g = [-0.3, 0.0, 0.45] at 4 bits -> scale 0.05 (stored as the next bfloat16 up), zero point 6, q = [0, 6, 15].
    weight = torch.tensor([[-0.3, 0.0, 0.45]])
    qt = quantize_weight(weight, 4, 3, symmetric=False)
    assert qt.q.tolist() == [[0, 6, 15]]
    assert qt.zero_point.tolist() == [[6]]
    assert 0.05 <= qt.scale.item() <= 0.05 * (1 + 2**-7)  # one bfloat16 step (8 significant bits) above 0.05
    w_hat = dequantize_weight(qt.q, qt.scale, qt.zero_point, 4, False)
    assert w_hat[0, 1].item() == 0.0  # zero stays exactly representable
    assert torch.allclose(w_hat, weight, atol=qt.scale.item() / 2)


def test_symmetric_codes_at_4_bits_are_offset_by_8():
    # max |w| = 0.7 -> scale 0.1 (rounded up to bfloat16), values [-7, 0, 7] stored as [1, 8, 15].
    weight = torch.tensor([[-0.7, 0.0, 0.7, 0.0]])
    qt = quantize_weight(weight, 4, 4, symmetric=True)
    assert qt.q.tolist() == [[1, 8, 15, 8]]
    qt8 = quantize_weight(weight, 8, 4, symmetric=True)
    assert qt8.q.tolist() == [[-127, 0, 127, 0]]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_all_zero_group_has_positive_scale_and_gives_exact_zeros(bits, symmetric):
    weight = torch.randn((3, 64), generator=torch.Generator().manual_seed(5))
    weight[1] = 0.0  # a whole row
    weight[2, 32:] = 0.0  # one group of another row
    qt = quantize_weight(weight, bits, 32, symmetric)
    assert bool((qt.scale > 0).all())
    assert qt.scale[1].tolist() == [1.0, 1.0] and qt.scale[2, 1].item() == 1.0  # documented: scale 1
    w_hat = dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric)
    assert torch.equal(w_hat[1], torch.zeros(64))
    assert torch.equal(w_hat[2, 32:], torch.zeros(32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_or_inf_raises_value_error(bits, symmetric, bad):
    weight = torch.randn((4, 64))
    weight[2, 17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_weight(weight, bits, 32, symmetric)


def test_invalid_shapes_raise_value_error():
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(64), 8, 32, True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(2, 3, 64), 8, 32, True)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(4, 96), 4, 64, False)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_weight(torch.randn(4, 64), 4, 0, False)


@pytest.mark.parametrize(
    "in_features, group_size, bits, expected",
    [
        (576, 128, 4, 64),  # docstring example: 576 = 64 * 9
        (576, 128, 8, 64),
        (96, 64, 4, 32),
        (96, 64, 8, 32),
        (64, 128, 4, 64),  # fewer inputs than the group: the whole row is one group
        (4096, 128, 4, 128),
        (1056, 1024, 8, 32),
        (48, 32, 8, None),  # 48 = 16 * 3: no power of two >= 32 divides it
        (48, 32, 4, None),
        (48, None, 8, 48),  # per-channel: one group of in_features
        (48, None, 4, 48),
        (576, None, 4, 576),
        (33, None, 8, 33),  # odd K is fine at 8 bits per-channel
        (33, None, 4, None),  # but two 4-bit codes share a byte
        (33, 32, 8, None),
        (0, None, 8, None),
    ],
)
def test_effective_group_size_cases(in_features, group_size, bits, expected):
    assert effective_group_size(in_features, group_size, bits) == expected


@pytest.mark.parametrize("bits", [8, 4])
def test_effective_group_size_follows_the_documented_rule(bits):
    powers = [2**p for p in range(5, 11)]
    for k in range(1, 2200):
        for asked in powers:
            got = effective_group_size(k, asked, bits)
            if bits == 4 and k % 2:
                expected = None
            elif k % asked == 0:
                expected = asked
            else:
                divisors = [p for p in powers if k % p == 0]
                expected = max(divisors) if divisors else None
            assert got == expected, (k, asked, bits)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_chunking_does_not_change_results(monkeypatch, bits, symmetric):
    n, k, group = 37, 96, 32
    weight = torch.randn((n, k), generator=torch.Generator().manual_seed(7)) * torch.linspace(0.1, 10, n)[:, None]
    whole = quantize_weight(weight, bits, group, symmetric)
    monkeypatch.setattr(rtn, "_CHUNK_BYTES", 4 * k * 5)  # 5 rows per chunk: 8 chunks, the last one short
    assert rtn._rows_per_chunk(k) == 5
    chunked = quantize_weight(weight, bits, group, symmetric)
    rows = [quantize_weight(weight[i : i + 1], bits, group, symmetric) for i in range(n)]
    by_row = rtn.QuantizedTensor(
        torch.cat([r.q for r in rows]),
        torch.cat([r.scale for r in rows]),
        None if symmetric else torch.cat([r.zero_point for r in rows]),
    )
    for result in (whole, chunked):
        assert torch.equal(result.q, by_row.q)
        assert torch.equal(result.scale, by_row.scale)
        if symmetric:
            assert result.zero_point is None
        else:
            assert torch.equal(result.zero_point, by_row.zero_point)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_quantize_like_their_float32_copy(dtype):
    weight = torch.randn((5, 64), generator=torch.Generator().manual_seed(11)).to(dtype)
    low = quantize_weight(weight, 4, 32, False)
    high = quantize_weight(weight.float(), 4, 32, False)
    assert torch.equal(low.q, high.q) and torch.equal(low.scale, high.scale)
    assert torch.equal(low.zero_point, high.zero_point)


def test_dequantize_weight_casts_to_the_requested_dtype():
    weight = torch.randn((3, 64), generator=torch.Generator().manual_seed(13))
    qt = quantize_weight(weight, 8, 64, True)
    reference = dequantize_weight(qt.q, qt.scale, None, 8, True)
    for dtype in (torch.bfloat16, torch.float16):
        out = dequantize_weight(qt.q, qt.scale, None, 8, True, dtype=dtype)
        assert out.dtype == dtype
        assert torch.equal(out, reference.to(dtype))
