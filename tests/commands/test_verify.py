"""`hfquant.verification`: a sound checkpoint passes; each damaged index, header, tensor, config or checksum is reported
by name with its fix; and a pre-quantized `from_pretrained` of a tensor of the wrong dtype or shape fails loudly."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import auto_class
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.checksums import SUMS_NAME, write_checksums
from hfquant.checkpoint.files import SAFETENSORS_DTYPES, read_headers
from hfquant.verification import verify

INDEX = "model.safetensors.index.json"
# (architecture, dtype, HfQuantConfig kwargs, max_shard_size): every stored layout, Conv1D, bias, tied lm_head.
VARIANTS = {
    "llama-int4-asym": ("llama", torch.bfloat16, dict(bits=4, group_size=32), "40KB"),
    "llama_tied-int8-sym": ("llama_tied", torch.float32, dict(bits=8), "60KB"),
    "gpt2-int4-sym": ("gpt2", torch.float32, dict(bits=4, group_size=64, symmetric=True), "80KB"),
    "bert-int8-asym": ("bert", torch.float32, dict(bits=8, group_size=32, symmetric=False), None),
}


@pytest.fixture(scope="module")
def quantized(float_checkpoint, tmp_path_factory):
    """Factory: name -> folder of a saved quantized checkpoint (built once per module)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            arch, dtype, qconfig, shard = VARIANTS[name]
            model = auto_class(arch).from_pretrained(
                float_checkpoint(arch, dtype),
                quantization_config=HfQuantConfig(**qconfig),
                dtype=dtype,
                device_map="cpu",
            )
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
            cache[name] = path
        return cache[name]

    return make


@pytest.fixture
def copy_of(quantized, tmp_path):
    def make(name: str = "llama-int4-asym") -> Path:
        target = tmp_path / name
        shutil.copytree(quantized(name), target)
        return target

    return make


def _index(folder: Path) -> dict:
    return json.loads((folder / INDEX).read_text())


def _write_index(folder: Path, index: dict) -> None:
    (folder / INDEX).write_text(json.dumps(index))


def _shard_of(folder: Path, key: str) -> Path:
    index_path = folder / INDEX
    return folder / (_index(folder)["weight_map"][key] if index_path.exists() else "model.safetensors")


def _rewrite(folder: Path, key: str, change) -> Path:
    """Replace tensor `key` in its shard by `change(tensor)` (None removes it); returns the shard."""
    shard = _shard_of(folder, key)
    tensors = load_file(shard)
    new = change(tensors[key])
    if new is None:
        del tensors[key]
    else:
        tensors[key] = new.contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    return shard


def _file_tensor_count(folder: Path) -> int:
    count = 0
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            count += len(list(handle.keys()))
    return count


SCALE = "model.layers.0.mlp.down_proj.weight_scale"
WEIGHT = "model.layers.0.mlp.down_proj.weight"


# -- sound checkpoints --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_sound_checkpoint_has_no_problem_and_every_tensor_is_compared(quantized, name):
    folder = quantized(name)
    result = verify(folder)
    assert result.problems == []
    assert result.ok
    assert result.tensors == _file_tensor_count(folder)
    assert result.files == len(list(folder.glob("*.safetensors")))


def test_read_headers_matches_the_safetensors_library(quantized):
    folder = quantized("llama-int4-asym")
    for shard in folder.glob("*.safetensors"):
        tensors = read_headers(shard)
        with safe_open(str(shard), framework="pt") as handle:
            assert sorted(tensors) == sorted(handle.keys())
            for key, header in tensors.items():
                view = handle.get_slice(key)
                assert header.dtype == SAFETENSORS_DTYPES[view.get_dtype()]
                assert list(header.shape) == list(view.get_shape())
                assert header.file == shard.name
                assert header.file == shard.name


