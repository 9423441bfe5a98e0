"""The R8 compute layout of IQ4_NL / IQ4_XS weights (csrc/blocks_cpu.c's r8_offset, csrc/blocks_r8_body.h):
`native.block_interleave` is an exact byte permutation both ways; the R8 GEMVs agree with the row kernels and with the
float reference within the stated tolerance, whatever the thread count or the rows' group neighbours, inside a fused
group with plain parts too; the dequantization of an R8 weight is its storage's; bad arguments are refused by name.

The GEMV tests need the R8 kernel, which runs only on AVX2 CPUs without AVX512-VNNI: on an AVX512-VNNI CPU they run
in a child process under `HFQUANT_ISA=avx2` (the AVX2 body, as tests/ops/test_isa.py does)."""

from __future__ import annotations

import pytest
import torch
from test_block_gemv import HALF_FIELDS, _quantized_row, _random_blocks, _row

from hfquant.core import blocks
from hfquant.ops import native, torch_ops

R8 = {"iq4_nl": 20, "iq4_xs": 23, "q3_k": 11}
"""The types with an R8 layout and their GGUF numbers."""

SHAPES = {
    "iq4_nl": [(8, 32), (16, 96), (64, 576), (24, 1536)],
    "iq4_xs": [(8, 256), (16, 768), (40, 1536)],
    "q3_k": [(8, 256), (16, 768), (40, 1536), (8, 8192)],
}
"""(N, K) per type: one block, a few, SmolLM2's K."""

has_library = pytest.mark.skipif(native.built_library() is None, reason="needs the native library (a C compiler)")
runs_r8 = pytest.mark.skipif(
    not native.block_rows8_supported(20),
    reason="the R8 GEMVs need the AVX2 body (an x86-64 CPU with AVX2 + FMA + F16C)",
)


