"""The block-format GEMV (csrc/blocks_cpu.c, `native.block_gemv`): for every llama.cpp type it computes the formula its
source states (the row quantized to int8 per block of the type, then x_hat @ dequantize(blocks).T) to float32
accuracy, stays within the int8 rounding bound of the float product, refuses what it cannot do by name, is what a
block layer's plan picks for one bfloat16 row, and compiles with fullgraph=True."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.core.format import StoredFormat
from hfquant.nn.linear import QuantLinear
from hfquant.ops import block_layout, gemv, machine, native, plan, torch_ops
from hfquant.ops.gemv import RowKernel

TYPES = list(blocks.LAYOUTS)

HALF_FIELDS = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq4_nl": (0,),
    "iq4_xs": (0,),
    "hq3_0": (0,),
    "hq3_nl": (0,),
    "hq3_r": (),  # its float16 is the row header's
}
"""Byte offsets of each block's float16 fields (ggml-common.h's d / dmin / m)."""

ACTIVATION_BLOCK = {"hq3_r": 32}
"""Inputs per int8 activation block where it is not the type's block size (HQ3_R: two per 64-weight block)."""

needs_kernel = pytest.mark.skipif(
    not native.block_gemv_supported(blocks.layout("q4_k").ggml_type),
    reason="the block GEMV needs a C compiler and AVX2 or AVX512-VNNI",
)


