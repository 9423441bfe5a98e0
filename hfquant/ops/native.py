"""hfquant's own C kernels, called through ctypes: the single-row int4 GEMVs (`csrc/int4_cpu.c`, and by integer dot
products `csrc/int4_intdot_cpu.c`), the int8 GEMV (`csrc/int8_cpu.c`), the bfloat16 GEMV (`csrc/bf16_cpu.c`), the int4
dequantization that feeds the prefill GEMM, the int4 repacking (`csrc/int4_cpu.c`) and the round-to-nearest quantizer
(`csrc/rtn_cpu.c`). Their prototypes: `csrc/hfquant_kernels.h`.

Why our own: for one activation row (batch-1 decode) PyTorch's `_weight_int4pack_mm_for_cpu` is limited by its
instruction count, not by memory: it reads an int4 weight well below the memory bandwidth. `csrc/int4_cpu.c` reads
the same bytes (the aten CPU layout, so nothing is repacked) with a few shuffles and bit operations per pair of
inputs and AVX512-BF16 dot products, closer to memory speed; several rows still go to the aten kernel. For prefill (`kernels._dequantized_gemm`)
the same file turns a slice of output channels into the (K, slice) bfloat16 operand of `torch.mm` in one pass, where
the torch ops took six. `csrc/rtn_cpu.c` quantizes a weight in one pass where `hfquant.core.rtn` takes about six
torch passes and a float32 copy, with the same bytes out (it bounds quantize-on-load). Measured speeds:
docs/performance.md.

The library is built on first use, cached and trust-checked by `hfquant.ops.native_build`; this module loads it with
ctypes, declares the C signatures and calls the kernels with raw pointers. OpenMP resolves to the libgomp torch
already loaded, so `torch.set_num_threads` applies.

Not available (None, logged once at INFO level) when: `HFQUANT_NATIVE` is 0/false/no/off, the machine is not x86-64
with AVX512-F/BW/VL and AVX512-BF16 (or `HFQUANT_ISA` lowers the instruction sets below them: `isa`), no compiler
works, or the build fails. hfquant then uses the aten kernel alone.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import subprocess

import torch

from hfquant.core import blocks, rtn
from hfquant.core.blocks import hq3, hq3r, iq4, legacy
from hfquant.core.blocks.importance import default_importance
from hfquant.ops import native_build

__all__ = [
    "built_library",
    "ISA_NAMES",
    "isa",
    "block_codes",
    "int4_cpu_library",
    "int4_gemv",
    "int4_gemv_a8",
    "int4_a8_supported",
    "int4_gemv_avx2",
    "int4_dequantize_t",
    "int8_gemv",
    "int8_gemv_supported",
    "int4_repack",
    "rtn_quantize",
    "sinq_balance",
    "bf16_gemv",
    "block_gemv",
    "block_gemv_supported",
    "block_gemv_group",
    "block_dequantize_t",
    "BLOCK_ROWS8",
    "BLOCK_ROWS16",
    "block_interleave",
    "block_rows8_supported",
    "block_rows16_supported",
    "layout_code",
    "KQUANT_TYPES",
    "kquant_quantize",
    "BLOCK_QUANTIZE_TYPES",
    "block_quantize",
    "bf16_f32_gemv",
    "fold_chunk",
    "iq4_quantize_fold",
]

logger = logging.getLogger(__name__)

_ABI = 7
"""`HFQUANT_INT4_CPU_ABI` of `csrc/int4_cpu.c`: a library built from other signatures is not called."""

ISA_NAMES = {1: "avx2", 2: "avx512", 4: "avx512_bf16", 8: "avx512_vnni", 16: "avx512_vbmi_gfni"}
"""The bits of `csrc/isa_cpu.c`'s hfquant_isa() (HFQUANT_ISA_* in `csrc/hfquant_kernels.h`) and their names: AVX2
(with FMA and F16C), AVX512-F/BW/VL, AVX512-BF16, AVX512-VNNI, AVX512-VBMI with AVX512-BITALG and GFNI
(HQ3_R's GEMV step on AVX512-VNNI CPUs)."""
_ISA_REFUSED = 1 << 30
_ISA_VALUES = ("native", "avx512vnni", "avx512", "avx2", "generic")
"""Values of `HFQUANT_ISA` (unset: native), the instruction sets the kernels may use (`csrc/isa_cpu.c`)."""

_POINTER, _INT, _INT64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "hfquant_int4_gemv": [_POINTER] * 4 + [_INT64] * 3,
    "hfquant_int4_gemv_a8": [_POINTER] * 4 + [_INT64] * 4,
    "hfquant_int4_gemv_avx2": [_POINTER] * 4 + [_INT64] * 3,
    "hfquant_int4_a8_supported": [_INT64],
    "hfquant_int4_dequantize_t": [_POINTER] * 3 + [_INT64] * 5,
    "hfquant_int8_gemv": [_POINTER] * 4 + [_INT64] * 2,
    "hfquant_bf16_gemv": [_POINTER] * 4 + [_INT64] * 2,
    "hfquant_bf16_f32_gemv": [_POINTER] * 3 + [_INT64] * 2,
    "hfquant_fold_chunk": [_POINTER, _INT64, _INT64, _INT64, _POINTER, _POINTER, _POINTER],
    "hfquant_fold_span": [_POINTER] + [_INT64] * 4 + [_POINTER] * 3,  # called by iq4_search_cpu.c
    "hfquant_rtn_quantize": [_POINTER, _INT] + [_INT64] * 3 + [_INT] * 2 + [_POINTER] * 3 + [_INT64],
    "hfquant_int4_to_cpu_layout": [_POINTER] * 2 + [_INT64] * 2,
    "hfquant_block_gemv": [_POINTER] * 3 + [_INT64] * 3,
    "hfquant_block_gemv_group": [_POINTER] * 5 + [_INT64] * 2,
    "hfquant_block_gemv_supported": [_INT64],
    "hfquant_block_dequantize_t": [_POINTER] * 2 + [_INT64] * 6,
    "hfquant_block_interleave": [_POINTER] * 2 + [_INT64] * 4,
    "hfquant_int4_from_cpu_layout": [_POINTER] * 2 + [_INT64] * 2,
    "hfquant_kquant_quantize": [_POINTER] * 2 + [_INT64] * 2 + [_INT, _POINTER],
    "hfquant_block_quantize": [_POINTER] * 2 + [_INT64] * 2 + [_INT, _POINTER, _INT64, _POINTER, _INT64, _POINTER],
    "hfquant_iq4_quantize": [_POINTER] * 2
    + [_INT64] * 2
    + [_INT, _POINTER, _INT64, _POINTER, _INT64, _INT64]
    + [ctypes.c_float]
    + [_INT64] * 2
    + [ctypes.c_float] * 2
    + [_INT64, _INT64, _POINTER],
    "hfquant_iq4_quantize_fold": [_POINTER, _INT64, _INT64, _INT64]
    + [_POINTER] * 3
    + [_INT64, _INT, _POINTER, _INT64, _POINTER, _INT64, _INT64]
    + [ctypes.c_float]
    + [_INT64] * 2
    + [ctypes.c_float] * 2
    + [_INT64, _INT64, _POINTER],
    "hfquant_hq3_quantize": [_POINTER] * 2 + [_INT64] * 2 + [_POINTER, _INT64, _POINTER],
    "hfquant_hq3_nl_quantize": [_POINTER] * 2 + [_INT64] * 2 + [_POINTER, _INT64, _POINTER],
    "hfquant_hq3_r_quantize": [_POINTER] * 2 + [_INT64] * 3 + [_POINTER, _INT64, _POINTER, _POINTER],
    "hfquant_rtn_quantize_scaled": [_POINTER, _INT] + [_INT64] * 3 + [_INT] * 2 + [_POINTER] * 5 + [_INT64],
    "hfquant_sinq_balance": [_POINTER] * 3 + [_INT64, _INT] + [_INT64] * 4 + [_POINTER],
    "hfquant_rms_norm_row": [_POINTER] * 3 + [_INT64, ctypes.c_float],  # called as torch.ops.hfquant_cpu.rms_norm_row
    "hfquant_attention_row": [_POINTER, _INT64, _POINTER, _POINTER, _INT64, _INT64, _POINTER]
    + [_INT64] * 4
    + [ctypes.c_float],  # called as torch.ops.hfquant_cpu.attention_row
    "hfquant_rotary_row": [_POINTER] * 6 + [_INT64] * 3,  # called as torch.ops.hfquant_cpu.rotary_row
    "hfquant_silu_mul_row": [_POINTER] * 3 + [_INT64],  # called as torch.ops.hfquant_cpu.silu_mul_row
    "hfquant_add_rms_norm_row": [_POINTER] * 5 + [_INT64, ctypes.c_float],  # torch.ops.hfquant_cpu.add_rms_norm_row
}
"""Argument types of the exported functions (`csrc/hfquant_kernels.h`, pointers as void *); each returns int."""


