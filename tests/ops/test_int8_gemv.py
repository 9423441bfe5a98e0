"""hfquant's int8 GEMV (csrc/int8_cpu.c, `native.int8_gemv`) in whichever body this CPU runs: on K % 64 == 0 its W8A16
body (AVX512-VNNI, or the AVX2 body on CPUs without AVX-512) against a float32 model of the VNNI body's operations, bit
for bit, so the AVX2 body is checked against the VNNI one's arithmetic on a machine that has only AVX2 (where both
exist, tests/ops/test_isa.py also compares them directly); on K % 64 != 0 its float body against float64 within the
bfloat16 rounding of each output."""

from __future__ import annotations

import pytest
import torch

from hfquant.ops import gemv, native

needs_int8 = pytest.mark.skipif(not gemv.native_int8_works(), reason="hfquant's native int8 GEMV does not run here")
w8a16_here = pytest.mark.skipif(
    "avx512" in native.isa() and "avx512_vnni" not in native.isa(),
    reason="AVX-512 without VNNI (or HFQUANT_ISA=avx512) runs the float body on K % 64 == 0",
)


def _inputs(n: int, k: int, seed: int):
    """(x (1, K) bfloat16 with block maxima over 3 decades, codes (N, K) int8, scale (N,) bfloat16)."""
    generator = torch.Generator().manual_seed(seed)
    decades = 10.0 ** torch.randint(-2, 2, (k // 16, 1), generator=generator)
    x = (torch.randn((k // 16, 16), generator=generator) * decades).reshape(1, k)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scale = (torch.rand(n, generator=generator) * 0.01 + 1e-4).to(torch.bfloat16)
    return x.to(torch.bfloat16), codes, scale


def _cancelling(n: int, k: int, seed: int):
    """`_inputs` whose float32 rounding shows in the bfloat16 outputs: in each 32 inputs x[16:32] = x[0:16] and the
    codes [16:32] are minus those of [0:16] but for about 8 per row off by one, so lanes i and 8 + i of the VNNI body's
    accumulator (and the row's partial sums) nearly cancel and the result is some 2^-16 of its terms. A model with
    another lane mapping, a separate multiply and add instead of the FMA, or the lanes summed in sequence gives some
    other outputs on these (tried: each of the three differs on 1 to 36 outputs of every shape tested but (7, 128))."""
    x, codes, scale = _inputs(n, k, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    x = x.reshape(-1, 2, 16)[:, :1].expand(-1, 2, -1).reshape(1, k)
    first = codes.reshape(n, -1, 2, 16)[:, :, 0].to(torch.int64)
    off = torch.randint(-1, 2, first.shape, generator=generator) * (
        torch.rand(first.shape, generator=generator) < 8 / k
    )
    second = (off - first).clamp(-128, 127)
    codes = torch.stack([first, second], dim=2).reshape(n, k).to(torch.int8)
    x[:, :64] = 0.0  # an all-zero block: scale 0, codes times 0
    return x, codes, scale


def _vnni_model(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The VNNI body's result from its steps in float32 (csrc/int8_cpu.c): per block of 64, xq = rne(x * f32(32767 /
    max|x|)) clamped to +-32767 and xs = f32(max|x| / 32767); 16 int32 lanes per block, lane i the words 2i and 2i+1
    of each 32-code half; per lane acc = fma(f32(lane), xs, acc) (the exact product, under 2^48, plus acc in float64,
    then one rounding to float32); the 16 lanes summed upper half onto lower (16 -> 8 -> 4 -> 2 -> 1); y =
    bf16(f32(scale * sum))."""
    n, k = codes.shape
    xb = x.float().reshape(-1, 64)
    top = xb.abs().amax(dim=1, keepdim=True)
    to_int = torch.where(top > 0, torch.tensor(32767.0) / top, torch.zeros_like(top))
    xq = torch.round(xb * to_int).clamp(-32767, 32767).to(torch.int64)
    xs = (top / torch.tensor(32767.0)).reshape(-1)
    lanes = (codes.to(torch.int64).reshape(n, -1, 64) * xq).reshape(n, -1, 2, 16, 2).sum(dim=(2, 4))  # (N, B, 16)
    acc = torch.zeros((n, 16), dtype=torch.float32)
    for b in range(k // 64):
        acc = (lanes[:, b].to(torch.float32).double() * xs[b].double() + acc.double()).float()
    while acc.shape[1] > 1:
        half = acc.shape[1] // 2
        acc = acc[:, half:] + acc[:, :half]
    return (scale.float() * acc[:, 0]).to(torch.bfloat16).reshape(1, n)


@needs_int8
@w8a16_here
@pytest.mark.parametrize(
    "n, k", [(7, 128), (256, 512), (128, 2048), (42, 4096), (86, 8256), (66, 16384)]
)  # the one-row loop; the 4-row loop (K >= 4096 in the AVX2 body, K > 8192 in the VNNI one) and its leftover rows
@pytest.mark.parametrize("threads", [1, 2])
def test_w8a16_body_gives_the_vnni_bodys_bits(n, k, threads):
    x, codes, scale = _cancelling(n, k, n + k)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        y = native.int8_gemv(x, codes, scale)
    finally:
        torch.set_num_threads(before)
    expected = _vnni_model(x, codes, scale)
    assert torch.equal(y, expected), (y.float() - expected.float()).abs().max()


@needs_int8
@pytest.mark.parametrize("n, k", [(100, 48), (33, 1040), (9, 8208)])  # K % 64 != 0: the float body
def test_float_body_matches_float64(n, k):
    """Exact float32 products summed in float32 (16 or 8 lanes, each a sum of at most K / 16 terms, then a tree),
    rounded once to bfloat16: within half a bfloat16 step (2^-9, taken as 2^-8) of each output plus the float32
    summation bound (K / 16 + 4) * 2^-24 * sum |x * q| * scale."""
    x, codes, scale = _inputs(n, k, n * k)
    y = native.int8_gemv(x, codes, scale).double()
    reference = (x.double() @ codes.double().t()) * scale.double()
    magnitude = (x.double().abs() @ codes.double().abs().t()) * scale.double()
    assert ((y - reference).abs() <= reference.abs() * 2**-8 + (k / 16 + 4) * 2**-24 * magnitude).all()


def test_the_gemv_runs_where_the_library_says_it_does():
    """`int8_gemv_supported` follows the instruction sets: AVX2 alone is enough (the AVX2 bodies)."""
    isa = set(native.isa())
    assert native.int8_gemv_supported() == ("avx2" in isa or {"avx512", "avx512_bf16"} <= isa)
