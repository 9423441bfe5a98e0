"""A GGUF file read as hfquant's stored tensors: block types kept as their bytes, float tensors as torch tensors.

The file is memory-mapped in copy-on-write mode (`read_gguf`; `open_gguf` is gguf-py's reader, for `hfquant
inspect`): a tensor in a block type that hfquant stores (`hfquant.core.blocks.LAYOUTS`) is a (rows, K / block_size *
type_size) uint8 array viewing the file's pages, the very bytes `docs/format.md` describes for a layer in that block
format; `stored_blocks` reads those bytes from the file straight into a new tensor (`os.preadv` at the tensor's
`offset`, one tensor at a time, a Llama q/k row each into its place), so the mapping's pages are never touched (given
no open file, it copies them from the mapping and drops its pages; a write to the mapping stays in this process, the
file is never changed). Tensors that transformers keeps in float (norms, biases, a table in a
type without a layout) are decoded a chunk of rows at a time into the asked dtype, so no float32 copy of a whole table
exists.

`read_gguf` parses the header itself (`GgufFile`: the metadata and the tensors): gguf-py's reader makes two numpy
views per string of the tokenizer's arrays, about 160 MiB for SmolLM2's 49152 tokens and merges, more than the 94 MiB
file; here a string array is walked and kept as its length only (the tokenizer is read by transformers on its own).

llama.cpp stores the rows of a Llama-architecture q_proj / k_proj permuted (`gguf_export.llama_permutation`);
`llama_row_order` gives the order that undoes it, an exact reordering of whole rows of blocks.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from typing import NamedTuple

import numpy as np
import torch

from hfquant.checkpoint.gguf_export import llama_permutation
from hfquant.config import HfQuantConfig
from hfquant.core import blocks, huge_pages
from hfquant.core.optional import GGUF_IMPORT, require

gguf = require(GGUF_IMPORT)

__all__ = [
    "FLOAT_TYPES",
    "GgufTensor",
    "block_name",
    "float_tensor",
    "llama_row_order",
    "open_gguf",
    "quantization_config",
    "read_tensors",
    "file_architecture",
    "stored_blocks",
    "GgufFile",
    "read_gguf",
]

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
"""ggml types of float tensors (`GGMLQuantizationType` F32, F16, BF16): kept float, never quantized on import."""
_BY_GGML_TYPE = {layout.ggml_type: layout for layout in blocks.LAYOUTS.values()}
_CHUNK_BYTES = 4 << 20
"""Float32 bytes decoded at a time when a block tensor is dequantized (an embedding table)."""


class GgufTensor(NamedTuple):
    """One tensor of a GGUF file.

    Attributes:
        name: GGUF's name ("blk.0.attn_q.weight"), as the file spells it (untrusted text).
        ggml_type: the `GGMLQuantizationType` number the file stores.
        type_name: its name ("Q4_K", "F32"; "type 99" for a number gguf-py does not know).
        shape: (rows, K) in torch's orientation (GGUF lists dimensions innermost first), (K,) for a vector.
        data: the file's bytes as gguf-py maps them: (rows, row bytes) uint8 for block types, the values for float
            types; a view of the memory-mapped file.
        offset: where `data` starts in the file (bytes), for `stored_blocks` to read it with `os.preadv`; -1 when
            unknown.
    """

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int = -1

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight (Q4_K: 4.5; F16: 16)."""
        size = gguf.GGML_QUANT_SIZES.get(gguf.GGMLQuantizationType(self.ggml_type)) if self.known else None
        if size is None:
            return float("nan")
        block_size, type_size = size
        return type_size * 8 / block_size

    @property
    def known(self) -> bool:
        """Whether gguf-py knows the type number."""
        return self.ggml_type in gguf.GGMLQuantizationType._value2member_map_

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """gguf-py's reader of `path`, memory-mapped copy-on-write (arrays are writable; the file is never written).

    Raises:
        ValueError: not a GGUF file (gguf-py's message, with the path).
        FileNotFoundError: no such file.
    """
    try:
        return gguf.GGUFReader(path, "c")
    except (ValueError, struct.error) as error:
        raise ValueError(f"{path} is not a GGUF file gguf-py can read: {error}") from None


