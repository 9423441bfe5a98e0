"""llama.cpp's block formats (GGUF's quantized types) as hfquant stores them: one table of layouts, one entry point
to quantize a float matrix into blocks and to dequantize them back.

A weight (rows, K) in a block format is stored as one uint8 tensor (rows, K // block_size * type_size): each row is
its blocks in input order, each block the bytes of llama.cpp's `block_<type>` struct (`ggml-common.h`), little
endian. The bytes are exactly a GGUF tensor's data, so GGUF export and import are copies (docs/format.md).

The codecs live in one module per family, each defining `quantize_<name>(weight, importance=None)` and
`dequantize_<name>(data)` with the shapes of `quantize` and `dequantize` below:
- `legacy`: 32-weight blocks with a float16 scale (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0);
- `kquants`: 256-weight super-blocks with quantized block scales (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K);
- `iq4`: 4-bit codes on llama.cpp's non-uniform grid (IQ4_NL, 32-weight blocks; IQ4_XS, 256-weight super-blocks);
- `hq3`: hfquant's own HQ3_0 and HQ3_NL (3-bit codes, 32-weight blocks, 3.5 bits per weight; HQ3_NL's codes on a
  non-uniform grid with a zero), not GGUF types (`gguf` False);
- `hq3r`: hfquant's own HQ3_R (HQ3_NL's codes, a 6-bit scale per 16 weights under a float16 per row: a 2-byte row
  header, `row_header`, then 27-byte blocks of 64 weights; 3.375 + 16 / K bits per weight).
"""

from __future__ import annotations

import dataclasses

import torch

from . import hq3, hq3r, iq4, kquants, legacy

__all__ = ["BlockLayout", "LAYOUTS", "layout", "quantize", "dequantize"]


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """One of llama.cpp's block types.

    Attributes:
        name: the GGUF type name in lower case ("q4_k"), as configs and messages write it.
        ggml_type: gguf-py's `GGMLQuantizationType` value (the number a GGUF file stores).
        block_size: weights per block (32, or 256 for a super-block, llama.cpp's QK_K).
        type_size: bytes per block (`sizeof(block_<type>)` in ggml-common.h).
        bits: bits of one code (the nominal bit width a config asks for).
        symmetric: whether a block is only scaled (w = d * q on a grid centred on 0), not also offset by a stored
            minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K: w = d * q - m).
        fallback: the type llama.cpp's quantizer uses for rows that `block_size` does not divide (llama-quant.cpp),
            None for 32-weight types.
        family: the module under `hfquant.core.blocks` that holds the codec.
        gguf: whether GGUF has the type (False: hfquant's own format, `ggml_type` then a number >= 1000 that only
            hfquant's kernels read; the GGUF and compressed-tensors exports refuse it).
        row_header: bytes stored at the start of every row before its blocks (HQ3_R's float16 row scale: 2; 0 for
            every GGUF type).
    """

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    bits: int
    symmetric: bool
    fallback: str | None
    family: str
    gguf: bool = True
    row_header: int = 0

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight of the blocks, block metadata included (Q4_K: 144 * 8 / 256 = 4.5); a row header
        adds `row_bits_per_weight(K) - bits_per_weight`."""
        return self.type_size * 8 / self.block_size

    def row_bits_per_weight(self, in_features: int) -> float:
        """Stored bits per weight of rows of `in_features` weights, the row header included (HQ3_R at 576: 3.403).

        Raises:
            ValueError: `block_size` does not divide `in_features`.
        """
        return self.row_bytes(in_features) * 8 / in_features

    def in_features_of(self, row_bytes: int) -> int:
        """The weights of a stored row of `row_bytes` bytes (the inverse of `row_bytes`).

        Raises:
            ValueError: `row_bytes` is not a row header and whole blocks.
        """
        body = row_bytes - self.row_header
        if body < 0 or body % self.type_size:
            raise ValueError(
                f"{self.name} rows are {self.row_header} header byte(s) and whole {self.type_size}-byte blocks; got "
                f"{row_bytes} bytes"
            )
        return body // self.type_size * self.block_size

    def divides(self, in_features: int) -> bool:
        """Whether rows of `in_features` weights are whole blocks of this type."""
        return in_features > 0 and in_features % self.block_size == 0

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one stored row of `in_features` weights.

        Raises:
            ValueError: `block_size` does not divide `in_features`.
        """
        if not self.divides(in_features):
            raise ValueError(
                f"{self.name} stores rows in blocks of {self.block_size} weights; in_features={in_features} is not a "
                f"multiple of {self.block_size}"
                + (f" (llama.cpp uses {self.fallback} for such rows)" if self.fallback else "")
            )
        return self.row_header + in_features // self.block_size * self.type_size


