"""One activation row (batch-1 decode) on CPU: hfquant's native GEMVs, their checks against the aten kernels, and
the calls that run them.

`hfquant.ops.native` builds and calls the C kernels; this module says whether they may serve a layer
(`native_int4_works`, `native_int8_works`, ... compare them with the aten kernels once per process) and runs the one a
layer's plan names (`row_product`, with a `RowKernel` and a `RowCall`). Which kernel serves which layer is decided
once per layer by `hfquant.ops.plan.plan_kernel`, from the timings of `hfquant.ops.choice`. The GEMVs are called as
PyTorch dispatcher operators (`torch.ops.hfquant_cpu.*`, `hfquant.ops.torch_ops`) wherever those build, in eager and
in torch.compile graphs alike (`RowCall.OPERATOR`). Where they do not (no C++ compiler), eager calls the C kernels
through ctypes (`RowCall.CTYPES`) and compiled graphs through the Python custom ops `hfquant::int4_gemv` /
`hfquant::int8_gemv` below (`RowCall.CUSTOM_OP`), which cost `custom_op_overhead_s()` more per call than an aten op: a
plan then keeps the GEMV in compiled graphs only where it is faster by more than that (on a small model a custom op in
every layer made compiled decoding slower than aten's: docs/performance.md).
"""

from __future__ import annotations

import enum
import functools
import logging
import time

import torch

from hfquant.core import blocks, packing, rtn
from hfquant.ops import block_layout, native, torch_ops

__all__ = [
    "RowKernel",
    "RowCall",
    "row_product",
    "row_function",
    "int4_row",
    "INT4_ROWS",
    "native_int4_works",
    "native_int8_works",
    "native_bf16_works",
    "native_int4_a8_works",
    "native_int4_avx2_works",
    "custom_op_overhead_s",
    "int4_gemv_op",
    "int8_gemv_op",
    "int4_gemv_a8_op",
    "int4_gemv_avx2_op",
    "block_gemv_op",
    "native_block_works",
]

logger = logging.getLogger(__name__)


class RowKernel(str, enum.Enum):
    """The kernel that multiplies one bfloat16 activation row (batch-1 decode) of a layer on CPU."""

    ATEN = "aten"
    """The layer's own product: its `Kernel`'s aten op (`F.linear` for a layer kept in float)."""
    INT4_GEMV = "int4_gemv"
    """`native.int4_gemv`: PyTorch's CPU int4 layout in 64-row blocks (AVX512-BF16)."""
    INT4_GEMV_AVX2 = "int4_gemv_avx2"
    """`native.int4_gemv_avx2`: the CPU int4 layout in 32-row blocks (AVX2 CPUs, or `ATEN_CPU_CAPABILITY=avx2`)."""
    INT4_A8 = "int4_gemv_a8"
    """`native.int4_gemv_a8` on 64-row blocks: W4A8, the row quantized to int8 per block of 32 (AVX512-VNNI)."""
    INT4_A8_AVX2 = "int4_gemv_a8_avx2"
    """`native.int4_gemv_a8` on 32-row blocks (AVX2)."""
    INT8_GEMV = "int8_gemv"
    """`native.int8_gemv`: per-channel int8 weights in the stored row-major layout."""
    BF16_GEMV = "bf16_gemv"
    """`native.bf16_gemv`: a bfloat16 weight kept in float (`hfquant.nn.float_linear`)."""
    BLOCK_GEMV = "block_gemv"
    """`native.block_gemv`: a block format (`KernelPlan.block`), the row quantized to int8 blocks (AVX512-VNNI or
    AVX2)."""


class RowCall(str, enum.Enum):
    """How a native GEMV is called."""

    OPERATOR = "operator"
    """The PyTorch dispatcher operator `torch.ops.hfquant_cpu.*` (`hfquant.ops.torch_ops`), in eager and in graphs."""
    CTYPES = "ctypes"
    """`hfquant.ops.native` through ctypes (eager, where the operators do not build)."""
    CUSTOM_OP = "custom_op"
    """The Python custom op `torch.ops.hfquant.*` below (compiled graphs, where the operators do not build)."""


