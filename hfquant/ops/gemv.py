"""One activation row (batch-1 decode) on CPU: hfquant's native GEMVs as operators, their checks against the aten
kernels, and which of the two serves each layer shape.

`hfquant.ops.native` builds and calls the C kernels; this module decides whether they may serve a layer:
`native_int4_works` / `native_int8_works` compare them with the aten kernels once per process, and
`choose_int4_row_kernel` / `choose_int8_row_kernel` record, per layer shape, the kernel that `hfquant.ops.choice`
timed faster on this CPU (`NATIVE_INT4_ROWS`, `NATIVE_INT8_ROWS`, read by `kernels.quantized_matmul`). The GEMVs are
called as PyTorch dispatcher operators (`torch.ops.hfquant_cpu.*`, `hfquant.ops.torch_ops`) wherever those build, in
eager and in torch.compile graphs alike. Where they do not (no C++ compiler), eager calls the C kernels through ctypes
and compiled graphs through the Python custom ops `hfquant::int4_gemv` / `hfquant::int8_gemv` below, which cost
`custom_op_overhead_s()` more per call than an aten op: compiled graphs then keep the GEMV only where it is faster by
more than that (`COMPILED_INT4_ROWS`, `COMPILED_INT8_ROWS`). On SmolLM2-135M int4 the Python custom op in every layer
made compiled decoding 0.88x aten's speed (docs/performance.md).
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from hfquant.core import packing, rtn
from hfquant.ops import choice, native, torch_ops

__all__ = [
    "NATIVE_INT4_ROWS",
    "NATIVE_INT8_ROWS",
    "choose_int4_row_kernel",
    "choose_int8_row_kernel",
    "native_int4_works",
    "native_int8_works",
    "int4_gemv_op",
    "int8_gemv_op",
    "COMPILED_INT4_ROWS",
    "COMPILED_INT8_ROWS",
    "custom_op_overhead_s",
    "NATIVE_BF16_ROWS",
    "choose_bf16_row_kernel",
    "native_bf16_works",
    "int4_row",
    "int8_row",
    "native_int4_a8_works",
    "int4_gemv_a8_op",
    "int4_a8_row",
    "native_int4_avx2_works",
    "int4_gemv_avx2_op",
]

logger = logging.getLogger(__name__)

NATIVE_INT4_ROWS: dict[tuple[int, int, int], bool] = {}
"""(out_features, in_features, group size) -> whether one bfloat16 row of such a `Kernel.INT4PACK_MM_CPU` layer runs
hfquant's GEMV (True) or the aten kernel (False), as measured on this CPU (`choose_int4_row_kernel`). A shape not
listed (a layer prepared before the choice existed) runs the GEMV wherever `_takes_native_int4` holds."""


def choose_int4_row_kernel(out_features: int, in_features: int, group_size: int) -> bool:
    """Decide, by measurement on this CPU (`hfquant.ops.choice`), which kernel serves single bfloat16 rows of
    `Kernel.INT4PACK_MM_CPU` layers of this shape, and record it for `quantized_matmul`; returns True for hfquant's
    GEMV. Without a working GEMV (`native_int4_works`, or N not a multiple of 64) nothing is measured: False."""
    shape = (out_features, in_features, group_size)
    if shape not in NATIVE_INT4_ROWS:
        usable = (native_int4_works() and out_features % 64 == 0) or (
            native_int4_avx2_works() and out_features % 32 == 0 and group_size % 32 == 0
        )
        NATIVE_INT4_ROWS[shape] = usable and choice.int4_row_uses_native(out_features, in_features, group_size)
        COMPILED_INT4_ROWS[shape] = NATIVE_INT4_ROWS[shape] and _wins_compiled(
            choice.row_timings(out_features, in_features, group_size)
        )
    return NATIVE_INT4_ROWS[shape]


COMPILED_INT4_ROWS: dict[tuple[int, int, int], bool] = {}
"""`NATIVE_INT4_ROWS` for graphs compiled by torch.compile: the GEMV only where it beats aten by more than the custom
op's call overhead (`custom_op_overhead_s`)."""

COMPILED_INT8_ROWS: dict[tuple[int, int], bool] = {}
"""`NATIVE_INT8_ROWS` for compiled graphs, as `COMPILED_INT4_ROWS`."""


def _wins_compiled(timings: tuple[float, float] | None) -> bool:
    """Whether the GEMV, timed (GEMV s, aten s) in eager, stays faster when a compiled graph calls it as a custom op.
    Without timings (a forced choice) the eager choice stands."""
    if timings is None:
        return True
    native_s, aten_s = timings
    return native_s + custom_op_overhead_s() < aten_s


