"""The R16 compute layout of IQ4_XS weights (csrc/blocks_cpu.c's r16_offset, the AVX512-VNNI body's r16_iq4_xs_):
`native.block_interleave(..., rows=16)` is an exact byte permutation both ways; the R16 GEMV agrees with the row kernel
and with the float reference within the stated tolerance, whatever the thread count or the rows' group neighbours,
inside a fused group with plain parts too; the dequantization of an R16 weight is its storage's; bad arguments are
refused by name. The GEMV tests need an AVX512-VNNI CPU (`native.block_rows16_supported`)."""

from __future__ import annotations

import pytest
import torch
from test_block_gemv import HALF_FIELDS, _random_blocks, _row
from test_block_rows8 import _check_close, _magnitude, assert_group_is_its_parts

from hfquant.ops import native, torch_ops

XS = 23
"""IQ4_XS's GGUF number."""

SHAPES = [(16, 256), (32, 768), (48, 2048), (16, 8192)]
"""(N, K): one super-block, a few, the 1.2B's K, its down projection's K."""

has_library = pytest.mark.skipif(native.built_library() is None, reason="needs the native library (a C compiler)")
runs_r16 = pytest.mark.skipif(
    not native.block_rows16_supported(XS), reason="the R16 GEMV needs the AVX512-VNNI body of the block GEMVs"
)


