"""An hfquant checkpoint loaded by plain transformers: refused naming hfquant; a marked config reloads with hfquant
as its base config (issue #11, docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert

_PLAIN_LOAD = """
import sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
except Exception as error:
    print("ERROR", type(error).__name__, error)
else:
    print("LOADED")
assert "hfquant" not in sys.modules
"""


@pytest.fixture(scope="module")
def saves_of_every_kind(float_checkpoint, tmp_path_factory):
    """{name: folder} of hfquant checkpoints written each way hfquant writes one: convert, save_pretrained of a model
    quantized on load, save_pretrained over an existing folder (the staged save), and save_pretrained of a reloaded
    model; at 8 and 4 bits."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("kinds")
    src = float_checkpoint("llama")
    folders = {}
    for bits in (8, 4):
        folders[f"convert-{bits}"] = root / f"convert-{bits}"
        convert(src, folders[f"convert-{bits}"], HfQuantConfig(bits=bits, group_size=32), progress=False)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=HfQuantConfig(bits=bits, group_size=32))
        folders[f"on-load-{bits}"] = root / f"on-load-{bits}"
        model.save_pretrained(folders[f"on-load-{bits}"])
        folders[f"over-existing-{bits}"] = root / f"over-existing-{bits}"
        shutil.copytree(src, folders[f"over-existing-{bits}"])
        model.save_pretrained(folders[f"over-existing-{bits}"])
        folders[f"reloaded-{bits}"] = root / f"reloaded-{bits}"
        AutoModelForCausalLM.from_pretrained(folders[f"convert-{bits}"]).save_pretrained(folders[f"reloaded-{bits}"])
    return folders


@pytest.mark.parametrize(
    "kind",
    [
        "convert-8",
        "on-load-8",
        "over-existing-8",
        "reloaded-8",
        "convert-4",
        "on-load-4",
        "over-existing-4",
        "reloaded-4",
    ],
)
def test_plain_transformers_refuses_an_hfquant_checkpoint_naming_hfquant(saves_of_every_kind, kind):
    """Without hfquant, AutoModelForCausalLM raises naming hfquant (config.json's model_type is "hfquant"), where
    transformers alone loaded the int8 codes as float weights with a warning. Fails if any way of saving leaves the
    model's own model_type in config.json."""
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, str(saves_of_every_kind[kind])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ERROR ValueError") and "model type `hfquant`" in result.stdout, result.stdout


@pytest.mark.parametrize("kind", ["convert-8", "on-load-4", "reloaded-4"])
def test_marked_config_reloads_with_hfquant_as_the_base_config(saves_of_every_kind, kind):
    """With hfquant, the marked config.json parses to the base config class (LlamaConfig, model_type "llama"), through
    AutoConfig and through the model class itself, and the checkpoint's hfquant readers see the base type."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hfquant.checkpoint.files import read_config
    from hfquant.checkpoint.model_type import BASE_MODEL_TYPE_KEY

    folder = saves_of_every_kind[kind]
    on_disk = json.loads((folder / "config.json").read_text())
    assert on_disk["model_type"] == "hfquant" and on_disk[BASE_MODEL_TYPE_KEY] == "llama"
    assert type(AutoConfig.from_pretrained(folder)) is LlamaConfig
    assert read_config(folder)["model_type"] == "llama" and BASE_MODEL_TYPE_KEY not in read_config(folder)
    tokens = torch.tensor([[1, 5, 9, 2]])
    by_auto, by_class = AutoModelForCausalLM.from_pretrained(folder), LlamaForCausalLM.from_pretrained(folder)
    for model in (by_auto, by_class):
        assert model.config.model_type == "llama" and BASE_MODEL_TYPE_KEY not in model.config.to_dict()
    assert torch.equal(by_auto(tokens).logits, by_class(tokens).logits)


def test_unmark_refuses_a_marked_config_without_its_base_type():
    from hfquant.checkpoint.model_type import mark, unmark

    quantized = {"model_type": "llama", "quantization_config": {"quant_method": "hfquant"}, "hidden_size": 8}
    assert unmark(mark(quantized)) == quantized
    assert mark({"model_type": "llama", "hidden_size": 8}) == {"model_type": "llama", "hidden_size": 8}  # float: kept
    with pytest.raises(ValueError, match=r"x/config.json: model_type is 'hfquant' but hfquant_base_model_type=None"):
        unmark({"model_type": "hfquant", "quantization_config": {"quant_method": "hfquant"}}, "x/config.json")
