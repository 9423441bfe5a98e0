"""hfquant's one-row GEMVs as PyTorch dispatcher operators: `torch.ops.hfquant_cpu.int4_gemv`, `int4_gemv_a8` (W4A8)
and `int8_gemv` (`csrc/torch_ops.cpp`).

Why: the C kernels (`hfquant.ops.native`) are called through ctypes, which costs several microseconds of Python per
call, and inside a `torch.compile` graph through a Python custom op, more (`gemv.custom_op_overhead_s` measures it;
figures in docs/performance.md). A small layer's whole product takes about as long, so on a small model that overhead
decided whether the GEMV paid at all. Registered with PyTorch's dispatcher from C++, a call costs what an aten op's does, in eager and in a
compiled graph, which then calls it without leaving C++ for Python.

Built on first use like the C library, by `native_build.build_torch_ops`: `csrc/torch_ops.cpp` with the C sources,
against the headers and libraries of the installed torch, into `<cache>/native/<hash>/torch_ops.so`, with the same
ownership, permission and sha256 checks before loading a cached file.

Not available (`loaded()` is False, logged once at INFO) wherever the C library is not (`native.built_library`), or
without a C++ compiler, or when the build or the load fails. hfquant then calls the C kernels through ctypes in eager
and through the Python custom ops `hfquant::int4_gemv` / `hfquant::int8_gemv` under torch.compile (`gemv.RowCall`, decided
per layer by `hfquant.ops.plan.plan_kernel`).
"""

from __future__ import annotations

import functools
import logging
import subprocess

import torch

from hfquant.ops import native, native_build

__all__ = [
    "loaded",
    "int4_gemv",
    "int4_gemv_avx2",
    "int4_gemv_a8",
    "int8_gemv",
    "block_gemv",
    "block_gemv_group",
]

logger = logging.getLogger(__name__)


