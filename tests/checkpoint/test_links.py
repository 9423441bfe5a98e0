"""Links that leave a checkpoint folder are never read, copied, uploaded or written through (docs/reliability.md)."""

from __future__ import annotations

import logging
import shutil

import pytest
from helpers import auto_class

from hfquant import HfQuantConfig
from hfquant.checkpoint.files import stays_inside
from hfquant.conversion.convert import convert
from hfquant.inspection import inspect_checkpoint
from hfquant.publishing.hub import _operations
from hfquant.verification import verify


def test_stays_inside(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "a.json").write_text("{}")
    (tmp_path / "secret").write_text("x")
    (folder / "inside").symlink_to(folder / "a.json")
    (folder / "outside").symlink_to(tmp_path / "secret")
    assert stays_inside(folder, folder / "a.json") and stays_inside(folder, folder / "inside")
    assert not stays_inside(folder, folder / "outside") and not stays_inside(folder, folder / ".." / "secret")
    snapshot = tmp_path / "models--org--name" / "snapshots" / "abc123"  # Hub cache: files link into blobs/
    (tmp_path / "models--org--name" / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (tmp_path / "models--org--name" / "blobs" / "f00").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/f00")
    assert stays_inside(snapshot, snapshot / "config.json")


def test_convert_skips_a_small_file_linking_outside_and_says_so(float_checkpoint, tmp_path, caplog):
    src = tmp_path / "src"
    shutil.copytree(float_checkpoint("llama"), src)
    (tmp_path / "secret.txt").write_text("private")
    (src / "tokenizer_extra.json").symlink_to(tmp_path / "secret.txt")
    (src / "special_tokens_map.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        convert(src, tmp_path / "dst", HfQuantConfig(bits=8), progress=False)
    assert (tmp_path / "dst" / "special_tokens_map.json").is_file()
    assert not (tmp_path / "dst" / "tokenizer_extra.json").exists()
    assert "not copying" in caplog.text and "tokenizer_extra.json" in caplog.text


@pytest.fixture
def shard_linking_outside(float_checkpoint, tmp_path):
    """A quantized checkpoint whose model.safetensors is a link to a file outside its folder."""
    folder = tmp_path / "q"
    model = auto_class("llama").from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=8), device_map="cpu"
    )
    model.save_pretrained(folder)
    (folder / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    return folder


def test_a_shard_linking_outside_is_refused_by_every_reader(shard_linking_outside, tmp_path):
    folder = shard_linking_outside
    with pytest.raises(ValueError, match="outside the checkpoint folder; hfquant never reads through a link"):
        inspect_checkpoint(folder)
    with pytest.raises(ValueError, match="outside the checkpoint folder; hfquant never reads through a link"):
        auto_class("llama").from_pretrained(folder, device_map="cpu")
    problems = verify(folder).problems
    assert any("model.safetensors" in p and "outside" in p for p in problems), problems


def test_a_float_source_shard_linking_outside_is_refused_by_convert(float_checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(float_checkpoint("llama"), src)
    (src / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="outside the checkpoint folder"):
        convert(src, tmp_path / "dst", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "dst").exists()


def test_push_leaves_out_files_linking_outside(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "id_rsa").write_text("private key")
    (folder / "notes.txt").symlink_to(tmp_path / "id_rsa")
    with caplog.at_level(logging.WARNING):
        names = [op.path_in_repo for op in _operations(folder, None)]
    assert names == ["config.json"]
    assert "not uploading notes.txt" in caplog.text