@has_library
def test_interleave_is_an_exact_permutation_both_ways():
    """Random bytes (not only valid blocks): forward then inverse gives them back; forward moves bytes (a permutation:
    the sorted bytes agree) and each group of 16 rows keeps its own bytes; R16 is not R8."""
    for n, k in SHAPES + [(0, 256)]:
        generator = torch.Generator().manual_seed(n + k)
        w = torch.randint(0, 256, (n, k // 256 * 136), dtype=torch.uint8, generator=generator)
        r16 = native.block_interleave(w, k, XS, rows=16)
        assert r16.shape == w.shape and r16.is_contiguous()
        assert torch.equal(native.block_interleave(r16, k, XS, inverse=True, rows=16), w)
        if n:
            assert not torch.equal(r16, w) and not torch.equal(r16, native.block_interleave(w, k, XS))
            group = w.shape[1] * 16
            for g in range(n // 16):
                span = slice(g * group, (g + 1) * group)
                assert torch.equal(r16.reshape(-1)[span].sort().values, w.reshape(-1)[span].sort().values)


def _r16_offset(r: int, i: int) -> int:
    """Where byte i of row r's IQ4_XS super-block lies in its 2176-byte R16 block (csrc/blocks_cpu.c's comment)."""
    if i < 2:
        return 2 * r + i  # d
    if i < 4:
        return 32 + 2 * r + (i - 2)  # scales_h
    if i < 8:
        return 64 + 4 * r + (i - 4)  # scales_l
    s, c = divmod(i - 8, 16)
    return 128 + 256 * s + 64 * (c // 4) + 4 * r + c % 4


@has_library
def test_every_byte_lies_where_the_layout_says():
    """Each byte of each row's super-blocks at its documented place (the AVX-512 gather path of an AVX-512 CPU and the
    permutation by runs elsewhere both): int32 lane r of every 64-byte load of codes is row r's."""
    n, k = 32, 512
    w = torch.randint(0, 256, (n, k // 256 * 136), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    r16 = native.block_interleave(w, k, XS, rows=16).view(-1)
    row_bytes = w.shape[1]
    want = torch.empty_like(r16)
    for row in range(n):
        for b in range(k // 256):
            for i in range(136):
                group_start = (row // 16) * 16 * row_bytes + b * 2176
                want[group_start + _r16_offset(row % 16, i)] = w[row, b * 136 + i]
    assert torch.equal(r16, want)


@runs_r16
def test_in_place_interleave_is_the_out_of_place_one():
    """The load interleaves its own weights in place (`block_layout.to_compute`): the bytes are those of a copy's
    interleave; a view overlapping the weight elsewhere is still refused."""
    for n, k in SHAPES:
        w = torch.randint(0, 256, (n, k // 256 * 136), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
        want = native.block_interleave(w, k, XS, rows=16)
        buffer = w.clone()
        got = native.block_interleave(buffer, k, XS, out=buffer, rows=16)
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, want)
    with pytest.raises(ValueError, match="shares the weight's memory"):
        native.block_interleave(w, k, XS, out=w)  # R8's permutation by runs needs distinct buffers
    both = torch.cat([w, w])
    with pytest.raises(ValueError, match="shares the weight's memory"):
        native.block_interleave(both[:16], k, XS, out=both[16:32], rows=16)


@has_library
def test_interleave_and_gemv_refuse_by_name():
    w = _random_blocks("iq4_xs", 24, 256, seed=0)
    with pytest.raises(ValueError, match="N 24 is not a multiple of 16"):
        native.block_interleave(w, 256, XS, rows=16)
    with pytest.raises(ValueError, match="GGUF type 20 has no R16 layout"):
        native.block_interleave(_random_blocks("iq4_nl", 16, 64, seed=0), 64, 20, rows=16)
    with pytest.raises(ValueError, match="rows=4"):
        native.block_interleave(w[:16], 256, XS, rows=4)
    assert not native.block_rows16_supported(20)
    assert not native.block_gemv_supported(20 | native.BLOCK_ROWS16)  # IQ4_NL has no R16 layout
    out = torch.empty(64, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"GGUF type {20 | native.BLOCK_ROWS16}"):
        native.block_dequantize_t(w[:16], 64, 20 | native.BLOCK_ROWS16, 0, 16, out)


@has_library
def test_dequantize_of_r16_is_that_of_storage():
    """prefill reads the weight as it lies: rows start..stop of an R16 weight (any start, not a group boundary)
    dequantize to the storage bytes' floats"""
    for n, k in SHAPES:
        w = _random_blocks("iq4_xs", n, k, seed=n)
        r16 = native.block_interleave(w, k, XS, rows=16)
        for start, stop, dtype in ((0, n, torch.float32), (3, n - 2, torch.bfloat16), (n - 1, n, torch.float32)):
            plain = native.block_dequantize_t(w, k, XS, start, stop, torch.empty(k, stop - start, dtype=dtype))
            mine = native.block_dequantize_t(
                r16, k, XS | native.BLOCK_ROWS16, start, stop, torch.empty(k, stop - start, dtype=dtype)
            )
            assert torch.equal(mine, plain)


@runs_r16
def test_r16_gemv_is_the_row_gemv_and_the_float_reference():
    """Both kernels: the same integer sub-block dots (the quantized row's), float32 products and sums in another
    order, rounded once to bfloat16; so each agrees with the float64 reference x_hat @ w_hat.T within one bfloat16
    rounding plus float32 summation, and with each other within two bfloat16 steps plus that summation."""
    for n, k in SHAPES:
        w = _random_blocks("iq4_xs", n, k, seed=k)
        r16 = native.block_interleave(w, k, XS, rows=16)
        x = _row(k, seed=n)
        row = native.block_gemv(x, w, k, XS)
        mine = native.block_gemv(x, r16, k, XS | native.BLOCK_ROWS16)
        assert torch.equal(torch_ops.block_gemv(x, r16, k, XS | native.BLOCK_ROWS16), mine)
        want, size = _magnitude("iq4_xs", x, w, k)
        _check_close(mine, want, size, 1)
        _check_close(mine, row.reshape(-1).double(), size, 2)
        assert len(set(mine.reshape(-1).tolist())) > n // 2  # not all alike: the comparisons can fail


@runs_r16
def test_r16_outputs_do_not_depend_on_threads_or_neighbours():
    """a row's output is the same bytes at 1 or 2 threads and whatever the other rows of its group of 16 (rows
    16..31 of a 48-row weight against the same rows alone)"""
    k = 2048
    w = _random_blocks("iq4_xs", 48, k, seed=5)
    x = _row(k, seed=6)
    code = XS | native.BLOCK_ROWS16
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outputs.append(native.block_gemv(x, native.block_interleave(w, k, XS, rows=16), k, code))
        assert torch.equal(outputs[0], outputs[1])
        torch.set_num_threads(1)
        alone = native.block_gemv(x, native.block_interleave(w[16:32].contiguous(), k, XS, rows=16), k, code)
        assert torch.equal(alone, outputs[0][:, 16:32])
    finally:
        torch.set_num_threads(before)


@runs_r16
def test_a_group_mixes_r16_and_plain_parts():
    """q/k in R16 beside a plain IQ4_XS part and a Q5_K one (activation rows of 256): each part's outputs are the bytes
    of its own call, through ctypes and the dispatcher operator"""
    members = [("iq4_xs", 32, True), ("iq4_xs", 16, True), ("iq4_xs", 8, False), ("q5_k", 16, False)]
    assert_group_is_its_parts(members, 512, rows=16)


@runs_r16
def test_r16_gemv_refuses_rows_not_in_groups_of_16_and_a_call_with_r8_parts():
    w = native.block_interleave(_random_blocks("iq4_xs", 32, 256, seed=0), 256, XS, rows=16)
    x = _row(256, seed=0)
    with pytest.raises(RuntimeError, match="N=24"):
        native.block_gemv(x, w[:24], 256, XS | native.BLOCK_ROWS16)
    with pytest.raises(RuntimeError, match=f"GGUF type {XS | native.BLOCK_ROWS16}"):
        torch_ops.block_gemv(x, w[:24], 256, XS | native.BLOCK_ROWS16)
    r8 = native.block_interleave(_random_blocks("iq4_xs", 8, 256, seed=1), 256, XS)
    with pytest.raises(RuntimeError, match="refused"):  # an R8 part runs the call on the AVX2 bodies: no R16 there
        native.block_gemv_group(x, [w[:16], r8], 256, [XS | native.BLOCK_ROWS16, XS | native.BLOCK_ROWS8])


@runs_r16
def test_a_nan_block_scale_gives_a_nan_output_in_its_row_only():
    """the R16 GEMV keeps a NaN d a NaN in its row and leaves the group's other rows finite"""
    w = _random_blocks("iq4_xs", 16, 512, seed=1)
    d = HALF_FIELDS["iq4_xs"][0]  # the float16 d of row 3's first super-block
    w[3, d : d + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    r16 = native.block_interleave(w, 512, XS, rows=16)
    y = native.block_gemv(_row(512, seed=1), r16, 512, XS | native.BLOCK_ROWS16).reshape(-1)
    assert torch.isnan(y[3])
    assert torch.isfinite(torch.cat([y[:3], y[4:]])).all()
