"""The optional dependencies: packages a feature needs that a plain `pip install hfquant` does not install.

A bare install imports hfquant and quantizes (pyproject.toml's `dependencies`); each optional package is imported
only by the module of the feature that uses it, through `require`, and a missing one is named with its pip command:

    gguf = require(GGUF)  # ImportError: GGUF export needs gguf: pip install 'hfquant[gguf]'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

__all__ = ["GGUF", "GGUF_IMPORT", "PEFT", "OptionalDependency", "require"]


@dataclass(frozen=True)
class OptionalDependency:
    """One optional package: its import name, its pip (distribution) name, hfquant's extra that installs it, and the
    feature that needs it (said in the error)."""

    module: str
    package: str
    extra: str
    feature: str

    def missing(self) -> ImportError:
        """The error raised when the package is not installed: the feature, the package and the pip command."""
        return ImportError(f"{self.feature} needs {self.package}: pip install 'hfquant[{self.extra}]'")

    def is_missing(self, error: ModuleNotFoundError) -> bool:
        """Whether `error` says this package itself is not installed (not a module missing inside it)."""
        return error.name is not None and error.name.partition(".")[0] == self.module


GGUF = OptionalDependency(module="gguf", package="gguf", extra="gguf", feature="GGUF export")
GGUF_IMPORT = OptionalDependency(module="gguf", package="gguf", extra="gguf", feature="GGUF import")
PEFT = OptionalDependency(module="peft", package="peft", extra="peft", feature="LoRA adapters (hfquant.peft)")


def require(dependency: OptionalDependency) -> ModuleType:
    """The optional package `dependency`, imported.

    Raises:
        ImportError: the package is not installed; the message names the feature, the package and the pip command
            (`OptionalDependency.missing`). A module missing inside an installed package propagates unchanged.
    """
    try:
        return importlib.import_module(dependency.module)
    except ModuleNotFoundError as error:
        if not dependency.is_missing(error):
            raise
        raise dependency.missing() from error
