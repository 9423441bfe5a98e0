"""Which matmul runs a quantized layer, and the runtime tensors each kernel needs.

Kernels (`Kernel`: PyTorch's aten ops, and one of our own for single int4 rows):
  - `Kernel.INT8PACK_MM` ("int8pack_mm"): `torch.ops.aten._weight_int8pack_mm` (CPU, and CUDA builds that have it),
    int8 symmetric per-channel weights, activations bf16/fp16/fp32. A single bfloat16 row on CPU may run hfquant's
    int8 GEMV instead (`hfquant.ops.native`), where it works and, timed on the layer's shape on this CPU, is faster.
  - `Kernel.INT4PACK_MM_CPU` ("int4pack_mm_cpu"): `torch.ops.aten._weight_int4pack_mm_for_cpu`, 4-bit group-wise
    (group 32..256), weight repacked into the CPU layout (`hfquant.core.packing`), scale and zero folded into one
    (K/g, N, 2) tensor. On some CPUs the aten kernel is instruction-bound at one row, so
    a single bfloat16 row (batch-1 decode) of such a layer may run hfquant's own GEMV on the same bytes instead
    (`hfquant.ops.native`, built from `csrc/int4_cpu.c` on first use): where it builds and matches the aten kernel
    (`gemv.native_int4_works`) and, timed on the layer's shape on this CPU, is the faster of the two
    (`hfquant.ops.choice`); elsewhere the aten kernel serves every row.
  - `Kernel.INT4PACK_MM_CUDA` ("int4pack_mm_cuda"): `torch.ops.aten._weight_int4pack_mm` (tinygemm), bf16
    activations, weight repacked with `_convert_weight_to_int4pack`.
  - `Kernel.DEQUANT` ("dequant"): dequantize the weight to the activation dtype and call
    `torch.nn.functional.linear`. Covers every case and is the numerical reference in tests.

On CPU, a call with at least `GEMM_MIN_ROWS[kernel]` activation rows (a prompt's prefill) does not use the int8/int4
aten kernels, which are built for few rows and take several times the float GEMM's time there: it dequantizes
output-channel chunks of the runtime weight and runs the float GEMM (`_dequantized_gemm`), close to the bf16 layer's
time. Measured timings of every path: docs/performance.md.

Both int4 kernels compute w = (q - 8) * scale + zero with a float `zero`, so an integer zero point z becomes
zero = (8 - z) * scale (rounded to the activation dtype). `select_kernel()` picks the kernel; a kernel is only
chosen after a small probe on the device matched the dequantize reference (`kernel_works`), so a PyTorch build
without the op, or with a different layout, falls back to `Kernel.DEQUANT` instead of failing.

What runs a layer's products is one value, its `KernelPlan` (the kernel, the one-row GEMV in eager and in compiled
graphs and how it is called, the activation format, the CPU int4 block, from how many rows the chunked GEMM runs),
decided once per layer and device by `hfquant.ops.plan.plan_kernel` and stored on the layer; `quantized_matmul(plan,
tensors, x)` follows it without deciding anything.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import NamedTuple

import torch

from hfquant.config import DecodeActivations
from hfquant.core import blocks, huge_pages, packing, rtn
from hfquant.core.choice import Choice
from hfquant.core.format import StoredFormat
from hfquant.core.packing import scale_zero_for_int4
from hfquant.ops import block_layout, gemv, machine, native
from hfquant.ops.gemv import RowCall, RowKernel

__all__ = [
    "Kernel",
    "DecodeActivations",
    "KernelPlan",
    "LayerTensors",
    "plain_plan",
    "int8_decode_activations_available",
    "GEMM_MIN_ROWS",
    "NO_GEMM",
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


class Kernel(Choice):
    """The matmuls a quantized layer can run (see the module docstring). A `Choice`: each member equals its value
    ("int8pack_mm" == Kernel.INT8PACK_MM), and logs and module reprs show that plain value."""

    INT8PACK_MM = "int8pack_mm"
    INT4PACK_MM_CPU = "int4pack_mm_cpu"
    INT4PACK_MM_CUDA = "int4pack_mm_cuda"
    DEQUANT = "dequant"


INT4_KERNELS = (Kernel.INT4PACK_MM_CPU, Kernel.INT4PACK_MM_CUDA)
"""The kernels that read the weight repacked into their own layout from unpacked codes (`prepare_weight`), which
`restore_codes` undoes; the others read the stored layout."""

_INT4_KERNEL_GROUP_SIZES = (32, 64, 128, 256)


GEMM_MIN_ROWS = {Kernel.INT8PACK_MM: 32, Kernel.INT4PACK_MM_CPU: 128}
"""Per CPU kernel, the activation rows from which its layers run as "dequantize a chunk, float GEMM" instead. The aten
int8/int4 kernels pay a cost per activation row several times the float GEMM's; the chunked path pays a fixed
dequantization of the weight (larger for int4 with torch ops: nibble unpacking and group scales on top of the pass to
the activation dtype), then the float GEMM's small cost per row. Each threshold sits above the crossover measured for
its kernel (docs/performance.md, "Prefill"). hfquant's C dequantization (`KernelPlan.native_dequant`) lowers int4's
fixed cost and so its crossover; the int4 threshold was not lowered for it."""

NO_GEMM = 2**62
"""`KernelPlan.gemm_min_rows` of a layer without the chunked GEMM: more rows than any call has."""


@dataclasses.dataclass(frozen=True, slots=True)
class KernelPlan:
    """Everything that decides which kernel multiplies a layer's activations, decided once per layer and device
    (`hfquant.ops.plan.plan_kernel`; `plain_plan` for the kernel alone) and read by `quantized_matmul`.

    A frozen, hashable value of enums, ints and bools: a layer stores it (`QuantLinear.plan`) and torch.compile reads
    it as a constant, guarding only the fields a traced call reads.

    Attributes:
        kernel: the matmul of the layer (`Kernel`).
        bits, group_size, symmetric: the stored format of the weight (`StoredFormat`, method aside).
        in_features, out_features: K and N.
        activations: the decode activations the layer asked for (`DecodeActivations`); `row` says what runs.
        row: the kernel of one bfloat16 activation row in eager (`gemv.RowKernel`; `RowKernel.ATEN`: `kernel`).
        row_call: how eager calls `row` (`RowCall.OPERATOR` or `RowCall.CTYPES`).
        compiled_row, compiled_row_call: the same inside a torch.compile graph (`RowCall.OPERATOR` or
            `RowCall.CUSTOM_OP`); the GEMV stays only where it beats aten by more than the custom op's cost.
        cpu_int4_block: rows per block of PyTorch's CPU int4 layout when its full blocks are "halves" (32 or 64;
            `hfquant.core.packing`), else 0.
        gemm_min_rows: the activation rows from which the product runs as `_dequantized_gemm` (`GEMM_MIN_ROWS`;
            `NO_GEMM` where it does not apply).
        gemv_max_rows: the most bfloat16 activation rows an eager call without autograd runs as one `row` call per
            row (`hfquant.ops.plan.block_gemv_max_rows` for block formats with the block GEMV; 1: single rows only).
        native_dequant: whether that chunked GEMM dequantizes int4 chunks with hfquant's C kernel (eager, bfloat16).
        block: the block type of a block format (`StoredFormat.block`, e.g. "q4_k"), "" for the uniform formats.
        block_rows: the layout of a block format's runtime weight (`hfquant.ops.block_layout`): 1, its stored rows; 8,
            its rows interleaved by 8 for the R8 GEMV.
    """

    kernel: Kernel
    bits: int
    group_size: int
    symmetric: bool
    in_features: int
    out_features: int
    activations: DecodeActivations = DecodeActivations.FLOAT
    row: RowKernel = RowKernel.ATEN
    row_call: RowCall = RowCall.OPERATOR
    compiled_row: RowKernel = RowKernel.ATEN
    compiled_row_call: RowCall = RowCall.OPERATOR
    cpu_int4_block: int = 0
    gemm_min_rows: int = NO_GEMM
    gemv_max_rows: int = 1
    native_dequant: bool = False
    block: str = ""
    block_rows: int = 1
    key: str = dataclasses.field(init=False, repr=False, compare=False)
    """The plan as JSON (`from_key` reads it back): how the autograd custom op receives it."""

    def __post_init__(self) -> None:
        for name, enum_type in _PLAN_ENUMS.items():
            object.__setattr__(self, name, enum_type(getattr(self, name)))
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.init}
        object.__setattr__(self, "key", json.dumps(fields))

    @classmethod
    def from_key(cls, key: str) -> KernelPlan:
        """The plan whose `key` this is."""
        return cls(**json.loads(key))


_PLAN_ENUMS = {
    "kernel": Kernel,
    "activations": DecodeActivations,
    "row": RowKernel,
    "row_call": RowCall,
    "compiled_row": RowKernel,
    "compiled_row_call": RowCall,
}


class LayerTensors(NamedTuple):
    """A layer's tensors as `quantized_matmul` reads them.

    weight: the kernel's runtime weight (`prepare_weight`: the stored layout except for the `INT4_KERNELS`).
    scale: the stored (N, G) scales (the int8 kernel and `Kernel.DEQUANT` read them); None for a block format.
    zero_point: the stored (N, G) uint8 zero points, or None (symmetric; or not needed: the int4 kernels read
        `scale_zero`).
    scale_zero: the (G, N, 2) tensor of `scale_zero_for_int4` for the int4 kernels, else None.
    """

    weight: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None = None
    scale_zero: torch.Tensor | None = None


@functools.cache
def plain_plan(kernel: Kernel, fmt: StoredFormat, in_features: int, out_features: int, device_type: str) -> KernelPlan:
    """The plan of `kernel` for a layer of this format and shape on a `device_type` ("cpu", "cuda") device, without
    hfquant's one-row GEMVs (`hfquant.ops.plan.plan_kernel` adds them): every row runs `kernel`, and on CPU many rows
    the chunked GEMM where the kernel's layout has one. Cached per process."""
    kernel = Kernel(kernel)
    block = 0
    if kernel == Kernel.INT4PACK_MM_CPU:
        layout = packing.cpu_int4_layout()
        block = layout.block_n if layout is not None and layout.full_blocks_halves else 0
    gemm_min_rows = NO_GEMM
    if (
        device_type == "cpu"
        and kernel in GEMM_MIN_ROWS
        and (kernel != Kernel.INT4PACK_MM_CPU or _whole_blocks(block, out_features))
    ):
        gemm_min_rows = GEMM_MIN_ROWS[kernel]
    return KernelPlan(
        kernel,
        fmt.bits,
        fmt.group_size,
        fmt.symmetric,
        in_features,
        out_features,
        cpu_int4_block=block,
        gemm_min_rows=gemm_min_rows,
        block=fmt.block or "",
    )