NATIVE_BF16_ROWS: dict[tuple[int, int], bool] = {}
"""(out_features, in_features) -> whether one bfloat16 row of a bfloat16 layer kept in float (`FloatLinear`) runs
hfquant's bf16 GEMV (True) or ATen's (False), as measured on this CPU (`choose_bf16_row_kernel`); a shape not listed
runs ATen's."""


def choose_bf16_row_kernel(out_features: int, in_features: int) -> bool:
    """`choose_int4_row_kernel` for bfloat16 layers kept in float: True when hfquant's bf16 GEMV serves their single
    rows. Without a working GEMV (`native_bf16_works`, K % 32) nothing is measured: False."""
    shape = (out_features, in_features)
    if shape not in NATIVE_BF16_ROWS:
        usable = in_features % 32 == 0 and native_bf16_works()
        NATIVE_BF16_ROWS[shape] = usable and choice.bf16_row_uses_native(out_features, in_features)
    return NATIVE_BF16_ROWS[shape]


@functools.cache
def native_bf16_works() -> bool:
    """True if hfquant's bf16 GEMV (`native.bf16_gemv`) loads here and, on a small random layer (96 x 256, with a
    bias), matches ATen's `F.linear` within 1% of the output range. Cached."""
    if native.int4_cpu_library() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn((96, 256), generator=generator).to(torch.bfloat16)
    bias = torch.randn((96,), generator=generator).to(torch.bfloat16)
    x = torch.randn((1, 256), generator=generator).to(torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    try:
        y = native.bf16_gemv(x, weight, bias).float()
    except RuntimeError:
        return False
    works = bool(((y - reference).abs().max() <= 0.01 * reference.abs().max()).item())
    if not works:
        logger.warning("hfquant native bf16 GEMV disagrees with F.linear; using ATen's")
    return works


@functools.cache
def custom_op_overhead_s() -> float:
    """Seconds one GEMV call costs more in a compiled graph than in eager. 0 where hfquant's dispatcher operators are
    registered (`torch_ops.AVAILABLE`: both call them) or the int8 GEMV does not run; else the Python custom op's
    extra cost (`torch.ops.hfquant.int8_gemv` against the ctypes call), measured once per process on a 64 x 64 int8
    layer, best of 5 passes of 200 calls each."""
    if not native_int8_works() or torch_ops.AVAILABLE:
        return 0.0
    x = torch.randn((1, 64)).to(torch.bfloat16)
    weight = torch.randint(-127, 128, (64, 64), dtype=torch.int8)
    scale = torch.ones(64, dtype=torch.bfloat16)
    op = torch.ops.hfquant.int8_gemv

    def best(call) -> float:
        fastest = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                call(x, weight, scale)
            fastest = min(fastest, (time.perf_counter() - start) / 200)
        return fastest

    return max(0.0, best(op) - best(native.int8_gemv))


NATIVE_INT8_ROWS: dict[tuple[int, int], bool] = {}
"""(out_features, in_features) -> whether one bfloat16 row of such a `Kernel.INT8PACK_MM` layer runs hfquant's int8
GEMV (True) or the aten kernel (False), as measured on this CPU (`choose_int8_row_kernel`); a shape not listed runs the
aten kernel."""


def choose_int8_row_kernel(out_features: int, in_features: int) -> bool:
    """`choose_int4_row_kernel` for `Kernel.INT8PACK_MM` layers: True when hfquant's int8 GEMV serves their single
    bfloat16 rows. Without a working GEMV (`native_int8_works`) nothing is measured: False."""
    shape = (out_features, in_features)
    if shape not in NATIVE_INT8_ROWS:
        usable = in_features % 16 == 0 and native_int8_works()
        NATIVE_INT8_ROWS[shape] = usable and choice.int8_row_uses_native(out_features, in_features)
        COMPILED_INT8_ROWS[shape] = NATIVE_INT8_ROWS[shape] and _wins_compiled(
            choice.row_timings(out_features, in_features, None)
        )
    return NATIVE_INT8_ROWS[shape]


_PROBE_SHAPE = (128, 256, 64)
"""(N, K, group size) of the small random layer the works-checks compare kernels on."""


def _int4_probe():
    """The works-checks' layer: (RTN result (N, K) group 64 asymmetric, x (1, K) bfloat16, weight in this PyTorch's
    CPU int4 layout, (scale, zero) pairs in bfloat16, aten's `_weight_int4pack_mm_for_cpu` of x in float32)."""
    generator = torch.Generator().manual_seed(0)
    n, k, group = _PROBE_SHAPE
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 4, group, False)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    runtime = packing.to_cpu_int4_layout(q.q)
    sz = packing.scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16)
    return q, x, runtime, sz, torch.ops.aten._weight_int4pack_mm_for_cpu(x, runtime, group, sz).float()