def row_product(row: RowKernel, call: RowCall, x: torch.Tensor, tensors, plan) -> torch.Tensor:
    """y = x @ w_hat.T for one bfloat16 row by the native GEMV `row` (not `RowKernel.ATEN`), called as `call`.

    Args:
        x: (1, K) bfloat16.
        tensors: the layer's `kernels.LayerTensors`: for the int4 GEMVs `weight` in PyTorch's CPU int4 layout
            ((N, K // 2) uint8) and `scale_zero` ((K // group_size, N, 2), converted to x's dtype here); for the
            int8 GEMV the stored (N, K) int8 `weight` and (N, 1) `scale`.
        plan: the layer's `kernels.KernelPlan` (the int4 GEMVs read its `group_size`, the block GEMV its `block` and
            `in_features`; a compiled graph guards each field it reads, so the int8 GEMV reads none).
    Returns:
        (1, N) bfloat16.
    """
    if row is RowKernel.BLOCK_GEMV:
        if not x.is_contiguous():
            x = x.contiguous()
        ggml_type = block_layout.kernel_type(plan.block, plan.block_rows)
        if call is RowCall.OPERATOR:
            return torch.ops.hfquant_cpu.block_gemv(x, tensors.weight, plan.in_features, ggml_type)
        op = native.block_gemv if call is RowCall.CTYPES else block_gemv_op
        return op(x, tensors.weight, plan.in_features, ggml_type)
    if row is RowKernel.INT8_GEMV:
        # as for aten's int8 kernel: rows 64-byte aligned (a fresh copy under torch.compile, where the pointer is
        # unknown at trace time)
        if torch.compiler.is_compiling():
            x = x.clone(memory_format=torch.contiguous_format)
        elif not x.is_contiguous() or x.data_ptr() % 64:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        scale = tensors.scale.reshape(-1)
        if scale.dtype != x.dtype:  # (a no-op .to() costs more than this test)
            scale = scale.to(x.dtype)
        if call is RowCall.OPERATOR:
            return torch.ops.hfquant_cpu.int8_gemv(x, tensors.weight, scale)
        op = native.int8_gemv if call is RowCall.CTYPES else int8_gemv_op
        return op(x, tensors.weight, scale)
    if not x.is_contiguous():
        x = x.contiguous()
    scale_zero = tensors.scale_zero
    if scale_zero.dtype != x.dtype:
        scale_zero = scale_zero.to(x.dtype)
    return int4_row(row, call, x, tensors.weight, scale_zero, plan.group_size)


INT4_ROWS = (RowKernel.INT4_GEMV, RowKernel.INT4_GEMV_AVX2, RowKernel.INT4_A8, RowKernel.INT4_A8_AVX2)
"""The one-row kernels that read PyTorch's CPU int4 layout and a (K / group, N, 2) `scale_zero`."""