def _random_blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """(N, row bytes) uint8: random bytes (every code and block-scale bit pattern), with finite float16 fields (and
    a finite float16 row header where the type has one)."""
    fmt = blocks.layout(name)
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // fmt.block_size, fmt.type_size), dtype=torch.uint8, generator=generator)
    for offset in HALF_FIELDS[name]:
        values = ((torch.rand((n, k // fmt.block_size), generator=generator) - 0.5) * 0.02).to(torch.float16)
        data[:, :, offset : offset + 2] = values.view(torch.uint8).reshape(n, -1, 2)
    data = data.reshape(n, -1)
    if fmt.row_header:
        header = ((torch.rand(n, generator=generator) - 0.5) * 2e-4).to(torch.float16).view(torch.uint8).reshape(n, 2)
        data = torch.cat([header, data], dim=1)
    return data.contiguous()


def _row(k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn((1, k), generator=generator) * torch.rand((1, k), generator=generator) * 4
    return x.to(torch.bfloat16)


def _quantized_row(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat in float64, max|x| per input's block): csrc/blocks_cpu.c's activation format, xq = round(x * (127 /
    max|x_block|)) to nearest even in float32, x_hat = xq * (max|x_block| / 127)."""
    values = x.float().reshape(-1, block)
    top = values.abs().amax(dim=1, keepdim=True)
    to_int = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    codes = torch.round(values * to_int)
    x_hat = codes.double() * (top / 127.0).double()
    return x_hat.reshape(-1), top.expand_as(values).reshape(-1).double()


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "shape",
    [(64, 512), (33, 256 * 3), (17, 32 * 18), (5, 32 * 3), (7, 64 * 7)],
    # 18 and 3 blocks of 32: the AVX-512 steps of two blocks (four per loop) and the one-block steps after them; 9 and
    # 7 HQ3_R blocks: its AVX-512 loop of four blocks, then one and three one-block steps
    ids=["64x512", "33x768", "17x576", "5x96", "7x448"],
)
def test_block_gemv_is_the_stated_formula_and_within_the_int8_bound(name, shape):
    n, k = shape
    fmt = blocks.layout(name)
    if k % fmt.block_size:
        pytest.skip("K not whole blocks")
    data = _random_blocks(name, n, k, seed=n + k)
    weight = blocks.dequantize(name, data).double()  # (N, K)
    x = _row(k, seed=k)
    y = native.block_gemv(x, data, k, fmt.ggml_type).double().reshape(-1)
    x_hat, top = _quantized_row(x, ACTIVATION_BLOCK.get(name, fmt.block_size))
    stated = weight @ x_hat
    magnitude = weight.abs() @ x_hat.abs()
    # float32 products and sums of the kernel, then one bfloat16 rounding (relative 2**-9, one step allowed)
    assert ((y - stated).abs() <= 2**-8 * stated.abs() + 1e-5 * magnitude).all(), (y - stated).abs().max()
    exact = weight @ x.double().reshape(-1)
    bound = weight.abs() @ top / 254 + 2**-8 * exact.abs() + 1e-5 * magnitude
    assert ((y - exact).abs() <= bound).all()
    assert (y - exact).abs().max() > 0  # the activation rounding is visible: the test compares different products


IQ4_PATTERNS = ((0, 0x00), (63, 0x00), (0, 0xFF), (63, 0xFF), (0, 0x0F), (63, 0xF0), (0, 0x88), (63, 0x77))
"""IQ4 rows of one block scale (6-bit, minus 32: -32 or +31; IQ4_XS only) and one code byte everywhere (codes 0 / 15:
grid values -127 / 113, and mixes of low and high nibbles, either side of the grid's sign change at 8)."""


def _iq4_rows(name: str, k: int, seed: int) -> torch.Tensor:
    """(len(IQ4_PATTERNS) + 4, row bytes) uint8 IQ4_NL / IQ4_XS rows: IQ4_PATTERNS' with d = +-2**-10 alternating,
    then 4 rows of random bytes (every code and scale bit pattern) with random finite d."""
    fmt = blocks.layout(name)
    nb = k // fmt.block_size
    rows = _random_blocks(name, len(IQ4_PATTERNS) + 4, k, seed).reshape(-1, nb, fmt.type_size)
    for r, (scale, code) in enumerate(IQ4_PATTERNS):
        d = torch.tensor([2.0**-10 * (-1) ** r], dtype=torch.float16).view(torch.uint8)
        rows[r, :, 0:2] = d
        if name == "iq4_xs":  # scales_h (2 bits per block) at 2, scales_l (4 per block) at 4
            rows[r, :, 2:4] = 0xFF if scale == 63 else 0
            rows[r, :, 4:8] = 0xFF if scale == 63 else 0
            rows[r, :, 8:] = code
        else:
            rows[r, :, 2:] = code
    return rows.reshape(len(rows), -1).contiguous()


def _iq4_activation(kind: str, k: int) -> torch.Tensor:
    """(1, K) bfloat16: `ones` (every input quantized to +127), `signs` (+-1 alternating by 4: +-127, each int32 lane's
    four products of one sign), `random_signs` (+-1 at random) or `normal` (as _row)."""
    generator = torch.Generator().manual_seed(k)
    if kind == "ones":
        return torch.ones((1, k), dtype=torch.bfloat16)
    if kind == "signs":
        return (1 - 2 * ((torch.arange(k) // 4) % 2)).to(torch.bfloat16).reshape(1, k)
    if kind == "random_signs":
        return (torch.randint(0, 2, (1, k), generator=generator) * 2 - 1).to(torch.bfloat16)
    return _row(k, seed=k)


@needs_kernel
@pytest.mark.parametrize("kind", ["ones", "signs", "random_signs", "normal"])
@pytest.mark.parametrize(
    ("name", "k"),
    [
        ("iq4_xs", 256),
        ("iq4_xs", 768),
        ("iq4_xs", 2048 + 256),
        ("iq4_nl", 96),
        ("iq4_nl", 576),
        ("iq4_nl", 608),
        ("iq4_nl", 2048 + 256),
    ],
    # IQ4_XS: one, three and nine super-blocks (odd counts); IQ4_NL: its AVX2 row's steps of four blocks with 3, 2 and
    # 3 blocks left over, and 72 blocks
)
def test_iq4_rows_are_the_dequantized_weight_times_the_quantized_row_at_the_extremes(name, k, kind):
    """The IQ4 rows' integer dots at their bounds (blocks_body.h: IQ4_XS's AVX2 row sums a super-block's blocks times
    their scales in int32, at most 8 * 2 * (2 * 127 * 127) * 32 = 16516096 per lane, reached by codes 0 at scale -32
    against inputs of one sign; IQ4_NL's its blocks' two nibble halves): the output is the float64 product of the
    dequantized weight with the quantized row (x_hat) within one bfloat16 rounding (2**-8 relative) of it plus float32
    rounding of each block's product and of the sums, (K / 32 + 16) * 2**-23 of sum |w| |x_hat|. A wrong scale, sign,
    block order or an overflow in any row would be off by a fraction of that sum."""
    _assert_row_is_dequantized_times_quantized_row(name, _iq4_rows(name, k, seed=k), k, kind)


def _assert_row_is_dequantized_times_quantized_row(name: str, data: torch.Tensor, k: int, kind: str) -> None:
    """The block GEMV of `data` (rows of type `name`) with `_iq4_activation(kind, k)` is the float64 product of the
    dequantized weight with the quantized row (x_hat) within one bfloat16 rounding (2**-8 relative) of it plus float32
    rounding of each block's product and of the sums, (K / 32 + 16) * 2**-23 of sum |w| |x_hat|; and not only
    cancelling sums (the relative bound is tested)."""
    fmt = blocks.layout(name)
    weight = blocks.dequantize(name, data).double()
    x = _iq4_activation(kind, k)
    y = native.block_gemv(x, data, k, fmt.ggml_type).double().reshape(-1)
    x_hat, _ = _quantized_row(x, fmt.block_size)
    if kind != "normal":
        assert ((x_hat.abs() - 1).abs() < 1e-6).all()  # every input quantized to +-127 (x_hat: +-127 * (1 / 127))
    stated = weight @ x_hat
    magnitude = weight.abs() @ x_hat.abs()
    bound = 2**-8 * stated.abs() + (k / 32 + 16) * 2**-23 * magnitude
    assert ((y - stated).abs() <= bound).all(), ((y - stated).abs() - bound).max()
    assert (stated.abs() > 0.01 * magnitude).any()


Q3_K_PATTERNS = (
    (0x00, 0x00, 0x00, 0x00),
    (0xFF, 0xFF, 0xFF, 0xFF),
    (0x00, 0x00, 0xFF, 0xFF),
    (0xFF, 0xFF, 0x00, 0x00),
    (0x0F, 0x33, 0xAA, 0x1B),
    (0xF0, 0xCC, 0x55, 0xE4),
    (0x00, 0xFF, 0x0F, 0x33),
    (0xFF, 0x00, 0xF0, 0xCC),
)
"""Q3_K rows of one byte everywhere in each field: scales' low-nibble bytes (0-7), their 2-bit-high bytes (8-11), hmask
and qs. Scales 6-bit minus 32: all -32, all +31, and mixes of 15 / 0 lows with 0 / 3 / 1 / 2 highs (+31, -17, -32,
+15 ...); codes 0 (w = -4 d s) and 7 (+3 d s), and per 32-code group j of a qs byte and hmask bit every code 0-7."""


def _q3_k_rows(k: int, seed: int) -> torch.Tensor:
    """(len(Q3_K_PATTERNS) + 4, row bytes) uint8 Q3_K rows (110-byte blocks: hmask 0-31, qs 32-95, scales 96-107, d
    108-109): Q3_K_PATTERNS' with d = +-2**-10 alternating, then 4 rows of random bytes with random finite d."""
    rows = _random_blocks("q3_k", len(Q3_K_PATTERNS) + 4, k, seed).reshape(-1, k // 256, 110)
    for r, (lows, highs, hmask, qs) in enumerate(Q3_K_PATTERNS):
        rows[r, :, 0:32] = hmask
        rows[r, :, 32:96] = qs
        rows[r, :, 96:104] = lows
        rows[r, :, 104:108] = highs
        rows[r, :, 108:110] = torch.tensor([2.0**-10 * (-1) ** r], dtype=torch.float16).view(torch.uint8)
    return rows.reshape(len(rows), -1).contiguous()


@needs_kernel
@pytest.mark.parametrize("kind", ["ones", "signs", "random_signs", "normal"])
@pytest.mark.parametrize("k", [256, 768, 2048 + 256, 8192])
# one, three and nine super-blocks (the AVX2 row's steps of two with one left over) and 32
def test_q3_k_rows_are_the_dequantized_weight_times_the_quantized_row_at_the_extremes(k, kind):
    """Q3_K's rows at their field extremes (blocks_body.h: the AVX2 row takes a super-block's codes two per byte, their
    bit 2 from a table by hmask's nibble, codes 2 and 3 times 16, each register's pair sums times 256 * its scale:
    an int32 lane reaches 4 * 2 * 28448 * 32 * 256 = 1864368128 < 2^31 with scales -32, codes 7 and inputs +127, the
    third pattern row under "ones"; the AVX-512 body's int16 quad sums 4 * 7 * 127 = 3556): the output is the float64
    product of the dequantized weight with the quantized row (x_hat) within one bfloat16 rounding (2**-8 relative) of
    it plus float32 rounding, (K / 32 + 16) * 2**-23 of sum |w| |x_hat|. A wrong code bit, scale field, sign or
    sub-block order would be off by a fraction of that sum."""
    fmt = blocks.layout("q3_k")
    data = _q3_k_rows(k, seed=k)
    weight = blocks.dequantize("q3_k", data).double()
    x = _iq4_activation(kind, k)
    y = native.block_gemv(x, data, k, fmt.ggml_type).double().reshape(-1)
    x_hat, _ = _quantized_row(x, fmt.block_size)
    if kind != "normal":
        assert ((x_hat.abs() - 1).abs() < 1e-6).all()  # every input quantized to +-127
    stated = weight @ x_hat
    magnitude = weight.abs() @ x_hat.abs()
    bound = 2**-8 * stated.abs() + (k / 32 + 16) * 2**-23 * magnitude
    assert ((y - stated).abs() <= bound).all(), ((y - stated).abs() - bound).max()
    assert (stated.abs() > 0.01 * magnitude).any()  # not only cancelling sums: the relative bound is tested


K4_PATTERNS = (
    (0x00, 0x00, 0x00, 0x00, 0x00),
    (0xFF, 0xFF, 0xFF, 0xFF, 0xFF),
    (0x3F, 0x3F, 0x00, 0x00, 0xFF),
    (0xC0, 0xC0, 0xFF, 0xFF, 0x0F),
    (0x3F, 0x00, 0x0F, 0xAA, 0xF0),
    (0x00, 0x3F, 0xF0, 0x55, 0x0F),
    (0x95, 0x6A, 0x3C, 0x0F, 0x5A),
    (0x6A, 0x95, 0xC3, 0xF0, 0xA5),
)
"""Q4_K / Q5_K rows of one byte everywhere in each field: the scales' bytes 0-3 (scales 0-3 and bits 4-5 of scales
4-7) and 4-7 (minimums 0-3, bits 4-5 of minimums 4-7), bytes 8-11 (low nibbles scales 4-7, high minimums 4-7), qh
(Q5_K) and qs. Scales and minimums 0 and 63 in every combination of the four groups, and mixed bits (21 / 42 with
highs 2 / 1, ...); codes 0 and 15 (Q5_K: 31) and per sub-block every fifth bit."""


def _k4_rows(name: str, k: int, seed: int) -> torch.Tensor:
    """(len(K4_PATTERNS) + 4, row bytes) uint8 Q4_K (144-byte blocks: d 0-1, dmin 2-3, scales 4-15, qs 16-143) or Q5_K
    (176: qh 16-47, qs 48-175) rows: K4_PATTERNS' with d = +-2**-10 and dmin = -+2**-11 alternating, then 4 rows of
    random bytes with random finite d and dmin."""
    fmt = blocks.layout(name)
    rows = _random_blocks(name, len(K4_PATTERNS) + 4, k, seed).reshape(-1, k // 256, fmt.type_size)
    qs = 48 if name == "q5_k" else 16
    for r, (scales, mins, highs, qh, codes) in enumerate(K4_PATTERNS):
        rows[r, :, 4:8] = scales
        rows[r, :, 8:12] = mins
        rows[r, :, 12:16] = highs
        rows[r, :, 16:qs] = qh
        rows[r, :, qs:] = codes
        fields = torch.tensor([2.0**-10 * (-1) ** r, -(2.0**-11) * (-1) ** r], dtype=torch.float16)
        rows[r, :, 0:4] = fields.view(torch.uint8)
    return rows.reshape(len(rows), -1).contiguous()


@needs_kernel
@pytest.mark.parametrize("kind", ["ones", "signs", "random_signs", "normal"])
@pytest.mark.parametrize("k", [256, 768, 2048 + 256])
@pytest.mark.parametrize("name", ["q4_k", "q5_k"])
def test_k4_rows_are_the_dequantized_weight_times_the_quantized_row_at_the_extremes(name, k, kind):
    """Q4_K / Q5_K's rows at their field extremes (blocks_body.h: the AVX2 row unpacks the 6-bit scales and minimums by
    vector instructions (k4_unpack_vec_), picks each sub-block's scale by a byte shuffle and moves Q5_K's fifth bit by
    one shift per sub-block): the output is the float64 product of the dequantized weight with the quantized row
    (x_hat) within one bfloat16 rounding (2**-8 relative) of it plus float32 rounding, (K / 32 + 16) * 2**-23 of sum
    |w| |x_hat|. A wrong scale or minimum bit, fifth bit or sub-block order would be off by a fraction of that sum."""
    _assert_row_is_dequantized_times_quantized_row(name, _k4_rows(name, k, seed=k), k, kind)


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_operator_and_ctypes_agree_bit_for_bit(name):
    fmt = blocks.layout(name)
    data = _random_blocks(name, 48, 512, seed=1)
    x = _row(512, seed=2)
    assert torch.equal(
        torch_ops.block_gemv(x, data, 512, fmt.ggml_type), native.block_gemv(x, data, 512, fmt.ggml_type)
    )


@needs_kernel
def test_block_gemv_refuses_unknown_types_and_partial_blocks_by_name():
    data = _random_blocks("q4_k", 8, 512, seed=0)
    x = _row(512, seed=0)
    with pytest.raises(RuntimeError, match="GGUF type 99"):
        native.block_gemv(x, data, 512, 99)
    with pytest.raises(RuntimeError, match="K=500"):
        native.block_gemv(_row(500, seed=0), data, 500, blocks.layout("q4_k").ggml_type)
    assert not native.block_gemv_supported(99)


@needs_kernel
def test_a_nan_block_scale_gives_a_nan_output_row_not_zero():
    """float16 0x7FFF is a NaN whose widened mantissa bits are all ones: rounding it to bfloat16 by adding the bias
    carried into the sign bit and gave -0 (the row looked valid). Row 1's only block gets that scale."""
    data = _random_blocks("q8_0", 3, 32, seed=0)
    data[1, 0:2] = torch.tensor([0xFF, 0x7F], dtype=torch.uint8)
    y = native.block_gemv(_row(32, seed=1), data, 32, blocks.layout("q8_0").ggml_type).float().reshape(-1)
    assert torch.isnan(y[1]) and torch.isfinite(y[[0, 2]]).all()


GROUPS = {
    "k-quants": (("q4_k", 40), ("q4_k", 8), ("q6_k", 24), ("q2_k", 3), ("iq4_xs", 17)),
    "32-weight": (("q4_1", 40), ("q8_0", 9), ("q4_0", 1), ("hq3_0", 33)),
    "mixed sizes": (("q5_k", 9), ("iq4_nl", 40), ("q5_1", 3), ("hq3_r", 5), ("iq4_xs", 8), ("q5_0", 1)),
}
"""Weights that one `block_gemv_group` call takes (rows of every remainder per thread; the last group's types read
activation rows of 32 and of 256, the IQ4_NL file's q/k and Q5_K v)."""


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("k_blocks", [1, 3, 9])
def test_group_call_gives_each_weights_own_bytes_whatever_the_threads(group, k_blocks, threads):
    """One C call for several weights (x quantized once, its blocks split over the threads, then each weight's rows):
    each weight's outputs are the bytes of its own call, at one thread or two."""
    members = GROUPS[group]
    k = k_blocks * blocks.layout(members[0][0]).block_size
    weights = [_random_blocks(name, n, k, seed=i) for i, (name, n) in enumerate(members)]
    types = [blocks.layout(name).ggml_type for name, _ in members]
    x = _row(k, seed=k_blocks)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([native.block_gemv(x, w, k, t) for w, t in zip(weights, types, strict=True)], dim=1)
        torch.set_num_threads(threads)
        for call in (native.block_gemv_group, torch_ops.block_gemv_group):
            together = call(x, weights, k, types)
            assert together.shape == (1, sum(n for _, n in members))
            assert torch.equal(together, alone)
        threaded = torch.cat([native.block_gemv(x, w, k, t) for w, t in zip(weights, types, strict=True)], dim=1)
        assert torch.equal(threaded, alone)
    finally:
        torch.set_num_threads(before)
    assert len(set(alone.reshape(-1).tolist())) > 10  # the outputs are not all alike: the comparison can fail


@needs_kernel
def test_group_call_refuses_k_not_whole_blocks_and_counts_by_name():
    k = 288  # 9 blocks of 32, not whole super-blocks of 256
    weights = [_random_blocks("q4_0", 8, k, seed=1), _random_blocks("q4_k", 8, k, seed=0)]
    types = [blocks.layout("q4_0").ggml_type, blocks.layout("q4_k").ggml_type]
    x = _row(k, seed=0)
    for call in (native.block_gemv_group, torch_ops.block_gemv_group):
        with pytest.raises(RuntimeError, match=r"types \[2, 12\]"):
            call(x, weights, k, types)
        with pytest.raises(RuntimeError, match="1-8 weights"):
            call(x, weights * 5, k, types * 5)


def _block_layer(name: str, n: int = 128, k: int = 512) -> QuantLinear:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn((n, k), generator=generator) * 0.02).to(torch.bfloat16)
    return QuantLinear.from_float(weight, None, StoredFormat.of_block(name))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_block_layer_refuses_a_weight_with_nan_or_inf(bad):
    weight = torch.zeros(8, 256)
    weight[5, 17] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        QuantLinear.from_float(weight, None, StoredFormat.of_block("iq4_xs"))


@needs_kernel
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q3_k", "q8_0", "hq3_0", "hq3_nl", "hq3_r"])
def test_plan_picks_the_block_gemv_for_one_bfloat16_row(name, monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # read when the layer is planned: no timing in tests
    assert gemv.native_block_works(name)
    layer = _block_layer(name)
    layer.prepare_kernel(torch.bfloat16)
    assert layer.plan.row is RowKernel.BLOCK_GEMV and layer.plan.compiled_row is RowKernel.BLOCK_GEMV
    x = _row(512, seed=3)
    ggml_type = block_layout.kernel_type(name, layer.plan.block_rows)  # the R8 layout's code where it runs
    expected = native.block_gemv(x, layer.weight, 512, ggml_type)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
        several = layer(x.expand(2, -1).contiguous())  # two rows: the GEMV per row (a short prompt's prefill)
        assert torch.equal(several, expected.expand(2, -1))

    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "aten")
    layer = _block_layer(name)
    layer.prepare_kernel(torch.bfloat16)
    assert layer.plan.row is RowKernel.ATEN


@needs_kernel
def test_block_layer_compiles_without_graph_breaks_and_calls_the_gemv(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    torch._dynamo.reset()
    layer = _block_layer("q4_k")
    layer.prepare_kernel(torch.bfloat16)
    x = _row(512, seed=4)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        assert torch.equal(compiled(x), layer(x))


@needs_kernel
@pytest.mark.parametrize("name", TYPES)
def test_c_dequantization_is_the_torch_dequantizers_bfloat16_transposed(name):
    fmt = blocks.layout(name)
    data = _random_blocks(name, 40, 512, seed=5)
    out = torch.empty((512, 30), dtype=torch.bfloat16)
    native.block_dequantize_t(data, 512, fmt.ggml_type, 5, 35, out)
    assert torch.equal(out.t(), blocks.dequantize(name, data[5:35]).to(torch.bfloat16))
    wide = torch.empty((512, 30), dtype=torch.float32)  # for CPUs whose GEMM runs in float32
    native.block_dequantize_t(data, 512, fmt.ggml_type, 5, 35, wide)
    assert torch.equal(wide.t(), blocks.dequantize(name, data[5:35]))
    with pytest.raises(RuntimeError, match="rows 30..50"):
        native.block_dequantize_t(data, 512, fmt.ggml_type, 30, 50, torch.empty((512, 20), dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("name", ["q4_k", "hq3_r"])
def test_prefill_of_a_block_layer_multiplies_the_c_dequantized_weight(name):
    """More rows than `plan.block_gemv_max_rows`: the dequantized weight's product."""
    layer = _block_layer(name, n=96)
    layer.prepare_kernel(torch.bfloat16)
    rows = plan.block_gemv_max_rows(96, 512) + 1
    x = torch.randn((rows, 512), generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    weight = blocks.dequantize(name, layer.weight)
    if machine.gemm_dtype(torch.bfloat16, "cpu") == torch.bfloat16:
        expected = x @ weight.to(torch.bfloat16).t()
    else:  # no bfloat16 GEMM on this CPU: the float32 weight, the product rounded once
        expected = (x.float() @ weight.t()).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)


@needs_kernel
@pytest.mark.parametrize("name", ["iq4_xs", "iq4_nl", "q4_k"])
def test_few_rows_of_a_block_layer_run_its_one_row_gemv_per_row(name):
    """A short prompt's rows (2 to `plan.block_gemv_max_rows`) each take the block GEMV, as a decode step would: the same
    bytes as one-row calls, within the int8-activation bound of the float product (`native.block_gemv`)."""
    layer = _block_layer(name, n=512)  # 512 x 512: the GEMV without timing (`plan.UNTIMED_BLOCK_WEIGHTS`)
    layer.prepare_kernel(torch.bfloat16)
    most = plan.block_gemv_max_rows(512, 512)
    assert layer.plan.row is RowKernel.BLOCK_GEMV and layer.plan.gemv_max_rows == most
    generator = torch.Generator().manual_seed(8)
    weight = blocks.dequantize(name, layer.stored_weight()).double()
    for rows in (2, 9, most):
        x = torch.randn((1, rows, 512), generator=generator).to(torch.bfloat16)
        with torch.inference_mode():
            y = layer(x)
            one_by_one = torch.cat([layer(x[:, i : i + 1]) for i in range(rows)], dim=1)
        assert y.shape == (1, rows, 512) and torch.equal(y, one_by_one)
        exact = x[0].double() @ weight.t()
        bound = weight.abs().sum(1) * x[0].double().abs().amax(1, keepdim=True) / 254 + exact.abs() / 128 + 1e-6
        assert ((y[0].double() - exact).abs() <= bound).all()
    # under autograd the rows keep the float product whose gradient the backward rule gives: within the bfloat16
    # rounding of the result (the int8 activations of the GEMV are several times further off here); where the CPU
    # has a bfloat16 GEMM the product reads the weight rounded to bfloat16
    x = torch.randn((3, 512), generator=generator).to(torch.bfloat16)
    if machine.gemm_dtype(torch.bfloat16, "cpu") == torch.bfloat16:
        weight = weight.to(torch.bfloat16).double()
    exact = x.double() @ weight.t()
    y = layer(x.clone().requires_grad_()).detach().double()
    assert ((y - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 7, 200], ids=lambda r: f"M{r}")
@pytest.mark.parametrize("name", ["hq3_0", "hq3_r"])
def test_hq3_layer_gradients_are_those_of_its_dequantized_weight(rows, name):
    """hfquant's own HQ3_0 / HQ3_R take the block formats' autograd rule (the LoRA path): grad_x = grad_y @ w_hat."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn((48, 576), generator=generator)
    layer = QuantLinear.from_float(weight, None, StoredFormat.of_block(name))
    layer.prepare_kernel(torch.float32)
    w_hat = blocks.dequantize(name, layer.weight)
    x = torch.randn((rows, 576), generator=generator, requires_grad=True)
    grad_y = torch.randn((rows, 48), generator=generator)
    layer(x).backward(grad_y)
    torch.testing.assert_close(x.grad, grad_y @ w_hat, rtol=1e-4, atol=1e-4)