def test_checksums_are_recorded_and_checked(copy_of):
    folder = copy_of()
    manifest = json.loads(write_checksums(folder).read_text())
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert sorted(manifest["files"]) == sorted(shards + ["config.json", INDEX])
    result = verify(folder)
    assert result.problems == []
    assert result.checksums == len(shards) + 2
    # flip one byte of tensor data: the header stays valid, only the checksum can tell
    shard = folder / shards[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    problems = verify(folder).problems
    assert len(problems) == 1
    assert shards[0] in problems[0] and manifest["files"][shards[0]] in problems[0] and "copy it again" in problems[0]


# -- damaged checkpoints: (mutation, words every problem message must contain) ------------------------------------


def _missing_shard(folder):
    shard = sorted(set(_index(folder)["weight_map"].values()))[1]
    (folder / shard).unlink()
    return [shard, "missing", "copy the complete checkpoint"]


def _entry_not_in_its_shard(folder):
    index = _index(folder)
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"][SCALE])
    index["weight_map"][SCALE] = wrong
    _write_index(folder, index)
    return [SCALE, wrong, f"has no tensor '{SCALE}'", "different saves"]


def _tensor_not_in_index(folder):
    index = _index(folder)
    del index["weight_map"][SCALE]
    _write_index(folder, index)
    return [SCALE, "not in model.safetensors.index.json"]


def _stray_shard(folder):
    save_file({"x": torch.zeros(2)}, folder / "model-extra.safetensors")
    return ["model-extra.safetensors", "not named in", "ignores it"]


def _path_outside_folder(folder):
    index = _index(folder)
    index["weight_map"][SCALE] = "../elsewhere.safetensors"
    _write_index(folder, index)
    return ["'../elsewhere.safetensors'", "not a file name inside the checkpoint folder"]


def _index_not_json(folder):
    (folder / INDEX).write_text('{"weight_map": {')
    return [INDEX, "not valid JSON"]


def _index_unknown_field(folder):
    index = _index(folder)
    index["loader"] = "custom"
    _write_index(folder, index)
    return [INDEX, "'loader'", "weight_map"]


def _truncated_shard(folder):
    shard = _shard_of(folder, SCALE)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    return [shard.name, "file not fully covered", "copy or download it again"]


def _padded_shard(folder):
    shard = _shard_of(folder, SCALE)
    shard.write_bytes(shard.read_bytes() + b"\0" * 16)
    return [shard.name, "file not fully covered"]


def _header_not_json(folder):
    shard = _shard_of(folder, SCALE)
    data = bytearray(shard.read_bytes())
    data[8:12] = b"{{{{"
    shard.write_bytes(bytes(data))
    return [shard.name, "invalid JSON in header", "copy or download it again"]


def _header_length_huge(folder):
    shard = _shard_of(folder, SCALE)
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2**40)
    shard.write_bytes(bytes(data))
    return [shard.name, "header too large", "not a readable safetensors file"]


def _header_edit(edit):
    def mutate(folder):
        shard = _shard_of(folder, SCALE)
        data = shard.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        words = edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])
        return [shard.name, "not a readable safetensors file", *words]

    return mutate


def _bad_dtype(header):
    header[SCALE]["dtype"] = "BF17"
    return ["unknown variant `BF17`"]


def _offsets_overlap(header):
    begin, end = header[SCALE]["data_offsets"]
    header[SCALE]["data_offsets"] = [begin + 2, end + 2]
    return ["invalid offset for tensor"]


def _wrong_size(header):
    header[SCALE]["shape"] = [header[SCALE]["shape"][0], header[SCALE]["shape"][1] * 2]
    return ["invalid shape, data type, or offset"]


def _scale_dtype(folder):
    _rewrite(folder, SCALE, lambda t: t.float())
    return [
        SCALE,
        "float32",
        "expected bfloat16 (64, 4)",
        "4-bit QuantLinear (group size 32, asymmetric)",
        "restore config.json",
    ]


def _scale_shape(folder):
    _rewrite(folder, SCALE, lambda t: t[:, :2])
    return [SCALE, "bfloat16 (64, 2)", "expected bfloat16 (64, 4)"]


def _weight_signed(folder):
    _rewrite(folder, WEIGHT, lambda t: t.view(torch.int8))
    return [WEIGHT, "int8 (64, 64)", "expected uint8 (64, 64)"]


def _weight_float(folder):
    _rewrite(folder, WEIGHT, lambda t: torch.zeros(64, 128))
    return [WEIGHT, "float32 (64, 128)", "expected uint8 (64, 64)"]


def _zero_point_missing(folder):
    key = "model.layers.1.self_attn.q_proj.weight_zero_point"
    _rewrite(folder, key, lambda t: None)
    index = _index(folder)
    del index["weight_map"][key]
    _write_index(folder, index)
    return [key, "missing from the checkpoint files", "uninitialized"]


def _scale_nan(folder):
    _rewrite(folder, SCALE, lambda t: t.index_fill(1, torch.tensor([2]), float("nan")))
    return [SCALE, "impossible scale value", "nan", "finite and > 0"]


def _scale_zero(folder):
    _rewrite(folder, SCALE, lambda t: t.index_fill(0, torch.tensor([5]), 0.0))
    return [SCALE, "impossible scale value", "first: 0.0 at index (5, 0)"]


