"""`hfquant inspect model.gguf` and `hfquant convert model.gguf DST` (issue #29), run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import MERGES_VOCAB, tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig, export_checkpoint

pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]


def hfquant(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "hfquant_cli.py"), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    """A tiny Llama in Q4_0 with its q_proj in Q8_0 and o_proj kept in float, as one GGUF (hfquant's exporter)."""
    folder = tmp_path_factory.mktemp("gguf")
    tiny_model("llama", hidden_size=64, intermediate_size=128, **MERGES_VOCAB).save_pretrained(folder / "float")
    config = HfQuantConfig(
        format="q4_0", module_overrides={"*.q_proj": {"format": "q8_0"}}, modules_to_not_convert=["*.o_proj"]
    )
    model = AutoModelForCausalLM.from_pretrained(folder / "float", quantization_config=config)
    model.save_pretrained(folder / "q")
    tiny_tokenizer(merges=True).save_pretrained(folder / "q")
    path = folder / "tiny\x1b]0;x\x07.gguf"  # a file name that would retitle a terminal
    export_checkpoint(folder / "q", path, format="gguf")
    return path


def test_inspect_shows_types_and_bits_per_weight(gguf_file):
    done = hfquant("inspect", str(gguf_file))
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "tiny\\x1b]0;x\\x07.gguf" in done.stdout
    lines = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert lines["Q4_0"][1:2] == ["10"] and lines["Q4_0"][-2:] == ["4.500", "blocks"]  # 5 projections x 2 layers
    assert lines["Q8_0"][1:2] == ["2"] and lines["Q8_0"][-2:] == ["8.500", "blocks"]
    assert lines["blk.0.attn_q.weight"][1:] == ["Q8_0", "64x64", "8.500"]
    report = json.loads(hfquant("inspect", str(gguf_file), "--json").stdout)
    by_name = {row["name"]: row for row in report["tensors"]}
    assert by_name["blk.1.attn_output.weight"]["hfquant"] == "float"
    assert by_name["blk.1.ffn_down.weight"] == {
        "name": "blk.1.ffn_down.weight",
        "type": "Q4_0",
        "shape": [64, 128],
        "bytes": 64 * 128 // 32 * 18,
        "bits_per_weight": 4.5,
        "hfquant": "blocks",
    }


def test_convert_a_gguf_file_to_a_checkpoint_folder(gguf_file, tmp_path):
    done = hfquant("convert", str(gguf_file), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "layers kept in their GGUF blocks: 10 q4_0, 2 q8_0" in done.stdout
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "q4_0" and config["modules_to_not_convert"] == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.model.layers[0].self_attn.q_proj.format.block == "q8_0"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
    again = hfquant("convert", str(gguf_file), str(tmp_path / "out"))
    assert again.returncode != 0 and "exists" in again.stderr
    options = hfquant("convert", str(gguf_file), str(tmp_path / "other"), "--method", "sinq")
    assert options.returncode != 0 and "--method: a GGUF source keeps its own block types" in options.stderr
    default = hfquant("convert", str(gguf_file), str(tmp_path / "other"), "--bits", "4")  # the default's value, given
    assert default.returncode != 0 and "--bits: a GGUF source keeps its own block types" in default.stderr
    assert not (tmp_path / "other").exists()


def test_eval_of_a_gguf_file_says_to_convert_it_first(gguf_file):
    done = hfquant("eval", str(gguf_file))
    assert done.returncode != 0 and "hfquant convert FILE.gguf DST" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
