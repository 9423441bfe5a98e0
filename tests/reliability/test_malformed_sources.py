"""Malformed SRC files (config.json, index, shards) and out of memory while quantizing: one line naming the file or
the tensor, nothing left behind (issue #11, docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert
from hfquant.verification import verify


def _edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _with(key, value):
    def change(config):
        config[key] = value
        return config

    return change


SRC_DAMAGES = {
    "config a list": (lambda f: _edit_config(f, lambda c: [c]), r"config.json must hold a JSON object, not a list"),
    "config truncated": (
        lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:40]),
        r"config.json is not valid JSON",
    ),
    "dtype float17": (
        lambda f: _edit_config(f, _with("dtype", "float17")),
        r"config.json: dtype='float17' is not a float torch dtype",
    ),
    "dtype a number": (
        lambda f: _edit_config(f, _with("dtype", 16)),
        r"config.json: dtype=16 is not a float torch dtype",
    ),
    "architectures a string": (
        lambda f: _edit_config(f, _with("architectures", "LlamaForCausalLM")),
        r"config.json: architectures='LlamaForCausalLM' is not a list of class names",
    ),
    "quantization_config a string": (
        lambda f: _edit_config(f, _with("quantization_config", "hfquant")),
        r"config.json: quantization_config must be a JSON object, got str 'hfquant'",
    ),
    "quantization_config false": (
        lambda f: _edit_config(f, _with("quantization_config", False)),
        r"config.json: quantization_config must be a JSON object, got bool False",
    ),
    "unknown model_type": (
        lambda f: _edit_config(f, _with("model_type", "llama9")),
        r"config.json: model_type='llama9' is not a model type transformers \S+ knows; upgrade",
    ),
    "index a list": (
        lambda f: (f / "model.safetensors.index.json").write_text("[]"),
        r"model.safetensors.index.json must be an object .* found list",
    ),
    "index without weight_map": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        r"model.safetensors.index.json must be an object .* found \['metadata'\]",
    ),
    "index truncated": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": {'),
        r"model.safetensors.index.json is not valid JSON",
    ),
}


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory):
    from helpers import tiny_model

    folder = tmp_path_factory.mktemp("sharded-src")
    tiny_model("llama", dtype=torch.float32).save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.mark.parametrize("damage", sorted(SRC_DAMAGES))
def test_malformed_source_files_are_one_line_naming_the_file(sharded_source, tmp_path, capsys, damage):
    from hfquant.commands.cli import main

    make, message = SRC_DAMAGES[damage]
    src = tmp_path / "src"
    shutil.copytree(sharded_source, src)
    make(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), str(tmp_path / "dst"), "--bits", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("hfquant: error: ") and str(src) in lines[-1], err
    assert __import__("re").search(message, lines[-1]), lines[-1]
    assert "Traceback" not in err and not (tmp_path / "dst").exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    if damage != "unknown model_type" and not damage.startswith("architectures"):  # inspect reads no class
        with pytest.raises(SystemExit) as exit_info:
            main(["inspect", str(src)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err and str(src) in err, err


def test_an_architecture_that_is_a_class_but_not_a_model_is_one_line(sharded_source, tmp_path, capsys):
    """`architectures: ["TrainingArguments"]` names a transformers class that is not a model: refused by name, exit 2
    (was an AttributeError traceback from `TrainingArguments._from_config`)."""
    from hfquant.commands.cli import main

    src = tmp_path / "src"
    shutil.copytree(sharded_source, src)
    _edit_config(src, _with("architectures", ["TrainingArguments"]))
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), str(tmp_path / "dst"), "--bits", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert "'TrainingArguments' of config.json is not a transformers model class" in err.strip().splitlines()[-1]
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "damage", ["config a list", "dtype float17", "unknown model_type", "quantization_config false"]
)
def test_convert_from_python_refuses_a_malformed_config_in_one_value_error(sharded_source, tmp_path, damage):
    """The same check as the CLI's, in `convert` itself (a list config.json was an AttributeError from Python)."""

    src = tmp_path / "src"
    shutil.copytree(sharded_source, src)
    SRC_DAMAGES[damage][0](src)
    with pytest.raises(ValueError, match=SRC_DAMAGES[damage][1]):
        convert(src, tmp_path / "dst", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize(
    "damage", ["config a list", "dtype float17", "unknown model_type", "quantization_config a string"]
)
def test_verify_lists_a_malformed_config_as_a_problem(two_saves, tmp_path, damage):
    folder = tmp_path / "q"
    shutil.copytree(two_saves[0], folder)
    SRC_DAMAGES[damage][0](folder)
    problems = verify(folder).problems
    assert any(__import__("re").search(SRC_DAMAGES[damage][1], p) for p in problems), problems


def test_out_of_memory_while_quantizing_is_one_line_and_leaves_nothing(sharded_source, tmp_path, capsys, monkeypatch):
    import hfquant.integration.quantize_weights as quantize_weights
    from hfquant.commands.cli import main

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(quantize_weights, "quantize_to_buffers", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(sharded_source), str(tmp_path / "dst"), "--bits", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err
    assert "hfquant: error: out of memory" in err and "--max-shard-size" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_while_quantizing_on_load_is_a_memory_error_naming_the_tensor(sharded_source, monkeypatch):
    """transformers turns any error in a conversion into a generic RuntimeError with a traceback text: hfquant keeps
    the MemoryError and says what to do."""
    from transformers import AutoModelForCausalLM

    import hfquant.integration.quantize_weights as quantize_weights

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(quantize_weights, "quantize_to_buffers", out_of_memory)
    with pytest.raises(
        MemoryError, match=r"out of memory while quantizing model\.layers\.\d+\..*weight .*hfquant convert"
    ):
        AutoModelForCausalLM.from_pretrained(
            sharded_source, quantization_config=HfQuantConfig(bits=8), device_map="cpu"
        )