def _zero_point_too_large(folder):
    key = SCALE.replace("weight_scale", "weight_zero_point")
    _rewrite(folder, key, lambda t: t.index_fill(0, torch.tensor([3]), 16))
    return [key, "zero point(s) above 15", "at 4 bits"]


def _float_shape(folder):
    key = "model.layers.0.input_layernorm.weight"
    _rewrite(folder, key, lambda t: t[:32])
    return [key, "shape (32)", "expected (64)"]


def _unexpected_tensor(folder):
    shard = _rewrite(folder, SCALE, lambda t: t)
    tensors = load_file(shard)
    tensors["model.layers.0.mlp.extra"] = torch.zeros(3)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = _index(folder)
    index["weight_map"]["model.layers.0.mlp.extra"] = shard.name
    _write_index(folder, index)
    return ["model.layers.0.mlp.extra", "not a tensor of LlamaForCausalLM"]


def _config_edit(edit):
    def mutate(folder):
        config = json.loads((folder / "config.json").read_text())
        words = edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        return ["config.json", *words]

    return mutate


def _no_quantization(config):
    del config["quantization_config"]
    return ["no quantization_config", "not a quantized checkpoint", "hfquant convert"]


def _other_method(config):
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    return ["quant_method='gptq'", "another method"]


def _future_version(config):
    config["quantization_config"]["format_version"] = 2
    return ["format_version=2", "upgrade hfquant"]


def _unknown_field(config):
    config["quantization_config"]["act_order"] = True
    return ["'act_order'", "allowed fields"]


def _bits_mismatch(config):  # config says 8 bits, the files hold 4-bit tensors
    config["quantization_config"].update(bits=8, symmetric=True, group_size=None, module_overrides={})
    return [WEIGHT, "expected int8 (64, 128)", "8-bit QuantLinear"]


def _config_not_json(folder):
    (folder / "config.json").write_text('{"quantization_config": NaN}')
    return ["config.json", "not valid JSON", "NaN"]


def _duplicate_key(folder):
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace("{", '{"model_type": "gpt2", ', 1))
    return ["config.json", "'model_type' appears twice"]


def _checksum_manifest_bad(folder):
    (folder / SUMS_NAME).write_text(json.dumps({"algorithm": "md5", "files": {}}))
    return [SUMS_NAME, "sha256"]


def _checksummed_file_missing(folder):
    write_checksums(folder)
    (folder / "config.json").rename(folder / "config.json.bak")
    return ["config.json", "missing"]


