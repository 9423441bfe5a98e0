"""`hfquant.publishing.cards`: the model card's metadata (through huggingface_hub's ModelCardData) and body, from the files."""

from __future__ import annotations

import json

import pytest
import torch
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
    assert "int8" not in data["tags"]


def test_int8_encoder_card(float_checkpoint, tmp_path):
    out = tmp_path / "bert-int8"
    convert(float_checkpoint("bert"), out, HfQuantConfig(bits=8), progress=False)
    card = build_card(out)
    data = card.data.to_dict()
    assert "int8" in data["tags"] and "int4" not in data["tags"]
    assert "base_model" not in data and "base_model_relation" not in data  # unknown float model: no broken link
    assert "pipeline_tag" not in data
    assert "AutoModel.from_pretrained" in card.content and "one scale per output channel" in card.content


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
    assert "`lm_head`: output embedding" in card.content
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
