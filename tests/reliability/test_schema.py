"""config.json against the stored tensors: one check (`hfquant.checkpoint.schema.schema_problems`, with
`hfquant.checkpoint.model_config.base_type_problem`) for a pre-quantized `from_pretrained`, `hfquant verify`, `inspect`,
`convert` and `export`, each refusing a mismatch with the same one-line message (issue #28 item 2).

Was: a SINQ checkpoint whose config.json says method "rtn" loaded without a word (its column scales ignored, the model
computing another function) while verify refused it; an RTN checkpoint whose config.json says "sinq" exported without a
word; verify passed a base model type (`hfquant_base_model_type`) that is not the architecture's, which from_pretrained
refuses or builds another model from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import auto_class
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.checksums import SUMS_NAME
from hfquant.checkpoint.schema import schema_error
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint
from hfquant.inspection import inspect_checkpoint
from hfquant.verification import verify

LAYER = "model.layers.0.mlp.down_proj"


@pytest.fixture(scope="module")
def stored(float_checkpoint, tmp_path_factory):
    """method -> a tiny Llama converted at 4 bits, group 32, with that method (SINQ's column scales stored); its
    lm_head "keep" (not the 4-bit default's int8): the float layer whose stray scale `UNUSED` adds."""
    root = tmp_path_factory.mktemp("schema")
    folders = {}
    for method in ("sinq", "rtn"):
        config = HfQuantConfig(
            bits=4, group_size=32, method=method, fold_column_scales=False, mixed_precision="none", lm_head="keep"
        )
        folders[method] = root / method
        convert(float_checkpoint("llama"), folders[method], config, progress=False)
    return folders


def _edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of the checkpoint `source` at `target`, config.json edited by `edit(config)`, its sums removed."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    edit(config)
    (target / "config.json").write_text(json.dumps(config))
    (target / SUMS_NAME).unlink()
    return target


def _method(method: str):
    def edit(config):
        config["quantization_config"]["method"] = method

    return edit


MISMATCHES = {
    # stored tensors' method -> the method config.json names
    "sinq tensors, config rtn": ("sinq", "rtn"),
    "rtn tensors, config sinq": ("rtn", "sinq"),
}


@pytest.fixture(params=list(MISMATCHES))
def mismatched(request, stored, tmp_path):
    """(folder whose config.json names another method than its tensors, the words the message must hold)."""
    tensors, configured = MISMATCHES[request.param]
    folder = _edited_copy(stored[tensors], tmp_path / "mismatched", _method(configured))
    if tensors == "sinq":  # file tensors in file order; missing model tensors in the model's order
        return folder, [f"{LAYER}.weight_col_scale", "method rtn", "not a tensor of LlamaForCausalLM", "and no"]
    return folder, ["model.layers.0.self_attn.q_proj.weight_col_scale", "method sinq", "missing from the checkpoint"]


def _load_error(folder: Path) -> str:
    with pytest.raises(ValueError) as info:
        auto_class("llama").from_pretrained(folder, device_map="cpu")
    return str(info.value)


def _one_line(message: str, words: list[str]) -> str:
    assert "\n" not in message, message
    assert all(word in message for word in words), (words, message)
    return message


def test_from_pretrained_refuses_a_config_naming_another_method(mismatched):
    folder, words = mismatched
    message = _one_line(_load_error(folder), words)
    assert message.startswith("the hfquant checkpoint does not match its config (14 problems): "), message


def test_verify_refuses_it_with_the_same_problems(mismatched):
    folder, words = mismatched
    problems = verify(folder).problems
    assert len(problems) == 14, problems  # one per quantized layer: 7 per block, 2 blocks
    assert all(word in problems[0] for word in words), problems[0]
    assert schema_error(problems) == _load_error(folder)


def test_inspect_refuses_it_with_the_same_message(mismatched):
    folder, words = mismatched
    with pytest.raises(ValueError) as info:
        inspect_checkpoint(folder)
    assert _one_line(str(info.value), words) == _load_error(folder)


def test_convert_refuses_it_with_the_same_message(mismatched, tmp_path):
    folder, words = mismatched
    with pytest.raises(ValueError) as info:
        convert(folder, tmp_path / "out", HfQuantConfig(bits=8), progress=False)
    assert _one_line(str(info.value), words) == _load_error(folder)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("format", ["compressed-tensors", "gguf"])
def test_export_refuses_it_with_the_same_message(mismatched, tmp_path, format):
    if format == "gguf":
        pytest.importorskip("gguf")
    folder, words = mismatched
    dst = tmp_path / ("out.gguf" if format == "gguf" else "out")
    with pytest.raises(ValueError) as info:
        export_checkpoint(folder, dst, format=format)
    assert _one_line(str(info.value), words) == _load_error(folder)
    assert not dst.exists()


def _add_tensor(folder: Path, key: str, tensor: torch.Tensor) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors[key] = tensor
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / SUMS_NAME).unlink(missing_ok=True)


UNUSED = {
    # a column scale beside an RTN layer, a scale of a layer config.json keeps in float, a stray float tensor
    "column scale of an rtn layer": (f"{LAYER}.weight_col_scale", torch.ones(128, dtype=torch.bfloat16)),
    "scale of a float layer": ("lm_head.weight_scale", torch.ones(256, 2, dtype=torch.bfloat16)),
    "stray tensor in a layer": ("model.layers.1.mlp.extra", torch.zeros(3)),
}


@pytest.mark.parametrize("case", list(UNUSED))
def test_a_tensor_nothing_uses_is_refused_by_load_and_verify(stored, tmp_path, case):
    """Was: from_pretrained ignored it (transformers' UNEXPECTED report, the load went on)."""
    key, tensor = UNUSED[case]
    folder = tmp_path / "unused"
    shutil.copytree(stored["rtn"], folder)
    _add_tensor(folder, key, tensor)
    problems = verify(folder).problems
    assert len(problems) == 1 and key in problems[0] and "not a tensor of LlamaForCausalLM" in problems[0], problems
    assert _one_line(_load_error(folder), [key]) == schema_error(problems)


def test_integer_codes_where_the_config_keeps_a_float_tensor_are_refused(stored, tmp_path):
    """Was: loaded, the int8 values cast to float weights."""
    folder = tmp_path / "codes"
    shutil.copytree(stored["rtn"], folder)
    key = "model.layers.0.input_layernorm.weight"
    _add_tensor(folder, key, torch.ones(64, dtype=torch.int8))
    problems = verify(folder).problems
    assert len(problems) == 1 and key in problems[0] and "integer codes" in problems[0], problems
    assert _load_error(folder) == schema_error(problems)


def _base_type(base: str):
    def edit(config):
        config["hfquant_base_model_type"] = base

    return edit


@pytest.mark.parametrize("base", ["qwen3", "mistral", "gpt2", "clip"])
def test_a_base_model_type_other_than_the_architectures_is_refused_by_verify_and_load(stored, tmp_path, base):
    """Was: verify said ok for each (it builds the `architectures` class); from_pretrained refused gpt2 and clip, and
    built a Qwen3 or Mistral model over the Llama tensors (Qwen3's missing q/k norms initialized)."""
    folder = _edited_copy(stored["rtn"], tmp_path / base, _base_type(base))
    problems = verify(folder).problems
    assert problems and f"base model type {base!r}" in problems[0] and "LlamaForCausalLM ('llama')" in problems[0]
    message = _load_error(folder)
    if base != "clip":  # transformers refuses a CLIPConfig for AutoModelForCausalLM before hfquant's hook runs
        assert message.startswith("the hfquant checkpoint does not match its config") and problems[0] in message
    with pytest.raises(ValueError, match="base model type"):
        inspect_checkpoint(folder)


def test_a_sound_checkpoint_passes_every_entry_point(stored, tmp_path):
    """The check refuses what differs, not every checkpoint: SINQ and RTN as written pass, load and inspect."""
    for method, folder in stored.items():
        assert verify(folder).ok, (method, verify(folder).problems)
        auto_class("llama").from_pretrained(folder, device_map="cpu")
        assert {row["method"] for row in inspect_checkpoint(folder)["quantized"]} == {method}
    export_checkpoint(stored["rtn"], tmp_path / "ct")
    assert (tmp_path / "ct" / "config.json").is_file()


def test_convert_refuses_a_float_source_holding_quantized_layers(stored, tmp_path):
    """A quantized checkpoint whose config.json lost its quantization_config: its scales are not float weights."""

    def strip(config):
        del config["quantization_config"]
        config["model_type"] = config.pop("hfquant_base_model_type")

    folder = _edited_copy(stored["rtn"], tmp_path / "stripped", strip)
    with pytest.raises(
        ValueError, match=r"weight_scale is a stored tensor of a quantized layer .* no quantization_config"
    ):
        convert(folder, tmp_path / "out", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "out").exists()


def test_the_int8_lm_head_s_tensors_are_checked_against_the_config(float_checkpoint, tmp_path):
    """The 4-bit default's lm_head is int8 per channel: its scale must be (V, 1); a checkpoint of it whose config.json
    loses the field (read as "keep", a float lm_head) has codes and a scale where a float weight is expected."""
    folder = tmp_path / "default"
    convert(float_checkpoint("llama"), folder, HfQuantConfig(bits=4, group_size=32), progress=False)
    assert verify(folder).problems == []
    assert load_file(folder / "model.safetensors")["lm_head.weight_scale"].shape == (256, 1)
    wrong = tmp_path / "wrong-scale"
    shutil.copytree(folder, wrong)
    tensors = load_file(wrong / "model.safetensors")
    tensors["lm_head.weight_scale"] = tensors["lm_head.weight_scale"].repeat(1, 2).contiguous()
    save_file(tensors, wrong / "model.safetensors", metadata={"format": "pt"})
    (wrong / SUMS_NAME).unlink()
    problems = verify(wrong).problems
    assert len(problems) == 1 and "lm_head.weight_scale" in problems[0], problems
    assert _one_line(_load_error(wrong), ["lm_head.weight_scale"]) == schema_error(problems)

    def drop_lm_head(config):
        del config["quantization_config"]["lm_head"]

    legacy = _edited_copy(folder, tmp_path / "legacy", drop_lm_head)
    problems = verify(legacy).problems
    assert problems and any("lm_head" in problem for problem in problems), problems
    assert _one_line(_load_error(legacy), ["lm_head"]) == schema_error(problems)