def row_function(
    row: RowKernel, call: RowCall, group_size: int, in_features: int = 0, block: str = "", block_rows: int = 1
):
    """The eager call of the GEMV `row` (one of `INT4_ROWS`, or `RowKernel.BLOCK_GEMV`) made `call`s way, bound once
    per plan: f(x, weight, scale_zero) -> (1, N) bfloat16, with x (1, K) or (1, ..., 1, K) contiguous bfloat16 and
    weight / scale_zero as `row_product` takes them (for the int4 GEMVs scale_zero already bfloat16; the block GEMV
    ignores it, None there). It skips `row_product`'s per-call dispatch on the kernel and call (a layer's decode call
    is a few microseconds of kernel on a small model, docs/performance.md). `in_features`, `block` and `block_rows`
    (the plan's K, block type and weight layout) are read for `RowKernel.BLOCK_GEMV` only. Returns None for the other kernels, and for
    `RowCall.CUSTOM_OP` (compiled graphs only).

    The function reads x as a flat row (the operators and the ctypes kernels check or read x.numel() / x.shape[-1]),
    so callers need not reshape it; it returns the same bytes as `row_product`.
    """
    if call not in (RowCall.OPERATOR, RowCall.CTYPES):
        return None
    # a plan unpickled in a fresh process (torch.save(model)) names operators not loaded there yet: loading them here
    # (cached after the first call) keeps its choice, or falls back to ctypes where they cannot be had
    operator = call is RowCall.OPERATOR and torch_ops.loaded()
    if row is RowKernel.BLOCK_GEMV:
        ggml_type = block_layout.kernel_type(block, block_rows)
        block_op = torch.ops.hfquant_cpu.block_gemv.default if operator else native.block_gemv

        def block_row(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor | None) -> torch.Tensor:
            return block_op(x, weight, in_features, ggml_type)

        return block_row
    if row not in INT4_ROWS:
        return None
    if row is RowKernel.INT4_GEMV:
        op = torch.ops.hfquant_cpu.int4_gemv.default if operator else native.int4_gemv
    elif row is RowKernel.INT4_GEMV_AVX2:
        op = torch.ops.hfquant_cpu.int4_gemv_avx2.default if operator else native.int4_gemv_avx2
    else:
        block_n = 64 if row is RowKernel.INT4_A8 else 32
        a8 = torch.ops.hfquant_cpu.int4_gemv_a8.default if operator else native.int4_gemv_a8

        def int4_a8(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
            return a8(x, weight, scale_zero, group_size, block_n)

        return int4_a8

    def int4(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
        return op(x, weight, scale_zero, group_size)

    return int4


def int4_row(
    row: RowKernel, call: RowCall, x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`row_product` for the int4 GEMVs `row` (one of `INT4_ROWS`) called as `call`: x (1, K) contiguous bfloat16,
    weight (N, K / 2) uint8 in PyTorch's CPU int4 layout, scale_zero (K / group_size, N, 2) bfloat16; returns (1, N)
    bfloat16 (arguments as `native.int4_gemv`)."""
    if row is RowKernel.INT4_GEMV:
        if call is RowCall.OPERATOR:
            return torch.ops.hfquant_cpu.int4_gemv(x, weight, scale_zero, group_size)
        op = native.int4_gemv if call is RowCall.CTYPES else int4_gemv_op
        return op(x, weight, scale_zero, group_size)
    if row is RowKernel.INT4_GEMV_AVX2:
        if call is RowCall.OPERATOR:
            return torch.ops.hfquant_cpu.int4_gemv_avx2(x, weight, scale_zero, group_size)
        op = native.int4_gemv_avx2 if call is RowCall.CTYPES else int4_gemv_avx2_op
        return op(x, weight, scale_zero, group_size)
    block_n = 64 if row is RowKernel.INT4_A8 else 32
    if call is RowCall.OPERATOR:
        return torch.ops.hfquant_cpu.int4_gemv_a8(x, weight, scale_zero, group_size, block_n)
    op = native.int4_gemv_a8 if call is RowCall.CTYPES else int4_gemv_a8_op
    return op(x, weight, scale_zero, group_size, block_n)


@functools.cache
def native_bf16_works() -> bool:
    """True if hfquant's bf16 GEMV (`native.bf16_gemv`: AVX512-BF16, or AVX2 + FMA) loads here and, on a small random
    layer (96 x 256, with a bias), matches ATen's `F.linear` within 1% of the output range. Cached."""
    if native.built_library() is None:
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
    registered (`torch_ops.loaded()`: both call them) or the int8 GEMV does not run; else the Python custom op's
    extra cost (`torch.ops.hfquant.int8_gemv` against the ctypes call), measured once per process on a 64 x 64 int8
    layer, best of 5 passes of 200 calls each."""
    if not native_int8_works() or torch_ops.loaded():
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
    """True if hfquant's native int8 GEMV (`hfquant.ops.native.int8_gemv`) runs on this CPU (`native.int8_gemv_supported`:
    AVX-512 with BF16, or AVX2) and, on a small random layer (96 x 256), matches the aten kernel within 1% of the output
    range. Cached. Whether it serves a layer is the per-shape timing's decision (`choice.int8_row_uses_native`)."""
    if not native.int8_gemv_supported():
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


@functools.cache
def native_int4_avx2_works() -> bool:
    """True where PyTorch packs int4 weights in 32-row blocks (CPUs without AVX-512, or `ATEN_CPU_CAPABILITY=avx2`),
    the AVX2 GEMV (`native.int4_gemv_avx2`) runs, and on a small random layer (128 x 256, group 64, asymmetric) it
    matches aten's kernel within 1% of the output range. Cached."""
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
    of the inputs) plus 1% of the output range (bfloat16 roundings). Cached."""
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


@torch.library.custom_op("hfquant::block_gemv", mutates_args=())
def block_gemv_op(x: torch.Tensor, weight: torch.Tensor, in_features: int, ggml_type: int) -> torch.Tensor:
    """`native.block_gemv` as an opaque op for torch.compile."""
    return native.block_gemv(x, weight, in_features, ggml_type)


@block_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, in_features: int, ggml_type: int) -> torch.Tensor:
    return x.new_empty((1, weight.shape[0]))


@functools.cache
def native_block_works(name: str) -> bool:
    """True if the block GEMV (`native.block_gemv`) runs here for block type `name` (`blocks.LAYOUTS`) and, on a
    small random layer (64 x 512 of the type's default quantization), stays within its error bound of x @ w_hat.T
    (`native.block_gemv`'s Returns, plus 1% of the output range for the bfloat16 roundings), through the dispatcher
    operator as through ctypes. Cached per type."""
    fmt = blocks.layout(name)
    if not native.block_gemv_supported(fmt.ggml_type):
        return False
    generator = torch.Generator().manual_seed(0)
    k = 512
    data = native.block_codes(name, torch.randn((64, k), generator=generator))  # the torch codec's bytes
    weight = blocks.dequantize(name, data)
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    try:
        y = native.block_gemv(x, data, k, fmt.ggml_type).float()
    except RuntimeError as error:
        logger.info("hfquant block GEMV unusable for %s: %s", name, error)
        return False
    reference = x.float() @ weight.T
    top = x.float().reshape(-1, fmt.block_size).abs().amax(dim=1).repeat_interleave(fmt.block_size)
    bound = (weight.abs() * top).sum(dim=1) / 254 + 0.01 * reference.abs().max()
    works = bool(((y - reference).abs() <= bound).all())
    works = works and _operator_agrees(lambda: torch_ops.block_gemv(x, data, k, fmt.ggml_type).float(), y)
    if not works:
        logger.warning("hfquant's block GEMV disagrees with the dequantized %s weight; using the torch path", name)
    return works
