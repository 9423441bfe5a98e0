"""Fixtures of the reliability tests that several subjects share (docs/reliability.md)."""

from __future__ import annotations

import shutil

import pytest
from helpers import SHARD_SIZE
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert


@pytest.fixture(scope="session")
def two_saves(float_checkpoint, tmp_path_factory):
    """A tiny Llama converted at 8 bits (a), and the same with one weight doubled (b): the same tensor names and shapes
    in the same shards, other values, so two checkpoint ids."""
    root = tmp_path_factory.mktemp("two-saves")
    src = float_checkpoint("llama")
    edited = root / "edited"
    shutil.copytree(src, edited)
    tensors = load_file(edited / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 2
    save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})
    for name, source in (("a", src), ("b", edited)):
        convert(source, root / name, HfQuantConfig(bits=8), max_shard_size=SHARD_SIZE, progress=False)
    return root / "a", root / "b"