@functools.cache
def built_library() -> ctypes.CDLL | None:
    """The kernel library loaded on any x86-64 CPU (each kernel checks the instructions it needs: `int4_cpu_library`
    for the AVX-512 ones, `int4_a8_supported` for the W4A8 GEMV), or None: native kernels off, no C compiler, a failed
    build or a stale ABI (the reason logged at INFO level).

    Raises:
        ValueError: `HFQUANT_NATIVE` holds a value `native_build.native_enabled` does not understand, or `HFQUANT_ISA`
            one the library does not (`isa`).
    """
    if not native_build.native_enabled():
        logger.info("hfquant native int4 kernels off: HFQUANT_NATIVE=%s", os.environ.get("HFQUANT_NATIVE"))
        return None
    compiler = native_build.c_compiler()
    if compiler is None:
        logger.info("hfquant native int4 kernels unavailable: no C compiler ($CC or cc); using the aten kernel")
        return None
    try:
        library = ctypes.CDLL(str(native_build.build_c_library(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.info("hfquant native int4 kernels unavailable: build failed (%s); using the aten kernel", detail)
        return None
    if library.hfquant_int4_cpu_abi() != _ABI:
        logger.info("hfquant native int4 kernels unavailable: the library's ABI is not %d", _ABI)
        return None
    _check_isa(library)
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = argtypes
    return library


def _check_isa(library: ctypes.CDLL) -> None:
    """Raises ValueError when the library did not understand `HFQUANT_ISA` (csrc/isa_cpu.c), naming the value."""
    if library.hfquant_isa() & _ISA_REFUSED:
        raise ValueError(
            f"HFQUANT_ISA={os.environ.get('HFQUANT_ISA')!r} is not understood; use one of {list(_ISA_VALUES)} (the "
            "instruction sets hfquant's kernels may use), or leave it unset for all this CPU has"
        )


def isa() -> tuple[str, ...]:
    """The instruction sets hfquant's kernels may use in this process (`ISA_NAMES`, e.g. ("avx2", "avx512",
    "avx512_bf16", "avx512_vnni", "avx512_vbmi_gfni") on a Zen 4 or 5): what the CPU has, lowered by the environment
    variable `HFQUANT_ISA` when the library loads ("avx2": as on a CPU without AVX-512, the block and W4A8 GEMVs and
    the IQ4 search take their AVX2 bodies and `int4_cpu_library()` is None; "avx512": without VNNI; "avx512vnni":
    without VBMI and GFNI, as Cascade Lake; "generic": none), so tests run every body of a kernel on one machine
    (`csrc/isa_cpu.c`). Empty where the library is unavailable.

    Raises:
        ValueError: as `built_library` (an `HFQUANT_ISA` value not understood).
    """
    library = built_library()
    bits = library.hfquant_isa() if library is not None else 0
    return tuple(name for bit, name in ISA_NAMES.items() if bits & bit)


@functools.cache
def int4_cpu_library() -> ctypes.CDLL | None:
    """The loaded kernel library where its AVX-512 kernels run (AVX512-BF16: the int4 GEMV, the int4
    dequantization, the repacking), or None (the reason logged at INFO level)."""
    library = built_library()
    if library is not None and not library.hfquant_int4_cpu_supported():
        logger.info(
            "hfquant native int4 kernels unavailable: this CPU lacks AVX512-BF16 (or HFQUANT_ISA=%s); using the aten "
            "kernel",
            os.environ.get("HFQUANT_ISA"),
        )
        return None
    return library


def _loaded_library(any_x86: bool = False) -> ctypes.CDLL:
    """`int4_cpu_library()` (the AVX512-BF16 kernels), or with `any_x86` the built library on any x86-64 CPU (the AVX2
    and W4A8 entry points check their own instructions). Raises RuntimeError where it is unavailable."""
    library = built_library() if any_x86 else int4_cpu_library()
    if library is None:
        kind = "kernels" if any_x86 else "int4 kernels"
        raise RuntimeError(f"hfquant's native {kind} are unavailable on this machine")
    return library


def int4_gemv(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """y = x @ w.T for one bfloat16 row, w = (q - 8) * scale + zero from the aten CPU int4 layout.

    Args:
        x: (K,) or (1, K) contiguous bfloat16 (CPU).
        weight: (N, K // 2) uint8 in the 64-row "halves" layout of `_weight_int4pack_mm_for_cpu`; N % 64 == 0.
        scale_zero: (K // group_size, N, 2) contiguous bfloat16 from `kernels.scale_zero_for_int4`.
        group_size: inputs per scale, even, dividing K.
    Returns:
        (1, N) bfloat16; each output summed in float32 and rounded once.
    Raises:
        RuntimeError: the library is unavailable or refused the shapes (callers check `int4_cpu_library()` and the
            shapes first).
    """
    library = _loaded_library()
    out_features = weight.shape[0]
    y = torch.empty((1, out_features), dtype=torch.bfloat16)
    status = library.hfquant_int4_gemv(
        x.data_ptr(), weight.data_ptr(), scale_zero.data_ptr(), y.data_ptr(), out_features, x.shape[-1], group_size
    )
    if status:
        raise RuntimeError(
            f"hfquant native int4 GEMV refused N={out_features}, K={x.shape[-1]}, group_size={group_size} "
            "(needs N % 64 == 0, an even group size dividing K)"
        )
    return y


def int4_gemv_avx2(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """`int4_gemv` for CPUs without AVX-512: PyTorch's 32-row int4 layout (N / 32, K, 16), AVX2 + FMA; x enters as int16
    per block of 32 inputs (`csrc/int4_intdot_cpu.c`), which keeps bfloat16 accuracy (each input's rounding at most
    max|x_block| / 65534).

    Args:
        x: (K,) or (1, K) contiguous bfloat16 (CPU).
        weight: (N, K // 2) uint8 in the 32-row layout; N % 32 == 0.
        scale_zero: (K // group_size, N, 2) contiguous bfloat16.
        group_size: a multiple of 32 dividing K.
    Returns:
        (1, N) bfloat16; each output summed in float32 and rounded once.
    Raises:
        RuntimeError: the library is unavailable or refused the shapes (or the CPU lacks AVX2 / FMA).
    """
    library = _loaded_library(any_x86=True)
    out_features = weight.shape[0]
    y = torch.empty((1, out_features), dtype=torch.bfloat16)
    status = library.hfquant_int4_gemv_avx2(
        x.data_ptr(), weight.data_ptr(), scale_zero.data_ptr(), y.data_ptr(), out_features, x.shape[-1], group_size
    )
    if status:
        raise RuntimeError(
            f"hfquant native AVX2 int4 GEMV refused N={out_features}, K={x.shape[-1]}, group_size={group_size} "
            "(needs N % 32 == 0, a group size that is a multiple of 32 dividing K, and AVX2 with FMA)"
        )
    return y


def int4_a8_supported(block_n: int) -> bool:
    """Whether `int4_gemv_a8` runs here on PyTorch's int4 layout with `block_n`-row blocks: 64 (AVX-512 CPUs; needs
    AVX512-VNNI and AVX512-BF16) or 32 (AVX2 CPUs; needs AVX2 and FMA)."""
    library = built_library()
    return library is not None and bool(library.hfquant_int4_a8_supported(block_n))


def int4_gemv_a8(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int = 64
) -> torch.Tensor:
    """`int4_gemv` with x quantized to int8 per block of 32 inputs (W4A8, llama.cpp's Q8_0 activation blocks): x_hat @
    w.T for the quantized row x_hat, the products with the codes in int32 by VNNI (`csrc/int4_intdot_cpu.c`).

    Args:
        x, weight, scale_zero: as `int4_gemv`, the weight in PyTorch's int4 CPU layout with `block_n`-row blocks.
        group_size: inputs per scale, a multiple of 32 dividing K.
        block_n: 64 (the layout on AVX-512 CPUs) or 32 (on AVX2 CPUs; `packing.cpu_int4_layout().block_n`).
    Returns:
        (1, N) bfloat16. Against x @ w.T each output differs by at most sum_k |w[n, k]| * max|x_block| / 254 (the
        int8 rounding of each input, max over the input's block of 32) plus the bfloat16 rounding of the result.
    Raises:
        RuntimeError: the library is unavailable or refused the shapes (N % block_n, group_size % 32, or a CPU
            without the instructions; callers check `int4_a8_supported(block_n)` and the shapes first).
    """
    library = _loaded_library(any_x86=True)
    out_features = weight.shape[0]
    y = torch.empty((1, out_features), dtype=torch.bfloat16)
    status = library.hfquant_int4_gemv_a8(
        x.data_ptr(),
        weight.data_ptr(),
        scale_zero.data_ptr(),
        y.data_ptr(),
        out_features,
        x.shape[-1],
        group_size,
        block_n,
    )
    if status:
        raise RuntimeError(
            f"hfquant native W4A8 GEMV refused N={out_features}, K={x.shape[-1]}, group_size={group_size}, "
            f"block_n={block_n} (needs N % block_n == 0, a group size that is a multiple of 32 dividing K, and "
            "AVX512-VNNI for block_n=64 or AVX2 for block_n=32)"
        )
    return y


def int4_dequantize_t(
    weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, start: int, stop: int, out: torch.Tensor
) -> torch.Tensor:
    """Write the transposed dequantized weight of output channels start..stop-1 into `out` and return it.

    Args:
        weight, scale_zero, group_size: as for `int4_gemv` (N = weight.shape[0], K = weight.shape[1] * 2).
        start, stop: output channels, multiples of 64, 0 <= start < stop <= N.
        out: (K, stop - start) contiguous bfloat16; out[k, c] = (q[start + c, k] - 8) * scale + zero, computed in
            float32 and rounded once.
    Raises:
        RuntimeError: the library is unavailable, or it refused the arguments.
    """
    library = _loaded_library()
    out_features, in_features = weight.shape[0], weight.shape[1] * 2
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or tuple(out.shape) != (in_features, stop - start):
        raise RuntimeError(f"int4_dequantize_t needs a contiguous bfloat16 ({in_features}, {stop - start}) output")
    status = library.hfquant_int4_dequantize_t(
        weight.data_ptr(), scale_zero.data_ptr(), out.data_ptr(), out_features, in_features, group_size, start, stop
    )
    if status:
        raise RuntimeError(
            f"hfquant native int4 dequantization refused N={out_features}, K={in_features}, group_size={group_size}, "
            f"channels {start}..{stop} (needs multiples of 64 within N)"
        )
    return out


def int8_gemv_supported() -> bool:
    """Whether `int8_gemv` runs here: an x86-64 CPU with AVX512-F/BW/VL + BF16 (its VNNI or float body) or with AVX2 +
    FMA + F16C (its AVX2 bodies, the VNNI body's bits where K % 64 == 0), as `HFQUANT_ISA` allows."""
    library = built_library()
    return library is not None and bool(library.hfquant_int8_gemv_supported())


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ q.T) * scale for one bfloat16 row and per-channel int8 codes (the stored layout).

    Args:
        x: (K,) or (1, K) contiguous bfloat16 (CPU); K % 16 == 0.
        weight: (N, K) contiguous int8 codes.
        scale: (N,) contiguous bfloat16 per-channel scales.
    Returns:
        (1, N) bfloat16; each output summed in float32 and rounded once.
    Raises:
        RuntimeError: the library is unavailable or refused the shapes (K % 16 != 0) or the CPU
            (`int8_gemv_supported`).
    """
    library = _loaded_library(any_x86=True)
    out_features, in_features = weight.shape
    y = torch.empty((1, out_features), dtype=torch.bfloat16)
    status = library.hfquant_int8_gemv(
        x.data_ptr(), weight.data_ptr(), scale.data_ptr(), y.data_ptr(), out_features, in_features
    )
    if status:
        raise RuntimeError(
            f"hfquant native int8 GEMV refused N={out_features}, K={in_features} (needs K % 16 == 0, and AVX2 or "
            "AVX-512 with BF16)"
        )
    return y


def int4_repack(weight: torch.Tensor, to_cpu_layout: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The int4 weight (N, K // 2) uint8 moved between the stored layout and the 64-row "halves" CPU kernel layout, in
    one pass (`hfquant.core.packing` does the same with torch ops through unpacked codes).

    Args:
        weight: (N, K // 2) contiguous uint8, N % 64 == 0.
        to_cpu_layout: True: stored -> kernel layout; False: kernel layout -> stored.
        out: a contiguous (N, K // 2) uint8 CPU tensor not overlapping `weight` to write into instead of a new one
            (e.g. a layer's rows of a fused decode group's tensor, `hfquant.nn.fused`); with `to_cpu_layout`, also
            `weight` itself (the same bytes): repacked in place, a block of 64 rows at a time through a copy.
    Returns:
        A new (N, K // 2) uint8 tensor, or `out`.
    Raises:
        RuntimeError: the library is unavailable or refused the shape; `out` is not as above.
        MemoryError: in place, a thread's block copy could not be allocated (the weight is unchanged then).
    """
    library = _loaded_library()
    n, k = weight.shape[0], weight.shape[1] * 2
    weight = weight.contiguous()
    in_place = out is not None and to_cpu_layout and out.data_ptr() == weight.data_ptr() and out.shape == weight.shape
    if out is None:
        out = torch.empty_like(weight)
    elif (
        out.shape != weight.shape
        or out.dtype != torch.uint8
        or out.device.type != "cpu"
        or not out.is_contiguous()
        or (_overlap(out, weight) and not in_place)
    ):
        raise RuntimeError(
            f"int4_repack's out must be a contiguous {tuple(weight.shape)} uint8 CPU tensor apart from the weight "
            f"(or the weight itself, to the CPU layout), got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    function = library.hfquant_int4_to_cpu_layout if to_cpu_layout else library.hfquant_int4_from_cpu_layout
    status = function(weight.data_ptr(), out.data_ptr(), n, k)
    if status == 2:
        raise MemoryError(f"hfquant native int4 repacking in place: no {32 * k} bytes for a block's copy")
    if status:
        raise RuntimeError(f"hfquant native int4 repacking refused N={n}, K={k} (needs N % 64 == 0)")
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two contiguous tensors overlap."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def rtn_quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of a CPU weight in one C pass (`csrc/rtn_cpu.c`), bit for bit what
    `hfquant.core.rtn.quantize_weight(weight, bits, group_size, symmetric)` gives, packed at 4 bits as
    `hfquant.core.packing.pack_int4` packs. With `row_scale` / `col_scale` (a fold's factors), the weight quantized is
    `weight.float() * row_scale[:, None] / col_scale` in those float32 operations, without making that copy.

    Args:
        weight: (N, K) contiguous bfloat16 or float32 on the CPU.
        bits: 4 (K even) or 8.
        group_size: inputs per scale, dividing K, at most 65536.
        symmetric: as in `hfquant.core.rtn`.
        out: (codes, scale, zero_point) tensors to write into instead of new ones (contiguous, the shapes and dtypes
            below; zero_point None when symmetric), e.g. row slices of a layer's buffers: no temporary, no copy.
        row_scale: None or (N,) float32 CPU factors of the rows.
        col_scale: None or (K,) float32 CPU divisors of the columns.
        threads: OpenMP threads over the rows (>= 1), None for OpenMP's default (torch's count); the bytes do not
            depend on it. A load whose fold worker keeps a core busy passes one fewer (`HfQuantQuantize.convert`).
    Returns:
        (codes, scale, zero_point): codes (N, K // 2) uint8 at 4 bits, (N, K) int8 at 8 bits symmetric, (N, K) uint8
        at 8 bits asymmetric; scale (N, K // group_size) bfloat16; zero_point (N, K // group_size) uint8, or None when
        symmetric. `out`'s tensors when given.
    Raises:
        ValueError: the weight holds NaN or Inf values (the message of `hfquant.core.rtn`); `threads` < 1.
        RuntimeError: the library is unavailable, or it refused the arguments (`out` included: naming the tensor).
    """
    library = _loaded_library(any_x86=True)
    if threads is not None and threads < 1:
        raise ValueError(f"rtn_quantize threads={threads}: give at least 1, or None for OpenMP's default")
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2 or weight.device.type != "cpu":
        raise RuntimeError(
            f"rtn_quantize needs a 2-D bfloat16 or float32 CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}"
        )
    weight = weight.contiguous()
    n, k = weight.shape
    groups = k // group_size if group_size > 0 else 0
    specs = {
        "codes": ((n, k // 2) if bits == 4 else (n, k), torch.int8 if bits == 8 and symmetric else torch.uint8),
        "scale": ((n, groups), torch.bfloat16),
        "zero_point": None if symmetric else ((n, groups), torch.uint8),
    }
    codes, scale, zero_point = _rtn_outputs(specs, out)
    factors = [_rtn_factor("row_scale", row_scale, n), _rtn_factor("col_scale", col_scale, k)]
    arguments = [weight.data_ptr(), int(weight.dtype == torch.bfloat16), n, k, group_size, bits, int(symmetric)]
    outputs = [codes.data_ptr(), scale.data_ptr(), None if zero_point is None else zero_point.data_ptr()]
    if all(vector is None for vector in factors):
        status = library.hfquant_rtn_quantize(*arguments, *outputs, threads or 0)
    else:
        pointers = [None if vector is None else vector.data_ptr() for vector in factors]
        status = library.hfquant_rtn_quantize_scaled(*arguments, *pointers, *outputs, threads or 0)
    if status == 2:
        raise ValueError("cannot quantize a weight that contains NaN or Inf values")
    if status:
        raise RuntimeError(f"hfquant native RTN refused N={n}, K={k}, bits={bits}, group_size={group_size}")
    return codes, scale, zero_point


def _rtn_outputs(specs: dict, out: tuple | None) -> tuple:
    """`rtn_quantize`'s (codes, scale, zero_point): new tensors of `specs` ((shape, dtype) or None each), or `out`'s
    after checking each against its spec (RuntimeError naming the tensor)."""
    if out is None:
        return tuple(None if spec is None else torch.empty(spec[0], dtype=spec[1]) for spec in specs.values())
    for (name, spec), tensor in zip(specs.items(), out, strict=False):
        if (
            (spec is None) != (tensor is None)
            or tensor is not None
            and (
                tuple(tensor.shape) != spec[0]
                or tensor.dtype != spec[1]
                or not tensor.is_contiguous()
                or tensor.device.type != "cpu"
            )
        ):
            wanted = "None" if spec is None else f"a contiguous CPU {spec[1]} tensor of shape {spec[0]}"
            got = (
                "None"
                if tensor is None
                else f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
                + ("" if tensor.is_contiguous() else ", not contiguous")
            )
            raise RuntimeError(f"rtn_quantize: out {name} must be {wanted}, got {got}")
    return out


def _rtn_factor(name: str, vector: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """A fold factor of `rtn_quantize` made contiguous, or None; RuntimeError unless (length,) float32 on the CPU."""
    if vector is None:
        return None
    vector = vector.contiguous()
    if vector.shape != (length,) or vector.dtype != torch.float32 or vector.device.type != "cpu":
        raise RuntimeError(
            f"rtn_quantize: {name} must be a float32 CPU tensor of shape ({length},), got {vector.dtype} "
            f"{tuple(vector.shape)} on {vector.device}"
        )
    return vector


def sinq_balance(
    weights: list[torch.Tensor],
    group_size: int,
    iterations: int,
    row_scales: list[torch.Tensor | None] | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """SINQ's Sinkhorn balancing (`hfquant.core.sinq`) of the matrices `weights` stacked along their rows, in C
    (`csrc/sinq_cpu.c`): each tile of `group_size` columns is balanced on a bfloat16 copy that stays in cache, with
    float32 sums. Runs on any x86-64 CPU where the library loads (`built_library`).

    Args:
        weights: matrices (N_i, K) on the CPU, one width, any float dtype (bfloat16 and float32 are read in place,
            others converted); at least 2 rows in all.
        group_size: columns per tile, dividing K.
        iterations: balancing iterations (>= 0).
        row_scales: per matrix, None or (N_i,) factors its rows are multiplied by first.
        threads: OpenMP threads (>= 1), None for OpenMP's default; the result does not depend on it. The fold worker
            passes 1: beside the load's main thread, a second thread only contends for the other core.
    Returns:
        (K,) float32: the inverse column factors of the kept iterate (`hfquant.core.sinq.scale_from_balance` makes
        the column scale of them).
    Raises:
        ValueError: a weight holds NaN or Inf values (naming the problem), or the shapes do not fit (naming them).
        MemoryError: a tile copy could not be allocated.
        RuntimeError: the library is unavailable.
    """
    library = _loaded_library(any_x86=True)
    widths = {w.shape[1] if w.dim() == 2 else None for w in weights}
    if not weights or len(widths) != 1 or None in widths:
        raise ValueError(
            f"sinq_balance needs 2-D matrices of one width, got shapes {[tuple(w.shape) for w in weights]}"
        )
    k = widths.pop()
    if group_size <= 0 or k % group_size or iterations < 0:
        raise ValueError(f"group_size={group_size} does not divide in_features={k} (or iterations={iterations} < 0)")
    if threads is not None and threads < 1:
        raise ValueError(f"sinq_balance threads={threads}: give at least 1, or None for OpenMP's default")
    row_scales = row_scales or [None] * len(weights)
    bf16 = all(w.dtype == torch.bfloat16 for w in weights)
    dtype = torch.bfloat16 if bf16 else torch.float32
    mats = [w.detach().to("cpu", dtype).contiguous() for w in weights]
    factors = []
    for weight, rows in zip(mats, row_scales, strict=True):
        if rows is not None:
            rows = rows.detach().to("cpu", torch.float32).contiguous()
            if rows.shape != (weight.shape[0],):
                raise ValueError(f"row scale of {tuple(rows.shape)} does not fit a weight of {tuple(weight.shape)}")
        factors.append(rows)
    count = len(mats)
    pointers = (ctypes.c_void_p * count)(*[w.data_ptr() for w in mats])
    rows_array = (ctypes.c_int64 * count)(*[w.shape[0] for w in mats])
    scales = (ctypes.c_void_p * count)(*[None if f is None else f.data_ptr() for f in factors])
    inv_col = torch.empty(k, dtype=torch.float32)
    status = library.hfquant_sinq_balance(
        pointers, rows_array, scales, count, int(bf16), k, group_size, iterations, threads or 0, inv_col.data_ptr()
    )
    if status == 2:
        raise ValueError("the weight holds NaN or Inf values; SINQ cannot balance it")
    if status == 3:
        raise MemoryError(f"sinq_balance: no memory for a tile of {sum(w.shape[0] for w in mats)} x {group_size}")
    if status:
        raise ValueError(f"sinq_balance refused matrices of shapes {[tuple(w.shape) for w in mats]}")
    return inv_col


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) for one bfloat16 row (`csrc/bf16_cpu.c`: AVX512-BF16 dot products, or on CPUs
    without them (or `HFQUANT_ISA=avx2`) AVX2 + FMA on the weights widened to float32; the two sum in other orders).

    Args:
        x: (..., K) with one row in all, contiguous bfloat16 (CPU); K % 32 == 0.
        weight: (N, K) contiguous bfloat16.
        bias: (N,) contiguous bfloat16, or None.
    Returns:
        (..., N) bfloat16; each output summed in float32 (every product exact) and rounded once.
    Raises:
        RuntimeError: the library is unavailable or refused the shapes (K % 32 != 0) or the CPU (neither AVX512-BF16
            nor AVX2 with FMA).
        MemoryError: the AVX2 body could not allocate x widened to float32 (K floats).
    """
    library = _loaded_library(any_x86=True)
    out_features, in_features = weight.shape
    y = torch.empty((*x.shape[:-1], out_features), dtype=torch.bfloat16)
    status = library.hfquant_bf16_gemv(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        out_features,
        in_features,
    )
    if status == 2:
        raise MemoryError(f"hfquant native bf16 GEMV: no memory for x in float32 ({in_features} floats)")
    if status:
        raise RuntimeError(
            f"hfquant native bf16 GEMV refused N={out_features}, K={in_features} (needs K % 32 == 0, and AVX512-BF16 "
            "or AVX2 with FMA)"
        )
    return y


def bf16_f32_gemv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = weight @ x in float32 for a bfloat16 weight, read once as stored (`csrc/bf16_cpu.c`; the fold pre-pass's
    BOS forward, `hfquant.integration.bos_importance`): each product float32(w) * x exact, summed by fused
    multiply-adds into 16 partial sums per row (element k into sum k % 16) added in a fixed tree, one thread; the same
    float32 results from the AVX-512, the AVX2 and the C body (`HFQUANT_ISA` picks one).

    Args:
        weight: (N, K) contiguous bfloat16 (CPU), K >= 1.
        x: (K,) contiguous float32.
    Returns:
        (N,) float32.
    Raises:
        ValueError: the dtypes, shapes or layout are not as above.
        RuntimeError: the library is unavailable.
    """
    if (
        weight.dtype != torch.bfloat16
        or x.dtype != torch.float32
        or weight.dim() != 2
        or x.shape != (weight.shape[1],)
        or weight.shape[1] < 1
        or not (weight.is_contiguous() and x.is_contiguous())
        or weight.device.type != "cpu"
    ):
        raise ValueError(
            f"bf16_f32_gemv needs a contiguous bfloat16 (N, K) CPU weight and a float32 (K,) x; got {weight.dtype} "
            f"{tuple(weight.shape)} and {x.dtype} {tuple(x.shape)}"
        )
    library = _loaded_library(any_x86=True)
    y = torch.empty(weight.shape[0], dtype=torch.float32)
    if library.hfquant_bf16_f32_gemv(weight.data_ptr(), x.data_ptr(), y.data_ptr(), *weight.shape):
        raise RuntimeError(f"hfquant native bf16 x float32 GEMV refused {tuple(weight.shape)}")
    return y


def fold_chunk(
    weight: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    out: torch.Tensor,
) -> bool:
    """out = float32(weight) * row_scale[:, None] / col_scale in one C pass (`csrc/fold_chunk_cpu.c`): the same float32
    values as torch's copy, product and quotient (no fused multiply-add), for the block searches on load.

    Args:
        weight: (rows, K) contiguous bfloat16 or float32 CPU tensor.
        row_scale, col_scale: None or contiguous float32 (rows,) / (K,).
        out: (rows, K) contiguous float32 CPU tensor (written).
    Returns:
        Whether every value of `out` is finite (False: NaN or Inf in the weight, or from the scales).
    Raises:
        ValueError: the dtypes, shapes or layouts are not as above.
        RuntimeError: the library is unavailable.
    """
    rows, k = weight.shape
    _check_fold_inputs(weight, row_scale, col_scale, out)
    status = _loaded_library(any_x86=True).hfquant_fold_chunk(
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        rows,
        k,
        _as_float_pointer(row_scale),
        _as_float_pointer(col_scale),
        out.data_ptr(),
    )
    if status not in (0, 3):
        raise RuntimeError(f"hfquant native fold_chunk refused {tuple(weight.shape)}")
    return status == 0


def _check_fold_inputs(
    weight: torch.Tensor, row_scale: torch.Tensor | None, col_scale: torch.Tensor | None, out: torch.Tensor
) -> None:
    """`fold_chunk`'s ValueError unless its tensors are as it documents (`out`: float32 of the weight's shape, or the
    weight itself for a caller without one)."""
    rows, k = weight.shape
    tensors = [t for t in (weight, row_scale, col_scale, out) if t is not None]
    if (
        weight.dtype not in (torch.bfloat16, torch.float32)
        or (out is not weight and (out.dtype != torch.float32 or out.shape != weight.shape))
        or (row_scale is not None and (row_scale.dtype != torch.float32 or row_scale.shape != (rows,)))
        or (col_scale is not None and (col_scale.dtype != torch.float32 or col_scale.shape != (k,)))
        or not all(t.is_contiguous() and t.device.type == "cpu" for t in tensors)
    ):
        raise ValueError(
            f"fold_chunk needs contiguous CPU tensors: a bfloat16/float32 (rows, K) weight, float32 (rows,) / (K,) "
            f"scales and a float32 out of the weight's shape; got {weight.dtype} {tuple(weight.shape)}, out "
            f"{out.dtype} {tuple(out.shape)}"
        )


def block_gemv_supported(ggml_type: int) -> bool:
    """Whether `block_gemv` runs here for the GGUF type numbered `ggml_type` (`hfquant.core.blocks.LAYOUTS`): one of
    hfquant's block types, on an x86-64 CPU with AVX512-VNNI or with AVX2 + FMA + F16C."""
    library = built_library()
    return library is not None and bool(library.hfquant_block_gemv_supported(ggml_type))


def block_gemv(x: torch.Tensor, weight: torch.Tensor, in_features: int, ggml_type: int) -> torch.Tensor:
    """y = x_hat @ w_hat.T for one bfloat16 row and a weight in one of llama.cpp's block formats (`csrc/blocks_cpu.c`):
    w_hat the dequantized blocks (`hfquant.core.blocks.dequantize`), x_hat the row quantized to int8 per block of the
    type (256 inputs for the k-quants and IQ4_XS, 32 for the others; scale max|x_block| / 127).

    Args:
        x: (K,) or (1, K) contiguous bfloat16 (CPU).
        weight: (N, K // block_size * type_size) contiguous uint8, the blocks as GGUF stores them.
        in_features: K, a multiple of the type's block size.
        ggml_type: the GGUF type number (`BlockLayout.ggml_type`).
    Returns:
        (1, N) bfloat16. Against x @ w_hat.T each output differs by at most sum_k |w_hat[n, k]| * max|x_block(k)| / 254
        (the int8 rounding of each input, max over its activation block) plus float32 summation and the bfloat16
        rounding of the result.
    Raises:
        RuntimeError: the library is unavailable or refused the arguments (an unknown type, K not whole blocks, a CPU
            without AVX2; callers check `block_gemv_supported` first).
    """
    library = _loaded_library(any_x86=True)
    out_features = weight.shape[0]
    y = torch.empty((1, out_features), dtype=torch.bfloat16)
    status = library.hfquant_block_gemv(
        x.data_ptr(), weight.data_ptr(), y.data_ptr(), out_features, in_features, ggml_type
    )
    if status:
        raise RuntimeError(
            f"hfquant native block GEMV refused N={out_features}, K={in_features}, GGUF type {ggml_type} (needs one of "
            "hfquant's block types, K a multiple of its block size, and AVX2 or AVX512-VNNI)"
        )
    return y


def block_gemv_group(
    x: torch.Tensor, weights: list[torch.Tensor], in_features: int, ggml_types: list[int]
) -> torch.Tensor:
    """`block_gemv` of several weights against the same row in one C call (a fused decode group: q/k/v, gate/up): x
    quantized once per activation block size the types need (32 and / or 256), one OpenMP region. Each weight's
    outputs are the bytes `block_gemv` gives it alone.

    Args:
        x: (K,) or (1, K) contiguous bfloat16 (CPU).
        weights: 1 to 8 (N_i, K // block_size_i * type_size_i) contiguous uint8 tensors of GGUF blocks.
        in_features: K, a multiple of the block size.
        ggml_types: each weight's GGUF type number; block sizes may differ (256: the k-quants and IQ4_XS; 32 or 64:
            the others), K a multiple of each.
    Returns:
        (1, sum N_i) bfloat16, the weights' outputs in order.
    Raises:
        RuntimeError: the library is unavailable or refused the arguments (as `block_gemv`).
    """
    library = _loaded_library(any_x86=True)
    count = len(weights)
    if not 1 <= count <= 8 or len(ggml_types) != count:
        raise RuntimeError(
            f"hfquant block GEMV group needs 1-8 weights and one type each, got {count} and {ggml_types}"
        )
    rows = [weight.shape[0] for weight in weights]
    y = torch.empty((1, sum(rows)), dtype=torch.bfloat16)
    pointers = (ctypes.c_void_p * count)(*[weight.data_ptr() for weight in weights])
    types = (ctypes.c_int64 * count)(*ggml_types)
    ns = (ctypes.c_int64 * count)(*rows)
    status = library.hfquant_block_gemv_group(x.data_ptr(), pointers, types, ns, y.data_ptr(), count, in_features)
    if status:
        raise RuntimeError(
            f"hfquant native block GEMV group refused N={rows}, K={in_features}, GGUF types {ggml_types} (needs "
            "hfquant's block types, K a multiple of each block size, and AVX2 or AVX512-VNNI)"
        )
    return y


BLOCK_ROWS8 = 1 << 16
"""Flag of the R8 compute layout (`csrc/blocks_cpu.c`, before r8_offset): `ggml_type | BLOCK_ROWS8` is the type code
of an IQ4_NL (20), IQ4_XS (23) or Q3_K (11) weight whose groups of 8 rows `block_interleave` interleaved block by
block, accepted by `block_gemv`, `block_gemv_group` (where `block_rows8_supported`) and `block_dequantize_t` (any
x86-64 CPU)."""

BLOCK_ROWS16 = 1 << 17
"""Flag of the R16 compute layout (`csrc/blocks_cpu.c`, after r8_offset): `23 | BLOCK_ROWS16` is the type code of an
IQ4_XS weight whose groups of 16 rows `block_interleave(..., rows=16)` interleaved super-block by super-block,
accepted by `block_gemv`, `block_gemv_group` (where `block_rows16_supported`: the AVX512-VNNI body) and
`block_dequantize_t` (any x86-64 CPU)."""

_R8_LAYOUTS = {blocks.layout(name).ggml_type: blocks.layout(name) for name in ("iq4_nl", "iq4_xs", "q3_k")}
"""The GGUF types with an R8 layout (IQ4_NL, IQ4_XS, Q3_K) and their block layouts."""

_R16_LAYOUTS = {blocks.layout("iq4_xs").ggml_type: blocks.layout("iq4_xs")}
"""The GGUF types with an R16 layout (IQ4_XS) and their block layouts."""

_INTERLEAVED = {8: (_R8_LAYOUTS, BLOCK_ROWS8), 16: (_R16_LAYOUTS, BLOCK_ROWS16)}
"""Rows per group -> (the GGUF types with that interleaved layout and their block layouts, its type-code flag)."""


def layout_code(ggml_type: int, rows: int) -> int:
    """The type code the C kernels take for a plain GGUF type's weight with `rows` rows per interleaved group: 1 (the
    stored layout) the type itself, 8 with `BLOCK_ROWS8`, 16 with `BLOCK_ROWS16`; KeyError for another count."""
    return ggml_type if rows == 1 else ggml_type | _INTERLEAVED[rows][1]


def _interleaved_supported(ggml_type: int, rows: int) -> bool:
    """Whether the GEMV of the layout of `rows` runs here for the plain GGUF type `ggml_type`."""
    layouts, flag = _INTERLEAVED[rows]
    library = built_library()
    return (
        ggml_type in layouts and library is not None and bool(library.hfquant_block_gemv_supported(ggml_type | flag))
    )


def block_rows8_supported(ggml_type: int) -> bool:
    """Whether the R8 GEMVs run here for the plain GGUF type `ggml_type` (IQ4_NL 20, IQ4_XS 23, Q3_K 11): an x86-64
    CPU with AVX2 + FMA + F16C (AVX-512 CPUs included: a call with an R8 part runs on the AVX2 bodies). Whether a
    layer is interleaved is `block_layout.rows_for`'s decision."""
    return _interleaved_supported(ggml_type, 8)


def block_rows16_supported(ggml_type: int) -> bool:
    """Whether the R16 GEMV runs here for the plain GGUF type `ggml_type` (IQ4_XS 23): an x86-64 CPU whose block GEMVs
    run the AVX512-VNNI body. Whether a layer is interleaved is `block_layout.rows_for`'s decision."""
    return _interleaved_supported(ggml_type, 16)


def block_interleave(
    weight: torch.Tensor,
    in_features: int,
    ggml_type: int,
    inverse: bool = False,
    out: torch.Tensor | None = None,
    rows: int = 8,
) -> torch.Tensor:
    """The bytes of a GGUF-layout IQ4_NL / IQ4_XS / Q3_K weight permuted into the R8 compute layout (rows=8), or of an
    IQ4_XS weight into the R16 layout (rows=16) (inverse=False), or such a weight's back into GGUF's layout
    (inverse=True); `csrc/blocks_cpu.c` documents where each byte goes. An exact permutation:
    `block_interleave(block_interleave(w, k, t, rows=r), k, t, inverse=True, rows=r)` equals w for any bytes.

    Args:
        weight: (N, K // block_size * type_size) uint8 (made contiguous if it is not), N a multiple of `rows`.
        in_features: K, a multiple of the type's block size (32 for IQ4_NL, 256 for IQ4_XS and Q3_K).
        ggml_type: the plain GGUF type, 20 (IQ4_NL), 23 (IQ4_XS) or 11 (Q3_K); the result's type code is `ggml_type |
            BLOCK_ROWS8` (R8) or `ggml_type | BLOCK_ROWS16` (R16) forward, `ggml_type` inverse.
        out: a contiguous uint8 tensor of weight's shape, not sharing its memory, to write the result into (default:
            a new one); for R16 forward where `block_rows16_supported`, also the weight itself (interleaved in place).
        rows: 8 (R8) or 16 (R16, IQ4_XS only).
    Returns:
        `out`, or a new contiguous uint8 tensor of weight's shape.
    Raises:
        ValueError: rows not 8 or 16, a type without that layout, N not a multiple of `rows`, K not whole blocks, or
            weight not (N, row bytes) uint8 (the message names the value).
        RuntimeError: the native library is unavailable.
        MemoryError: no memory for an in-place interleave's copies of 16 rows per thread.
    """
    if rows not in _INTERLEAVED:
        raise ValueError(f"block_interleave: rows={rows} is not an interleaved layout; use 8 (R8) or 16 (R16)")
    layouts = _INTERLEAVED[rows][0]
    if ggml_type not in layouts:
        have = "IQ4_NL 20, IQ4_XS 23, Q3_K 11 have" if rows == 8 else "IQ4_XS 23 has"
        raise ValueError(f"block_interleave: GGUF type {ggml_type} has no R{rows} layout ({have})")
    layout = layouts[ggml_type]
    if not layout.divides(in_features):
        raise ValueError(
            f"block_interleave: in_features {in_features} is not a positive multiple of {layout.block_size}"
        )
    row_bytes = layout.row_bytes(in_features)
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes:
        raise ValueError(
            f"block_interleave: weight must be (N, {row_bytes}) uint8 for K={in_features}, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if weight.shape[0] % rows:
        raise ValueError(f"block_interleave: N {weight.shape[0]} is not a multiple of {rows}")
    library = _loaded_library(any_x86=True)
    src = weight.contiguous()
    dst = torch.empty_like(src) if out is None else out
    if dst.shape != src.shape or dst.dtype != torch.uint8 or not dst.is_contiguous():
        raise ValueError(
            f"block_interleave: out must be contiguous uint8 {tuple(src.shape)}, got {dst.dtype} {tuple(dst.shape)}"
        )
    in_place = rows == 16 and not inverse and block_rows16_supported(ggml_type) and dst.data_ptr() == src.data_ptr()
    if (
        out is not None
        and src.numel()
        and not in_place
        and dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    ):
        raise ValueError("block_interleave: out shares the weight's memory; the permutation needs distinct buffers")
    code = layout_code(ggml_type, rows)  # the C map is picked by the flag (R8's also under the plain type)
    status = library.hfquant_block_interleave(
        src.data_ptr(), dst.data_ptr(), src.shape[0], in_features, code, int(bool(inverse))
    )
    if status == 2:
        raise MemoryError(f"block_interleave: no memory for the in-place copies (K={in_features})")
    if status:
        raise ValueError(f"block_interleave refused N={src.shape[0]}, K={in_features}, GGUF type {ggml_type}")
    return dst


def block_dequantize_t(
    weight: torch.Tensor, in_features: int, ggml_type: int, start: int, stop: int, out: torch.Tensor
) -> torch.Tensor:
    """Write rows start..stop-1 of a block-format weight, dequantized, transposed into `out` and return it
    (`csrc/blocks_cpu.c`): rounded once to bfloat16 for a bfloat16 `out` (bit for bit
    `hfquant.core.blocks.dequantize(...).to(torch.bfloat16)` on the blocks checked in tests/ops/test_block_gemv.py),
    the float32 values for a float32 `out`.

    Args:
        weight: (N, K // block_size * type_size) contiguous uint8 blocks of GGUF type `ggml_type`.
        in_features: K, a multiple of the type's block size.
        start, stop: rows, 0 <= start < stop <= N.
        out: (K, stop - start) contiguous bfloat16 or float32.
    Raises:
        RuntimeError: the library is unavailable, or it refused the arguments (naming them).
    """
    library = _loaded_library(any_x86=True)
    out_features = weight.shape[0]
    wanted = (in_features, stop - start)
    if out.dtype not in (torch.bfloat16, torch.float32) or not out.is_contiguous() or tuple(out.shape) != wanted:
        raise RuntimeError(f"block_dequantize_t needs a contiguous bfloat16 or float32 {wanted} output")
    status = library.hfquant_block_dequantize_t(
        weight.data_ptr(),
        out.data_ptr(),
        out_features,
        in_features,
        ggml_type,
        start,
        stop,
        int(out.dtype == torch.float32),
    )
    if status:
        raise RuntimeError(
            f"hfquant native block dequantization refused N={out_features}, K={in_features}, GGUF type {ggml_type}, "
            f"rows {start}..{stop}"
        )
    return out


KQUANT_TYPES = {"q2_k": 10, "q3_k": 11, "q4_k": 12, "q5_k": 13, "q6_k": 14}
"""The block types `kquant_quantize` writes, with their ggml type numbers."""


def kquant_quantize(name: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """hfquant's k-quant search in C (`csrc/blocks_quant_cpu.c`), super-blocks split over threads: the blocks
    `hfquant.core.blocks.quantize(name, weight, importance)` gives, up to float32 summation order (a near tie in one
    comparison can rarely go the other way; tests/ops/test_native_blocks.py).

    Args:
        name: one of `KQUANT_TYPES`.
        weight: (rows, K) finite float CPU tensor, K a multiple of 256.
        importance: None (the torch codec's default, `blocks.importance.default_importance`), or (K,) or (rows, K) finite
            float weights >= 0 of each element's squared error.
    Returns:
        (rows, K // 256 * type_size) uint8, GGUF's bytes.
    Raises:
        ValueError: an unknown type, a badly shaped weight or importance, or non-finite / negative values.
        RuntimeError: the library is unavailable.
    """
    if name not in KQUANT_TYPES:
        raise ValueError(f"kquant_quantize covers {list(KQUANT_TYPES)}; got {name!r}")
    library = _loaded_library(any_x86=True)
    x, w = _block_search_inputs(name, blocks.layout(name), weight, importance)
    rows, k = x.shape
    period = _importance_period(w, k, 256)

    type_size = blocks.layout(name).type_size
    out = torch.empty(rows, k // 256 * type_size, dtype=torch.uint8)
    nblocks = rows * (k // 256)
    status = library.hfquant_kquant_quantize(
        x.data_ptr(), None if w is None else w.data_ptr(), period, nblocks, KQUANT_TYPES[name], out.data_ptr()
    )
    if status:
        raise RuntimeError(f"hfquant native k-quant quantizer refused type {name}")
    return out


def _search_parameters(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch codec's search constants for `name`, as `csrc/blocks_quant_cpu.c` takes them: the candidate targets
    of the symmetric types (`legacy._symmetric_candidates`: both grid ends times the factors) or the shrink fractions
    of the affine ones, and IQ4_XS's super-block factors."""
    if name in ("q4_1", "q5_1"):
        return legacy._SHRINK, None
    grid, factors = {
        "q4_0": (legacy._Q4_0_GRID, legacy._FACTORS_4BIT),
        "q5_0": (legacy._Q5_0_GRID, legacy._FACTORS_5BIT),
        "q8_0": (legacy._Q8_0_GRID, legacy._FACTORS_8BIT),
    }.get(name, (iq4._GRID, iq4._FACTORS))
    targets = torch.cat([grid.low * factors, grid.high * factors])
    return targets, iq4._SUPER_FACTORS if name == "iq4_xs" else None


_LEGACY_IQ4_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "iq4_xs": 23}

BLOCK_QUANTIZE_TYPES = {
    **_LEGACY_IQ4_TYPES,
    **KQUANT_TYPES,
    "hq3_0": blocks.LAYOUTS["hq3_0"].ggml_type,
    "hq3_nl": blocks.LAYOUTS["hq3_nl"].ggml_type,
    "hq3_r": blocks.LAYOUTS["hq3_r"].ggml_type,
}
"""The block types `block_quantize` writes in C (every `hfquant.core.blocks.LAYOUTS` type), with their ggml numbers."""


def block_codes(name: str, weight: torch.Tensor) -> torch.Tensor:
    """`block_quantize(name, weight)` where the C search covers `name` and the library builds, else the torch codec
    (`hfquant.core.blocks.quantize`): the same bytes but for IQ4_NL / IQ4_XS (the default search against the torch
    codec's exhaustive one). (rows, K) float -> (rows, row bytes) uint8."""
    if name in BLOCK_QUANTIZE_TYPES and built_library() is not None:
        return block_quantize(name, weight)
    return blocks.quantize(name, weight)


def _as_float_pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def block_quantize(
    name: str,
    weight: torch.Tensor,
    importance: torch.Tensor | None = None,
    iq4_search: str = iq4.SEARCHES[0],
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    finite: bool = False,
) -> torch.Tensor:
    """hfquant's block search in C (`csrc/blocks_quant_cpu.c`), blocks split over threads: the bytes
    `hfquant.core.blocks.quantize(name, weight, importance)` gives (the same float32 steps and sums accumulated in
    double, tests/ops/test_native_blocks.py; a near tie in one comparison could in principle go the other way).
    K-quants go to `kquant_quantize`.

    Args:
        name: one of `BLOCK_QUANTIZE_TYPES`.
        weight: (rows, K) finite float CPU tensor, K a multiple of the type's block size.
        importance: None (the torch codec's default, `blocks.importance.default_importance`: all 1 where it gives
            None), or (K,) or (rows, K) finite float weights >= 0 of each element's squared error.
        iq4_search: IQ4_NL / IQ4_XS only: one of `iq4.SEARCHES` (`HfQuantConfig.iq4_search`): "exhaustive" is the
            torch codec's search here, the others `iq4_quantize` with `IQ4_SEARCHES[iq4_search]`.
        out, threads, finite: `iq4_quantize`'s, for its searches (another type's bytes are copied into `out`; its
            threads are OpenMP's default and its weight is always checked).
    Returns:
        (rows, K // block_size * type_size) uint8, GGUF's bytes (`out` when given).
    Raises:
        ValueError: an unknown type or IQ4 search, a badly shaped weight or importance, or non-finite / negative
            values.
        RuntimeError: the library is unavailable.
    """
    iq4_search = str(iq4_search)  # a config's `Iq4SearchMode` member reads as its value
    if iq4_search not in iq4.SEARCHES:
        raise ValueError(f"iq4_search={iq4_search!r} is not allowed; use one of {list(iq4.SEARCHES)}")
    if name in ("iq4_nl", "iq4_xs") and iq4_search != "exhaustive":
        search = IQ4_SEARCHES[iq4_search]
        return iq4_quantize(name, weight, importance, search, out=out, threads=threads, finite=finite)
    codes = _block_quantize(name, weight, importance)
    return codes if out is None else out.copy_(codes)


def _block_quantize(name: str, weight: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """`block_quantize` of the types other than the fast IQ4 searches, into a new tensor."""
    if name in KQUANT_TYPES:
        return kquant_quantize(name, weight, importance)
    if name not in BLOCK_QUANTIZE_TYPES:
        raise ValueError(f"block_quantize covers {list(BLOCK_QUANTIZE_TYPES)}; got {name!r}")
    library = _loaded_library(any_x86=True)
    fmt = blocks.layout(name)
    x, w = _block_search_inputs(name, fmt, weight, importance)
    out = torch.empty(x.shape[0], fmt.row_bytes(x.shape[1]), dtype=torch.uint8)
    if name == "hq3_r":
        status = _hq3_r_search(library, x, w, out)
    elif name in ("hq3_0", "hq3_nl"):
        status = _hq3_search(library, name, x, w, out)
    else:
        status = _legacy_iq4_search(library, name, fmt, x, w, out)
    if status:
        raise RuntimeError(f"hfquant native block quantizer refused type {name}")
    return out


def _importance_period(w: torch.Tensor | None, k: int, block_size: int) -> int:
    """The C searches' `w_period`: blocks per row when one (K,) importance serves every row, else 0 (none, or one
    per row)."""
    return k // block_size if w is not None and w.dim() == 1 else 0


def _hq3_r_search(library: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor | None, out: torch.Tensor) -> int:
    """HQ3_R's row search (a float16 row scale, then 64-weight blocks: `hq3r`) of x (rows, K) into out; C's status."""
    rows, k = x.shape
    targets = hq3r.search_targets().contiguous()
    levels = hq3r.LEVELS.contiguous()
    stride = 0 if w is None or w.dim() == 1 else k
    return library.hfquant_hq3_r_quantize(
        x.data_ptr(),
        _as_float_pointer(w),
        stride,
        rows,
        k,
        targets.data_ptr(),
        targets.numel(),
        levels.data_ptr(),
        out.data_ptr(),
    )


def _hq3_search(library: ctypes.CDLL, name: str, x: torch.Tensor, w: torch.Tensor | None, out: torch.Tensor) -> int:
    """HQ3_0's or HQ3_NL's search (3-bit codes in 32-weight blocks: `hq3`) of x (rows, K) into out; C's status."""
    rows, k = x.shape
    targets = hq3.search_targets(name).to(torch.float32).contiguous()
    search = library.hfquant_hq3_quantize if name == "hq3_0" else library.hfquant_hq3_nl_quantize
    return search(
        x.data_ptr(),
        _as_float_pointer(w),
        _importance_period(w, k, 32),
        rows * (k // 32),
        targets.data_ptr(),
        targets.numel(),
        out.data_ptr(),
    )


def _legacy_iq4_search(
    library: ctypes.CDLL,
    name: str,
    fmt: blocks.BlockLayout,
    x: torch.Tensor,
    w: torch.Tensor | None,
    out: torch.Tensor,
) -> int:
    """The search of a 32-weight legacy type (Q4_0 .. Q8_0), IQ4_NL or IQ4_XS, with its parameters from
    `_search_parameters`, of x (rows, K) into out; C's status."""
    rows, k = x.shape
    params, params2 = _search_parameters(name)
    params = params.to(torch.float32).contiguous()
    params2 = None if params2 is None else params2.to(torch.float32).contiguous()
    return library.hfquant_block_quantize(
        x.data_ptr(),
        _as_float_pointer(w),
        _importance_period(w, k, fmt.block_size),
        rows * (k // fmt.block_size),
        _LEGACY_IQ4_TYPES[name],
        params.data_ptr(),
        params.numel(),
        _as_float_pointer(params2),
        0 if params2 is None else params2.numel(),
        out.data_ptr(),
    )


@dataclasses.dataclass(frozen=True)
class Iq4Search:
    """The candidates of the fast IQ4_NL / IQ4_XS search (`csrc/iq4_search_cpu.c`).

    Attributes:
        targets: the grid values the largest weight of a 32-weight block is mapped to, one candidate scale each
            (llama.cpp's data-free scan maps it to -127 + t, t in [-7, 7]).
        refine: then this many pairs of candidates target * (1 +- step) around each block's best target so far,
            the step halving after each pair.
        refine_step: the first pair's relative step.
        super_factors: IQ4_XS: super-block scale candidates peak / -32 / f and peak / 31 / f for each f.
        level_options: IQ4_XS: 6-bit levels tried per block around scale / d (1 or 3).
        rounds: least-squares refits (IQ4_XS: of d; IQ4_NL: of the block's float16 scale).
        sweep: None, or (lo, hi) with 0 < lo < hi <= 2 lo: the block stage is the exact breakpoint sweep of the
            scales peak / (-127 f) and peak / (113 f) over every f in [lo, hi] instead of the targets' scan.
    """

    targets: tuple[float, ...] = (-127.0, -119.0, 113.0, 121.0)
    refine: int = 0
    refine_step: float = 0.05
    super_factors: tuple[float, ...] = (1.0,)
    level_options: int = 3
    rounds: int = 1
    sweep: tuple[float, float] | None = None


def _both_ends(factors) -> tuple[float, ...]:
    return tuple([iq4.KVALUES[0] * f for f in factors] + [iq4.KVALUES[-1] * f for f in factors])


_FAST_FACTORS = (0.8, 0.8667, 0.9333, 1.0, 1.0667, 1.1333, 1.2)

IQ4_SEARCHES = {
    "fast": Iq4Search(targets=_both_ends(_FAST_FACTORS)),
    "lean": Iq4Search(targets=_both_ends(_FAST_FACTORS), level_options=1),
    "thorough": Iq4Search(
        targets=_both_ends(iq4._FACTORS.tolist()), super_factors=tuple(iq4._SUPER_FACTORS.tolist()), rounds=3
    ),
    "exact": Iq4Search(
        targets=(iq4.KVALUES[0],),
        super_factors=tuple(iq4._SUPER_FACTORS.tolist()),
        rounds=3,
        sweep=(float(iq4._FACTORS[0]), float(iq4._FACTORS[-1])),
    ),
}
"""`iq4.SEARCHES`' searches in `csrc/iq4_search_cpu.c` (`HfQuantConfig.iq4_search`, whose field decides the configs'
default): "thorough" (`iq4_quantize`'s when none is given: the exhaustive search's candidates, 42 scales per block over
0.8-1.2 at both ends of the grid, 10 super-block scales, 3 refits; its errors equal the exhaustive search's to 4 digits,
SmolLM2 1.120x, MiniLM 0.9859) and "fast" (14 scales per block over the same range, one super-block scale at each end,
one refit: 0.3-0.4% more squared error but SmolLM2 1.139x; docs/performance.md, "The IQ4 search at load speed").
"exact": thorough's super-block stage after the exact breakpoint sweep of each block's scale over the same 0.8-1.2
(every segment of constant codes; 0.000-0.003% less squared error than thorough, about 0.8x its speed, SmolLM2 1.121x,
MiniLM 0.9858; docs/performance.md, issues #30 and #32, tenth session). "lean": fast's candidates with one 6-bit level
per block (the nearest to scale / d) instead of three: IQ4_XS in 18 passes over each weight instead of 24 (1.30x fast's
one-thread speed on AVX2), IQ4_NL's bytes unchanged; 0.25-0.27% more squared error on SmolLM2's and MiniLM's IQ4_XS
layers, SmolLM2 1.103x (fast 1.107x), MiniLM 0.9857 (fast 0.9859; docs/performance.md, twenty-fourth session).
"exhaustive" is the torch codec's search (`block_quantize`'s C port of `iq4.quantize_iq4_xs`, its bytes bit for bit)."""


IQ4_BODIES = ("portable", "avx2", "avx512")
"""The bodies of `iq4_quantize`'s C search, by `csrc/iq4_search_cpu.c`'s number: all give the same bytes."""


def iq4_search_body() -> str:
    """The body of `iq4_quantize`'s C search this process runs (`IQ4_BODIES`): "avx512" with AVX512-F/BW/VL, "avx2"
    with AVX2, FMA and F16C but not those (a CPU without AVX-512, or `HFQUANT_ISA=avx2`: `isa`), else "portable".

    Raises:
        RuntimeError: the library is unavailable.
        ValueError: as `built_library` (an `HFQUANT_ISA` value not understood).
    """
    return IQ4_BODIES[_loaded_library(any_x86=True).hfquant_iq4_search_body()]


def iq4_quantize(
    name: str,
    weight: torch.Tensor,
    importance: torch.Tensor | None = None,
    search: Iq4Search | None = None,
    portable: bool = False,
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    finite: bool = False,
) -> torch.Tensor:
    """IQ4_NL / IQ4_XS blocks of `weight` by the fast search in C (`csrc/iq4_search_cpu.c`: llama.cpp's
    `quantize_row_iq4_nl_impl` scan with hfquant's candidates, 16 blocks per AVX-512 vector or two AVX2 ones: the
    body `iq4_search_body` names), blocks split over threads.

    Args:
        name: "iq4_nl" or "iq4_xs".
        weight: (rows, K) finite float CPU tensor, K a multiple of 32 (iq4_nl) or 256 (iq4_xs).
        importance: None (all 1, the types' data-free default) or (K,) or (rows, K) float weights >= 0 of each
            element's squared error.
        search: the candidates (`Iq4Search`; None: `IQ4_SEARCHES[iq4.SEARCHES[0]]`, the default).
        portable: use the portable C body even where the AVX-512 or AVX2 one runs (`iq4_search_body`; the same
            bytes; for tests).
        out: a contiguous (rows, K // block_size * type_size) uint8 CPU tensor to write the blocks into (a layer's
            stored rows: no new tensor and copy per call), None for a new one.
        threads: OpenMP threads (>= 1), None for OpenMP's default; the bytes do not depend on it.
        finite: the caller has checked that `weight` is finite (quantize-on-load checks each chunk once, after its
            fold's scales): skips this function's own pass over it. A non-finite weight then gives unspecified
            bytes, never an error or a crash.
    Returns:
        (rows, K // block_size * type_size) uint8, GGUF's bytes (`out` when given).
    Raises:
        ValueError: another type, a badly shaped weight or importance, non-finite or negative values, or a search
            with no targets, no super factors or level_options other than 1 or 3.
        MemoryError: the C search could not allocate its work buffers.
        RuntimeError: the library is unavailable.
    """
    if name not in ("iq4_nl", "iq4_xs"):
        raise ValueError(f"iq4_quantize covers iq4_nl and iq4_xs; got {name!r}")
    if search is None:
        search = IQ4_SEARCHES[iq4.SEARCHES[0]]
    if threads is not None and threads < 1:
        raise ValueError(f"iq4_quantize threads={threads}: give at least 1, or None for OpenMP's default")
    library = _loaded_library(any_x86=True)
    fmt = blocks.layout(name)
    x, w = _block_search_inputs(name, fmt, weight, importance, finite)
    rows, k = x.shape
    period = _importance_period(w, k, fmt.block_size)
    out = _block_rows_out(out, (rows, fmt.row_bytes(k)))
    status = library.hfquant_iq4_quantize(
        x.data_ptr(),
        _as_float_pointer(w),
        period,
        rows * (k // fmt.block_size),
        _LEGACY_IQ4_TYPES[name],
        *_iq4_search_arguments(search),
        threads or 0,
        int(portable),
        out.data_ptr(),
    )
    if status == 2:
        raise MemoryError("hfquant native IQ4 search could not allocate its work buffers")
    if status:
        raise ValueError(f"hfquant native IQ4 search refused {name} with {search}")
    return out


def _iq4_search_arguments(search: Iq4Search) -> tuple:
    """The C searches' arguments from `targets` to `sweep_hi` (`csrc/iq4_search_cpu.c`)."""
    targets, factors = _iq4_search_tensors(search)
    return (
        targets.data_ptr(),
        targets.numel(),
        factors.data_ptr(),
        factors.numel(),
        search.refine,
        search.refine_step,
        search.level_options,
        search.rounds,
        search.sweep[0] if search.sweep else 0.0,
        search.sweep[1] if search.sweep else 0.0,
    )


@functools.cache
def _iq4_search_tensors(search: Iq4Search) -> tuple[torch.Tensor, torch.Tensor]:
    """`search`'s targets and super factors as float32 tensors, made once per search (never written)."""
    return torch.tensor(search.targets, dtype=torch.float32), torch.tensor(search.super_factors, dtype=torch.float32)


def iq4_quantize_fold(
    name: str,
    weight: torch.Tensor,
    row_scale: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    importance: torch.Tensor | None,
    search: Iq4Search,
    out: torch.Tensor,
    threads: int | None = None,
) -> bool:
    """`iq4_quantize(name, fold_chunk(weight, row_scale, col_scale), importance, search, out=out, finite=True)` in one
    parallel C pass (`hfquant_iq4_quantize_fold`, csrc/iq4_search_cpu.c): each thread folds a group of 16 blocks
    into a buffer of its own and searches it, so no float32 copy of the weight is made and no thread waits while
    another converts (the load's IQ4 layers, `hfquant.nn.linear._quantize_blocks`). The same bytes.

    Args:
        name: "iq4_nl" or "iq4_xs".
        weight: (rows, K) contiguous bfloat16 or float32 CPU tensor, K a multiple of the type's block size.
        row_scale, col_scale: None or contiguous float32 (rows,) / (K,): rows multiplied, columns divided.
        importance: None, or (K,) or (rows, K) float weights >= 0 of each element's squared error (of the folded
            weight).
        search: the candidates (`Iq4Search`).
        out: contiguous (rows, K // block_size * type_size) uint8 CPU tensor (written).
        threads: OpenMP threads (>= 1), None for OpenMP's default; the bytes do not depend on it.
    Returns:
        Whether every folded value was finite (False: NaN or Inf in the weight or from the scales; `out` then holds
        unspecified bytes).
    Raises:
        ValueError: another type, badly shaped or typed tensors, an importance that is not finite and >= 0, or a
            search the C code refuses.
        MemoryError: the C search could not allocate its work buffers.
        RuntimeError: the library is unavailable.
    """
    if name not in ("iq4_nl", "iq4_xs"):
        raise ValueError(f"iq4_quantize_fold covers iq4_nl and iq4_xs; got {name!r}")
    if threads is not None and threads < 1:
        raise ValueError(f"iq4_quantize_fold threads={threads}: give at least 1, or None for OpenMP's default")
    fmt = blocks.layout(name)
    rows, k = weight.shape
    if not fmt.divides(k):
        raise ValueError(f"{name} quantizes (rows, K) with K a multiple of {fmt.block_size}; got {(rows, k)}")
    _check_fold_inputs(weight, row_scale, col_scale, weight)  # fold_chunk's checks (no out)
    w = _checked_importance(importance, rows, k)
    out = _block_rows_out(out, (rows, fmt.row_bytes(k)))
    status = _loaded_library(any_x86=True).hfquant_iq4_quantize_fold(
        weight.data_ptr(),
        int(weight.dtype == torch.bfloat16),
        rows,
        k,
        _as_float_pointer(row_scale),
        _as_float_pointer(col_scale),
        _as_float_pointer(w),
        _importance_period(w, k, fmt.block_size),
        _LEGACY_IQ4_TYPES[name],
        *_iq4_search_arguments(search),
        threads or 0,
        0,
        out.data_ptr(),
    )
    if status == 2:
        raise MemoryError("hfquant native IQ4 search could not allocate its work buffers")
    if status not in (0, 3):
        raise ValueError(f"hfquant native IQ4 search refused {name} with {search}")
    return status == 0


def _block_rows_out(out: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """`iq4_quantize`'s `out`: a new (rows, row bytes) uint8 tensor for None, else `out` checked (ValueError)."""
    if out is None:
        return torch.empty(shape, dtype=torch.uint8)
    if out.shape != shape or out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(
            f"iq4_quantize out must be a contiguous {shape} uint8 CPU tensor; got {out.dtype} {out.shape}"
        )
    return out


def _block_search_inputs(
    name: str, fmt: blocks.BlockLayout, weight: torch.Tensor, importance: torch.Tensor | None, finite: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`block_quantize`'s checked inputs: the weight as contiguous float32 (rows, K), and the importance as contiguous
    float32 (K,) or (rows, K), or None (all 1); the errors of `block_quantize`. `finite`: the weight's values are not
    checked (the caller did)."""
    if weight.dim() != 2 or not fmt.divides(weight.shape[1]) or weight.device.type != "cpu":
        raise ValueError(
            f"{name} quantizes a 2-D float CPU weight (rows, K) with K a multiple of {fmt.block_size}; got "
            f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        )
    if not weight.is_floating_point():
        raise ValueError(f"{name} quantizes a float weight; got {weight.dtype}")
    x = weight.detach().to(torch.float32).contiguous()
    if not finite and not rtn.value_range(x)[2]:
        raise ValueError(f"{name} quantizes finite weights; the weight holds NaN or inf")
    rows, k = x.shape
    if importance is None:
        importance = default_importance(name, x)  # the torch codec's default (None: all 1), for the same bytes
    if importance is None:
        return x, None
    return x, _checked_importance(importance, rows, k)


def _checked_importance(importance: torch.Tensor | None, rows: int, k: int) -> torch.Tensor | None:
    """`importance` as contiguous float32 (K,) or (rows, K), or None; ValueError unless it is finite and >= 0."""
    if importance is None:
        return None
    w = importance.detach().to(torch.float32).contiguous()
    low, _, finite = rtn.value_range(w)
    if tuple(w.shape) not in ((k,), (rows, k)) or not finite or low < 0:
        raise ValueError(
            f"importance must be finite, >= 0 and of shape {(k,)} or {(rows, k)}; got shape {tuple(w.shape)}"
        )
    return w
