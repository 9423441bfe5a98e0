"""`hfquant.publishing.cards`: the model card's metadata (through huggingface_hub's ModelCardData) and body, from the files."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
from helpers import read_tensors
from huggingface_hub import ModelCard

from hfquant import HfQuantConfig
from hfquant.checkpoint.files import EVAL_FILE
from hfquant.conversion.convert import convert
from hfquant.inspection import human_bytes, inspect_checkpoint
from hfquant.publishing.cards import build_card, is_hfquant_card, write_card

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture()
def llama_int4(float_checkpoint, tmp_path):
    out = tmp_path / "tiny-int4"
    convert(
        float_checkpoint("llama", torch.bfloat16),
        out,
        HfQuantConfig(bits=4, group_size=32, mixed_precision="none"),
        progress=False,
    )
    return out


def test_metadata(llama_int4):
    card = build_card(llama_int4, base_model=BASE)
    data = card.data.to_dict()
    assert data["base_model"] == BASE
    assert data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert {"hfquant", "int4", "4-bit", "quantized"} <= set(data["tags"])
    assert {"int8", "8-bit"} <= set(data["tags"])  # the 4-bit default's int8 lm_head: a stored width
    assert "int2" not in data["tags"]


def test_a_block_format_card_names_its_types_and_how_they_are_stored(float_checkpoint, tmp_path):
    """The 4-bit default (IQ4_XS; IQ4_NL where 256 does not divide the inputs; an int8 lm_head): the card's tags,
    first sentence, tables and kernels name llama.cpp's block types, not 4-bit integers and PyTorch's int4 kernel."""
    out = tmp_path / "default"
    convert(float_checkpoint("llama", torch.bfloat16, hidden_size=256), out, HfQuantConfig(bits=4), progress=False)
    card = build_card(out, base_model=BASE)
    tags = set(card.data.to_dict()["tags"])
    assert {"iq4_xs", "iq4_nl", "int8", "4-bit", "8-bit"} <= tags and "int4" not in tags
    content = card.content
    assert (
        "IQ4_XS (llama.cpp's block type: 4.25 bits per weight, its scales inside each block of 256 inputs)" in content
    )
    assert "IQ4_NL (llama.cpp's block type: 4.5 bits per weight" in content and "4-bit integers" not in content
    assert "8-bit integers (one scale per output channel)" in content  # the lm_head
    assert "block-type layers as GGUF's block bytes" in content and "hfquant's C kernels" in content
    assert "| `model.layers.*.self_attn.q_proj` | 2 | 4 (iq4_xs) | 256 | yes | sinq (folded) |" in content
    assert "| | bfloat16 | hfquant iq4_xs/" in content and "`hfquant export --format gguf`" in content


def test_int8_encoder_card(float_checkpoint, tmp_path):
    out = tmp_path / "bert-int8"
    convert(float_checkpoint("bert"), out, HfQuantConfig(bits=8), progress=False)
    card = build_card(out)
    data = card.data.to_dict()
    assert "int8" in data["tags"] and "int4" not in data["tags"]
    assert "base_model" not in data and "base_model_relation" not in data  # unknown float model: no broken link
    assert "pipeline_tag" not in data
    assert "AutoModel.from_pretrained" in card.content and "one scale per output channel" in card.content
    assert "GGUF's block bytes" not in card.content and "hfquant's C kernels" not in card.content


def test_body_has_the_config_table_sizes_and_usage(llama_int4):
    card = build_card(llama_int4, base_model=BASE, repo_id="me/tiny-int4")
    qconfig = json.loads((llama_int4 / "config.json").read_text())["quantization_config"]
    for key in qconfig:
        assert f"| `{key}` |" in card.content
    assert "| `bits` | 4 |" in card.content and "| `group_size` | 32 |" in card.content
    totals = inspect_checkpoint(llama_int4)["totals"]
    assert (
        f"| tensor bytes | {human_bytes(totals['float_bytes'])} | {human_bytes(totals['tensor_bytes'])}"
        in card.content
    )
    assert "| `model.layers.*.mlp.down_proj` | 2 | 4 | 32 | no |" in card.content
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-int4"' in card.content
    assert f"https://huggingface.co/{BASE}" in card.content
    # the 4-bit default's lm_head: an int8 per-channel row of the layer table, not a float layer
    assert "| `lm_head` | 1 | 8 | per-channel | yes |" in card.content
    assert "`lm_head`: output embedding" not in card.content
    assert "Not measured yet" in card.content


def test_evaluation_results_appear(llama_int4):
    results = [
        {"label": "this model (hfquant int4)", "path": ".", "perplexity": 12.3456, "tokens_per_second": 41.26},
        {"label": "base (bfloat16)", "path": "base", "perplexity": 11.0, "tokens_per_second": 30.0},
    ]
    (llama_int4 / EVAL_FILE).write_text(
        json.dumps(
            {
                "text": "a test text",
                "tokens": 99,
                "max_length": 512,
                "new_tokens": 8,
                "device": "CPU",
                "results": results,
            }
        )
    )
    content = build_card(llama_int4).content
    assert "| this model (hfquant int4) | 12.346 | 41.3 |" in content
    assert "| base (bfloat16) | 11.000 | 30.0 |" in content
    assert "Not measured yet" not in content


def test_written_card_round_trips_and_keeps_base_model(llama_int4):
    path = write_card(llama_int4, base_model=BASE)
    assert is_hfquant_card(path)
    loaded = ModelCard.load(path)
    assert loaded.data.base_model == BASE and loaded.data.base_model_relation == "quantized"
    again = build_card(llama_int4)  # re-rendered (as push and eval do): the base model is read back from README.md
    assert again.data.base_model == BASE


def test_license_of_the_float_model_carries_over(llama_int4, tmp_path):
    base_card = tmp_path / "base-README.md"
    base_card.write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# base\n")
    data = build_card(llama_int4, base_model=BASE, base_card=base_card).data.to_dict()
    assert data["license"] == "apache-2.0" and data["language"] == ["en"]


def test_errors(llama_int4, float_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="base_model 'not a repo id'"):
        build_card(llama_int4, base_model="not a repo id")
    with pytest.raises(ValueError, match="not an hfquant checkpoint"):
        build_card(float_checkpoint("llama"))
    with pytest.raises(FileNotFoundError, match="template"):
        build_card(llama_int4, template_path=tmp_path / "missing.jinja")
    (tmp_path / "README.md").write_text("# my own card\n")
    assert not is_hfquant_card(tmp_path / "README.md")


def _card_command(readme) -> list[str]:
    """The command of the card's "How it was made" section, split as a POSIX shell splits it."""
    text = readme.read_text()
    block = text.split("## How it was made", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    return shlex.split(block)


def test_card_command_reproduces_the_tensors(float_checkpoint, tmp_path, monkeypatch):
    """Issue #27 item 2: the card's command, with the user's own options (a JSON module_overrides, a list, a group
    and a dtype), is shell-quoted; run as the shell would split it, it writes the same tensors and config."""
    from hfquant.commands.cli import main

    src = float_checkpoint("llama", torch.bfloat16, hidden_size=96)
    options = ["--bits", "4", "--group-size", "64", "--module-overrides", '{"o_proj": {"bits": 8}}']
    options += ["--modules-to-not-convert", "k_proj", "--dtype", "float32", "--no-progress"]
    assert main(["convert", str(src), str(tmp_path / "mine"), *options]) == 0
    command = _card_command(tmp_path / "mine" / "README.md")
    assert command[:4] == ["hfquant", "convert", str(src), "mine"]
    assert command[command.index("--module-overrides") + 1] == '{"o_proj":{"bits":8}}'
    assert "--dtype" in command and "k_proj" in command
    (tmp_path / "again").mkdir()
    monkeypatch.chdir(tmp_path / "again")
    assert main([*command[1:], "--no-progress"]) == 0
    want, got = read_tensors(tmp_path / "mine"), read_tensors(tmp_path / "again" / "mine")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    configs = [json.loads((p / "config.json").read_text()) for p in (tmp_path / "mine", tmp_path / "again" / "mine")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    # re-rendered (hfquant push, hfquant eval), the card keeps the command
    assert _card_command(write_card(tmp_path / "mine", repo_id="me/mine")) == command


def test_card_summarizes_layers_names_the_method_and_says_how_to_install(float_checkpoint, tmp_path):
    """The int format's 4-bit defaults record every layer's format in module_overrides: the card counts the layers per
    format instead of dumping the dict, names the method as its tables do, and installs from source."""
    out = tmp_path / "default"
    config = HfQuantConfig(format="int")
    convert(float_checkpoint("llama", torch.bfloat16, hidden_size=96), out, config, progress=False)
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(qconfig["module_overrides"]) == 14
    card = build_card(out, base_model=BASE).content
    assert "model.layers.0" not in card and '"group_size"' not in card  # no entry of the dict in the card
    assert "| `module_overrides` | 14 layers by name, each with the format it is stored in (table below) |" in card
    assert "| 11 | 4 | 32 | no | sinq (folded) |" in card and "| 2 | 4 | 64 | no | sinq (folded) |" in card
    assert "| 1 | 8 | per-channel | yes | sinq (folded) |" in card
    assert "round-to-nearest (RTN)" not in card and "`sinq (folded)`: SINQ with its column scales folded" in card
    assert "pip install hfquant\n" not in card and "not published on PyPI" in card
    assert not (out / "README.md").exists()  # the library's convert writes no card: the command is made from config
    assert (
        build_card(out)
        .content.split("```bash\n")[-1]
        .startswith(f"hfquant convert SRC {out.name} --bits 4 --format int\n")
    )