@functools.cache
def loaded() -> bool:
    """Whether `torch.ops.hfquant_cpu.int4_gemv` / `int8_gemv` are registered in this process: builds (or takes from
    the cache) and loads `torch_ops.so` on the first call, and registers the fake kernels torch.compile traces with.
    Never raises: False (the reason logged at INFO level) where the operators cannot be had."""
    if native.built_library() is None:
        return False
    c_compiler, cpp_compiler = native_build.c_compiler(), native_build.cpp_compiler()
    if c_compiler is None or cpp_compiler is None:
        logger.info(
            "hfquant's GEMV operators unavailable: no C++ compiler ($CXX or c++); calling the C kernels through ctypes"
        )
        return False
    try:
        torch.ops.load_library(str(native_build.build_torch_ops(c_compiler, cpp_compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.info(
            "hfquant's GEMV operators unavailable: build or load failed (%s); calling the C kernels through ctypes",
            str(detail)[-2000:],
        )
        return False
    _register_fakes()
    return True


def int4_gemv(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """`native.int4_gemv` (same arguments, same (1, N) bfloat16 result, bit for bit) through the dispatcher operator
    when it is registered (`loaded()`), else through ctypes. For measurements and checks: a layer's decode step calls
    the GEMV its plan names (`gemv.row_product`).

    Raises:
        RuntimeError: the kernels are unavailable or refused the arguments (naming them).
    """
    if loaded():
        return torch.ops.hfquant_cpu.int4_gemv(x, weight, scale_zero, group_size)
    return native.int4_gemv(x, weight, scale_zero, group_size)


def int4_gemv_avx2(x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """`native.int4_gemv_avx2` through the dispatcher operator when it is registered, else through ctypes."""
    if loaded():
        return torch.ops.hfquant_cpu.int4_gemv_avx2(x, weight, scale_zero, group_size)
    return native.int4_gemv_avx2(x, weight, scale_zero, group_size)


def int4_gemv_a8(
    x: torch.Tensor, weight: torch.Tensor, scale_zero: torch.Tensor, group_size: int, block_n: int = 64
) -> torch.Tensor:
    """`native.int4_gemv_a8` through the dispatcher operator when it is registered, else through ctypes; as
    `int4_gemv`."""
    if loaded():
        return torch.ops.hfquant_cpu.int4_gemv_a8(x, weight, scale_zero, group_size, block_n)
    return native.int4_gemv_a8(x, weight, scale_zero, group_size, block_n)


def int8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`native.int8_gemv` through the dispatcher operator when it is registered, else through ctypes; as
    `int4_gemv`."""
    if loaded():
        return torch.ops.hfquant_cpu.int8_gemv(x, weight, scale)
    return native.int8_gemv(x, weight, scale)


def block_gemv(x: torch.Tensor, weight: torch.Tensor, in_features: int, ggml_type: int) -> torch.Tensor:
    """`native.block_gemv` through the dispatcher operator when it is registered, else through ctypes; as
    `int4_gemv`."""
    if loaded():
        return torch.ops.hfquant_cpu.block_gemv(x, weight, in_features, ggml_type)
    return native.block_gemv(x, weight, in_features, ggml_type)


def block_gemv_group(
    x: torch.Tensor, weights: list[torch.Tensor], in_features: int, ggml_types: list[int]
) -> torch.Tensor:
    """`native.block_gemv_group` through the dispatcher operator when it is registered, else through ctypes; as
    `int4_gemv`."""
    if loaded():
        return torch.ops.hfquant_cpu.block_gemv_group(x, weights, in_features, ggml_types)
    return native.block_gemv_group(x, weights, in_features, ggml_types)


def _register_fakes() -> None:
    """Output shapes for torch.compile's tracing: (1, N) in the activation's dtype (the GEMVs), x's (the norm)."""

    @torch.library.register_fake("hfquant_cpu::int4_gemv")
    def _(x, weight, scale_zero, group_size):
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("hfquant_cpu::int4_gemv_avx2")
    def _(x, weight, scale_zero, group_size):
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("hfquant_cpu::int4_gemv_a8")
    def _(x, weight, scale_zero, group_size, block_n):
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("hfquant_cpu::block_gemv")
    def _(x, weight, in_features, ggml_type):
        return x.new_empty((1, weight.shape[0]))

    @torch.library.register_fake("hfquant_cpu::block_gemv_group")
    def _(x, weights, in_features, ggml_types):
        return x.new_empty((1, sum(weight.shape[0] for weight in weights)))

    @torch.library.register_fake("hfquant_cpu::rms_norm_row")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("hfquant_cpu::attention_row")
    def _(query, key, value, scale):
        return query.new_empty((1, 1, query.shape[1], query.shape[3]))

    @torch.library.register_fake("hfquant_cpu::attention_row_masked")
    def _(query, key, value, scale, mask):
        return query.new_empty((1, 1, query.shape[1], query.shape[3]))

    @torch.library.register_fake("hfquant_cpu::rotary_row")
    def _(query, key, cos, sin, head_dim):
        return (
            query.new_empty((1, query.numel() // head_dim, 1, head_dim)),
            key.new_empty((1, key.numel() // head_dim, 1, head_dim)),
        )

    @torch.library.register_fake("hfquant_cpu::decode_attention_row")
    def _(qkv, cos, sin, key_cache, value_cache, position, scale):
        return qkv.new_empty((1, 1, qkv.numel() - 2 * key_cache.shape[1] * key_cache.shape[3]))

    @torch.library.register_fake("hfquant_cpu::silu_mul_row")
    def _(gate, up):
        return torch.empty_like(gate, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hfquant_cpu::silu_mul_halves_row")
    def _(gate_up):
        return gate_up.new_empty((1, 1, gate_up.numel() // 2))

    @torch.library.register_fake("hfquant_cpu::add_rms_norm_row")
    def _(residual, hidden, weight, eps):
        return torch.empty_like(residual), torch.empty_like(residual)

    @torch.library.register_fake("hfquant_cpu::decode_layer_row")
    def _(hidden, cos, sin, key_cache, value_cache, position, weights, ints, floats):
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hfquant_cpu::decode_layer_static")
    def _(hidden, cos, sin, key_cache, value_cache, length, mask, weights, ints, floats):
        return torch.empty_like(hidden, memory_format=torch.contiguous_format)

    @torch.library.register_fake("hfquant_cpu::int8_gemv")
    def _(x, weight, scale):
        return x.new_empty((1, weight.shape[0]))