def _whole_row(fmt: BlockLayout, row_bytes: int) -> bool:
    """Whether `row_bytes` is a row of `fmt`: its row header and whole blocks (`BlockLayout.in_features_of`)."""
    try:
        fmt.in_features_of(row_bytes)
    except ValueError:
        return False
    return True


def _layouts(*rows: tuple) -> dict[str, BlockLayout]:
    return {row[0]: BlockLayout(*row) for row in rows}


LAYOUTS: dict[str, BlockLayout] = _layouts(
    # name, ggml_type, block_size, type_size, bits, symmetric, fallback, family[, gguf, row_header]
    ("q4_0", 2, 32, 18, 4, True, None, "legacy"),
    ("q4_1", 3, 32, 20, 4, False, None, "legacy"),
    ("q5_0", 6, 32, 22, 5, True, None, "legacy"),
    ("q5_1", 7, 32, 24, 5, False, None, "legacy"),
    ("q8_0", 8, 32, 34, 8, True, None, "legacy"),
    ("q2_k", 10, 256, 84, 2, False, "iq4_nl", "kquants"),
    ("q3_k", 11, 256, 110, 3, True, "iq4_nl", "kquants"),
    ("q4_k", 12, 256, 144, 4, False, "q5_0", "kquants"),
    ("q5_k", 13, 256, 176, 5, False, "q5_1", "kquants"),
    ("q6_k", 14, 256, 210, 6, True, "q8_0", "kquants"),
    ("iq4_nl", 20, 32, 18, 4, True, None, "iq4"),
    ("iq4_xs", 23, 256, 136, 4, True, "iq4_nl", "iq4"),
    ("hq3_0", 1000, 32, 14, 3, True, None, "hq3", False),
    ("hq3_nl", 1001, 32, 14, 3, True, None, "hq3", False),
    ("hq3_r", 1002, 64, 27, 3, True, "hq3_nl", "hq3r", False, 2),
)
"""Every block type hfquant stores, by name (sizes from ggml-common.h; gguf-py's `GGML_QUANT_SIZES` agrees)."""


def layout(name: str) -> BlockLayout:
    """The layout named `name` (case-insensitive).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    found = LAYOUTS.get(str(name).lower()) if isinstance(name, str) else None
    if found is None:
        raise ValueError(f"unknown block format {name!r}; allowed values are {list(LAYOUTS)}")
    return found


_FAMILIES = {"hq3": hq3, "hq3r": hq3r, "iq4": iq4, "kquants": kquants, "legacy": legacy}
"""`BlockLayout.family` -> its codec module, imported with the package: a `torch.compile` graph that dequantizes
blocks (a block-format embedding's lookup) cannot trace `importlib.import_module`."""


def _codec(name: str, verb: str):
    fmt = layout(name)
    return fmt, getattr(_FAMILIES[fmt.family], f"{verb}_{fmt.name}")


def quantize(name: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize `weight` into blocks of type `name`.

    Args:
        name: a `LAYOUTS` name.
        weight: (rows, K) float tensor; K a multiple of the type's `block_size`.
        importance: optional (K,) or (rows, K) float32 weights >= 0 of each element's squared error in the search for
            block scales (None: the type's data-free default, `importance.default_importance`).
    Returns:
        (rows, row_header + K // block_size * type_size) uint8: the blocks as GGUF stores them.
    Raises:
        ValueError: an unknown name, a weight that is not 2-D, or K not a multiple of the block size.
    """
    fmt, function = _codec(name, "quantize")
    if weight.dim() != 2:
        raise ValueError(f"{fmt.name} quantizes a 2-D (rows, in_features) weight; got shape {tuple(weight.shape)}")
    fmt.row_bytes(weight.shape[1])
    if importance is None:
        from .importance import default_importance

        importance = default_importance(fmt.name, weight)
    return function(weight, importance)


def dequantize(name: str, data: torch.Tensor) -> torch.Tensor:
    """The float32 weights (rows, K) of blocks `data` (rows, K // block_size * type_size) uint8 of type `name`.

    Raises:
        ValueError: an unknown name, or data that is not 2-D uint8 of whole blocks.
    """
    fmt, function = _codec(name, "dequantize")
    if data.dtype != torch.uint8 or data.dim() != 2 or not _whole_row(fmt, data.shape[1]):
        header = f"a {fmt.row_header}-byte row header and " if fmt.row_header else ""
        raise ValueError(
            f"{fmt.name} blocks are a 2-D uint8 tensor of {header}whole {fmt.type_size}-byte blocks per row; got "
            f"{data.dtype} {tuple(data.shape)}"
        )
    return function(data)
