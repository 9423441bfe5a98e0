"""Which matmul runs a quantized layer, and the runtime tensors each kernel needs.

Kernels (`Kernel`: PyTorch's aten ops, and one of our own for single int4 rows):
  - `Kernel.INT8PACK_MM` ("int8pack_mm"): `torch.ops.aten._weight_int8pack_mm` (CPU, and CUDA builds that have it),
    int8 symmetric per-channel weights, activations bf16/fp16/fp32. A single bfloat16 row on CPU may run hfquant's
    int8 GEMV instead (`hfquant.ops.native`), where it works and, timed on the layer's shape on this CPU, is faster
    (`gemv.choose_int8_row_kernel`).
  - `Kernel.INT4PACK_MM_CPU` ("int4pack_mm_cpu"): `torch.ops.aten._weight_int4pack_mm_for_cpu`, 4-bit group-wise
    (group 32..256), weight repacked into the CPU layout (`hfquant.core.packing`), scale and zero folded into one
    (K/g, N, 2) tensor. On some CPUs the aten kernel is instruction-bound at one row, so
    a single bfloat16 row (batch-1 decode) of such a layer may run hfquant's own GEMV on the same bytes instead
    (`hfquant.ops.native`, built from `csrc/int4_cpu.c` on first use): where it builds and matches the aten kernel
    (`gemv.native_int4_works`) and, timed on the layer's shape on this CPU, is the faster of the two
    (`hfquant.ops.gemv`, `hfquant.ops.choice`); elsewhere the aten kernel serves every row.
  - `Kernel.INT4PACK_MM_CUDA` ("int4pack_mm_cuda"): `torch.ops.aten._weight_int4pack_mm` (tinygemm), bf16
    activations, weight repacked with `_convert_weight_to_int4pack`.
  - `Kernel.DEQUANT` ("dequant"): dequantize the weight to the activation dtype and call
    `torch.nn.functional.linear`. Covers every case and is the numerical reference in tests.

On CPU, a call with at least `GEMM_MIN_ROWS[kernel]` activation rows (a prompt's prefill) does not use the int8/int4
aten kernels, which are built for few rows and take several times the float GEMM's time there: it dequantizes
output-channel chunks of the runtime weight and runs the float GEMM (`_dequantized_gemm`), close to the bf16 layer's
time. Measured timings of every path: docs/performance.md.

Both int4 kernels compute w = (q - 8) * scale + zero with a float `zero`, so an integer zero point z becomes
zero = (8 - z) * scale (rounded to the activation dtype). `select_kernel()` is the one place that decides; a kernel
is only chosen after a small probe on the device matched the dequantize reference (`kernel_works`), so a PyTorch
build without the op, or with a different layout, falls back to `Kernel.DEQUANT` instead of failing.
"""

from __future__ import annotations

import enum
import functools
import logging

import torch

from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.core.packing import scale_zero_for_int4
from hfquant.ops import gemv, native

__all__ = [
    "Kernel",
    "INT4_KERNELS",
    "select_kernel",
    "kernel_works",
    "prepare_weight",
    "restore_codes",
    "prepare_packed_int4",
    "stored_int4",
    "scale_zero_for_int4",
    "quantized_matmul",
]

logger = logging.getLogger(__name__)


class Kernel(str, enum.Enum):
    """The matmuls a quantized layer can run (see the module docstring).

    A `str` enum: each member equals its value ("int8pack_mm" == Kernel.INT8PACK_MM), and str(), format() and repr()
    give that plain value, so logs and module reprs read as the kernel names always did.
    """

    INT8PACK_MM = "int8pack_mm"
    INT4PACK_MM_CPU = "int4pack_mm_cpu"
    INT4PACK_MM_CUDA = "int4pack_mm_cuda"
    DEQUANT = "dequant"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


INT4_KERNELS = (Kernel.INT4PACK_MM_CPU, Kernel.INT4PACK_MM_CUDA)
"""The kernels that read the weight repacked into their own layout from unpacked codes (`prepare_weight`), which
`restore_codes` undoes; the others read the stored layout."""

_INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


def _shape_fits(kernel: Kernel, fmt: StoredFormat, in_features: int, out_features: int) -> bool:
    if kernel == Kernel.INT8PACK_MM:
        # The bf16 path of the aten kernel reads rows in 32-byte vectors with no tail: in_features must be a
        # multiple of 16 (it returns garbage or crashes otherwise, seen with torch 2.13).
        return fmt.bits == 8 and fmt.symmetric and fmt.group_size == in_features and in_features % 16 == 0
    if kernel == Kernel.INT4PACK_MM_CPU:
        return fmt.bits == 4 and fmt.group_size in _INT4_KERNEL_GROUP_SIZES and out_features % 16 == 0
    if kernel == Kernel.INT4PACK_MM_CUDA:
        return (
            fmt.bits == 4
            and fmt.group_size in _INT4_KERNEL_GROUP_SIZES
            and out_features % 8 == 0
            and _cuda_inner_k_tiles(in_features) is not None
        )
    return kernel == Kernel.DEQUANT


def select_kernel(fmt: StoredFormat, *, in_features: int, out_features: int, device: torch.device | str) -> Kernel:
    """The matmul used for a layer of this stored format and shape on `device`.

    Preference: the aten kernel that fits the format and device and passed its probe, else `Kernel.DEQUANT`.
    """
    device_type = torch.device(device).type
    if device_type == "cpu":
        candidates = (Kernel.INT8PACK_MM, Kernel.INT4PACK_MM_CPU)
    elif device_type == "cuda":
        candidates = (Kernel.INT4PACK_MM_CUDA, Kernel.INT8PACK_MM)
    else:
        candidates = ()
    for kernel in candidates:
        if _shape_fits(kernel, fmt, in_features, out_features) and kernel_works(kernel, str(torch.device(device))):
            return kernel
    return Kernel.DEQUANT


