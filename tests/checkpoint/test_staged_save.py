"""`save_pretrained` of a model hfquant loaded, into a folder that already holds a checkpoint
(`hfquant.checkpoint.saving`): the folder holds the old checkpoint or the new one, never a mix, and keeps its other
files."""

from __future__ import annotations

import copy
import errno
import hashlib

import pytest
import torch
import transformers.modeling_utils
from helpers import auto_class, input_ids, model_output

from hfquant import HfQuantConfig


def _contents(folder) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (symlinks as their target text)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = "link:" + str(path.readlink())
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture()
def quantized(float_checkpoint):
    src = float_checkpoint("llama", torch.bfloat16)
    return auto_class("llama").from_pretrained(
        src, quantization_config=HfQuantConfig(bits=4, group_size=32), device_map="cpu"
    )


def test_resave_keeps_other_files_and_leaves_no_stale_weights(quantized, tmp_path):
    """A single-file checkpoint with a tokenizer file, a README and a sub-folder beside it, re-saved in shards: the
    old `model.safetensors` is gone (transformers would load it instead of the index), the other entries stay."""
    out = tmp_path / "out"
    quantized.save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    (out / "README.md").write_text("my notes\n")
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("step 1\n")
    (out / "pytorch_model.bin").write_bytes(b"stale weights of another format")
    quantized.save_pretrained(out, max_shard_size="40KB")
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" not in names and "pytorch_model.bin" not in names
    assert "model.safetensors.index.json" in names and any(n.startswith("model-0000") for n in names)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}' and (
        out / "README.md"
    ).read_text() == "my notes\n"
    assert (out / "runs" / "log.txt").read_text() == "step 1\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no hidden folder left behind
    reloaded = auto_class("llama").from_pretrained(out, device_map="cpu")
    ids = input_ids()
    assert torch.equal(model_output(reloaded, ids), model_output(quantized, ids))


def test_a_save_failing_half_way_leaves_the_previous_checkpoint_as_it_was(quantized, tmp_path, monkeypatch):
    """The disk fills after the first shard of the new save: the folder's files are byte for byte the previous
    checkpoint's, and it still loads (transformers writes config.json before the shards: in place, the old shards
    would now sit under a new config)."""
    out = tmp_path / "out"
    quantized.save_pretrained(out, max_shard_size="40KB")
    (out / "tokenizer.json").write_text("{}")
    before = _contents(out)
    real_save, calls = transformers.modeling_utils.safe_save_file, []

    def disk_full(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        quantized.save_pretrained(out, max_shard_size="20KB")
    assert len(calls) == 2
    assert _contents(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    monkeypatch.undo()
    reloaded = auto_class("llama").from_pretrained(out, device_map="cpu")
    assert torch.equal(model_output(reloaded, input_ids()), model_output(quantized, input_ids()))


def test_empty_or_new_folders_are_written_directly_and_a_copy_saves_itself(quantized, tmp_path):
    (tmp_path / "empty").mkdir()
    quantized.save_pretrained(tmp_path / "empty")
    quantized.save_pretrained(tmp_path / "new")
    assert _contents(tmp_path / "empty") == _contents(tmp_path / "new")
    twin = copy.deepcopy(quantized)
    assert twin.save_pretrained.args == (twin,)  # bound to the copy (core.binding): the copy saves the copy
