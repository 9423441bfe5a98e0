"""The compute layout of a block-format layer's weight: its stored rows, or its rows interleaved by 8 ("R8") or 16
("R16").

Storage is GGUF's row layout (`hfquant.core.blocks`: each row its blocks in input order); files, state dicts and
exports always hold it. On CPUs whose block GEMVs run the AVX2 body, IQ4_NL, IQ4_XS and Q3_K layers run faster with
their rows interleaved in groups of 8 (`csrc/blocks_cpu.c`, `hfquant_block_interleave`: within each group of 8 rows
a fixed permutation of their bytes, so that one activation load serves 8 rows and their block scales are one vector,
as llama.cpp's own repacked `IQ4_NL` GEMV does on AVX2). The kernels take such a weight under its R8 type code
(`kernel_type`). A layer's plan (`KernelPlan.block_rows`, decided by `rows_for`) says which layout its `weight`
holds; `QuantLinear` switches at `prepare_kernel` (`to_compute`) and gives the stored bytes back for a save
(`to_storage`), exactly.

On CPUs whose block GEMVs run the AVX512-VNNI body, IQ4_XS layers take the R16 layout instead (`csrc/blocks_cpu.c`,
after r8_offset: 16 rows per group, so that int32 lane r of a 512-bit register is row r's): its GEMV read 1.13-1.16x
the row kernel's GB/s from memory on the 1.2B's layer shapes on an AVX-512 Xeon, and a one-thread decode step took
1/1.14 of the time (docs/performance.md, issue #32, twenty-sixth session); the other types keep their stored rows
there.

`HFQUANT_BLOCK_ROWS=1` keeps the stored layout everywhere (for A/B measurements), 8 interleaves wherever the R8 GEMVs
run (any x86-64 CPU with AVX2), 16 takes R16 wherever its GEMV runs (IQ4_XS on AVX512-VNNI) and the stored layout
elsewhere; unset: R16 for IQ4_XS where the VNNI body runs, R8 where it does not.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import torch

from hfquant.core import blocks, huge_pages
from hfquant.ops import native, torch_ops

__all__ = ["ROWS", "ROWS16", "rows_for", "kernel_type", "to_compute", "to_storage", "storage_rows", "gather_rows"]

ROWS = 8
"""Rows per interleaved group of the R8 layout."""

ROWS16 = 16
"""Rows per interleaved group of the R16 layout."""

_ENV = "HFQUANT_BLOCK_ROWS"

logger = logging.getLogger(__name__)


def _requested() -> int | None:
    """`HFQUANT_BLOCK_ROWS`: "1" (the stored layout), "8" (R8 wherever its GEMVs run), "16" (R16 where its GEMV runs)
    or unset (None: the CPU's default, `rows_for`); ValueError for anything else."""
    value = os.environ.get(_ENV, "").strip()
    if value not in ("", "1", "8", "16"):
        raise ValueError(
            f"{_ENV}={value!r} is not understood; use 1 (stored rows), 8 (rows interleaved by 8) or 16 (by 16)"
        )
    return int(value) if value else None


def _row_kernels_preferred() -> bool:
    """Whether the block GEMVs' AVX512-VNNI body runs here (`native.isa()`): its row kernels stay the default there.
    R8's GEMVs are AVX2 bodies (they run on such a CPU too, for a model interleaved elsewhere and pickled); R8 was
    measured only on an AVX2-only Zen 3, never against the VNNI row kernels (docs/performance.md, twenty-second
    session)."""
    return {"avx512", "avx512_vnni"} <= set(native.isa())


def rows_for(block: str, out_features: int) -> int:
    """The rows per group of the compute layout of a CPU layer in block type `block` with `out_features` rows whose
    one-row kernel is the block GEMV. Where the VNNI row kernels run (`_row_kernels_preferred`): `ROWS16` for a type
    with an R16 layout whose GEMV runs here (`native.block_rows16_supported`), `ROWS16` dividing the rows, else 1.
    Elsewhere: `ROWS` where the R8 GEMV runs here for the type (`native.block_rows8_supported`) and `ROWS` divides the
    rows, else 1. `HFQUANT_BLOCK_ROWS` (1, 8 or 16) overrides the choice of layout (module docstring)."""
    requested = _requested()
    if requested == 1:
        return 1
    if requested == ROWS16 or (requested is None and _row_kernels_preferred()):
        supported = native.block_rows16_supported(blocks.layout(block).ggml_type)  # False for a type without R16
        return ROWS16 if supported and out_features % ROWS16 == 0 and _rows_work(block, ROWS16) else 1
    if out_features % ROWS:
        return 1
    return ROWS if native.block_rows8_supported(blocks.layout(block).ggml_type) and _rows_work(block, ROWS) else 1


@functools.cache
def _rows_work(block: str, rows: int) -> bool:
    """True if the GEMV of `block` in the layout of `rows` (`ROWS` or `ROWS16`) agrees on a small random layer (64 x
    512 of the type's default quantization) with the row kernel, within float32 summation and a bfloat16 step (2^-7 of
    each output plus 1% of the output range), through ctypes and the dispatcher operator alike. Cached per type and
    layout; a disagreement is logged and the type keeps the stored layout."""
    ggml_type, k = blocks.layout(block).ggml_type, 512
    generator = torch.Generator().manual_seed(0)
    data = native.block_codes(block, torch.randn((64, k), generator=generator))
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    want = native.block_gemv(x, data, k, ggml_type).float()
    interleaved, code = native.block_interleave(data, k, ggml_type, rows=rows), kernel_type(block, rows)
    bound = want.abs() / 128 + 0.01 * want.abs().max()
    got = [native.block_gemv(x, interleaved, k, code).float()]
    if torch_ops.loaded():
        got.append(torch_ops.block_gemv(x, interleaved, k, code).float())
    works = all(bool(((y - want).abs() <= bound).all()) for y in got)
    if not works:
        logger.warning(
            "hfquant's R%d GEMV disagrees with the row kernel for %s; keeping the stored layout", rows, block
        )
    return works


def kernel_type(block: str, rows: int) -> int:
    """The type code the C kernels take for a weight of block type `block` in the layout of `rows` (1, `ROWS` or
    `ROWS16`): the GGUF type number, with `native.BLOCK_ROWS8` set for R8, `native.BLOCK_ROWS16` for R16."""
    return native.layout_code(blocks.layout(block).ggml_type, rows)


def to_compute(stored: torch.Tensor, in_features: int, block: str, rows: int, in_place: bool) -> torch.Tensor:
    """The (N, row bytes) uint8 `stored` weight in the layout of `rows`: `stored` itself for 1; for `ROWS` or `ROWS16`
    its bytes interleaved, written back into `stored` where `in_place` (a weight nothing else reads: the load's own),
    else into new memory (on huge pages where large: a decode step streams it)."""
    if rows == 1:
        return stored
    ggml_type = blocks.layout(block).ggml_type
    # R16's gathers copy 16 rows at a time and write them back in place
    if in_place and rows == ROWS16 and native.block_rows16_supported(ggml_type):
        return native.block_interleave(stored, in_features, ggml_type, out=stored, rows=rows)
    if in_place:  # the C permutation by runs reads and writes distinct memory: through one copy (`_staged`)
        return native.block_interleave(_staged(stored), in_features, ggml_type, out=stored, rows=rows)
    return native.block_interleave(
        stored, in_features, ggml_type, out=huge_pages.empty(tuple(stored.shape), stored.dtype), rows=rows
    )


_staging = threading.local()
"""Per thread, `_staged`'s buffer (`buffer`), kept between in-place interleaves until `release_staging`."""


def _staged(stored: torch.Tensor) -> torch.Tensor:
    """A copy of the contiguous `stored` in this thread's staging buffer (grown to the largest weight asked for): a load
    interleaves every block weight in place, and a new copy each time faulted in fresh pages (`release_staging`)."""
    buffer = getattr(_staging, "buffer", None)
    if buffer is None or buffer.numel() < stored.numel():
        _staging.buffer = None  # freed before its successor: peak memory is the new size
        buffer = _staging.buffer = torch.empty(stored.numel(), dtype=torch.uint8)
    return buffer[: stored.numel()].view(stored.shape).copy_(stored)


def release_staging() -> None:
    """Free this thread's staging buffer (`_staged`), e.g. after a load's last in-place interleave."""
    _staging.buffer = None


def to_storage(weight: torch.Tensor, in_features: int, block: str, rows: int) -> torch.Tensor:
    """Inverse of `to_compute`: the stored bytes of a weight in the layout of `rows` (`weight` itself for 1, a new
    tensor for `ROWS` or `ROWS16`; any device)."""
    if rows == 1:
        return weight
    if weight.device.type == "cpu":
        return native.block_interleave(weight, in_features, blocks.layout(block).ggml_type, inverse=True, rows=rows)
    return storage_rows(weight, in_features, block, rows, 0, weight.shape[0])


def storage_rows(weight: torch.Tensor, in_features: int, block: str, rows: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the stored bytes of `weight` (layout of `rows`), by torch indexing: traceable by
    torch.compile and on any device (prefill and backward read a chunk of rows at a time)."""
    if rows == 1:
        return weight[start:stop]
    first, last = start // rows * rows, -(-stop // rows) * rows
    groups = weight[first:last].reshape(-1, rows * weight.shape[1])
    inverse = _inverse_permutation(block, in_features, rows).to(weight.device)
    return groups[:, inverse].view(-1, weight.shape[1])[start - first : stop - first]


def gather_rows(weight: torch.Tensor, in_features: int, block: str, rows: int, index: torch.Tensor) -> torch.Tensor:
    """The stored bytes of rows `index` ((R,) int64) of `weight` (layout of `rows`), (R, row bytes): a tied
    embedding's lookup in its lm_head's weight. Only the groups of `rows` holding those rows are read."""
    if rows == 1:
        return weight.index_select(0, index)
    row_bytes = weight.shape[1]
    groups = weight.view(-1, rows * row_bytes).index_select(0, torch.div(index, rows, rounding_mode="floor"))
    inverse = _inverse_permutation(block, in_features, rows).to(weight.device)
    stored = groups[:, inverse].view(-1, rows, row_bytes)
    return stored[torch.arange(index.numel(), device=weight.device), index % rows]


@functools.cache
def _inverse_permutation(block: str, in_features: int, rows: int) -> torch.Tensor:
    """For one group of `rows` rows flattened, the interleaved position of each stored byte: `stored =
    interleaved[inverse]`. Read off the C permutation itself (`native.block_interleave` of the positions written in
    base-256 digits), so there is one definition of the layout."""
    ggml_type = blocks.layout(block).ggml_type
    row_bytes = blocks.layout(block).row_bytes(in_features)
    positions = torch.arange(rows * row_bytes, dtype=torch.int64)
    source = torch.zeros(rows * row_bytes, dtype=torch.int64)  # source[q]: the stored position of interleaved byte q
    for digit in range(3):
        part = ((positions >> (8 * digit)) & 255).to(torch.uint8).view(rows, row_bytes)
        moved = native.block_interleave(part, in_features, ggml_type, rows=rows).view(-1).to(torch.int64)
        source |= moved << (8 * digit)
    inverse = torch.empty_like(source)
    inverse[source] = positions
    return inverse