@functools.cache
def native_int4_works() -> bool:
    """True if hfquant's native int4 kernels (`hfquant.ops.native`) build and load here, the CPU layout has 64-row "halves"
    blocks, and on a small random layer (128 x 256, group 64, asymmetric) both the single-row GEMV and x @ (the
    dequantized weight) match the aten CPU kernel within 1% of the output range. Cached."""
    if native.int4_cpu_library() is None:
        return False
    layout = packing.cpu_int4_layout()
    if layout is None or layout.block_n != 64 or not layout.full_blocks_halves:
        return False
    q, x, runtime, sz, reference = _int4_probe()
    n, k, group = _PROBE_SHAPE
    try:
        y = native.int4_gemv(x, runtime, sz, group).float()
        weight_t = native.int4_dequantize_t(runtime, sz, group, 0, n, torch.empty((k, n), dtype=torch.bfloat16))
    except RuntimeError as error:
        logger.info("hfquant native int4 kernels unusable: %s", error)
        return False
    works = torch.allclose(y, reference, rtol=0.01, atol=0.01 * reference.abs().max().item())
    works = works and _operator_agrees(lambda: torch_ops.int4_gemv(x, runtime, sz, group).float(), y)
    from_dequantized = (x.float() @ weight_t.float()).float()
    works = works and torch.allclose(from_dequantized, reference, rtol=0.01, atol=0.01 * reference.abs().max().item())
    if not works:
        logger.warning("hfquant native int4 kernels disagree with the aten kernel; using the aten kernel")
    return works


@functools.cache
def native_int8_works() -> bool:
    """True if hfquant's native int8 GEMV (`hfquant.ops.native.int8_gemv`) loads here and, on a small random layer
    (96 x 256), matches the aten kernel within 1% of the output range. Cached."""
    if native.int4_cpu_library() is None:
        return False
    generator = torch.Generator().manual_seed(0)
    n, k = 96, 256
    q = rtn.quantize_weight(torch.randn((n, k), generator=generator), 8, k, True)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    scale = q.scale.reshape(-1).to(torch.bfloat16).contiguous()
    reference = torch.ops.aten._weight_int8pack_mm(x, q.q.contiguous(), scale).float()
    try:
        y = native.int8_gemv(x, q.q.contiguous(), scale).float()
    except RuntimeError as error:
        logger.info("hfquant native int8 GEMV unusable: %s", error)
        return False
    works = torch.allclose(y, reference, rtol=0.01, atol=0.01 * reference.abs().max().item())
    works = works and _operator_agrees(lambda: torch_ops.int8_gemv(x, q.q.contiguous(), scale).float(), y)
    if not works:
        logger.warning("hfquant native int8 GEMV disagrees with the aten kernel; using the aten kernel")
    return works


def _operator_agrees(call, expected: torch.Tensor) -> bool:
    """Loads hfquant's GEMV operators (`torch_ops.loaded`); True when `call` (through them, or through ctypes where
    they are not registered) gives `expected` bit for bit."""
    torch_ops.loaded()
    return torch.equal(call(), expected)


@torch.library.custom_op("hfquant::int8_gemv", mutates_args=())
def int8_gemv_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`native.int8_gemv` as an opaque op for torch.compile (eager calls the function directly)."""
    return native.int8_gemv(x, weight, scale)


@int8_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


@torch.library.custom_op("hfquant::int4_gemv", mutates_args=())
def int4_gemv_op(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """`native.int4_gemv` as an opaque op for torch.compile (eager calls the function directly: no dispatch cost)."""
    return native.int4_gemv(x, weight, scale_zero, group_size)


@int4_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


@torch.library.custom_op("hfquant::int4_gemv_a8", mutates_args=())
def int4_gemv_a8_op(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int
) -> torch.Tensor:
    """`native.int4_gemv_a8` as an opaque op for torch.compile."""
    return native.int4_gemv_a8(x, weight, scale_zero, group_size, block_n)


@int4_gemv_a8_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


@torch.library.custom_op("hfquant::int4_gemv_avx2", mutates_args=())
def int4_gemv_avx2_op(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`native.int4_gemv_avx2` as an opaque op for torch.compile."""
    return native.int4_gemv_avx2(x, weight, scale_zero, group_size)


