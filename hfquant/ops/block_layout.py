"""The compute layout of a block-format layer's weight: its stored rows, or its rows interleaved by 8 ("R8").

Storage is GGUF's row layout (`hfquant.core.blocks`: each row its blocks in input order); files, state dicts and
exports always hold it. On CPUs whose block GEMVs run the AVX2 body, IQ4_NL, IQ4_XS and Q3_K layers run faster with
their rows interleaved in groups of 8 (`csrc/blocks_cpu.c`, `hfquant_block_interleave`: within each group of 8 rows
a fixed permutation of their bytes, so that one activation load serves 8 rows and their block scales are one vector,
as llama.cpp's own repacked `IQ4_NL` GEMV does on AVX2). The kernels take such a weight under its R8 type code
(`kernel_type`). A layer's plan (`KernelPlan.block_rows`, decided by `rows_for`) says which layout its `weight`
holds; `QuantLinear` switches at `prepare_kernel` (`to_compute`) and gives the stored bytes back for a save
(`to_storage`), exactly.

`HFQUANT_BLOCK_ROWS=1` keeps the stored layout everywhere (for A/B measurements), 8 interleaves wherever the R8 GEMVs
run (any x86-64 CPU with AVX2), unset: R8 where the VNNI row kernels do not run.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from hfquant.core import blocks, huge_pages
from hfquant.ops import native, torch_ops

__all__ = ["ROWS", "rows_for", "kernel_type", "to_compute", "to_storage", "storage_rows", "gather_rows"]

ROWS = 8
"""Rows per interleaved group of the R8 layout."""

_ENV = "HFQUANT_BLOCK_ROWS"

logger = logging.getLogger(__name__)


def _requested() -> int | None:
    """`HFQUANT_BLOCK_ROWS`: "1" (the stored layout), "8" (R8 wherever its GEMVs run) or unset (None: R8 where it is
    the default); ValueError for anything else."""
    value = os.environ.get(_ENV, "").strip()
    if value not in ("", "1", "8"):
        raise ValueError(f"{_ENV}={value!r} is not understood; use 1 (stored rows) or 8 (rows interleaved by 8)")
    return int(value) if value else None


def _row_kernels_preferred() -> bool:
    """Whether the block GEMVs' AVX512-VNNI body runs here (`native.isa()`): its row kernels stay the default there.
    R8's GEMVs are AVX2 bodies (they run on such a CPU too, for a model interleaved elsewhere and pickled); R8 was
    measured only on an AVX2-only Zen 3, never against the VNNI row kernels (docs/performance.md, twenty-second
    session)."""
    return {"avx512", "avx512_vnni"} <= set(native.isa())


def rows_for(block: str, out_features: int) -> int:
    """The rows per group of the compute layout of a CPU layer in block type `block` with `out_features` rows whose
    one-row kernel is the block GEMV: `ROWS` where the R8 GEMV runs here for the type (`native.block_rows8_supported`),
    `ROWS` divides the rows and the VNNI row kernels do not run (`_row_kernels_preferred`; `HFQUANT_BLOCK_ROWS=8`
    overrides that), else 1 (the stored layout)."""
    requested = _requested()
    if out_features % ROWS or requested == 1 or (requested is None and _row_kernels_preferred()):
        return 1
    return ROWS if native.block_rows8_supported(blocks.layout(block).ggml_type) and _rows8_works(block) else 1


@functools.cache
def _rows8_works(block: str) -> bool:
    """True if the R8 GEMV of `block` agrees on a small random layer (64 x 512 of the type's default quantization)
    with the row kernel, within float32 summation and a bfloat16 step (2^-7 of each output plus 1% of the output
    range), through ctypes and the dispatcher operator alike. Cached per type; a disagreement is logged and the type
    keeps the stored layout."""
    ggml_type, k = blocks.layout(block).ggml_type, 512
    generator = torch.Generator().manual_seed(0)
    data = native.block_codes(block, torch.randn((64, k), generator=generator))
    x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
    want = native.block_gemv(x, data, k, ggml_type).float()
    interleaved, code = native.block_interleave(data, k, ggml_type), ggml_type | native.BLOCK_ROWS8
    bound = want.abs() / 128 + 0.01 * want.abs().max()
    got = [native.block_gemv(x, interleaved, k, code).float()]
    if torch_ops.loaded():
        got.append(torch_ops.block_gemv(x, interleaved, k, code).float())
    works = all(bool(((y - want).abs() <= bound).all()) for y in got)
    if not works:
        logger.warning("hfquant's R8 GEMV disagrees with the row kernel for %s; keeping the stored layout", block)
    return works


def kernel_type(block: str, rows: int) -> int:
    """The type code the C kernels take for a weight of block type `block` in the layout of `rows` (1 or `ROWS`): the
    GGUF type number, with `native.BLOCK_ROWS8` set for R8."""
    ggml_type = blocks.layout(block).ggml_type
    return ggml_type | native.BLOCK_ROWS8 if rows == ROWS else ggml_type


def to_compute(stored: torch.Tensor, in_features: int, block: str, rows: int, in_place: bool) -> torch.Tensor:
    """The (N, row bytes) uint8 `stored` weight in the layout of `rows`: `stored` itself for 1; for `ROWS` its bytes
    interleaved, written back into `stored` where `in_place` (a weight nothing else reads: the load's own), else into
    new memory (on huge pages where large: a decode step streams it)."""
    if rows == 1:
        return stored
    ggml_type = blocks.layout(block).ggml_type
    if in_place:  # the C permutation reads and writes distinct memory: through one temporary copy
        return native.block_interleave(stored.clone(), in_features, ggml_type, out=stored)
    return native.block_interleave(
        stored, in_features, ggml_type, out=huge_pages.empty(tuple(stored.shape), stored.dtype)
    )


def to_storage(weight: torch.Tensor, in_features: int, block: str, rows: int) -> torch.Tensor:
    """Inverse of `to_compute`: the stored bytes of a weight in the layout of `rows` (`weight` itself for 1, a new
    tensor for `ROWS`; any device)."""
    if rows == 1:
        return weight
    if weight.device.type == "cpu":
        return native.block_interleave(weight, in_features, blocks.layout(block).ggml_type, inverse=True)
    return storage_rows(weight, in_features, block, rows, 0, weight.shape[0])


def storage_rows(weight: torch.Tensor, in_features: int, block: str, rows: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the stored bytes of `weight` (layout of `rows`), by torch indexing: traceable by
    torch.compile and on any device (prefill and backward read a chunk of rows at a time)."""
    if rows == 1:
        return weight[start:stop]
    first, last = start // ROWS * ROWS, -(-stop // ROWS) * ROWS
    groups = weight[first:last].reshape(-1, ROWS * weight.shape[1])
    inverse = _inverse_permutation(block, in_features).to(weight.device)
    return groups[:, inverse].view(-1, weight.shape[1])[start - first : stop - first]


def gather_rows(weight: torch.Tensor, in_features: int, block: str, rows: int, index: torch.Tensor) -> torch.Tensor:
    """The stored bytes of rows `index` ((R,) int64) of `weight` (layout of `rows`), (R, row bytes): a tied
    embedding's lookup in its lm_head's weight. Only the groups of 8 holding those rows are read."""
    if rows == 1:
        return weight.index_select(0, index)
    row_bytes = weight.shape[1]
    groups = weight.view(-1, ROWS * row_bytes).index_select(0, torch.div(index, ROWS, rounding_mode="floor"))
    inverse = _inverse_permutation(block, in_features).to(weight.device)
    stored = groups[:, inverse].view(-1, ROWS, row_bytes)
    return stored[torch.arange(index.numel(), device=weight.device), index % ROWS]


@functools.cache
def _inverse_permutation(block: str, in_features: int) -> torch.Tensor:
    """For one group of `ROWS` rows flattened, the R8 position of each stored byte: `stored = r8[inverse]`. Read off
    the C permutation itself (`native.block_interleave` of the positions written in base-256 digits), so there is one
    definition of the layout."""
    ggml_type = blocks.layout(block).ggml_type
    row_bytes = blocks.layout(block).row_bytes(in_features)
    positions = torch.arange(ROWS * row_bytes, dtype=torch.int64)
    source = torch.zeros(ROWS * row_bytes, dtype=torch.int64)  # source[q]: the stored position of R8 byte q
    for digit in range(3):
        part = ((positions >> (8 * digit)) & 255).to(torch.uint8).view(ROWS, row_bytes)
        moved = native.block_interleave(part, in_features, ggml_type).view(-1).to(torch.int64)
        source |= moved << (8 * digit)
    inverse = torch.empty_like(source)
    inverse[source] = positions
    return inverse
