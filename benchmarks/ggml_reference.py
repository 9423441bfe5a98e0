"""llama.cpp's own quantizer, through ctypes, as the yardstick for hfquant's block formats (issue #30).

llama-cpp-python's wheel ships `llama_cpp/lib/libggml-base.so`, which holds ggml's quantizers and dequantizers and
needs no Python: this module loads it into the calling process. `python scripts/engines.py --engines llama.cpp`
installs the wheel into `~/.cache/hfquant/engines/llama.cpp/.venv-llama` (built from source once, 15-25 minutes);
`HFQUANT_GGML_LIB` names another `libggml-base.so`.

- `GgmlLibrary.quantize(name, weight)` runs `ggml_quantize_chunk(type, src, dst, 0, rows, K, imatrix=NULL)` after
  `ggml_quantize_init(type)`: llama.cpp's data-free path, what `llama-quantize` does without `--imatrix`.
- `GgmlLibrary.dequantize(name, data)` runs the type's `to_float` from `ggml_get_type_traits`.
Types are named as `hfquant.core.blocks.LAYOUTS` names them; the type number is gguf-py's, and the library's own
`type_name` and block sizes are checked against the layout before any call.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from hfquant.core.blocks import layout

__all__ = ["GgmlLibrary", "find_library", "load"]

VENV = Path.home() / ".cache" / "hfquant" / "engines" / "llama.cpp" / ".venv-llama"


class _TypeTraits(ctypes.Structure):
    # struct ggml_type_traits (ggml.h): the leading fields, in order
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)),
        ("from_float_ref", ctypes.c_void_p),
    ]


def find_library() -> Path | None:
    """`HFQUANT_GGML_LIB`, else the `libggml-base.so` of the engines venv, else None."""
    named = os.environ.get("HFQUANT_GGML_LIB")
    if named:
        return Path(named) if Path(named).is_file() else None
    found = sorted(VENV.glob("lib/python*/site-packages/llama_cpp/lib/libggml-base.so"))
    return found[-1] if found else None


class GgmlLibrary:
    """ggml's quantize and dequantize entry points from one loaded `libggml-base.so`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(self.path))
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_float),
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.POINTER(ctypes.c_float),
        ]
        lib.ggml_quantize_init.argtypes = [ctypes.c_int]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        self._lib = lib

    def traits(self, name: str) -> _TypeTraits:
        """The library's traits of type `name`, checked against hfquant's layout of it.

        Raises:
            ValueError: the library names the type number differently or gives it other sizes.
        """
        fmt = layout(name)
        traits = self._lib.ggml_get_type_traits(fmt.ggml_type).contents
        found = (traits.type_name.decode().lower(), traits.blck_size, traits.type_size)
        if found != (fmt.name, fmt.block_size, fmt.type_size):
            raise ValueError(
                f"{self.path} has type {fmt.ggml_type} as {found} (name, block, bytes); hfquant expects "
                f"{(fmt.name, fmt.block_size, fmt.type_size)}"
            )
        return traits

    def row_size(self, name: str, k: int) -> int:
        """Bytes of one row of `k` weights (`ggml_row_size`)."""
        return int(self._lib.ggml_row_size(layout(name).ggml_type, k))

    def quantize(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """llama.cpp's data-free quantization of `weight` (rows, K) float -> (rows, row_size) uint8."""
        self.traits(name)
        fmt = layout(name)
        rows, k = weight.shape
        fmt.row_bytes(k)
        src = weight.detach().to(torch.float32).contiguous()
        dst = torch.zeros(rows, self.row_size(name, k), dtype=torch.uint8)
        self._lib.ggml_quantize_init(fmt.ggml_type)
        written = self._lib.ggml_quantize_chunk(
            fmt.ggml_type,
            ctypes.cast(src.data_ptr(), ctypes.POINTER(ctypes.c_float)),
            ctypes.c_void_p(dst.data_ptr()),
            0,
            rows,
            k,
            None,
        )
        if written != dst.numel():
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {name}; expected {dst.numel()}")
        return dst

    def dequantize(self, name: str, data: torch.Tensor) -> torch.Tensor:
        """The type's `to_float` on blocks `data` (rows, row_size) uint8 -> (rows, K) float32."""
        traits = self.traits(name)
        rows = data.shape[0]
        k = data.shape[1] // traits.type_size * traits.blck_size
        src = data.contiguous()
        out = torch.empty(rows, k, dtype=torch.float32)
        traits.to_float(
            ctypes.c_void_p(src.data_ptr()), ctypes.cast(out.data_ptr(), ctypes.POINTER(ctypes.c_float)), rows * k
        )
        return out


def load() -> GgmlLibrary | None:
    """The library `find_library` finds, loaded, or None when there is none."""
    path = find_library()
    return GgmlLibrary(path) if path is not None else None