def read_tensors(reader: gguf.GGUFReader) -> dict[str, GgufTensor]:
    """{GGUF name: `GgufTensor`} of every tensor in `reader`, in file order."""
    tensors = {}
    for tensor in reader.tensors:
        kind = int(tensor.tensor_type)
        known = kind in gguf.GGMLQuantizationType._value2member_map_
        type_name = gguf.GGMLQuantizationType(kind).name if known else f"type {kind}"
        shape = tuple(int(n) for n in reversed([int(d) for d in tensor.shape]))
        tensors[tensor.name] = GgufTensor(tensor.name, kind, type_name, shape, tensor.data, int(tensor.data_offset))
    return tensors


class GgufFile(NamedTuple):
    """A GGUF file's header as `read_gguf` reads it.

    Attributes:
        metadata: {key: value}: ints, floats, bools, strings (UTF-8, invalid bytes replaced), a list for an array of
            numbers, and the element count (an int) for an array of strings.
        tensors: {GGUF name: `GgufTensor`} in file order, the data viewing the copy-on-write memory map.
    """

    metadata: dict[str, object]
    tensors: dict[str, GgufTensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata value types of fixed width -> struct format (8 is a string, 9 an array)."""
_VALUE_DTYPES = {0: np.float32, 1: np.float16}
"""Tensor types gguf-py maps as values (F32, F16); every other type is given as its raw bytes."""


def _string(data: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, pos)
    end = pos + 8 + length
    if end > len(data):
        raise ValueError(f"a string of {length} bytes at offset {pos} runs past the end of the file")
    return data[pos + 8 : end].decode("utf-8", errors="replace"), end


def _value(data: mmap.mmap, pos: int, kind: int) -> tuple[object, int]:
    """(one metadata value, the offset after it); an array of strings is walked and given as its length."""
    if kind in _SCALARS:
        return struct.unpack_from(_SCALARS[kind], data, pos)[0], pos + struct.calcsize(_SCALARS[kind])
    if kind == 8:
        return _string(data, pos)
    if kind != 9:
        raise ValueError(f"metadata value type {kind} at offset {pos}; allowed: 0-12")
    item, count = struct.unpack_from("<IQ", data, pos)
    pos += 12
    if item in _SCALARS:
        values = struct.unpack_from(f"<{count}{_SCALARS[item][1]}", data, pos)
        return list(values), pos + count * struct.calcsize(_SCALARS[item])
    if item != 8:
        raise ValueError(f"an array of metadata value type {item} at offset {pos}; allowed: numbers and strings")
    for _ in range(count):
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + length
    return count, pos


def _tensor_table(data: mmap.mmap, pos: int, count: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    """([(name, shape in torch's order, ggml type, offset in the data section)], the offset after the table)."""
    table = []
    for _ in range(count):
        name, pos = _string(data, pos)
        (dims,) = struct.unpack_from("<I", data, pos)
        shape = struct.unpack_from(f"<{dims}Q", data, pos + 4)
        kind, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * dims)
        pos += 16 + 8 * dims
        table.append((name, tuple(int(n) for n in reversed(shape)), kind, offset))
    return table, pos


def _tensor_data(file: np.ndarray, start: int, shape: tuple[int, ...], kind: int) -> np.ndarray:
    """The tensor's bytes in `file` as gguf-py gives them: the values for F32/F16, else (rows, row bytes) uint8 (BF16
    as its raw bytes); an empty array for a type gguf-py does not know (its size is unknown)."""
    member = gguf.GGMLQuantizationType._value2member_map_.get(kind)
    if member is None or member not in gguf.GGML_QUANT_SIZES:
        return file[:0]
    block_size, type_size = gguf.GGML_QUANT_SIZES[member]
    count = int(np.prod(shape)) if shape else 1
    nbytes = count // block_size * type_size
    if start + nbytes > file.size:
        raise ValueError(f"a tensor of {nbytes} bytes at offset {start} runs past the end of the file")
    raw = file[start : start + nbytes]
    if kind in _VALUE_DTYPES:
        return raw.view(_VALUE_DTYPES[kind]).reshape(shape)
    return raw.reshape(*shape[:-1], -1) if len(shape) > 1 else raw


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """The metadata and the tensors of the GGUF file `path` (versions 2 and 3, little endian), memory-mapped copy on
    write (arrays are writable; the file is never written), without gguf-py's objects per string (`GgufFile`).

    Raises:
        ValueError: not a GGUF file this reads (magic, version, a header or tensor past the end), naming the path.
        FileNotFoundError: no such file.
    """
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        if data[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; allowed: 2, 3 (little endian)")
        pos, metadata = 24, {}
        for _ in range(kv_count):
            key, pos = _string(data, pos)
            (kind,) = struct.unpack_from("<I", data, pos)
            metadata[key], pos = _value(data, pos + 4, kind)
        table, pos = _tensor_table(data, pos, tensor_count)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment={alignment!r}; allowed: a power of two")
        start = -(-pos // alignment) * alignment
        file = np.frombuffer(data, dtype=np.uint8)
        tensors = {}
        for name, shape, kind, offset in table:
            known = kind in gguf.GGMLQuantizationType._value2member_map_
            type_name = gguf.GGMLQuantizationType(kind).name if known else f"type {kind}"
            data = _tensor_data(file, start + offset, shape, kind)
            tensors[name] = GgufTensor(name, kind, type_name, shape, data, start + offset)
    except (ValueError, struct.error) as error:
        raise ValueError(f"{path} is not a GGUF file hfquant can read: {error}") from None
    return GgufFile(metadata, tensors)


def file_architecture(reader: gguf.GGUFReader) -> str:
    """`general.architecture` of the file ("llama", "qwen2", ...), "" when absent."""
    field = reader.fields.get("general.architecture")
    if field is None:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def block_name(tensor: GgufTensor) -> str | None:
    """The `blocks.LAYOUTS` name of the tensor's type ("q4_k"), None for any other type (float or not stored)."""
    layout = _BY_GGML_TYPE.get(tensor.ggml_type)
    return None if layout is None else layout.name


def llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """(rows,) int64 indices undoing llama.cpp's q/k row permutation: `hf = stored[order]` for a tensor of `rows` rows
    over `heads` heads (the inverse of `gguf_export.llama_permutation`, as transformers' `_reverse_permute_weights`).

    Raises:
        ValueError: rows is not a multiple of 2 * heads.
    """
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"{rows} rows cannot be {heads} heads of an even head dim (llama.cpp's q/k row permutation)")
    return torch.argsort(llama_permutation(rows, heads))


def release_pages(array: np.ndarray) -> None:
    """Drop the resident pages of the memory-mapped file that lie wholly inside `array`'s bytes (MADV_DONTNEED on the
    copy-on-write mapping: the data read from it was copied, and a later read faults the pages in again); a no-op
    where `mmap.madvise` is missing or `array` does not view a mapped file."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    mapping = root.base.obj if isinstance(root.base, memoryview) else root.base  # `read_gguf`'s np.frombuffer
    if not isinstance(mapping, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    # a memmap's array starts `offset % ALLOCATIONGRANULARITY` bytes into its mapping
    offset = array.ctypes.data - root.ctypes.data + getattr(root, "offset", 0) % mmap.ALLOCATIONGRANULARITY
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (offset + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _rows(array: np.ndarray, order: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`array` (rows, ...) copied into memory of this process (into `out` when given; rows in `order` when given);
    its file pages dropped."""
    source = torch.from_numpy(array)
    if out is None:
        out = huge_pages.empty(tuple(source.shape), dtype=source.dtype)  # a decode step streams it: on huge pages
    copy = out.copy_(source) if order is None else torch.index_select(source, 0, order, out=out)
    release_pages(array)
    return copy


_IOV_MAX = 1024
"""Buffers per `os.preadv` call (Linux's IOV_MAX)."""


def _pread_into(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Fill the byte `buffers` with the file's consecutive bytes from `offset` (`os.preadv`, short reads resumed).

    Raises:
        ValueError: the file ends first.
    """
    pending = [buffer for buffer in buffers if buffer.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        count = os.preadv(fd, batch, offset)
        if count <= 0:
            raise ValueError(f"the file ends before offset {offset}")
        offset += count
        done = 0
        while done < len(batch) and count >= batch[done].nbytes:
            count -= batch[done].nbytes
            done += 1
        pending = pending[done:]
        if count:
            pending[0] = pending[0][count:]


def _read_rows(
    fd: int, offset: int, rows: int, row_bytes: int, order: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(rows, row_bytes) uint8 read from the file `fd` at `offset` (into `out` when given), rows in `order` when given
    (`hf = stored[order]`): each stored row is read straight into its place, so no copy is reordered afterwards."""
    if out is None:
        out = huge_pages.empty((rows, row_bytes), dtype=torch.uint8)  # a decode step streams it: on huge pages
    array = out.numpy()
    if order is None:
        buffers = [memoryview(array.reshape(-1))]
    else:
        place = torch.empty_like(order)
        place[order] = torch.arange(rows)  # stored row s goes to row place[s]
        buffers = [memoryview(array[row]) for row in place.tolist()]
    _pread_into(fd, buffers, offset)
    return out


def _reads_file(tensor: GgufTensor, fd: int | None) -> bool:
    """Whether `tensor`'s bytes are read from the file `fd` with `os.preadv` rather than through the memory map: a file
    given, the tensor's offset known, and `os.preadv` present (not on every platform)."""
    return fd is not None and tensor.offset >= 0 and hasattr(os, "preadv")


def _file_copy(tensor: GgufTensor, fd: int) -> np.ndarray:
    """A copy of `tensor.data` in this process's memory, read from the file `fd` at `tensor.offset` (`os.preadv`)."""
    copy = np.empty(tensor.data.shape, dtype=tensor.data.dtype)
    _pread_into(fd, [memoryview(copy.reshape(-1).view(np.uint8))], tensor.offset)
    return copy


def stored_blocks(
    tensor: GgufTensor, order: torch.Tensor | None = None, fd: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The tensor's blocks as hfquant stores a layer in that block format: (rows, K / block_size * type_size) uint8,
    rows in `order` when given; copied out of the file, so the layer does not depend on the file staying mapped or
    unchanged. With `fd` (the file open for reading) and a known `tensor.offset` the rows are read straight into
    place (`os.preadv`): the memory map's pages are never touched. Otherwise they are copied from the map, whose
    pages are then dropped. `out`: a contiguous tensor of that shape and dtype to hold them (rows of a fused decode
    group's tensor, `hfquant.nn.fused`), returned.

    Raises:
        ValueError: the type is not one of hfquant's block formats, or the tensor is not 2-D; the file is shorter
            than the header says; `out` is not of the tensor's shape.
    """
    name = block_name(tensor)
    if name is None or len(tensor.shape) != 2:
        raise ValueError(
            f"{tensor.name}: {tensor.type_name} {tensor.shape} is not a 2-D tensor in one of hfquant's block formats "
            f"({[n.upper() for n in blocks.LAYOUTS]})"
        )
    rows, k = tensor.shape
    row_bytes = blocks.LAYOUTS[name].row_bytes(k)
    if out is not None and (out.shape != (rows, row_bytes) or out.dtype != torch.uint8 or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous ({rows}, {row_bytes}) uint8 tensor, got {out.dtype} {tuple(out.shape)}"
        )
    if _reads_file(tensor, fd):
        return _read_rows(fd, tensor.offset, rows, row_bytes, order, out)
    return _rows(tensor.data.reshape(rows, row_bytes), order, out)


def float_tensor(
    tensor: GgufTensor, dtype: torch.dtype, order: torch.Tensor | None = None, fd: int | None = None
) -> torch.Tensor:
    """The tensor's values in `dtype`, rows in `order` when given: float types are cast, block types dequantized
    (hfquant's codecs for `blocks.LAYOUTS` types, gguf-py's `dequantize` for the others) a chunk of rows at a time.
    With `fd` (the file open for reading) and a known `tensor.offset` the bytes are read with `os.preadv`, never
    through the memory map: a read fault there maps the whole folio around it (up to 2 MiB on Linux 6.18 with large
    folios in the page cache), which the 2 KiB norm vectors of a model cannot drop page by page (62 MiB of the map
    stayed resident over SmolLM2's import).

    Raises:
        ValueError: a type neither hfquant nor gguf-py can decode (named).
    """
    source = _file_copy(tensor, fd) if _reads_file(tensor, fd) else tensor.data
    if tensor.ggml_type in FLOAT_TYPES:
        array = source
        if tensor.ggml_type == 30:  # gguf-py maps BF16 as raw bytes
            values = torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
        else:
            values = torch.from_numpy(array)
        values = values.reshape(tensor.shape)
        if order is not None:
            values = values.index_select(0, order)
        values = values.to(dtype, copy=True)
        release_pages(source)
        return values
    name = block_name(tensor)
    if name is None and not (tensor.known and gguf.GGMLQuantizationType(tensor.ggml_type) in gguf.GGML_QUANT_SIZES):
        raise ValueError(f"{tensor.name}: GGUF type {tensor.type_name} cannot be decoded by hfquant or gguf-py")
    rows, k = tensor.shape if len(tensor.shape) == 2 else (1, tensor.shape[0])
    data = source.reshape(rows, -1)
    out = torch.empty((rows, k), dtype=dtype)
    step = max(1, _CHUNK_BYTES // (4 * k))
    for start in range(0, rows, step):
        index = None if order is None else order[start : start + step]
        chunk = data[start : start + step] if index is None else data[index.numpy()]
        if name is not None:
            values = blocks.dequantize(name, torch.from_numpy(np.ascontiguousarray(chunk)))
        else:
            values = torch.from_numpy(gguf.quants.dequantize(chunk, gguf.GGMLQuantizationType(tensor.ggml_type)))
        out[start : start + step] = values.reshape(-1, k)
    release_pages(source)
    return out.reshape(tensor.shape)


def quantization_config(
    layer_types: dict[str, str | None], embedding_dtype: str, tables: dict[str, str] | None = None
) -> HfQuantConfig | None:
    """The `HfQuantConfig` that stores each Linear layer as the file does: `layer_types` maps a layer's name to its
    block format ("q4_k"), or None for a layer kept in float (an F16/BF16/F32 tensor). The most common block format is
    the config's `format`, every other layer gets a `module_overrides` entry by full name, float layers go to
    `modules_to_not_convert`; RTN, no mixed precision, no folding (the blocks are what the file holds). `tables` maps
    an embedding or the output embedding kept in its block format ({"model.embed_tokens": "q8_0"}) to that format,
    each recorded as an exact-name `module_overrides` entry (how hfquant stores an embedding in blocks,
    `hfquant.integration.embeddings`). None when nothing is in a block format (a float GGUF: nothing to keep
    quantized).
    """
    tables = tables or {}
    counts = Counter(kind for kind in layer_types.values() if kind is not None) or Counter(tables.values())
    if not counts:
        return None
    main = counts.most_common(1)[0][0]
    overrides = {name: {"format": kind} for name, kind in layer_types.items() if kind is not None and kind != main}
    overrides.update({name: {"format": kind} for name, kind in tables.items()})
    kept = sorted(name for name, kind in layer_types.items() if kind is None)
    return HfQuantConfig(
        format=main,
        method="rtn",
        mixed_precision="none",
        fold_column_scales=False,
        module_overrides=overrides,
        modules_to_not_convert=kept,
        embedding_dtype=embedding_dtype,
        lm_head="keep",  # the output table is its block override, else float: never the 4-bit int default's int8
    )
