"""Fixtures of the real-model modules: the SmolLM2-135M-Instruct checkpoint and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def example_model() -> Path:
    from benchmarks.example_model import build_example_model

    return build_example_model()


@pytest.fixture(scope="module")
def tokenizer(example_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(example_model)
