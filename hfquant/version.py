"""The version of hfquant (also in pyproject.toml)."""

__version__ = "0.1.0"
