"""`QuantEmbedding`: an int8 / int4 / block-format replacement for `nn.Embedding` whose lookup dequantizes only the
rows it gathers.

The table (num_embeddings, embedding_dim) is stored exactly like a `QuantLinear` weight of out_features =
num_embeddings and in_features = embedding_dim (docs/format.md): one row per token, scales per (row, group), or the
row's llama.cpp blocks in a block format (a GGUF's Q8_0 `token_embd`, kept as the file's bytes). A tied output
embedding (lm_head) is therefore a `QuantLinear` over the same tensors, and the two share them in memory and in the
file.
"""

from __future__ import annotations

import torch
from torch import nn

from hfquant.core import blocks, packing, rtn
from hfquant.core.format import Method, StoredFormat, require_format
from hfquant.nn.linear import QuantLinear, StoredWeight, quantize_to_buffers
from hfquant.ops import block_layout, native
from hfquant.ops.kernels import INT4_KERNELS, Kernel

__all__ = ["QuantEmbedding", "gather_cpu_int4_rows"]


class QuantEmbedding(StoredWeight):
    """out[..., :] = dequantize(weight[ids]) (times `embed_scale` for scaled word embeddings), in `compute_dtype`.

    Stored tensors (registered buffers; exactly what `state_dict()` and the files hold, see docs/format.md): weight,
    weight_scale[, weight_zero_point], the tensors of `fmt` for a weight (num_embeddings, embedding_dim) as
    `StoredFormat.tensor_specs((num_embeddings,), embedding_dim)` names them; in a block format (`fmt.block`) the one
    uint8 tensor weight (num_embeddings, embedding_dim / block_size * type_size) of llama.cpp's blocks.
    Example: embedding_dim 576, int4 with group 64 -> weight (V, 288) uint8, weight_scale (V, 9), zero point (V, 9);
    Q8_0 -> weight (V, 612) uint8 (18 blocks of 34 bytes per row), `weight_scale` and `weight_zero_point` None.

    Only the gathered rows are unpacked and dequantized: a lookup of T tokens costs T * embedding_dim work whatever
    the vocabulary size. When the table is shared with a tied lm_head whose int4 CPU kernel repacked it
    (`share_with`), rows are gathered from that kernel layout, so the table exists once in memory.

    Args:
        num_embeddings, embedding_dim, padding_idx: as in `nn.Embedding` (padding_idx is informational: the
            lookup has no gradient).
        fmt: the stored format, as in `QuantLinear` (its group size, or its block size, must divide embedding_dim;
            a block format with RTN only). Read back as `format`, and `bits`, `group_size`, `symmetric`.
        dtype: the compute dtype of the returned rows.
        device: where the buffers are allocated ("meta" while transformers builds the model).
        embed_scale: a float the rows are multiplied by (Gemma-style scaled word embeddings), or None.
    Raises:
        ValueError: group_size (block size) does not divide embedding_dim, 4 bits with an odd embedding_dim, or a block
            format with SINQ (an embedding stores no column scale).
        TypeError: `fmt` is not a `StoredFormat`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        fmt: StoredFormat,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        embed_scale: float | None = None,
    ):
        require_format(fmt)
        if fmt.block is not None:
            fmt.layout.row_bytes(embedding_dim)  # ValueError naming the block size
            if fmt.method is not Method.RTN:
                raise ValueError(
                    f"a {fmt.block} embedding stores method='rtn' only (no column scale); got {fmt.method}"
                )
        elif embedding_dim % fmt.group_size:
            raise ValueError(f"group_size={fmt.group_size} does not divide embedding_dim={embedding_dim}")
        elif fmt.bits == 4 and embedding_dim % 2:
            raise ValueError(f"4-bit embeddings need an even embedding_dim, got {embedding_dim}")
        super().__init__(fmt, (num_embeddings,), embedding_dim, device)
        if fmt.block is not None:  # the blocks hold their scales: none stored beside them
            self.weight_scale = None
            self.weight_zero_point = None
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.compute_dtype = dtype or torch.bfloat16
        self.embed_scale = embed_scale
        self.set_kernel_owner(None)

    @property
    def _kernel_owner(self) -> QuantLinear | None:
        """The tied lm_head whose kernel layout `weight` is, when `share_with` found one (kept out of the submodules,
        so that it adds no state_dict keys and is not visited twice)."""
        return self.__dict__.get("_kernel_owner_")

    def set_kernel_owner(self, head: QuantLinear | None) -> None:
        """Read rows from `head`'s CPU int4 kernel layout (`weight` must be `head.weight`), or stop (None)."""
        self.__dict__["_kernel_owner_"] = head  # not `self.x = module`: nn.Module would register it

    @property
    def source(self) -> nn.Module | None:
        """The float embedding module this one replaced (on the meta device; not a submodule), if known."""
        return self.__dict__.get("_source")

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        fmt: StoredFormat,
        padding_idx: int | None = None,
        embed_scale: float | None = None,
    ) -> QuantEmbedding:
        """Quantize a float table (num_embeddings, embedding_dim) into a new module returning `weight.dtype` rows."""
        num, dim = weight.shape
        module = cls(num, dim, fmt, padding_idx, weight.dtype, "meta", embed_scale)
        for name, tensor in quantize_to_buffers(weight, fmt).items():
            setattr(module, name, tensor)
        return module

    def extra_repr(self) -> str:
        if self.format.block is not None:
            text = f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.block}"
        else:
            text = (
                f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}, "
                f"symmetric={self.symmetric}"
            )
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.embed_scale is not None:
            text += f", embed_scale={self.embed_scale:g}"
        owner = self._kernel_owner
        if owner is not None:  # a tied lm_head's kernel layout: its int4 kernel, or its block rows interleaved
            text += f", layout=rows{owner.plan.block_rows}" if self.format.block else f", layout={owner.kernel}"
        return text

    # -- sharing with a tied lm_head -------------------------------------------------------------------------------

    def share_with(self, head: QuantLinear) -> str:
        """Make this table and the tied `head` (a `QuantLinear` over the same stored tensors) one tensor in memory.

        Call after `head.prepare_kernel()`. Returns how: "shared" (the kernel reads the stored layout, e.g. int8 or
        a block format's bytes), "kernel-layout" (rows are gathered from the CPU int4 kernel layout), or "copy" (a
        kernel layout rows cannot be gathered from, e.g. CUDA int4: this module keeps its own stored-layout tensor).
        """
        if self.format.block is not None:  # one tensor; rows are gathered from the head's R8 layout where it has one
            self.weight = head.weight
            interleaved = head.plan.block_rows > 1
            self.set_kernel_owner(head if interleaved else None)
            return "kernel-layout" if interleaved else "shared"
        self.weight_scale = head.weight_scale
        self.weight_zero_point = head.weight_zero_point
        if head.kernel == Kernel.INT4PACK_MM_CPU and packing.cpu_int4_layout() is not None:
            self.weight = head.weight
            self.set_kernel_owner(head)
            return "kernel-layout"
        if head.kernel in INT4_KERNELS:
            self.set_kernel_owner(None)
            return "copy"
        self.weight = head.weight
        self.set_kernel_owner(None)
        return "shared"

    def stored_weight(self) -> torch.Tensor:
        """`weight` in the stored (file) layout."""
        if self._kernel_owner is not None:
            return self._kernel_owner.stored_weight()
        return self.weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._kernel_owner is not None and prefix + "weight" in destination:
            destination[prefix + "weight"] = self.stored_weight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if self._kernel_owner is not None:  # loading writes the stored layout: stop reading the kernel layout
            self.weight = self.stored_weight()
            self.set_kernel_owner(None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- compute ---------------------------------------------------------------------------------------------------

    def _rows_codes(self, rows: torch.Tensor) -> torch.Tensor:
        """(R,) row indices -> (R, embedding_dim) codes (int8 values, or uint8 codes at 4 bits)."""
        if self._kernel_owner is not None:
            return gather_cpu_int4_rows(self.weight, rows, self.num_embeddings, self.embedding_dim)
        gathered = self.weight.index_select(0, rows)
        return packing.unpack_int4(gathered) if self.bits == 4 else gathered

    def _block_rows(self, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """(R, embedding_dim) rows `rows` (all when None) of a block-format table in `dtype`: only the gathered rows'
        blocks are decoded (`blocks.dequantize`, float32 values as llama.cpp's and gguf-py's decoders give them, then
        rounded once to `dtype`). One bfloat16 row in eager on the CPU (a decode step's token) is decoded by the C
        library instead (`native.block_dequantize_t`, the same bytes): the Python decoder's tensor operations took
        0.2 ms of a 1.2B Q4_K_M decode step at one thread (docs/performance.md, issue #30, eleventh session)."""
        if rows is not None and rows.numel() == 1 and dtype == torch.bfloat16 and self.weight.device.type == "cpu":
            row = self._native_row(int(rows.reshape(())))
            if row is not None:
                return row
        if rows is None:
            data = self.stored_weight()
        else:
            k, block, layout = self.embedding_dim, self.format.block, self._block_layout_rows()
            data = block_layout.gather_rows(self.weight, k, block, layout, rows.reshape(-1))
        return blocks.dequantize(self.format.block, data).to(dtype)

    def _block_layout_rows(self) -> int:
        """The rows per group of the layout `weight` is in: its kernel owner's (a tied lm_head in R8), else 1."""
        owner = self._kernel_owner
        return 1 if owner is None else owner.plan.block_rows

    def _native_row(self, row: int) -> torch.Tensor | None:
        """(1, embedding_dim) bfloat16 row `row` of a block-format table decoded by the C library, or None where it
        does not apply (a compiled graph, no library, a row out of range: the caller's path raises as usual)."""
        weight = self.weight
        if torch.compiler.is_compiling() or not weight.is_contiguous() or not 0 <= row < self.num_embeddings:
            return None
        if native.built_library() is None:
            return None
        out = torch.empty((self.embedding_dim, 1), dtype=torch.bfloat16)
        ggml_type = block_layout.kernel_type(self.format.block, self._block_layout_rows())
        return native.block_dequantize_t(weight, self.embedding_dim, ggml_type, row, row + 1, out).view(1, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float table (num_embeddings, embedding_dim) in `dtype` (without `embed_scale`)."""
        if self.format.block is not None:
            return self._block_rows(None, dtype)
        rows = torch.arange(self.num_embeddings, device=self.weight.device)
        return rtn.dequantize_weight(
            self._rows_codes(rows), self.weight_scale, self.weight_zero_point, self.bits, self.symmetric, dtype
        )

    @torch.no_grad()
    def dequantize_to_float(self, dtype: torch.dtype) -> nn.Embedding:
        """The float embedding this one replaced (same class: a scaled word embedding stays one), its table
        dequantized to `dtype`."""
        weight = self.dequantize(dtype)
        layer = self.source
        if layer is None:
            layer = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta")
        layer.weight = nn.Parameter(weight, requires_grad=False)
        if self.embed_scale is not None and isinstance(layer._buffers.get("embed_scale"), torch.Tensor):
            layer.embed_scale = torch.tensor(self.embed_scale, device=weight.device)
        return layer

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.reshape(-1)
        if self.format.block is not None:
            out = self._block_rows(rows, self.compute_dtype)
        else:
            zero_point = None if self.weight_zero_point is None else self.weight_zero_point.index_select(0, rows)
            out = rtn.dequantize_weight(
                self._rows_codes(rows),
                self.weight_scale.index_select(0, rows),
                zero_point,
                self.bits,
                self.symmetric,
                self.compute_dtype,
            )
        if self.embed_scale is not None:
            # as the float module does: the scale rounded to the activation dtype, then multiplied
            out = out * torch.tensor(self.embed_scale, dtype=torch.float32, device=out.device).to(out.dtype)
        return out.reshape(*input_ids.shape, self.embedding_dim)


def gather_cpu_int4_rows(packed: torch.Tensor, rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Codes (R, K) of `rows` of an (N, K) int4 weight held in the CPU kernel layout (`hfquant.core.packing`).

    Full blocks of `block_n` rows are stored as (K, block_n / 2) bytes; byte [k, j] holds rows j and j + block_n / 2
    ("halves") or rows 2j and 2j + 1 ("pairs") in its low and high nibble; a short last block is always "pairs".
    Reads R * K / 2 bytes; nothing else of the table is unpacked.
    """
    layout = packing.cpu_int4_layout()
    if layout is None:
        raise RuntimeError("the CPU int4 kernel layout is not available in this PyTorch build")
    block = layout.block_n
    full = n - n % block
    flat = packed.reshape(-1)
    columns = torch.arange(k, device=packed.device)
    codes = torch.empty((rows.numel(), k), dtype=torch.uint8, device=packed.device)
    in_full = rows < full
    if bool(in_full.any()):
        r = rows[in_full]
        b, i = r // block, r % block
        if layout.full_blocks_halves:
            j, high = i % (block // 2), i >= block // 2
        else:
            j, high = i // 2, (i % 2) == 1
        blocks = flat[: full * k // 2].view(full // block, k, block // 2)
        values = blocks[b[:, None], columns[None, :], j[:, None]]
        codes[in_full] = torch.where(high[:, None], values >> 4, values & 0x0F)
    if not bool(in_full.all()):
        r = rows[~in_full] - full
        tail = flat[full * k // 2 :].view(k, (n - full) // 2)
        values = tail[columns[None, :], (r // 2)[:, None]]
        codes[~in_full] = torch.where(((r % 2) == 1)[:, None], values >> 4, values & 0x0F)
    return codes