def prepare_packed_int4(kernel: Kernel, packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """`prepare_weight` for an int4 kernel from the stored (N, K // 2) packed weight: one native pass into the CPU
    layout where hfquant's kernels work (`gemv.native_int4_works`, N % 64 == 0), else through unpacked codes."""
    if kernel == Kernel.INT4PACK_MM_CPU and packed.device.type == "cpu" and packed.shape[0] % 64 == 0:
        _note_cpu_int4_layout()
        if _NATIVE_INT4:
            return native.int4_repack(packed, to_cpu_layout=True)
    return prepare_weight(kernel, packing.unpack_int4(packed), in_features)


def _note_cpu_int4_layout() -> None:
    """Set `_CPU_INT4_BLOCKS` and the `_NATIVE_INT4*` flags for the CPU int4 layout of this PyTorch build."""
    global _CPU_INT4_BLOCKS, _NATIVE_INT4, _NATIVE_INT4_A8, _NATIVE_INT4_AVX2
    layout = packing.cpu_int4_layout()
    _CPU_INT4_BLOCKS = None if layout is None or not layout.full_blocks_halves else layout.block_n
    _NATIVE_INT4 = gemv.native_int4_works()  # checks the layout too
    _NATIVE_INT4_A8 = _CPU_INT4_BLOCKS is not None and gemv.native_int4_a8_works()
    _NATIVE_INT4_AVX2 = _CPU_INT4_BLOCKS == 32 and gemv.native_int4_avx2_works()


def stored_int4(kernel: Kernel, runtime_weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `prepare_packed_int4`: the runtime weight of an int4 kernel -> the stored (N, K // 2) layout."""
    if (
        kernel == Kernel.INT4PACK_MM_CPU
        and _NATIVE_INT4
        and runtime_weight.device.type == "cpu"
        and out_features % 64 == 0
    ):
        return native.int4_repack(runtime_weight, to_cpu_layout=False)
    return packing.pack_int4(restore_codes(kernel, runtime_weight, out_features, in_features))


def prepare_weight(kernel: Kernel, codes_or_weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Storage weight -> the weight tensor `kernel` reads.

    Args:
        kernel: a `Kernel` (or its value).
        codes_or_weight: for the `INT4_KERNELS` the unpacked (N, K) uint8 codes; otherwise the stored weight
            ((N, K) int8/uint8, or (N, K // 2) uint8 packed int4 for `Kernel.DEQUANT`).
    """
    if kernel == Kernel.INT4PACK_MM_CPU:
        _note_cpu_int4_layout()
        return packing.to_cpu_int4_layout(codes_or_weight)
    if kernel == Kernel.INT4PACK_MM_CUDA:
        tiles = _cuda_inner_k_tiles(in_features)
        nibbles = _cuda_nibble_order_for(str(codes_or_weight.device))
        packed = _pack_for_cuda(codes_or_weight, nibbles)
        return torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
    # aten kernels read with unaligned loads, but a tensor viewing a memory-mapped file at an odd offset is
    # copied into our own allocation so the layer never depends on the file staying mapped.
    if codes_or_weight.data_ptr() % 64 or not codes_or_weight.is_contiguous():
        return codes_or_weight.contiguous().clone()
    return codes_or_weight


def restore_codes(kernel: Kernel, runtime_weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `prepare_weight` for the `INT4_KERNELS`: runtime weight -> (N, K) uint8 codes."""
    if kernel == Kernel.INT4PACK_MM_CPU:
        return packing.from_cpu_int4_layout(runtime_weight, out_features, in_features)
    if kernel == Kernel.INT4PACK_MM_CUDA:
        return _unpack_cuda_by_identity(runtime_weight, out_features, in_features)
    raise ValueError(f"kernel {kernel!r} keeps the stored layout; nothing to restore")


def _pack_for_cuda(codes: torch.Tensor, even_high: bool) -> torch.Tensor:
    if even_high:
        return (codes[:, 0::2] << 4) | codes[:, 1::2]
    return packing.pack_int4(codes)


def _unpack_cuda_by_identity(runtime_weight: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Exact unpack of the tinygemm layout: multiply the identity by the weight with scale 1 and zero 8.

    Every product is an integer in [0, 15], exact in bfloat16. Done in row blocks of 1024 inputs.
    """
    group = 32 if k % 32 == 0 else k
    unit = torch.empty((k // group, n, 2), dtype=torch.bfloat16, device=runtime_weight.device)
    unit[..., 0] = 1.0
    unit[..., 1] = 8.0
    codes = torch.empty((n, k), dtype=torch.uint8, device=runtime_weight.device)
    for start in range(0, k, 1024):
        stop = min(k, start + 1024)
        eye = torch.zeros((stop - start, k), dtype=torch.bfloat16, device=runtime_weight.device)
        eye[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
        block = torch.ops.aten._weight_int4pack_mm(eye, runtime_weight, group, unit)  # (rows, N)
        codes[:, start:stop] = block.t().round().to(torch.uint8)
    return codes


def quantized_matmul(
    kernel: Kernel,
    x: torch.Tensor,
    runtime_weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    scale_zero: torch.Tensor | None,
    fmt: StoredFormat,
    *,
    in_features: int,
    out_features: int,
    int8_activations: bool = False,
) -> torch.Tensor:
    """y = x @ w_hat.T for x (..., K) float; returns (..., N) in x's dtype.

    `fmt` is the stored format of the weight. `scale_zero` is the (G, N, 2) tensor from `scale_zero_for_int4` for the
    int4 kernels; `scale` (N, G) and `zero_point` are the stored ones (the int8 kernel reads `scale`,
    `Kernel.DEQUANT` reads both). `int8_activations`: a single bfloat16 row of a `Kernel.INT4PACK_MM_CPU` layer runs
    the W4A8 GEMV (x quantized to int8 per block of 32) wherever it can (`gemv.native_int4_a8_works`, group_size % 32
    == 0), instead of the kernel measured fastest for bfloat16 activations; other products are unchanged.
    """
    group_size = fmt.group_size
    shape = x.shape
    x2d = x.reshape(-1, in_features)
    if kernel in GEMM_MIN_ROWS and x2d.shape[0] >= GEMM_MIN_ROWS[kernel] and x2d.device.type == "cpu":
        y = _dequantized_gemm(kernel, x2d, runtime_weight, scale, scale_zero, group_size, out_features)
        if y is not None:
            return y.reshape(*shape[:-1], out_features)
    if kernel == Kernel.INT8PACK_MM:
        # The aten kernel needs the activation rows 32-byte aligned (it crashes otherwise); a view at an odd
        # offset is copied into a fresh (64-byte aligned) allocation.
        # Under torch.compile the pointer is unknown at trace time: always hand the kernel a fresh copy there.
        if torch.compiler.is_compiling():
            x2d = x2d.clone(memory_format=torch.contiguous_format)
        elif not x2d.is_contiguous() or x2d.data_ptr() % 64:
            x2d = x2d.contiguous() if not x2d.is_contiguous() else x2d.clone()
        channel_scale = scale.reshape(-1).to(x.dtype)
        rows = gemv.COMPILED_INT8_ROWS if torch.compiler.is_compiling() else gemv.NATIVE_INT8_ROWS
        if x2d.shape[0] == 1 and x2d.dtype == torch.bfloat16 and rows.get((out_features, in_features)):
            y = gemv.int8_row(x2d, runtime_weight, channel_scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2d, runtime_weight, channel_scale)
    elif kernel == Kernel.INT4PACK_MM_CPU:
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        sz = scale_zero if scale_zero.dtype == x.dtype else scale_zero.to(x.dtype)
        layer = (out_features, in_features, group_size)
        native_row = gemv.NATIVE_INT4_ROWS.get(layer, True)
        if torch.compiler.is_compiling():
            native_row = gemv.COMPILED_INT4_ROWS.get(layer, native_row)
        if int8_activations and _takes_int4_a8(x2d, sz, out_features, group_size):
            y = gemv.int4_a8_row(x2d, runtime_weight, sz, group_size, _CPU_INT4_BLOCKS)
        elif x2d.shape[0] == 1 and _takes_native_int4(x2d, sz, out_features) and native_row:
            y = gemv.int4_row(x2d, runtime_weight, sz, group_size)
        elif _NATIVE_INT4_AVX2 and _takes_int4_a8(x2d, sz, out_features, group_size, False) and native_row:
            y = gemv.int4_row(x2d, runtime_weight, sz, group_size, block_n=32)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, runtime_weight, group_size, sz)
    elif kernel == Kernel.INT4PACK_MM_CUDA:
        xb = x2d.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm(xb, runtime_weight, group_size, scale_zero).to(x.dtype)
    else:
        codes = packing.unpack_int4(runtime_weight) if fmt.bits == 4 else runtime_weight
        weight = rtn.dequantize_weight(codes, scale, zero_point, fmt.bits, fmt.symmetric, dtype=x.dtype)
        y = torch.nn.functional.linear(x2d, weight)
    return y.reshape(*shape[:-1], out_features)


# ---------------------------------------------------------------------------------------------------------------
# Many rows at once (prefill): dequantize a slice of output channels at a time and run the float GEMM.

GEMM_MIN_ROWS = {Kernel.INT8PACK_MM: 32, Kernel.INT4PACK_MM_CPU: 128}
"""Per CPU kernel, the activation rows from which its layers run as "dequantize a chunk, float GEMM" instead. The aten
int8/int4 kernels pay a cost per activation row several times the float GEMM's; the chunked path pays a fixed
dequantization of the weight (larger for int4 with torch ops: nibble unpacking and group scales on top of the pass to
the activation dtype), then the float GEMM's small cost per row. Each threshold sits above the crossover measured for
its kernel (docs/performance.md, "Prefill"). hfquant's C dequantization (`_takes_native_int4`) lowers int4's fixed
cost and so its crossover; the int4 threshold was not lowered for it."""
_CPU_INT4_BLOCKS: int | None = None
"""Rows per block of the CPU int4 layout when its full blocks are "halves" (`hfquant.core.packing`), set by
`prepare_weight`; a plain global so that torch.compile reads it as a constant."""
_NATIVE_INT4 = False
"""Whether single bfloat16 rows of `Kernel.INT4PACK_MM_CPU` layers run hfquant's own GEMV (`hfquant.ops.native`): set by
`prepare_weight` when the CPU layout has 64-row "halves" blocks and `gemv.native_int4_works()`; a plain global so that
torch.compile reads it as a constant."""
_NATIVE_INT4_AVX2 = False
"""Whether single bfloat16 rows of `Kernel.INT4PACK_MM_CPU` layers can run hfquant's AVX2 GEMV (`native.int4_gemv_avx2`,
`gemv.native_int4_avx2_works`): where PyTorch packs int4 in 32-row blocks; a layer shape runs it where it was timed
faster than aten's (`gemv.choose_int4_row_kernel`). A plain global, as `_NATIVE_INT4`."""
_NATIVE_INT4_A8 = False
"""Whether single bfloat16 rows of `Kernel.INT4PACK_MM_CPU` layers can run the W4A8 GEMV when a layer asks for int8
activations (`gemv.native_int4_a8_works`: AVX-512 CPUs and, with 32-row blocks, AVX2 ones), set with `_NATIVE_INT4`;
a plain global, as `_NATIVE_INT4`."""


def int8_decode_activations_available() -> bool:
    """Whether single bfloat16 rows of CPU int4 layers can run the W4A8 GEMV here (`gemv.native_int4_a8_works`; known
    once a CPU int4 layer has been prepared)."""
    return _NATIVE_INT4_A8


def _takes_int4_a8(
    x2d: torch.Tensor, scale_zero: torch.Tensor, out_features: int, group_size: int, a8: bool = True
) -> bool:
    """Whether this `Kernel.INT4PACK_MM_CPU` call has the shape hfquant's block-of-32 GEMVs take (the W4A8 one, and
    with `a8=False` the AVX2 one): one bfloat16 row, bfloat16 (scale, zero) pairs, whole blocks of the layout, groups
    of a multiple of 32; with `a8`, also that the W4A8 GEMV works here (`_NATIVE_INT4_A8`)."""
    return (
        (_NATIVE_INT4_A8 or not a8)
        and x2d.shape[0] == 1
        and x2d.dtype == torch.bfloat16
        and scale_zero.dtype == torch.bfloat16
        and out_features % _CPU_INT4_BLOCKS == 0
        and group_size % 32 == 0
    )


def _takes_native_int4(x2d: torch.Tensor, scale_zero: torch.Tensor, out_features: int) -> bool:
    """Whether hfquant's C kernels (`hfquant.ops.native`) serve this `Kernel.INT4PACK_MM_CPU` call: they are usable
    here, activations and (scale, zero) pairs are bfloat16, and the layer has whole 64-row blocks."""
    return (
        _NATIVE_INT4 and x2d.dtype == torch.bfloat16 and scale_zero.dtype == torch.bfloat16 and out_features % 64 == 0
    )


_GEMM_CHUNK_BYTES = 4 * 2**20
"""Dequantized weight per chunk: small enough that the allocator reuses it instead of mapping fresh pages."""


def _dequantized_gemm(
    kernel: Kernel,
    x2d: torch.Tensor,
    runtime_weight: torch.Tensor,
    scale: torch.Tensor,
    scale_zero: torch.Tensor | None,
    group_size: int,
    out_features: int,
) -> torch.Tensor | None:
    """y = x2d @ w_hat.T for (M, K) float `x2d` (M >= `GEMM_MIN_ROWS[kernel]`) from the kernel's runtime weight,
    chunk by chunk of output channels (`_GEMM_CHUNK_BYTES` of dequantized weight each): each chunk is dequantized to
    x's dtype and multiplied with `torch.mm` into its columns of y. Returns (M, N) in x's dtype, or None when the
    weight's layout has no chunked path (the caller then runs the kernel).

    int8 (per-channel, symmetric): y = (x @ q.T) * scale, the scale applied to the output (to the weight for float16
    activations, whose range x @ q.T could exceed). int4 (CPU kernel layout, "halves" blocks): w = q * scale +
    (zero - 8 * scale), the kernel's own formula, written straight into the (K, chunk) layout `torch.mm` reads: in one
    pass by hfquant's C kernel where `_NATIVE_INT4` holds (bfloat16 activations, N % 64 == 0, eager; several times
    faster than the torch ops, docs/performance.md), else by torch ops.
    """
    block = _CPU_INT4_BLOCKS
    if kernel == Kernel.INT4PACK_MM_CPU and (block is None or out_features % block or scale_zero is None):
        return None
    rows, in_features = x2d.shape
    # Eager writes each chunk in place (out=); torch.compile cannot trace out= into a strided view, so there the
    # chunks are concatenated instead (inductor fuses it).
    in_place = not torch.compiler.is_compiling()
    y = torch.empty((rows, out_features), dtype=x2d.dtype, device=x2d.device) if in_place else None
    pieces = []
    # a multiple of 64 rows: whole blocks of the int4 CPU layout (32 or 64 rows) in every chunk
    chunk = max(64, _GEMM_CHUNK_BYTES // (x2d.element_size() * in_features)) // 64 * 64
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()

    def product(weight_t: torch.Tensor, start: int, stop: int) -> None:
        if in_place:
            torch.mm(x2d, weight_t, out=y[:, start:stop])
        else:
            pieces.append(torch.mm(x2d, weight_t))

    def result() -> torch.Tensor:
        return y if in_place else torch.cat(pieces, dim=1)

    if kernel == Kernel.INT8PACK_MM:
        channel_scale = scale.reshape(-1).to(x2d.dtype)
        # float16 would overflow on x @ q.T (|q| up to 127) where x @ w_hat.T does not: scale the weight there
        scale_weight = x2d.dtype == torch.float16
        for start in range(0, out_features, chunk):
            stop = min(out_features, start + chunk)
            weight = runtime_weight[start:stop].to(x2d.dtype)
            if scale_weight:
                weight = weight * channel_scale[start:stop, None]
            product(weight.t(), start, stop)
        return result() if scale_weight else result() * channel_scale
    if in_place and _takes_native_int4(x2d, scale_zero, out_features):
        # one pass of hfquant's C dequantization per chunk, into one reused buffer
        buffer = torch.empty(in_features * min(chunk, out_features), dtype=torch.bfloat16, device=x2d.device)
        for start in range(0, out_features, chunk):
            stop = min(out_features, start + chunk)
            weight_t = buffer[: in_features * (stop - start)].view(in_features, stop - start)
            native.int4_dequantize_t(runtime_weight, scale_zero, group_size, start, stop, weight_t)
            product(weight_t, start, stop)
        return result()
    half, groups = block // 2, in_features // group_size
    step = scale_zero[..., 0].to(x2d.dtype).contiguous()  # (G, N): w = q * step + offset
    offset = (scale_zero[..., 1].float() - 8 * scale_zero[..., 0].float()).to(x2d.dtype).contiguous()
    for start in range(0, out_features, chunk):
        stop = min(out_features, start + chunk)
        blocks = (stop - start) // block
        # byte [block b, input k, j] holds row b*block + j (low nibble) and row b*block + half + j (high nibble)
        packed = runtime_weight[start:stop].reshape(blocks, groups, group_size, half).permute(1, 2, 0, 3)
        chunk_step = step[:, start:stop].reshape(groups, 1, blocks, block)
        chunk_offset = offset[:, start:stop].reshape(groups, 1, blocks, block)
        halves = ((packed & 0x0F, slice(0, half)), (packed >> 4, slice(half, block)))
        if in_place:
            weight_t = torch.empty((groups, group_size, blocks, block), dtype=x2d.dtype, device=x2d.device)
            for nibbles, cols in halves:
                torch.addcmul(
                    chunk_offset[..., cols], nibbles.to(x2d.dtype), chunk_step[..., cols], out=weight_t[..., cols]
                )
        else:
            weight_t = torch.cat(
                [
                    torch.addcmul(chunk_offset[..., cols], nibbles.to(x2d.dtype), chunk_step[..., cols])
                    for nibbles, cols in halves
                ],
                dim=-1,
            )
        product(weight_t.reshape(in_features, stop - start), start, stop)
    return result()


# ---------------------------------------------------------------------------------------------------------------
# Probes: a kernel is used only if it reproduces the dequantize reference on a small random layer.


def _probe(kernel: Kernel, device: str) -> bool:
    generator = torch.Generator().manual_seed(0)
    n, k = 64, 256
    # int8: symmetric per-channel, the only format its kernel runs; int4: group 64 with a zero point
    fmt = StoredFormat(8, k, True) if kernel == Kernel.INT8PACK_MM else StoredFormat(4, 64, False)
    weight = torch.randn((n, k), generator=generator)
    x = torch.randn((5, k), generator=generator).to(torch.bfloat16)
    q = rtn.quantize_weight(weight, fmt.bits, fmt.group_size, fmt.symmetric)
    stored = packing.pack_int4(q.q) if fmt.bits == 4 else q.q
    reference = quantized_matmul(
        Kernel.DEQUANT, x, stored, q.scale, q.zero_point, None, fmt, in_features=k, out_features=n
    ).float()
    source = q.q.to(device)
    runtime = prepare_weight(kernel, source, k)
    sz = scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16).to(device) if fmt.bits == 4 else None
    y = (
        quantized_matmul(
            kernel,
            x.to(device),
            runtime,
            q.scale.to(device),
            None if q.zero_point is None else q.zero_point.to(device),
            sz,
            fmt,
            in_features=k,
            out_features=n,
        )
        .float()
        .cpu()
    )
    close = torch.allclose(y, reference, rtol=0.02, atol=0.02 * reference.abs().max().item())
    if close and fmt.bits == 4:
        close = torch.equal(restore_codes(kernel, runtime, n, k).cpu(), q.q)
    return close


@functools.cache
def kernel_works(kernel: Kernel, device: str) -> bool:
    """True if `kernel` exists in this PyTorch build and matches the dequantize reference on `device`.

    The result is cached per (kernel, device). Failures are logged at INFO level and mean "use `Kernel.DEQUANT`".
    """
    kernel = Kernel(kernel)
    if kernel == Kernel.DEQUANT:
        return True
    if kernel == Kernel.INT4PACK_MM_CPU and packing.cpu_int4_layout() is None:
        return False
    try:
        works = _probe(kernel, device)
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        logger.info("kernel %s unavailable on %s: %s", kernel, device, error)
        return False
    if not works:
        logger.warning("kernel %s on %s disagrees with the reference; using dequantize-then-matmul", kernel, device)
    return works


@functools.cache
def _cuda_nibble_order_for(device: str) -> bool:
    """Whether `_convert_weight_to_int4pack` wants the even column in the high nibble (PyTorch >= 2.5 does)."""
    generator = torch.Generator().manual_seed(1)
    n, k = 64, 256
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    tiles = _cuda_inner_k_tiles(k)
    for even_high in (True, False):
        try:
            runtime = torch.ops.aten._convert_weight_to_int4pack(_pack_for_cuda(codes.to(device), even_high), tiles)
            if torch.equal(_unpack_cuda_by_identity(runtime, n, k).cpu(), codes):
                return even_high
        except RuntimeError:
            continue
    return True
