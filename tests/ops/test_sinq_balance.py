"""SINQ's Sinkhorn balancing in C (hfquant.ops.native.sinq_balance, csrc/sinq_cpu.c, behind hfquant.ops.balance)
against the torch steps of hfquant.core.sinq.balance computed in float64: the same iterations, so the inverse column
factors agree to float32 rounding and the stored bfloat16 scales are equal on almost every column (one bfloat16 step
at most). torch's own default path rounds each sum to bfloat16 and is further from that reference. The pass has three bodies,
picked by the CPU or `HFQUANT_ISA` (csrc/isa_cpu.c): block_pass_avx512, block_pass_avx2 (the same operations in the
same order with 8-lane vectors) and the portable block_pass; children of this process run the other two."""

from __future__ import annotations

import pytest
import torch
from helpers import results_by_isa, start_by_isa

from hfquant.core import folding, sinq
from hfquant.ops import balance, native

pytestmark = pytest.mark.skipif(not balance.native_balance_available(), reason="native kernels unavailable here")

BF16_STEP = 2.0**-7  # relative spacing of bfloat16 values (upper bound)


def _weight(n: int, k: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator) * 0.02
    weight[:, 7] *= 20  # outlier columns and rows: what the balancing is for
    weight[:, k // 3] *= 10
    weight[n // 2] *= 8
    return weight.to(dtype)


def _reference(weights, group_size, row_scales=None, iterations=sinq.ITERATIONS) -> torch.Tensor:
    """float64 torch steps on the stacked matrices (rows times their factors, exactly)."""
    row_scales = row_scales or [None] * len(weights)
    parts = [
        w.to(torch.bfloat16).double() * (1 if r is None else r.double()[:, None])
        for w, r in zip(weights, row_scales, strict=True)
    ]
    return sinq.balance(torch.cat(parts), group_size, iterations, stats_dtype=torch.float64)


def _assert_close_to_reference(weights, group_size, row_scales=None, iterations=sinq.ITERATIONS) -> None:
    got = native.sinq_balance(weights, group_size, iterations, row_scales)
    want = _reference(weights, group_size, row_scales, iterations)
    assert ((got - want).abs() / want).max() < 1e-4
    scale = sinq.scale_from_balance(got, group_size)
    expected = sinq.scale_from_balance(want, group_size)
    assert ((scale - expected).abs() / expected).max() <= BF16_STEP
    assert (scale == expected).float().mean() >= 0.99


@pytest.mark.parametrize("iterations", [0, 1, 4, 8])
@pytest.mark.parametrize(
    "n, k, group",
    # 20 tiles of 64 and 21 of 16: the C pass reduces 16 tiles at a time (a last partial set) in 32-column steps
    # 4608 columns: two strips of 2048 balanced one after the other and a last one of 512
    [(256, 512, 64), (96, 1536, 128), (64, 256, 256), (3, 64, 32), (45, 1280, 64), (37, 336, 16), (40, 4608, 128)],
)
def test_one_matrix_matches_the_float64_steps(n, k, group, iterations):
    _assert_close_to_reference([_weight(n, k, n + k)], group, iterations=iterations)


def test_stacked_matrices_with_row_factors_match_the_scaled_stack():
    weights = [_weight(192, 512, 1), _weight(64, 512, 2), _weight(64, 512, 3, torch.float32)]
    factors = torch.rand(64, generator=torch.Generator().manual_seed(4)) * 3 + 0.2
    _assert_close_to_reference(weights, 128, [None, None, factors])


def test_zero_rows_columns_and_clamped_rows_follow_the_torch_rules():
    """Rows or columns with standard deviation 0 keep factor 1; a row 10^5 times wider than the rest of its tile is
    clamped at 1e3: the C pass sums such rows with the wrong factor and corrects them afterwards."""
    weight = _weight(300, 256, 5).float()
    weight[5] = 0
    weight[17, :64] = 0
    weight[40, 64:128] *= 1e5
    weight[:, 3] = 0
    for iterations in (1, 4):
        _assert_close_to_reference([weight], 64, iterations=iterations)
    constant = torch.ones(16, 64)  # every row and column constant: nothing to balance
    assert torch.equal(native.sinq_balance([constant], 32, 4), torch.ones(64))


def test_closer_to_the_float64_steps_than_the_bfloat16_torch_path():
    weight = _weight(512, 1024, 6)
    expected = sinq.scale_from_balance(_reference([weight], 128), 128)
    c_path = balance.column_scale([weight], 128)
    torch_path = sinq.column_scale(weight, 128)
    assert (c_path == expected).float().mean() > (torch_path == expected).float().mean()


def test_same_result_for_any_thread_count():
    weights = [_weight(700, 512, 7), _weight(300, 512, 8)]
    factors = torch.rand(300, generator=torch.Generator().manual_seed(9)) + 0.5
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(native.sinq_balance(weights, 64, 4, [None, factors]))
    finally:
        torch.set_num_threads(threads)
    for count in (1, 3):  # the fold worker's explicit team
        results.append(native.sinq_balance(weights, 64, 4, [None, factors], threads=count))
    assert all(torch.equal(results[0], r) for r in results[1:])
    with pytest.raises(ValueError, match="threads=0"):
        native.sinq_balance(weights, 64, 4, threads=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_non_finite_weight_raises_the_sinq_error(value, dtype):
    weight = _weight(32, 128, 10, dtype)
    weight[20, 100] = value
    with pytest.raises(sinq.NonFiniteWeightError, match="NaN or Inf"):
        balance.column_scale([weight], 64)


@pytest.mark.parametrize("values", [(float("inf"), float("-inf")), (float("-inf"),), (float("nan"), 1.0)])
def test_non_finite_weight_in_any_pass_row_raises(values):
    # the first pass reads a row again only where its tile's sums are not finite (csrc/sinq_cpu.c): an infinity
    # cancelled by another of the other sign, or a lone one in the row's last tile, is still found
    weight = _weight(48, 256, 14)
    for offset, value in enumerate(values):
        weight[47, 255 - offset] = value
    with pytest.raises(sinq.NonFiniteWeightError, match="NaN or Inf"):
        balance.column_scale([weight], 64)


def test_finite_weight_whose_squares_overflow_is_not_refused():
    # squares above float32's range make a tile's sum of squares infinite; the values themselves are finite, so the
    # weight is not refused as holding NaN or Inf (the row is read again and found finite)
    weight = _weight(48, 256, 15)
    weight[5, 70] = 1e30
    native.sinq_balance([weight], 64, 4)  # no ValueError


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="does not divide in_features=96"):
        balance.column_scale([torch.randn(8, 96)], 64)
    with pytest.raises(ValueError, match="same width"):
        balance.column_scale([torch.randn(8, 64), torch.randn(8, 32)], 32)
    with pytest.raises(ValueError, match="row scale of \\(3,\\)"):
        native.sinq_balance([torch.randn(8, 64)], 32, 4, [torch.ones(3)])
    assert torch.equal(balance.column_scale([torch.randn(1, 64)], 32), torch.ones(64))  # one row: nothing to balance


def test_without_the_library_the_torch_steps_run(monkeypatch):
    weights = [_weight(64, 256, 11), _weight(32, 256, 12)]
    factors = torch.rand(32, generator=torch.Generator().manual_seed(13)) + 0.5
    monkeypatch.setattr(balance, "native_balance_available", lambda: False)
    got = balance.column_scale(weights, 64, [None, factors], iterations=2)
    assert torch.equal(got, folding.column_scale_of(weights, 64, [None, factors], iterations=2))


# The bodies' cases: (n, k, group, iterations) of one bfloat16 matrix, then the stacked matrices with row factors
# (a float32 one among them: its rows are rounded to bfloat16 first) and the zero and clamped rows.
_BODY_CASES = [(256, 512, 64, 4), (96, 1536, 128, 4), (64, 256, 256, 1), (45, 1280, 64, 4), (37, 336, 16, 8)]
_BODY_CASES += [(40, 4608, 128, 4), (3, 64, 32, 4), (600, 2048, 256, 4)]


def _stacked():
    weights = [_weight(192, 512, 1), _weight(64, 512, 2), _weight(64, 512, 3, torch.float32)]
    return weights, [None, None, torch.rand(64, generator=torch.Generator().manual_seed(4)) * 3 + 0.2]


def _odd_rows():
    weight = _weight(300, 256, 5).float()
    weight[5] = 0
    weight[17, :64] = 0
    weight[40, 64:128] *= 1e5
    weight[:, 3] = 0
    return weight


def _body_results() -> dict:
    """This process's body on every case: {"cases": {name: inv_col}, "threads": inv_col at 1, 2 and 3 threads,
    "refused": whether each non-finite weight was refused}."""
    cases = {case: native.sinq_balance([_weight(*case[:2], sum(case[:2]))], *case[2:]) for case in _BODY_CASES}
    weights, factors = _stacked()
    cases["stacked"] = native.sinq_balance(weights, 128, sinq.ITERATIONS, factors)
    cases["odd rows"] = native.sinq_balance([_odd_rows()], 64, 4)
    stack = [_weight(700, 512, 7), _weight(300, 512, 8)]
    row_factors = [None, torch.rand(300, generator=torch.Generator().manual_seed(9)) + 0.5]
    threads = [native.sinq_balance(stack, 64, 4, row_factors, threads=count) for count in (1, 2, 3)]
    refused = []
    for dtype in (torch.bfloat16, torch.float32):
        for values in ((float("nan"),), (float("inf"),), (float("inf"), float("-inf")), (float("-inf"),)):
            weight = _weight(48, 256, 14, dtype)
            for offset, value in enumerate(values):
                weight[47 if dtype == torch.bfloat16 else 20, 255 - offset] = value
            try:
                native.sinq_balance([weight], 64, 4)
                refused.append(False)
            except ValueError as error:
                refused.append("NaN or Inf" in str(error))
    return {"isa": native.isa(), "cases": cases, "threads": threads, "refused": refused}


_CHILD = """
    import sys, torch
    import test_sinq_balance
    torch.save(test_sinq_balance._body_results(), sys.argv[1])
"""


@pytest.fixture(scope="module")
def bodies(tmp_path_factory) -> dict:
    """{HFQUANT_ISA setting: `_body_results()` of a child with it} for "avx2" (block_pass_avx2, as on a CPU without
    AVX-512) and "generic" (block_pass)."""
    if "avx2" not in native.isa():
        pytest.skip("block_pass_avx2 needs AVX2, FMA and F16C")
    folder = tmp_path_factory.mktemp("sinq_bodies")
    results = results_by_isa(start_by_isa(_CHILD, ("avx2", "generic"), folder), folder)
    assert results["avx2"]["isa"] == ("avx2",) and results["generic"]["isa"] == ()
    return results


def _case_reference(case) -> torch.Tensor:
    if case == "stacked":
        weights, factors = _stacked()
        return _reference(weights, 128, factors)
    if case == "odd rows":
        return _reference([_odd_rows()], 64, iterations=4)
    n, k, group, iterations = case
    return _reference([_weight(n, k, n + k)], group, iterations=iterations)


def _group(case) -> int:
    return {"stacked": 128, "odd rows": 64}.get(case, case[2] if isinstance(case, tuple) else 0)


@pytest.mark.parametrize("setting", ["avx2", "generic"])
def test_each_body_matches_the_float64_steps(bodies, setting):
    """block_pass_avx2 and block_pass against the float64 reference, with the tolerance of the tests above."""
    for case, got in bodies[setting]["cases"].items():
        want = _case_reference(case)
        assert ((got - want).abs() / want).max() < 1e-4, case
        scale, expected = sinq.scale_from_balance(got, _group(case)), sinq.scale_from_balance(want, _group(case))
        assert ((scale - expected).abs() / expected).max() <= BF16_STEP, case
        assert (scale == expected).float().mean() >= 0.99, case


def test_the_avx2_body_agrees_with_the_portable_one(bodies):
    """The two bodies sum in different orders (block_pass's order is the compiler's vectorization): the same factors
    to float32 rounding (measured: at most 5e-7 relative on the 1.2B's shapes), and the same bfloat16 scales on
    almost every column."""
    avx2, generic = bodies["avx2"]["cases"], bodies["generic"]["cases"]
    assert avx2.keys() == generic.keys()
    for case in avx2:
        assert ((avx2[case] - generic[case]).abs() / generic[case]).max() < 1e-5, case
        scale, other = (
            sinq.scale_from_balance(avx2[case], _group(case)),
            sinq.scale_from_balance(generic[case], _group(case)),
        )
        assert ((scale - other).abs() / other).max() <= BF16_STEP, case
        assert (scale == other).float().mean() >= 0.99, case


@pytest.mark.parametrize("setting", ["avx2", "generic"])
def test_each_body_refuses_non_finite_weights_for_any_thread_count(bodies, setting):
    result = bodies[setting]
    assert all(result["refused"]), result["refused"]
    assert all(torch.equal(result["threads"][0], r) for r in result["threads"][1:])


def test_the_avx2_body_gives_the_avx512_bodys_floats(bodies):
    """On a CPU with AVX-512F, block_pass_avx512 (this process) and block_pass_avx2 (the child) give the same bits:
    every lane adds the same products in the same order, and the tiles' sums are reduced by the same additions."""
    if "avx512" not in native.isa():
        pytest.skip("this process runs block_pass_avx2 already (no AVX-512 here)")
    here = _body_results()
    for case, got in bodies["avx2"]["cases"].items():
        assert torch.equal(got, here["cases"][case]), case