def _whole_blocks(block: int, out_features: int) -> bool:
    return block > 0 and out_features % block == 0


def int8_decode_activations_available() -> bool:
    """Whether single bfloat16 rows of CPU int4 layers can run the W4A8 GEMV here: PyTorch's CPU int4 layout has
    "halves" blocks and the GEMV works on it (`gemv.native_int4_a8_works`)."""
    layout = packing.cpu_int4_layout()
    return layout is not None and layout.full_blocks_halves and gemv.native_int4_a8_works()


def _cuda_inner_k_tiles(in_features: int) -> int | None:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


def _shape_fits(kernel: Kernel, fmt: StoredFormat, in_features: int, out_features: int) -> bool:
    if fmt.block is not None:
        return kernel == Kernel.DEQUANT
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


def prepare_packed_int4(
    kernel: Kernel, packed: torch.Tensor, in_features: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`prepare_weight` for an int4 kernel from the stored (N, K // 2) packed weight: one native pass into the CPU
    layout where hfquant's kernels work (`gemv.native_int4_works`, N % 64 == 0), else through unpacked codes.

    `out` (`Kernel.INT4PACK_MM_CPU` only): a contiguous (N, K // 2) uint8 CPU tensor apart from `packed` that the
    runtime weight is written into and returned as, e.g. a layer's rows of a fused decode group's tensor
    (`hfquant.nn.fused`): the native pass writes there directly, the other path copies its result there. `out` may
    also be `packed` itself: repacked in place (`native.int4_repack`; the other path copies its result back).

    Raises:
        ValueError: `out` given for another kernel.
        RuntimeError: `out` is not as above.
    """
    if out is not None and kernel != Kernel.INT4PACK_MM_CPU:
        raise ValueError(f"out= is for the {Kernel.INT4PACK_MM_CPU} kernel's weight, not {kernel}'s")
    if kernel == Kernel.INT4PACK_MM_CPU and packed.device.type == "cpu" and packed.shape[0] % 64 == 0:
        if gemv.native_int4_works():
            return native.int4_repack(packed, to_cpu_layout=True, out=out)
    weight = prepare_weight(kernel, packing.unpack_int4(packed), in_features)
    if out is None:
        return weight
    if out.shape != weight.shape or out.dtype != weight.dtype or not out.is_contiguous():
        raise RuntimeError(
            f"prepare_packed_int4's out must be a contiguous {tuple(weight.shape)} {weight.dtype} tensor, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    return out.copy_(weight)


def stored_int4(kernel: Kernel, runtime_weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `prepare_packed_int4`: the runtime weight of an int4 kernel -> the stored (N, K // 2) layout."""
    if (
        kernel == Kernel.INT4PACK_MM_CPU
        and runtime_weight.device.type == "cpu"
        and out_features % 64 == 0
        and gemv.native_int4_works()
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
        return packing.to_cpu_int4_layout(codes_or_weight)
    if kernel == Kernel.INT4PACK_MM_CUDA:
        tiles = _cuda_inner_k_tiles(in_features)
        nibbles = _cuda_nibble_order_for(str(codes_or_weight.device))
        packed = _pack_for_cuda(codes_or_weight, nibbles)
        return torch.ops.aten._convert_weight_to_int4pack(packed, tiles)
    # aten kernels read with unaligned loads, but a tensor viewing a memory-mapped file at an odd offset is
    # copied into our own allocation so the layer never depends on the file staying mapped.
    if codes_or_weight.data_ptr() % 64 or not codes_or_weight.is_contiguous():
        copy = huge_pages.empty(tuple(codes_or_weight.shape), codes_or_weight.dtype, codes_or_weight.device)
        return copy.copy_(codes_or_weight)  # on huge pages where large: a decode step streams it
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


def quantized_matmul(plan: KernelPlan, tensors: LayerTensors, x: torch.Tensor) -> torch.Tensor:
    """y = x @ w_hat.T for x (..., K) float; returns (..., N) in x's dtype, computed as `plan` says.

    One bfloat16 row runs the plan's one-row kernel (`plan.row`, `plan.compiled_row` in a torch.compile graph; W4A8
    where the layer asked for int8 decode activations and it works here), and in eager up to `plan.gemv_max_rows`
    bfloat16 rows that kernel once per row (`_row_by_row`); from `plan.gemm_min_rows` rows the chunked
    dequantized GEMM (`_dequantized_gemm`); every other call `plan.kernel`'s aten op (`Kernel.DEQUANT`: dequantize,
    then `F.linear`). `tensors` are the layer's (`LayerTensors`).
    """
    shape = x.shape
    flat = len(shape) == 2  # (M, K) already: no reshape either way (each costs about 1 us in eager)
    x2d = x if flat else x.reshape(-1, shape[-1])
    if x2d.shape[0] == 1 and x2d.dtype == torch.bfloat16:
        if torch.compiler.is_compiling():
            row, call = plan.compiled_row, plan.compiled_row_call
        else:
            row, call = plan.row, plan.row_call
        if row is not RowKernel.ATEN:
            y = gemv.row_product(row, call, x2d, tensors, plan)
            return y if flat else y.reshape(*shape[:-1], -1)  # (1, N), N > 0
    if 1 < x2d.shape[0] <= plan.gemv_max_rows and x2d.dtype == torch.bfloat16 and not torch.compiler.is_compiling():
        y = _row_by_row(plan, tensors, x2d)
    elif x2d.shape[0] >= plan.gemm_min_rows:
        y = _dequantized_gemm(plan, tensors, x2d)
    else:
        y = _kernel_product(plan, tensors, x2d)
    return y if flat else y.reshape(*shape[:-1], y.shape[-1])


def _row_by_row(plan: KernelPlan, tensors: LayerTensors, x2d: torch.Tensor) -> torch.Tensor:
    """(M, K) bfloat16 x2d @ w_hat.T as M calls of the plan's one-row kernel (`plan.row`): (M, N) bfloat16, each row
    the bytes a one-row call on it gives."""
    row, call = plan.row, plan.row_call
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    return torch.cat([gemv.row_product(row, call, x2d[i : i + 1], tensors, plan) for i in range(x2d.shape[0])])


def _kernel_product(plan: KernelPlan, tensors: LayerTensors, x2d: torch.Tensor) -> torch.Tensor:
    """(M, K) float x2d @ w_hat.T by `plan.kernel`'s own op; (M, N) in x2d's dtype."""
    kernel = plan.kernel
    if kernel is Kernel.INT4PACK_MM_CPU:
        if not x2d.is_contiguous():
            x2d = x2d.contiguous()
        scale_zero = tensors.scale_zero
        if scale_zero.dtype != x2d.dtype:
            scale_zero = scale_zero.to(x2d.dtype)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, tensors.weight, plan.group_size, scale_zero)
    if kernel is Kernel.INT8PACK_MM:
        # The aten kernel needs the activation rows 32-byte aligned (it crashes otherwise); a view at an odd
        # offset is copied into a fresh (64-byte aligned) allocation.
        # Under torch.compile the pointer is unknown at trace time: always hand the kernel a fresh copy there.
        if torch.compiler.is_compiling():
            x2d = x2d.clone(memory_format=torch.contiguous_format)
        elif not x2d.is_contiguous() or x2d.data_ptr() % 64:
            x2d = x2d.contiguous() if not x2d.is_contiguous() else x2d.clone()
        channel_scale = tensors.scale.reshape(-1)
        if channel_scale.dtype != x2d.dtype:  # (a no-op .to() costs more than this test)
            channel_scale = channel_scale.to(x2d.dtype)
        return torch.ops.aten._weight_int8pack_mm(x2d, tensors.weight, channel_scale)
    if kernel is Kernel.INT4PACK_MM_CUDA:
        xb = x2d.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm(xb, tensors.weight, plan.group_size, tensors.scale_zero)
        return y.to(x2d.dtype)
    if plan.block:
        return _block_product(plan, tensors.weight, x2d)
    bits, symmetric = plan.bits, plan.symmetric
    codes = packing.unpack_int4(tensors.weight) if bits == 4 else tensors.weight
    # dequantized straight into the GEMM's dtype: inductor would skip a rounding to x's dtype before an upcast
    gemm_dtype = machine.gemm_dtype(x2d.dtype, x2d.device)
    weight = rtn.dequantize_weight(codes, tensors.scale, tensors.zero_point, bits, symmetric, dtype=gemm_dtype)
    return torch.nn.functional.linear(x2d.to(gemm_dtype), weight).to(x2d.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Many rows at once (prefill): dequantize a slice of output channels at a time and run the float GEMM.

_GEMM_CHUNK_BYTES = 4 * 2**20
"""Dequantized weight per chunk: small enough that the allocator reuses it instead of mapping fresh pages."""


def _dequantized_gemm(plan: KernelPlan, tensors: LayerTensors, x2d: torch.Tensor) -> torch.Tensor:
    """y = x2d @ w_hat.T for (M, K) float `x2d` (M >= `plan.gemm_min_rows`) from the kernel's runtime weight, chunk
    by chunk of output channels (`_GEMM_CHUNK_BYTES` of dequantized weight each, a multiple of 64 rows: whole blocks
    of the int4 CPU layout): each chunk is dequantized to x's dtype and multiplied with `torch.mm` into its columns of
    y. Returns (M, N) in x's dtype.

    int8 (per-channel, symmetric): `_int8_chunks`. int4 (CPU kernel layout, "halves" blocks): w = q * scale +
    (zero - 8 * scale), the kernel's own formula, written straight into the (K, chunk) layout `torch.mm` reads: in one
    pass by hfquant's C kernel where `plan.native_dequant` holds (bfloat16 activations and (scale, zero) pairs, eager;
    several times faster than the torch ops, docs/performance.md, `_int4_chunks_in_c`), else by torch ops
    (`_int4_chunks`).
    """
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    columns = _Columns(x2d, tensors.weight.shape[0])
    chunk = max(64, _GEMM_CHUNK_BYTES // (x2d.element_size() * x2d.shape[1])) // 64 * 64
    if plan.kernel is Kernel.INT8PACK_MM:
        return _int8_chunks(columns, tensors, chunk)
    scale_zero = tensors.scale_zero
    # in_place first: a compiled graph then reads no more of the plan than it uses (each field read is a guard)
    if columns.in_place and plan.native_dequant and x2d.dtype == torch.bfloat16 and scale_zero.dtype == torch.bfloat16:
        return _int4_chunks_in_c(columns, tensors.weight, scale_zero, plan.group_size, chunk)
    return _int4_chunks(columns, plan, tensors, chunk)


def _block_product(plan: KernelPlan, weight: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """y = x2d @ w_hat.T for a block format: `blocks.dequantize` of a chunk of output rows at a time (about
    `_GEMM_CHUNK_BYTES` of float32 weight each), multiplied in `machine.gemm_dtype` of x's dtype. Returns (M, N) in
    x's dtype. In eager with bfloat16 activations the chunks are dequantized by hfquant's C kernel
    (`native.block_dequantize_t`: the same weights in one pass, straight into the (K, chunk) layout `torch.mm` reads,
    in the GEMM's dtype) where the library loads."""
    if not x2d.is_contiguous():
        x2d = x2d.contiguous()
    columns = _Columns(x2d, plan.out_features)
    if columns.in_place and x2d.dtype == torch.bfloat16 and x2d.device.type == "cpu" and native.built_library():
        k, ggml_type = plan.in_features, block_layout.kernel_type(plan.block, plan.block_rows)
        chunk = max(1, _GEMM_CHUNK_BYTES // (2 * k))
        # straight to float32 where the GEMM runs in it (`_Columns.gemm_dtype`): no second pass over the chunk
        buffer = torch.empty((k * min(chunk, plan.out_features),), dtype=columns.gemm_dtype)
        for start in range(0, plan.out_features, chunk):
            stop = min(plan.out_features, start + chunk)
            weight_t = buffer[: k * (stop - start)].view(k, stop - start)
            columns.add(native.block_dequantize_t(weight, k, ggml_type, start, stop, weight_t), start, stop)
        return columns.result()
    chunk = max(1, _GEMM_CHUNK_BYTES // (4 * plan.in_features))
    for start in range(0, plan.out_features, chunk):
        stop = min(plan.out_features, start + chunk)
        rows = block_layout.storage_rows(weight, plan.in_features, plan.block, plan.block_rows, start, stop)
        columns.add(blocks.dequantize(plan.block, rows).to(x2d.dtype).t(), start, stop)
    return columns.result()


class _Columns:
    """y (M, N) = x2d @ (weight chunks), filled chunk by chunk of output columns: in eager each chunk's product is
    written in place (out=); torch.compile cannot trace out= into a strided view, so there the chunks are concatenated
    instead (inductor fuses it). The chunks come in x2d's dtype; the products run in `machine.gemm_dtype` of it
    (float32 for bfloat16 on a CPU without oneDNN's bfloat16 GEMM) and y is returned in x2d's dtype."""

    def __init__(self, x2d: torch.Tensor, out_features: int):
        self.x2d = x2d
        self.out_features = out_features
        self.gemm_dtype = machine.gemm_dtype(x2d.dtype, x2d.device)
        self.x_gemm = x2d.to(self.gemm_dtype)
        self.in_place = not torch.compiler.is_compiling()
        self.y = (
            torch.empty((x2d.shape[0], out_features), dtype=self.gemm_dtype, device=x2d.device)
            if self.in_place
            else None
        )
        self.pieces = []

    def add(self, weight_t: torch.Tensor, start: int, stop: int) -> None:
        """Columns [start, stop) of y = x2d @ weight_t, weight_t (K, stop - start)."""
        weight_t = weight_t.to(self.gemm_dtype)
        if self.in_place:
            torch.mm(self.x_gemm, weight_t, out=self.y[:, start:stop])
        else:
            self.pieces.append(torch.mm(self.x_gemm, weight_t))

    def result(self) -> torch.Tensor:
        y = self.y if self.in_place else torch.cat(self.pieces, dim=1)
        return y.to(self.x2d.dtype)


def _int8_chunks(columns: _Columns, tensors: LayerTensors, chunk: int) -> torch.Tensor:
    """`_dequantized_gemm` of an int8 per-channel weight: y = (x @ q.T) * scale, the scale applied to the output (to
    the weight for float16 activations, whose range x @ q.T could exceed: |q| up to 127)."""
    dtype, out_features = columns.x2d.dtype, columns.out_features
    channel_scale = tensors.scale.reshape(-1).to(dtype)
    scale_weight = dtype == torch.float16
    for start in range(0, out_features, chunk):
        stop = min(out_features, start + chunk)
        weight = tensors.weight[start:stop].to(dtype)
        if scale_weight:
            weight = weight * channel_scale[start:stop, None]
        columns.add(weight.t(), start, stop)
    return columns.result() if scale_weight else columns.result() * channel_scale


def _int4_chunks_in_c(
    columns: _Columns, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, chunk: int
) -> torch.Tensor:
    """`_dequantized_gemm` of a CPU int4 layer, each chunk dequantized by one pass of hfquant's C kernel
    (`native.int4_dequantize_t`) into one reused bfloat16 buffer."""
    x2d, out_features = columns.x2d, columns.out_features
    in_features = x2d.shape[1]
    buffer = torch.empty(in_features * min(chunk, out_features), dtype=torch.bfloat16, device=x2d.device)
    for start in range(0, out_features, chunk):
        stop = min(out_features, start + chunk)
        weight_t = buffer[: in_features * (stop - start)].view(in_features, stop - start)
        native.int4_dequantize_t(weight, scale_zero, group_size, start, stop, weight_t)
        columns.add(weight_t, start, stop)
    return columns.result()


def _int4_chunks(columns: _Columns, plan: KernelPlan, tensors: LayerTensors, chunk: int) -> torch.Tensor:
    """`_dequantized_gemm` of a CPU int4 layer by torch ops: w = q * step + offset, step = scale and offset = zero -
    8 * scale per (group, output), written into the (K, chunk) layout `torch.mm` reads."""
    x2d, out_features = columns.x2d, columns.out_features
    dtype, in_features = x2d.dtype, x2d.shape[1]
    block, group_size = plan.cpu_int4_block, plan.group_size
    half, groups = block // 2, in_features // group_size
    scale_zero = tensors.scale_zero
    step = scale_zero[..., 0].to(dtype).contiguous()  # (G, N): w = q * step + offset
    offset = (scale_zero[..., 1].float() - 8 * scale_zero[..., 0].float()).to(dtype).contiguous()
    for start in range(0, out_features, chunk):
        stop = min(out_features, start + chunk)
        blocks = (stop - start) // block
        # byte [block b, input k, j] holds row b*block + j (low nibble) and row b*block + half + j (high nibble)
        packed = tensors.weight[start:stop].reshape(blocks, groups, group_size, half).permute(1, 2, 0, 3)
        chunk_step = step[:, start:stop].reshape(groups, 1, blocks, block)
        chunk_offset = offset[:, start:stop].reshape(groups, 1, blocks, block)
        halves = ((packed & 0x0F, slice(0, half)), (packed >> 4, slice(half, block)))
        if columns.in_place:
            weight_t = torch.empty((groups, group_size, blocks, block), dtype=dtype, device=x2d.device)
            for nibbles, cols in halves:
                torch.addcmul(
                    chunk_offset[..., cols], nibbles.to(dtype), chunk_step[..., cols], out=weight_t[..., cols]
                )
        else:
            weight_t = torch.cat(
                [
                    torch.addcmul(chunk_offset[..., cols], nibbles.to(dtype), chunk_step[..., cols])
                    for nibbles, cols in halves
                ],
                dim=-1,
            )
        columns.add(weight_t.reshape(in_features, stop - start), start, stop)
    return columns.result()


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
    reference_plan = plain_plan(Kernel.DEQUANT, fmt, k, n, "cpu")
    reference = quantized_matmul(reference_plan, LayerTensors(stored, q.scale, q.zero_point), x).float()
    source = q.q.to(device)
    runtime = prepare_weight(kernel, source, k)
    sz = scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16).to(device) if fmt.bits == 4 else None
    zero_point = None if q.zero_point is None else q.zero_point.to(device)
    tensors = LayerTensors(runtime, q.scale.to(device), zero_point, sz)
    plan = plain_plan(kernel, fmt, k, n, torch.device(device).type)
    y = quantized_matmul(plan, tensors, x.to(device)).float().cpu()
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