DAMAGES = {
    "missing shard": _missing_shard,
    "index entry not in its shard": _entry_not_in_its_shard,
    "tensor not in index": _tensor_not_in_index,
    "shard not in index": _stray_shard,
    "index names a path outside the folder": _path_outside_folder,
    "index not JSON": _index_not_json,
    "index unknown field": _index_unknown_field,
    "truncated shard": _truncated_shard,
    "padded shard": _padded_shard,
    "header not JSON": _header_not_json,
    "header length huge": _header_length_huge,
    "header unknown dtype": _header_edit(_bad_dtype),
    "header offsets overlap": _header_edit(_offsets_overlap),
    "header size not matching shape": _header_edit(_wrong_size),
    "scale dtype": _scale_dtype,
    "scale shape": _scale_shape,
    "weight signed": _weight_signed,
    "weight float": _weight_float,
    "zero point missing": _zero_point_missing,
    "scale NaN": _scale_nan,
    "scale zero": _scale_zero,
    "zero point above the codes": _zero_point_too_large,
    "float tensor shape": _float_shape,
    "unexpected tensor": _unexpected_tensor,
    "no quantization_config": _config_edit(_no_quantization),
    "other quant method": _config_edit(_other_method),
    "format version 2": _config_edit(_future_version),
    "unknown config field": _config_edit(_unknown_field),
    "config bits not the files'": _config_edit(_bits_mismatch),
    "config NaN": _config_not_json,
    "config duplicate key": _duplicate_key,
    "checksum manifest malformed": _checksum_manifest_bad,
    "checksummed file missing": _checksummed_file_missing,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damage_is_reported_by_name_with_the_fix(copy_of, damage):
    folder = copy_of()
    words = DAMAGES[damage](folder)
    problems = verify(folder).problems
    assert problems, f"{damage}: no problem reported"
    matching = [p for p in problems if all(w in p for w in words)]
    assert matching, f"{damage}: no problem contains {words}: {problems}"


def test_several_problems_are_all_listed(copy_of):
    folder = copy_of()
    words = [_scale_shape(folder), _weight_signed(folder), _float_shape(folder)]
    problems = verify(folder).problems
    assert len(problems) == 3
    for expected in words:
        assert any(all(w in p for w in expected) for p in problems)


def test_missing_or_file_path_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        verify(tmp_path / "file")


def test_custom_architecture_is_not_imported_and_only_files_are_checked(copy_of):
    folder = copy_of()
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["EvilForCausalLM"]
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('checkpoint code ran')\n")
    result = verify(folder)
    assert result.problems == []
    assert any("EvilForCausalLM" in note and "trust_remote_code" in note for note in result.notes)


# -- the same checks at load time ---------------------------------------------------------------------------------

LOAD_DAMAGES = [
    "scale dtype",
    "scale shape",
    "weight signed",
    "weight float",
    "zero point missing",
    "truncated shard",
    "header not JSON",
    "config bits not the files'",
    "scale NaN",
    "scale zero",
    "zero point above the codes",
]


@pytest.mark.parametrize("damage", LOAD_DAMAGES)
@pytest.mark.parametrize("ignore_mismatched_sizes", [False, True])
def test_pre_quantized_load_of_a_damaged_tensor_fails_naming_it(copy_of, damage, ignore_mismatched_sizes):
    folder = copy_of()
    words = DAMAGES[damage](folder)
    words = [w for w in words if w != "config.json"]  # load errors name the tensor or the shard
    with pytest.raises(ValueError) as info:
        auto_class("llama").from_pretrained(folder, device_map="cpu", ignore_mismatched_sizes=ignore_mismatched_sizes)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_without_the_load_check_transformers_keeps_a_wrong_dtype_or_reinitializes(copy_of, monkeypatch):
    """Why the check exists: transformers alone loads a float32 scale silently, and with ignore_mismatched_sizes
    re-initializes a scale of the wrong shape (so the layer computes garbage)."""
    import hfquant.integration.checks

    monkeypatch.setattr(hfquant.integration.checks, "check_stored_tensors", lambda *args, **kwargs: 0)
    # the value check would catch the re-initialized (zero) scale too: this test shows transformers without both
    monkeypatch.setattr(hfquant.integration.checks, "stored_value_problems", lambda model: [])
    folder = copy_of()
    _scale_dtype(folder)
    model = auto_class("llama").from_pretrained(folder, device_map="cpu")
    assert model.model.layers[0].mlp.down_proj.weight_scale.dtype == torch.float32
    folder = copy_of("llama_tied-int8-sym")
    key = "model.layers.0.mlp.down_proj.weight_scale"
    stored = _rewrite(folder, key, lambda t: t)
    good = load_file(stored)[key]
    _rewrite(folder, key, lambda t: t.repeat(1, 2))
    model = auto_class("llama").from_pretrained(folder, device_map="cpu", ignore_mismatched_sizes=True)
    loaded = model.model.layers[0].mlp.down_proj.weight_scale
    assert loaded.shape == good.shape and not torch.equal(loaded, good)


def test_sound_checkpoint_loads_with_the_check(quantized):
    model = auto_class("gpt2").from_pretrained(quantized("gpt2-int4-sym"), device_map="cpu")
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "QuantLinear"


# -- the command ------------------------------------------------------------------------------------------------------


def test_command_lists_every_problem_and_exits_1(copy_of):
    import subprocess
    import sys

    damaged = copy_of()
    expected = [_scale_shape(damaged), _weight_signed(damaged)]
    run = subprocess.run(
        [sys.executable, "-m", "hfquant.commands.cli", "verify", str(damaged)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert f"{damaged}: 2 problem(s):" in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("  - ")]
    assert len(lines) == 2
    for words in expected:
        assert any(all(w in line for w in words) for line in lines), (words, lines)


def test_command_records_sums_of_a_sound_checkpoint(quantized, tmp_path, capsys):
    from hfquant.commands.cli import main

    sound = tmp_path / "sound"
    shutil.copytree(quantized("gpt2-int4-sym"), sound)
    assert main(["verify", str(sound), "--write-checksums"]) == 0
    assert f"ok: {sound}: {_file_tensor_count(sound)} tensors" in capsys.readouterr().out
    recorded = sorted(json.loads((sound / SUMS_NAME).read_text())["files"])
    assert recorded == sorted([p.name for p in sound.glob("*.safetensors")] + ["config.json", INDEX])
    assert verify(sound).checksums == len(recorded)
    (sound / "config.json").write_text((sound / "config.json").read_text() + " ")
    assert main(["verify", str(sound)]) == 1
    assert "config.json has sha256" in capsys.readouterr().err
