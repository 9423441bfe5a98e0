"""The checkpoint layer's pieces for folders written file to file (convert, export, import): the shard plan, the small
files copied along, and config.json checked before anything is built from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hfquant.checkpoint.copying import NOT_EXPORTED, SKIPPED_FILES, copy_small_files
from hfquant.checkpoint.model_config import check_source_config, read_model_config, read_quantization_config
from hfquant.checkpoint.sharding import shard_plan


def test_shard_plan_splits_as_save_pretrained_and_names_a_bad_size():
    outputs = [SimpleNamespace(name=f"t{i}", shape=(256, 256), dtype=torch.bfloat16) for i in range(4)]  # 128 KiB each
    split = shard_plan(outputs, "300KB")
    assert split.is_sharded and list(split.filename_to_tensors) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert not shard_plan(outputs, "5GB").is_sharded
    with pytest.raises(ValueError, match="max_shard_size 'lots' is not a size; use bytes or e.g. 500MB"):
        shard_plan([], "lots")


def test_copy_small_files_skips_what_is_rewritten_or_describes_src(tmp_path):
    src, dst, export = tmp_path / "src", tmp_path / "dst", tmp_path / "export"
    for folder in (src, dst, export):
        folder.mkdir()
    for name in ("config.json", "README.md", "hfquant.sha256.json", "hfquant_eval.json", "tokenizer.json", ".hidden"):
        (src / name).write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "sub").mkdir()
    assert copy_small_files(src, dst) == ["hfquant.sha256.json", "hfquant_eval.json", "tokenizer.json"]
    assert copy_small_files(src, export, skipped=NOT_EXPORTED) == ["tokenizer.json"]
    assert {"config.json", "README.md"} <= SKIPPED_FILES and {
        "hfquant.sha256.json",
        "hfquant_eval.json",
    } <= NOT_EXPORTED


def test_config_json_checked_before_anything_is_built(tmp_path):
    check_source_config(tmp_path)  # no config.json: left to the caller
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="model_type='no-such-model' is not a model type transformers"):
        check_source_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_model_config(tmp_path) == {"model_type": "llama"}
    with pytest.raises(ValueError, match="has no quantization_config.*hfquant convert SRC DST"):
        read_quantization_config(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(ValueError, match="quant_method='gptq', not 'hfquant'"):
        read_quantization_config(tmp_path)
