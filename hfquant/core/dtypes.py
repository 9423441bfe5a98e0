"""dtype names as the config and the files spell them ("bfloat16") <-> torch dtypes: the one conversion."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "dtype_name", "torch_dtype"]

FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The float dtypes a config may name for storage or compute."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' (as transformers writes `config.dtype`) -> torch.bfloat16; a dtype is returned
    as it is.

    Raises:
        ValueError: `name` is not a torch dtype, naming it.
    """
    if isinstance(name, torch.dtype):
        return name
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype; use e.g. bfloat16, float16 or float32")
    return value