@int4_gemv_avx2_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


def int4_row(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int = 64
) -> torch.Tensor:
    """hfquant's int4 GEMV of one row (arguments and result as `native.int4_gemv`, or `native.int4_gemv_avx2` for the
    32-row layout of AVX2 CPUs, `block_n` 32) through the cheapest call at hand: the dispatcher operator
    (`torch_ops`), else ctypes in eager and the Python custom op in a compiled graph."""
    if torch.compiler.is_compiling() and not torch_ops.AVAILABLE:
        op = int4_gemv_avx2_op if block_n == 32 else int4_gemv_op
        return op(x, weight, scale_zero, group_size)
    call = torch_ops.int4_gemv_avx2 if block_n == 32 else torch_ops.int4_gemv
    return call(x, weight, scale_zero, group_size)


def int4_a8_row(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int
) -> torch.Tensor:
    """`int4_row` for the W4A8 GEMV (arguments and result as `native.int4_gemv_a8`)."""
    if torch.compiler.is_compiling() and not torch_ops.AVAILABLE:
        return int4_gemv_a8_op(x, weight, scale_zero, group_size, block_n)
    return torch_ops.int4_gemv_a8(x, weight, scale_zero, group_size, block_n)


@functools.cache
def native_int4_avx2_works() -> bool:
    """True where PyTorch packs int4 weights in 32-row blocks (CPUs without AVX-512, or `ATEN_CPU_CAPABILITY=avx2`),
    the AVX2 GEMV (`native.int4_gemv_avx2`) runs, and on a small random layer (128 x 256, group 64, asymmetric) it
    matches aten's kernel within 1% of the output range. Cached; callers read `kernels._NATIVE_INT4_AVX2`."""
    layout = packing.cpu_int4_layout()
    if layout is None or layout.block_n != 32 or not layout.full_blocks_halves or native.built_library() is None:
        return False
    _, x, runtime, sz, reference = _int4_probe()
    group = _PROBE_SHAPE[2]
    try:
        y = native.int4_gemv_avx2(x, runtime, sz, group).float()
    except RuntimeError as error:
        logger.info("hfquant AVX2 int4 GEMV unusable: %s", error)
        return False
    works = torch.allclose(y, reference, rtol=0.01, atol=0.01 * reference.abs().max().item())
    works = works and _operator_agrees(lambda: torch_ops.int4_gemv_avx2(x, runtime, sz, group).float(), y)
    if not works:
        logger.warning("hfquant's AVX2 int4 GEMV disagrees with the aten kernel; using the aten kernel")
    return works


@functools.cache
def native_int4_a8_works() -> bool:
    """True if the W4A8 GEMV (`native.int4_gemv_a8`) runs here on PyTorch's int4 CPU layout (64-row blocks with
    AVX512-VNNI, 32-row blocks with AVX2) and, on a small random layer (128 x 256, group 64, asymmetric), stays within
    its error bound of aten's `_weight_int4pack_mm_for_cpu`: per output, sum_k |w| * max|x| / 254 (the int8 rounding
    of the inputs) plus 1% of the output range (bfloat16 roundings). Cached; callers read `kernels._NATIVE_INT4_A8`."""
    layout = packing.cpu_int4_layout()
    if layout is None or not layout.full_blocks_halves or not native.int4_a8_supported(layout.block_n):
        return False
    q, x, runtime, sz, reference = _int4_probe()
    group = _PROBE_SHAPE[2]
    try:
        y = native.int4_gemv_a8(x, runtime, sz, group, layout.block_n).float()
    except RuntimeError as error:
        logger.info("hfquant W4A8 GEMV unusable: %s", error)
        return False
    weight = rtn.dequantize_weight(q.q, q.scale, q.zero_point, 4, False, dtype=torch.float32)
    bound = weight.abs().sum(dim=1) * x.float().abs().max() / 254 + 0.01 * reference.abs().max()
    works = bool(((y - reference).abs() <= bound).all())
    works = works and _operator_agrees(
        lambda: torch_ops.int4_gemv_a8(x, runtime, sz, group, layout.block_n).float(), y
    )
    if not works:
        logger.warning("hfquant's W4A8 GEMV disagrees with the aten int4 kernel; decode_activations='int8' is ignored")
    return works


def int8_row(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`int4_row` for the int8 GEMV (arguments and result as `native.int8_gemv`)."""
    if torch.compiler.is_compiling() and not torch_ops.AVAILABLE:
        return int8_gemv_op(x, weight, scale)
    return torch_ops.int8_gemv(x, weight, scale)