@has_library
@pytest.mark.parametrize("name", list(R8))
def test_interleave_is_an_exact_permutation_both_ways(name):
    """Random bytes (not only valid blocks): forward then inverse gives them back; forward moves every byte (a
    permutation: the sorted bytes agree) and changes the order where there are 8 rows of several bytes."""
    fmt = blocks.layout(name)
    for n, k in SHAPES[name] + [(0, fmt.block_size)]:
        generator = torch.Generator().manual_seed(n + k)
        w = torch.randint(0, 256, (n, k // fmt.block_size * fmt.type_size), dtype=torch.uint8, generator=generator)
        r8 = native.block_interleave(w, k, R8[name])
        assert r8.shape == w.shape and r8.is_contiguous()
        assert torch.equal(native.block_interleave(r8, k, R8[name], inverse=True), w)
        if n:
            assert torch.equal(r8.reshape(-1).sort().values, w.reshape(-1).sort().values)
            assert not torch.equal(r8, w)
            # each group of 8 rows keeps its own bytes
            group = w.shape[1] * 8
            assert torch.equal(r8.reshape(-1)[:group].sort().values, w.reshape(-1)[:group].sort().values)


@has_library
def test_interleave_and_gemv_refuse_by_name():
    w = _random_blocks("iq4_nl", 12, 64, seed=0)
    with pytest.raises(ValueError, match="N 12"):
        native.block_interleave(w, 64, 20)
    with pytest.raises(ValueError, match="GGUF type 2 "):
        native.block_interleave(_random_blocks("q4_0", 8, 64, seed=0), 64, 2)
    with pytest.raises(ValueError, match="in_features 48"):
        native.block_interleave(w[:8], 48, 20)
    with pytest.raises(ValueError, match=r"\(N, 36\)"):
        native.block_interleave(w[:8, :18], 64, 20)
    assert not native.block_rows8_supported(2)
    assert not native.block_gemv_supported(2 | native.BLOCK_ROWS8)  # Q4_0 has no R8 layout
    assert not native.block_gemv_supported(12 | native.BLOCK_ROWS8)
    out = torch.empty(64, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="GGUF type 65538"):
        native.block_dequantize_t(w[:8], 64, 2 | native.BLOCK_ROWS8, 0, 8, out)


@has_library
@pytest.mark.parametrize("name", list(R8))
def test_dequantize_of_r8_is_that_of_storage(name):
    """prefill reads the weight as it lies: rows start..stop of an R8 weight (any start, not a group boundary)
    dequantize to the storage bytes' floats"""
    t = R8[name]
    for n, k in SHAPES[name]:
        w = _random_blocks(name, n, k, seed=n)
        r8 = native.block_interleave(w, k, t)
        for start, stop, dtype in ((0, n, torch.float32), (3, n - 2, torch.bfloat16), (n - 1, n, torch.float32)):
            plain = native.block_dequantize_t(w, k, t, start, stop, torch.empty(k, stop - start, dtype=dtype))
            mine = native.block_dequantize_t(
                r8, k, t | native.BLOCK_ROWS8, start, stop, torch.empty(k, stop - start, dtype=dtype)
            )
            assert torch.equal(mine, plain)


def _magnitude(name: str, x: torch.Tensor, w: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat @ w_hat.T in float64, sum_k |x_hat_k w_hat_nk|): the float reference of both kernels and the scale of
    their float32 rounding"""
    block = blocks.layout(name).block_size
    x_hat, _ = _quantized_row(x, block)
    w_hat = blocks.dequantize(name, w).double()
    return w_hat @ x_hat, w_hat.abs() @ x_hat.abs()


def _check_close(y: torch.Tensor, want: torch.Tensor, size: torch.Tensor, steps: int) -> None:
    """|y - want| <= steps bfloat16 steps of |want| (2^-8 relative each) plus 2^-18 sum|terms| (float32 summation of
    up to a few thousand terms in either kernel's order, with margin)"""
    y = y.reshape(-1).double()
    bound = steps * 2.0**-8 * want.abs() + 2.0**-18 * size
    assert ((y - want).abs() <= bound).all(), (y - want).abs().max()


@runs_r8
@pytest.mark.parametrize("name", list(R8))
def test_r8_gemv_is_the_row_gemv_and_the_float_reference(name):
    """Both kernels: the same integer block dots (the quantized row's), float32 products and sums in another order,
    rounded once to bfloat16; so each agrees with the float64 reference x_hat @ w_hat.T within one bfloat16 rounding
    (2^-9 relative) plus float32 summation, and with each other within two bfloat16 steps plus that summation."""
    t = R8[name]
    for n, k in SHAPES[name]:
        w = _random_blocks(name, n, k, seed=k)
        r8 = native.block_interleave(w, k, t)
        x = _row(k, seed=n)
        row = native.block_gemv(x, w, k, t)
        mine = native.block_gemv(x, r8, k, t | native.BLOCK_ROWS8)
        assert torch.equal(torch_ops.block_gemv(x, r8, k, t | native.BLOCK_ROWS8), mine)
        want, size = _magnitude(name, x, w, k)
        _check_close(mine, want, size, 1)
        _check_close(mine, row.reshape(-1).double(), size, 2)
        assert len(set(mine.reshape(-1).tolist())) > n // 2  # not all alike: the comparisons can fail


@runs_r8
@pytest.mark.parametrize("name", list(R8))
def test_r8_outputs_do_not_depend_on_threads_or_neighbours(name):
    """a row's output is the same bytes at 1 or 2 threads and whatever the other rows of its group of 8 (rows
    16..23 of a 40-row weight against the same rows alone, with other neighbours)"""
    t = R8[name] | native.BLOCK_ROWS8
    k = SHAPES[name][-1][1]
    w = _random_blocks(name, 40, k, seed=5)
    x = _row(k, seed=6)
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append(native.block_gemv(x, native.block_interleave(w, k, R8[name]), k, t))
        assert torch.equal(outputs[0], outputs[1])
        torch.set_num_threads(1)
        alone = native.block_gemv(x, native.block_interleave(w[16:24].contiguous(), k, R8[name]), k, t)
        assert torch.equal(alone, outputs[0][:, 16:24])
    finally:
        torch.set_num_threads(before)


@runs_r8
def test_a_group_mixes_r8_and_plain_parts():
    """an IQ4_NL file's q/k in R8 with a Q5_K v (activation rows of 32 and 256), an IQ4_XS R8 part with a plain IQ4_XS
    one, a Q3_K R8 part with a plain Q3_K one: each part's outputs are the bytes of its own call"""
    k = 512
    members = [
        ("iq4_nl", 64, True),
        ("q5_k", 16, False),
        ("iq4_nl", 8, False),
        ("iq4_xs", 24, True),
        ("iq4_xs", 8, False),
        ("q3_k", 16, True),
        ("q3_k", 8, False),
    ]
    assert_group_is_its_parts(members, k, rows=8)


def assert_group_is_its_parts(members: list[tuple[str, int, bool]], k: int, rows: int) -> None:
    """One group call over `members` ((type, N, interleaved by `rows`) each, random blocks of K = `k`) gives each part
    the bytes of its own call, through ctypes and the dispatcher operator."""
    flag = native.BLOCK_ROWS8 if rows == 8 else native.BLOCK_ROWS16
    weights, types = [], []
    for i, (name, n, interleaved) in enumerate(members):
        w = _random_blocks(name, n, k, seed=i)
        t = blocks.layout(name).ggml_type
        weights.append(native.block_interleave(w, k, t, rows=rows) if interleaved else w)
        types.append(t | flag if interleaved else t)
    x = _row(k, seed=3)
    alone = torch.cat([native.block_gemv(x, w, k, t) for w, t in zip(weights, types, strict=True)], dim=1)
    for call in (native.block_gemv_group, torch_ops.block_gemv_group):
        assert torch.equal(call(x, weights, k, types), alone)


@runs_r8
def test_r8_gemv_refuses_rows_not_in_groups_of_8():
    w = native.block_interleave(_random_blocks("iq4_nl", 16, 64, seed=0), 64, 20)
    x = _row(64, seed=0)
    with pytest.raises(RuntimeError, match="N=12"):
        native.block_gemv(x, w[:12], 64, 20 | native.BLOCK_ROWS8)
    with pytest.raises(RuntimeError, match="GGUF type 65556"):
        torch_ops.block_gemv(x, w[:12], 64, 20 | native.BLOCK_ROWS8)


@runs_r8
@pytest.mark.parametrize("name", list(R8))
def test_a_nan_block_scale_gives_a_nan_output_in_its_row_only(name):
    """the R8 GEMV's bfloat16 rounding of 8 lanes at once keeps a NaN a NaN (not an infinity or zero) and leaves the
    group's other rows finite"""
    t = R8[name]
    k = blocks.layout(name).block_size * 2
    w = _random_blocks(name, 16, k, seed=1)
    d = HALF_FIELDS[name][0]  # the float16 d of row 3's first block
    w[3, d : d + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    y = native.block_gemv(_row(k, seed=1), native.block_interleave(w, k, t), k, t | native.BLOCK_ROWS8).reshape(-1)
    assert torch.isnan(y[3])
    assert torch.isfinite(torch.cat([y[:3], y[4:]])).all()
