"""`Choice`: the base of hfquant's closed string choices (config fields, stored methods, kernels).

A `str` enum whose `str()`, `format()` and `repr()` are its value's, so that a message or a log quoting one
(`lm_head='int4'`, `kernel=int4pack_mm_cpu`) reads as the user wrote it in Python or `config.json`, and each member
equals its plain string ("int8" == DecodeActivations.INT8).
"""

from __future__ import annotations

import enum

__all__ = ["Choice"]


class Choice(str, enum.Enum):
    """A closed choice of string values (see the module docstring)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)
