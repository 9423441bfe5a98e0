"""`hfquant.inspection`: per-kind bits, group sizes and bytes read from the safetensors headers, float layers and why."""

from __future__ import annotations

import json

import pytest
import torch

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert
from hfquant.inspection import FOLDED_SINQ, format_report, inspect_checkpoint, layer_kind

LLAMA_KINDS = [
    f"model.layers.*.{p}"
    for p in (
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    )
]


@pytest.fixture(scope="module")
def converted(float_checkpoint, tmp_path_factory):
    """Factory: (arch, source dtype, HfQuantConfig kwargs) -> folder converted once."""
    cache = {}

    def make(arch: str, dtype=torch.float32, **qconfig):
        key = (arch, dtype, json.dumps(qconfig, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-inspect") / "model"
            convert(float_checkpoint(arch, dtype), out, HfQuantConfig(**qconfig), progress=False)
            cache[key] = out
        return cache[key]

    return make


def test_layer_kind_replaces_indices_only():
    assert layer_kind("model.layers.12.mlp.down_proj") == "model.layers.*.mlp.down_proj"
    assert layer_kind("h2.attn.c_proj") == "h2.attn.c_proj"


@pytest.mark.parametrize("head", [{}, {"lm_head": "keep"}], ids=["default-lm_head", "keep"])
def test_int4_kinds_bits_groups_and_bytes(converted, head):
    """Group 128 asked: the 64-wide layers fall back to 64, down_proj (128 wide) keeps 128; bytes are exact. The
    4-bit default's lm_head is int8 per channel; with lm_head "keep" it is a float layer."""
    report = inspect_checkpoint(converted("llama", bits=4, format="int", method="rtn", mixed_precision="none", **head))
    rows = {row["kind"]: row for row in report["quantized"]}
    if not head:
        lm_head = rows.pop("lm_head")
        assert (lm_head["count"], lm_head["bits"], lm_head["symmetric"], lm_head["per_channel"]) == (1, 8, True, True)
        assert (lm_head["group_size"], lm_head["method"]) == (64, "rtn")
        # int8 codes (V, D) + one bfloat16 scale per row; float32 source (V, D)
        assert (lm_head["bytes"], lm_head["float_bytes"]) == (256 * 64 + 256 * 2, 256 * 64 * 4)
    assert sorted(rows) == LLAMA_KINDS
    for kind, row in rows.items():
        in_features = 128 if kind.endswith("down_proj") else 64
        out_features = {"down_proj": 64, "gate_proj": 128, "up_proj": 128, "k_proj": 32, "v_proj": 32}.get(
            kind.rpartition(".")[2], 64
        )
        groups = in_features // row["group_size"]
        assert (row["count"], row["bits"], row["symmetric"]) == (2, 4, False)
        assert row["group_size"] == (128 if kind.endswith("down_proj") else 64)
        # uint8 codes (N, K/2) + bfloat16 scales (N, K/g) + uint8 zero points (N, K/g), per layer
        assert row["bytes"] == 2 * out_features * (in_features // 2 + 2 * groups + groups)
        assert row["float_bytes"] == 2 * out_features * in_features * 4  # float32 source
    totals = report["totals"]
    assert totals["quantized_layers"] == (14 if head else 15)
    assert totals["tensor_bytes"] < totals["float_bytes"]
    assert totals["ratio"] == pytest.approx(totals["tensor_bytes"] / totals["float_bytes"])
    assert totals["file_bytes"] > totals["tensor_bytes"]  # plus the safetensors header
    assert report["quantization_config"]["bits"] == 4
    floats = {row["kind"]: row for row in report["float_tensors"]}
    assert floats["model.embed_tokens.weight"] == {
        "kind": "model.embed_tokens.weight",
        "count": 1,
        "dtype": "float32",
        "bytes": 256 * 64 * 4,
    }
    kept = [{"kind": "lm_head", "count": 1, "reason": "output embedding (lm_head), kept in float"}]
    assert report["float_layers"] == (kept if head else [])


def test_int8_per_channel_and_reasons(converted):
    report = inspect_checkpoint(converted("llama_tied", torch.bfloat16, bits=8, modules_to_not_convert=["o_proj"]))
    rows = {row["kind"]: row for row in report["quantized"]}
    assert "model.layers.*.self_attn.o_proj" not in rows
    for kind, row in rows.items():
        assert (row["bits"], row["symmetric"]) == (8, True)
        assert row["group_size"] == (128 if kind.endswith("down_proj") else 64)  # per channel: the whole row
        assert row["per_channel"] is True and row["method"] == "rtn"
    text = format_report(report)
    line = next(line for line in text.splitlines() if line.startswith("model.layers.*.mlp.down_proj"))
    assert line.split()[:5] == ["model.layers.*.mlp.down_proj", "2", "8", "per-channel", "yes"]
    reasons = {row["kind"]: (row["count"], row["reason"]) for row in report["float_layers"]}
    assert reasons["model.layers.*.self_attn.o_proj"] == (2, "listed in modules_to_not_convert")
    assert reasons["lm_head"][1].startswith("tied to model.embed_tokens.weight")


def test_conv1d_shapes(converted):
    """GPT-2 Conv1D weights are stored transposed: the float size still matches the (in, out) source."""
    report = inspect_checkpoint(converted("gpt2", bits=4, group_size=32))
    rows = {row["kind"]: row for row in report["quantized"]}
    assert rows["transformer.h.*.attn.c_attn"]["float_bytes"] == 2 * 64 * 192 * 4
    assert rows["transformer.h.*.mlp.c_proj"]["group_size"] == 32


def test_methods_as_stored_sinq_folded_sinq_and_rtn(converted):
    """Issue #27 item 3: the int format's default 4-bit Llama checkpoint folds SINQ (plain codes, no column scale) and
    is reported as folded SINQ, not as RTN; unfolded SINQ (GPT-2's Conv1D, or fold_column_scales off) stores column scales and
    is "sinq"; method rtn is "rtn". The v_proj the data-free rule stores in int8 is per-channel."""
    folded = {row["kind"]: row for row in inspect_checkpoint(converted("llama", format="int"))["quantized"]}
    assert folded.pop("lm_head")["method"] == "rtn"  # the 4-bit default's int8 lm_head: RTN, as embeddings
    assert {row["method"] for row in folded.values()} == {FOLDED_SINQ}
    int8 = [row for row in folded.values() if row["bits"] == 8]
    assert [(row["kind"], row["count"], row["per_channel"]) for row in int8] == [
        ("model.layers.*.self_attn.v_proj", 1, True)
    ]
    gpt2 = inspect_checkpoint(converted("gpt2", format="int", lm_head="keep"))["quantized"]
    assert {row["method"] for row in gpt2} == {"sinq"}
    unfolded = inspect_checkpoint(converted("llama", format="int", fold_column_scales=False))["quantized"]
    assert {row["method"] for row in unfolded if row["kind"] != "lm_head"} == {"sinq"}
    plain = inspect_checkpoint(converted("llama", format="int", method="rtn", mixed_precision="none"))["quantized"]
    assert {row["method"] for row in plain} == {"rtn"}
    # a layer asked in RTN by a pattern in a folded checkpoint is RTN
    overrides = {"o_proj": {"method": "rtn"}}
    mixed = inspect_checkpoint(converted("llama", format="int", module_overrides=overrides))["quantized"]
    assert {row["kind"]: row["method"] for row in mixed}["model.layers.*.self_attn.o_proj"] == "rtn"
    assert {row["kind"]: row["method"] for row in mixed}["model.layers.*.self_attn.q_proj"] == FOLDED_SINQ


def test_float_checkpoint(float_checkpoint):
    report = inspect_checkpoint(float_checkpoint("llama"))
    assert report["quantization_config"] is None and report["quantized"] == []
    assert report["totals"]["float_bytes"] == report["totals"]["tensor_bytes"]
    assert "quantization_config: none" in format_report(report)


def test_text_report_lists_every_kind(converted):
    text = format_report(inspect_checkpoint(converted("llama", bits=4)))
    for kind in LLAMA_KINDS:
        assert kind in text
    assert "lm_head: output embedding" not in text  # the 4-bit default's lm_head is int8: a quantized row
    assert next(line for line in text.splitlines() if line.startswith("lm_head")).split()[:5] == [
        "lm_head",
        "1",
        "8",
        "per-channel",
        "yes",
    ]
    assert "lm_head: output embedding" in format_report(inspect_checkpoint(converted("llama", lm_head="keep")))
    assert "smaller" in text


def test_cli_json_matches_library(converted, capsys):
    from hfquant.commands.cli import main

    path = converted("llama", bits=4)
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == inspect_checkpoint(path)
    assert main(["inspect", str(path)]) == 0
    assert capsys.readouterr().out.strip() == format_report(inspect_checkpoint(path))


def test_missing_folder_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        inspect_checkpoint(tmp_path)
