"""The stored format of a quantized weight: one value (`StoredFormat`) that names its tensors, dtypes and shapes once.

Every quantized module (`QuantLinear`, `QuantEmbedding`, `QuantExperts`), the quantization on load and the checkpoint
checks read the layout from here; docs/format.md describes the same layout for the files.
"""

from __future__ import annotations

import dataclasses

import torch

from hfquant.core import blocks, huge_pages, rtn
from hfquant.core.choice import Choice

__all__ = ["Method", "StoredFormat", "SUPPORTED_BITS", "format_name", "require_format"]

SUPPORTED_BITS = (8, 4)
"""Bit widths of the uniform integer formats (a block format has its own, `blocks.BlockLayout.bits`)."""


class Method(Choice):
    """How the integer codes were computed from the float weight (docs/format.md)."""

    RTN = "rtn"
    """Round-to-nearest with min/max scales (`hfquant.core.rtn`)."""
    SINQ = "sinq"
    """RTN of the weight divided by a SINQ column scale (`hfquant.core.sinq`), stored as `weight_col_scale`."""


@dataclasses.dataclass(frozen=True)
class StoredFormat:
    """Bit width, group size and symmetry of one quantized weight, and the tensors they store it in.

    A weight of shape (*rows, K) (K = in_features; `rows` is (N,) for a Linear layer or an embedding table of N rows,
    (E, N) for E fused experts) is stored as (docs/format.md):

        weight: 8 bits symmetric: (*rows, K) int8, values q in [-127, 127];
                8 bits asymmetric: (*rows, K) uint8, q in [0, 255];
                4 bits: (*rows, K // 2) uint8, two codes per byte, the even input column in the low nibble:
                byte [n, j] = c[n, 2j] | c[n, 2j + 1] << 4 with codes c in [0, 15] (symmetric codes are the signed
                value v in [-7, 7] plus 8).
        weight_scale: (*rows, K // group_size) bfloat16 (`rtn.SCALE_DTYPE`), one scale > 0 per (row, group).
        weight_zero_point: (*rows, K // group_size) uint8, one integer zero point z per (row, group); only when
                asymmetric (symmetric weights have the implicit zero 0 at 8 bits, code 8 at 4 bits).
        weight_col_scale: (*rows[:-1], K) bfloat16, one scale c > 0 per input column; only with `Method.SINQ`.

    Element (n, k) dequantizes to w = (q[n, k] - z[n, k // group_size]) * scale[n, k // group_size], times c[k] with
    `Method.SINQ`.

    Worked example (4 bits, asymmetric, one group of 4): weights [-0.3, 0.0, 0.45, 0.1] give lo = -0.3, hi = 0.45,
    scale = (0.45 - (-0.3)) / 15 = 0.05, zero point z = round(0.3 / 0.05) = 6, codes round(w / scale) + z =
    [0, 6, 15, 8], stored bytes [0x60, 0x8F] (0 | 6 << 4, 15 | 8 << 4); code 0 dequantizes to (0 - 6) * 0.05 = -0.3.
    `StoredFormat(4, 4, False).tensor_specs((1,), 4)` is {"weight": (uint8, (1, 2)), "weight_scale": (bfloat16,
    (1, 1)), "weight_zero_point": (uint8, (1, 1))}.

    A block format (`block`, one of llama.cpp's types in `hfquant.core.blocks.LAYOUTS`, e.g. "q4_k") stores the
    weight as one tensor of GGUF's block bytes instead (docs/format.md, "Block formats"):

        weight: (*rows, K // block_size * type_size) uint8, each row its blocks in input order.
        weight_col_scale: as above, only with `Method.SINQ`.

    Its bits, group_size and symmetric are the type's (`StoredFormat.of_block`): group_size is the block length (32,
    or the super-block's 256).

    Args:
        bits: 8 or 4 (a block format: the type's code width).
        group_size: consecutive input features sharing one scale (and zero point), > 0. A layer's resolved group size
            (`rtn.effective_group_size`), never None: per-channel is group_size = in_features.
        symmetric: signed codes with an implicit zero point, or unsigned codes with a stored zero point.
        method: how the codes were computed (`Method.RTN` or `Method.SINQ`); a string such as "rtn" is converted.
        block: None for the uniform integer formats, else the block type's name.
    Raises:
        ValueError: bits not 4 or 8, group_size not positive, an unknown method or block type, or bits, group_size
            or symmetric other than the block type's (naming the value and what is allowed).
        TypeError: a field of the wrong type (e.g. bits="4", symmetric=None).
    """

    bits: int
    group_size: int
    symmetric: bool
    method: Method = Method.RTN
    block: str | None = None

    @classmethod
    def of_block(cls, name: str, method: Method | str = Method.RTN) -> StoredFormat:
        """The format of block type `name` ("q4_k", case-insensitive; ValueError for an unknown one)."""
        layout = blocks.layout(name)
        return cls(layout.bits, layout.block_size, layout.symmetric, method, layout.name)

    @property
    def layout(self) -> blocks.BlockLayout | None:
        """The block type's layout, None for a uniform integer format."""
        return None if self.block is None else blocks.layout(self.block)

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"bits must be an int, one of {list(SUPPORTED_BITS)}; got {self.bits!r}")
        if self.block is not None:
            self._check_block()
        elif self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not supported; allowed values are {list(SUPPORTED_BITS)}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise TypeError(
                f"group_size must be a positive int (inputs per scale; per-channel is group_size = in_features); "
                f"got {self.group_size!r}"
            )
        if self.group_size <= 0:
            raise ValueError(
                f"group_size={self.group_size} is not allowed; it must be a positive number of inputs per scale"
            )
        if not isinstance(self.symmetric, bool):
            raise TypeError(f"symmetric must be True or False; got {self.symmetric!r}")
        if not isinstance(self.method, Method):
            try:
                object.__setattr__(self, "method", Method(self.method))
            except ValueError:
                allowed = [m.value for m in Method]
                raise ValueError(f"method={self.method!r} is not supported; allowed values are {allowed}") from None

    def _check_block(self) -> None:
        layout = blocks.layout(self.block)
        object.__setattr__(self, "block", layout.name)
        expected = {"bits": layout.bits, "group_size": layout.block_size, "symmetric": layout.symmetric}
        for name, value in expected.items():
            if getattr(self, name) != value or isinstance(getattr(self, name), bool) != isinstance(value, bool):
                raise ValueError(
                    f"block format {layout.name} stores {name}={value!r}; got {name}={getattr(self, name)!r} "
                    f"(use StoredFormat.of_block({layout.name!r}))"
                )

    # -- the stored tensors ----------------------------------------------------------------------------------------

    @property
    def code_dtype(self) -> torch.dtype:
        """dtype of the stored `weight`: int8 for 8-bit symmetric codes, else uint8 (packed nibbles at 4 bits)."""
        return torch.int8 if (self.bits == 8 and self.symmetric and self.block is None) else torch.uint8

    def tensor_names(self) -> tuple[str, ...]:
        """("weight", "weight_scale"[, "weight_zero_point"][, "weight_col_scale"]): the stored tensors, in the order
        `tensor_specs` gives."""
        if self.block is not None:
            names = ("weight",)
        else:
            names = ("weight", "weight_scale") + (() if self.symmetric else ("weight_zero_point",))
        return names + (("weight_col_scale",) if self.method is Method.SINQ else ())

    def tensor_specs(self, rows: tuple[int, ...], in_features: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{name: (dtype, shape)} of the stored tensors of a weight (*rows, in_features) (see the class docstring).

        Raises:
            ValueError: group_size does not divide in_features, or 4 bits with an odd in_features.
        """
        rows = tuple(rows)
        if self.block is not None:
            specs = {"weight": (torch.uint8, (*rows, self.layout.row_bytes(in_features)))}
            if self.method is Method.SINQ:
                specs["weight_col_scale"] = (rtn.SCALE_DTYPE, (*rows[:-1], in_features))
            return specs
        if in_features % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide in_features={in_features}")
        if self.bits == 4 and in_features % 2:
            raise ValueError(f"4-bit weights need an even in_features, got {in_features}")
        rows = tuple(rows)
        codes = in_features // 2 if self.bits == 4 else in_features
        groups = (*rows, in_features // self.group_size)
        specs = {"weight": (self.code_dtype, (*rows, codes)), "weight_scale": (rtn.SCALE_DTYPE, groups)}
        if not self.symmetric:
            specs["weight_zero_point"] = (torch.uint8, groups)
        if self.method is Method.SINQ:
            specs["weight_col_scale"] = (rtn.SCALE_DTYPE, (*rows[:-1], in_features))
        return specs

    def empty(
        self, rows: tuple[int, ...], in_features: int, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Uninitialized stored tensors of a weight (*rows, in_features), as `tensor_specs` gives them, on `device`
        (on the CPU, large ones on huge pages: `huge_pages.empty`)."""
        return {
            name: huge_pages.empty(shape, dtype=dtype, device=device)
            for name, (dtype, shape) in self.tensor_specs(rows, in_features).items()
        }

    def describe(self) -> str:
        """ "4-bit, group size 32, asymmetric" or "q4_k (4.5 bits per weight)" (", SINQ" added for that method): the
        format in words, for messages."""
        if self.block is not None:
            text = f"{self.block} ({self.layout.bits_per_weight:g} bits per weight)"
            return text + (", SINQ" if self.method is Method.SINQ else "")
        text = f"{self.bits}-bit, group size {self.group_size}, {'symmetric' if self.symmetric else 'asymmetric'}"
        return text + (", SINQ" if self.method is Method.SINQ else "")


def require_format(fmt: object) -> StoredFormat:
    """`fmt` itself when it is a `StoredFormat`, else a TypeError saying what to pass (modules that took bits,
    group_size and symmetric as three arguments now take one `StoredFormat`)."""
    if not isinstance(fmt, StoredFormat):
        raise TypeError(
            "expected a hfquant.core.format.StoredFormat for the stored format, e.g. "
            f"StoredFormat(bits=4, group_size=128, symmetric=False); got {fmt!r}"
        )
    return fmt


def format_name(fmt: str, bits: int) -> str:
    """A stored format's short name, as tags and labels give it: "int8" / "int4" for the config's `format` "int" at
    `bits`, else the block type's own name ("iq4_xs", "q4_k", "hq3_r")."""
    return f"int{bits}" if fmt == "int" else fmt
