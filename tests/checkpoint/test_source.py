"""`hfquant.checkpoint.source`: SRC as a local folder or a Hub repo id, and the repo id a card names as base_model."""

from __future__ import annotations

import pytest

from hfquant.checkpoint.source import base_model_of, resolve_source


def test_repo_id_source_offline_gives_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(OSError, match="Hub could not be reached.*hf download some-org/some-model"):
        resolve_source("some-org/some-model")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        resolve_source(str(tmp_path / "missing" / "model"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a folder"):
        resolve_source("./nothing-here")


def test_a_local_folder_is_itself_and_a_file_is_refused(tmp_path):
    assert resolve_source(tmp_path) == tmp_path
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        resolve_source(tmp_path / "model.safetensors")


def test_base_model_from_a_repo_id_or_a_hub_cache_snapshot(tmp_path):
    local = tmp_path / "my-model"
    local.mkdir()
    assert base_model_of("org/name", local) == "org/name"  # a repo id (not an existing path) names itself
    assert base_model_of(str(local), local) is None  # a plain local folder names no Hub repo
    assert base_model_of("name", local) is None  # no namespace: not taken as a repo id
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / ("0123abcd" * 5)
    snapshot.mkdir(parents=True)
    assert base_model_of(str(snapshot), snapshot) == "HuggingFaceTB/SmolLM2-135M"
