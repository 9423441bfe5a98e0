"""Shards of two saves told apart: every shard carries its checkpoint id; a mix is refused at load and by verify, and
shards replaced while the weights load are caught (issue #11, docs/reliability.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import SHARD_SIZE
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.files import checkpoint_ids, read_checkpoint_id
from hfquant.conversion.convert import convert
from hfquant.integration.checks import confirm_checkpoint_unchanged
from hfquant.verification import verify


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def test_every_shard_of_a_convert_carries_one_checkpoint_id(two_saves, float_checkpoint, tmp_path):
    """One id per save, derived from the bytes: another convert of the same source gives the same files."""
    a, b = two_saves
    again = tmp_path / "again"
    convert(float_checkpoint("llama"), again, HfQuantConfig(bits=8), max_shard_size=SHARD_SIZE, progress=False)
    assert all(path.read_bytes() == (again / path.name).read_bytes() for path in _shards(a))
    ids_a = {read_checkpoint_id(p) for p in _shards(a)}
    ids_b = {read_checkpoint_id(p) for p in _shards(b)}
    assert len(_shards(a)) > 2 and len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b
    assert None not in ids_a


def test_shards_of_two_save_pretrained_calls_are_told_apart(two_saves, tmp_path):
    """save_pretrained of a model hfquant loaded stamps its shards like convert: one id per save, from the bytes."""
    models = [_load(folder) for folder in two_saves]
    for i, model in enumerate(models):
        model.save_pretrained(tmp_path / f"s{i}", max_shard_size=SHARD_SIZE)
    models[0].save_pretrained(tmp_path / "s0-again", max_shard_size=SHARD_SIZE)
    ids = [set(checkpoint_ids(_shards(tmp_path / name)).values()) for name in ("s0", "s1", "s0-again")]
    assert all(len(one) == 1 and None not in one for one in ids), ids
    assert ids[0] == ids[2] and ids[0] != ids[1]
    odd = _shards(tmp_path / "s1")[-1].name
    shutil.copyfile(tmp_path / "s1" / odd, tmp_path / "s0" / odd)
    with pytest.raises(ValueError, match=rf"checkpoint changed while loading \({odd} belongs to another save"):
        _load(tmp_path / "s0")


def test_shards_of_two_saves_are_refused_at_load_and_by_verify(two_saves, tmp_path):
    a, b = two_saves
    mixed = tmp_path / "mixed"
    shutil.copytree(a, mixed)
    odd = _shards(b)[1].name
    shutil.copyfile(b / odd, mixed / odd)  # what a reader sees when convert --overwrite swaps the folder mid-load
    with pytest.raises(ValueError, match=rf"checkpoint changed while loading \({odd} belongs to another save.*retry"):
        _load(mixed)
    problems = verify(mixed).problems
    assert any("changed while loading" in p and odd in p for p in problems), problems
    assert verify(a).ok and verify(b).ok


def test_a_checkpoint_without_ids_still_loads(two_saves, tmp_path):
    a, _ = two_saves
    old = tmp_path / "old"
    shutil.copytree(a, old)
    for path in _shards(old):  # as written before checkpoint ids existed
        save_file(load_file(path), path, metadata={"format": "pt"})
    (old / "hfquant.sha256.json").unlink()
    assert set(checkpoint_ids(_shards(old)).values()) == {None}
    reference, reloaded = _load(a), _load(old)
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(reference(ids).logits, reloaded(ids).logits)


def test_shards_replaced_while_the_weights_load_are_caught_after(two_saves, tmp_path):
    """The ids read before the weights are compared again after (`confirm_checkpoint_unchanged`, a loaded-model hook)."""
    a, b = two_saves
    folder = tmp_path / "racing"
    shutil.copytree(a, folder)
    model = _load(folder)
    model._hfquant_checkpoint_ids = checkpoint_ids(_shards(folder))  # as check_stored_tensors records them
    odd = _shards(b)[-1].name
    shutil.copyfile(b / odd, folder / odd)
    with pytest.raises(ValueError, match=rf"changed while loading \({odd} belongs to another save now.*retry"):
        confirm_checkpoint_unchanged(model)
    confirm_checkpoint_unchanged(model)  # recorded once: nothing left to compare


def test_from_pretrained_says_retry_when_a_shard_is_replaced_during_the_load(two_saves, tmp_path, monkeypatch):
    """End to end: a shard of the other save copied in after the headers were read (here: once the weights are in)."""
    import hfquant.integration.checks as checks

    a, b = two_saves
    folder = tmp_path / "racing"
    shutil.copytree(a, folder)
    odd = _shards(b)[-1].name
    value_check = checks.stored_value_problems

    def replace_a_shard_then_check(model):
        shutil.copyfile(b / odd, folder / odd)
        return value_check(model)

    monkeypatch.setattr(checks, "stored_value_problems", replace_a_shard_then_check)
    with pytest.raises(ValueError, match=rf"changed while loading \({odd} belongs to another save now.*retry"):
        _load(folder)
    monkeypatch.setattr(checks, "stored_value_problems", value_check)
    shutil.copytree(a, tmp_path / "calm")
    _load(tmp_path / "calm")  # no replacement: loads
