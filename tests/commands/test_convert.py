"""`hfquant.conversion.convert` (and `hfquant convert` for what the command adds: the card): file-to-file quantization equal to quantize-on-load + save_pretrained, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import auto_class, read_tensors
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.checksums import SUMS_NAME
from hfquant.commands.cli import main
from hfquant.conversion.convert import convert

SHARD_SIZE = "40KB"  # the tiny models are 100-300 KB: several shards, and a layer's tensors may straddle two

# name -> (architecture, source dtype, load dtype or None for "auto", HfQuantConfig kwargs)
CASES = {
    "llama-int4-g32-fp32": ("llama", torch.float32, None, dict(bits=4, group_size=32)),
    "llama_tied-int8-bf16": ("llama_tied", torch.bfloat16, None, dict(bits=8)),
    "llama-int4-default-group-skip": (
        "llama",
        torch.bfloat16,
        None,
        dict(bits=4, format="int", modules_to_not_convert=["o_proj"]),
    ),
    "llama-4bit-default-skip": ("llama", torch.bfloat16, None, dict(bits=4, modules_to_not_convert=["o_proj"])),
    "gpt2-conv1d-int4-g64-sym-fp32-as-bf16": (
        "gpt2",
        torch.float32,
        torch.bfloat16,
        dict(bits=4, group_size=64, symmetric=True),
    ),
    "bert-int8-g32-asym-fp32": ("bert", torch.float32, None, dict(bits=8, group_size=32, symmetric=False)),
    "llama-int4-g32-sinq-bf16": ("llama", torch.bfloat16, None, dict(bits=4, group_size=32, method="sinq")),
    "gpt2-conv1d-int8-sinq-fp32": ("gpt2", torch.float32, None, dict(bits=8, method="sinq")),
}


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    """Same tensor names, dtypes, shapes and bytes; same config.json (quantization_config included); same index."""
    want, got = read_tensors(expected), read_tensors(actual)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    want_config = json.loads((expected / "config.json").read_text())
    got_config = json.loads((actual / "config.json").read_text())
    assert got_config["quantization_config"] == want_config["quantization_config"]
    assert got_config == want_config
    index = "model.safetensors.index.json"
    assert (actual / index).is_file() == (expected / index).is_file()
    if (expected / index).is_file():
        assert json.loads((actual / index).read_text()) == json.loads((expected / index).read_text())


def on_load_and_save(src: Path, out: Path, arch: str, load_dtype, qconfig: dict) -> Path:
    kwargs = dict(quantization_config=HfQuantConfig(**qconfig), device_map="cpu")
    if load_dtype is not None:
        kwargs["dtype"] = load_dtype
    auto_class(arch).from_pretrained(src, **kwargs).save_pretrained(out, max_shard_size=SHARD_SIZE)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_identical_to_quantize_on_load_then_save(float_checkpoint, tmp_path, case):
    arch, source_dtype, load_dtype, qconfig = CASES[case]
    src = float_checkpoint(arch, source_dtype)
    expected = on_load_and_save(src, tmp_path / "on-load", arch, load_dtype, qconfig)
    result = convert(
        src,
        tmp_path / "converted",
        HfQuantConfig(**qconfig),
        max_shard_size=SHARD_SIZE,
        dtype=load_dtype or "auto",
        progress=False,
    )
    assert_same_checkpoint(expected, tmp_path / "converted")
    assert len(result.shards) > 1
    tensors = read_tensors(expected)  # a quantized layer stores a scale beside its codes, or block bytes (uint8)
    quantized = {name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale")}
    quantized |= {
        n.removesuffix(".weight") for n, t in tensors.items() if n.endswith(".weight") and t.dtype == torch.uint8
    }
    assert result.quantized_layers == len(quantized)


@pytest.mark.parametrize(
    "arch,rename",
    [
        ("gpt2", lambda key: key.removeprefix("transformer.")),  # the original gpt2 checkpoints have no prefix
        (
            "bert",
            lambda key: key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"),
        ),
    ],
    ids=["gpt2-no-prefix", "bert-legacy-gamma-beta"],
)
def test_identical_with_legacy_checkpoint_names(float_checkpoint, tmp_path, arch, rename):
    """transformers renames legacy keys on load and back on save; convert names its output the same way."""
    src = tmp_path / "legacy"
    src.mkdir()
    original = float_checkpoint(arch)
    (src / "config.json").write_text((original / "config.json").read_text())
    tensors = load_file(original / "model.safetensors")
    renamed = {rename(key): value for key, value in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, src / "model.safetensors", metadata={"format": "pt"})
    qconfig = dict(bits=8)
    expected = on_load_and_save(src, tmp_path / "on-load", arch, None, qconfig)
    convert(src, tmp_path / "converted", HfQuantConfig(**qconfig), max_shard_size=SHARD_SIZE, progress=False)
    assert_same_checkpoint(expected, tmp_path / "converted")


def test_workers_give_the_same_files(float_checkpoint, tmp_path):
    src = float_checkpoint("llama")
    config = HfQuantConfig(bits=4, group_size=32)
    convert(src, tmp_path / "inline", config, max_shard_size=SHARD_SIZE, progress=False)
    convert(src, tmp_path / "workers", config, max_shard_size=SHARD_SIZE, progress=False, workers=1)
    assert_same_checkpoint(tmp_path / "inline", tmp_path / "workers")


def test_copies_small_files_and_writes_card(float_checkpoint, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    original = float_checkpoint("llama")
    for file in original.iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (src / "pytorch_model.bin").write_bytes(b"old weights")
    (src / ".hidden").write_text("x")
    (src / "README.md").write_text("---\nlicense: apache-2.0\n---\n# float model\n")
    convert(src, tmp_path / "library", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "library" / "README.md").exists()  # the library writes no card, nor copies SRC's
    assert main(["convert", str(src), str(tmp_path / "out"), "--bits", "8", "--no-progress"]) == 0
    out = tmp_path / "out"
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= names
    assert names - {"README.md"} == {p.name for p in (tmp_path / "library").iterdir()}
    assert not names & {"pytorch_model.bin", ".hidden"}
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    card = (out / "README.md").read_text()
    assert "hfquant" in card and "license: apache-2.0" in card  # the float model's license carries over
    assert json.loads((out / SUMS_NAME).read_text()) == json.loads((tmp_path / "library" / SUMS_NAME).read_text())


def test_before_publish_adds_files_in_the_same_atomic_step(float_checkpoint, tmp_path):
    """What `before_publish` writes is in the folder when DST appears; it sees the temporary folder and SRC."""
    src = float_checkpoint("llama")
    seen = []

    def add(folder, source):
        seen.append(
            (folder.parent == tmp_path, folder.name.startswith(".dst.tmp-"), source, (tmp_path / "dst").exists())
        )
        (folder / "notes.txt").write_text("made by the caller")

    convert(src, tmp_path / "dst", HfQuantConfig(bits=8), progress=False, before_publish=add)
    assert seen == [(True, True, src, False)]
    assert (tmp_path / "dst" / "notes.txt").read_text() == "made by the caller"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_refuses_to_overwrite_without_overwrite(float_checkpoint, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(float_checkpoint("llama"), dst, HfQuantConfig(bits=8), progress=False)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no temporary folder was even started


def test_overwrite_replaces_the_folder(float_checkpoint, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "stale.safetensors").write_bytes(b"stale")
    convert(float_checkpoint("llama"), dst, HfQuantConfig(bits=8), overwrite=True, progress=False)
    assert not (dst / "stale.safetensors").exists()
    assert (dst / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


class Boom(RuntimeError):
    pass


def test_failure_midway_leaves_dst_and_no_temporary_folder(float_checkpoint, tmp_path, monkeypatch):
    """A failure after some shards were written: the old DST stays as it was and the temporary folder is gone."""
    from safetensors import torch as safetensors_torch

    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"previous good checkpoint")
    written = []
    original = safetensors_torch.save_file

    def failing_save(tensors, filename, metadata=None):
        written.append(Path(filename))
        if len(written) == 3:
            raise Boom("disk full")
        original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors_torch, "save_file", failing_save)
    with pytest.raises(Boom):
        convert(
            float_checkpoint("llama"),
            dst,
            HfQuantConfig(bits=4, group_size=32),
            max_shard_size=SHARD_SIZE,
            overwrite=True,
            progress=False,
        )
    assert len(written) == 3 and written[0].parent.name.startswith(".dst.tmp-")  # shards go to a folder beside DST
    assert (dst / "model.safetensors").read_bytes() == b"previous good checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_bad_inputs_name_the_value_and_the_fix(float_checkpoint, tmp_path):
    src = float_checkpoint("llama")
    with pytest.raises(ValueError, match="max_shard_size 'lots'"):
        convert(src, tmp_path / "a", HfQuantConfig(bits=8), max_shard_size="lots", progress=False)
    with pytest.raises(ValueError, match="dtype 'int8'"):
        convert(src, tmp_path / "b", HfQuantConfig(bits=8), dtype="int8", progress=False)
    with pytest.raises(ValueError, match="DST .* is SRC"):
        convert(src, src, HfQuantConfig(bits=8), overwrite=True, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((src / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="reads safetensors only"):
        convert(empty, tmp_path / "c", HfQuantConfig(bits=8), progress=False)
    convert(src, tmp_path / "q", HfQuantConfig(bits=8), progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        convert(tmp_path / "q", tmp_path / "d", HfQuantConfig(bits=8), progress=False)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


_MEASURED_CONVERT = """
import json, sys
import hfquant, safetensors.torch, transformers.core_model_loading  # imported before the baseline is taken
from hfquant.conversion.convert import convert
from benchmarks.memory import peak_rss_mib, reset_peak_rss, rss_mib
src, dst, shard = sys.argv[1:4]
before = rss_mib()
reset_peak_rss()
result = convert(src, dst, hfquant.HfQuantConfig(bits=4), max_shard_size=shard, progress=False)
print(json.dumps({"growth_mib": peak_rss_mib() - before, "seconds": result.seconds}))
"""


@pytest.mark.slow
def test_smollm2_identical_to_on_load_with_bounded_memory(tmp_path):
    """The real SmolLM2: same files as on load + save_pretrained; peak RSS growth far below the float model."""
    import subprocess
    import sys

    from benchmarks.example_model import build_example_model

    src = build_example_model()
    shard = "50MB"
    # on load first: it also times the kernels of shapes new to this machine (once, about 64 MiB of random weights,
    # cached in kernel-choices.json), which is not the conversion's own memory
    kwargs = dict(quantization_config=HfQuantConfig(bits=4), dtype=torch.bfloat16, device_map="cpu")
    auto_class("llama").from_pretrained(src, **kwargs).save_pretrained(tmp_path / "on-load", max_shard_size=shard)
    # cwd: the repository root, where `-c` code finds benchmarks/ (not installed)
    result = subprocess.run(
        [sys.executable, "-c", _MEASURED_CONVERT, str(src), str(tmp_path / "converted"), shard],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert_same_checkpoint(tmp_path / "on-load", tmp_path / "converted")

    mib = 2**20
    source = read_tensors(src)
    largest = max(t.numel() * t.element_size() for t in source.values()) / mib
    float_model = sum(t.numel() * t.element_size() for t in source.values()) / mib
    # one source tensor, plus the shard being written twice over (save_file serializes it to bytes), plus slack
    bound = largest + 2 * max(50e6 / mib, largest) + 32
    assert measured["growth_mib"] < bound, measured
    assert measured["growth_mib"] < 0.75 * float_model, measured


def test_unusable_weights_and_paths_are_named(float_checkpoint, tmp_path):
    """A NaN weight names the tensor and the way out; a DST that is a file, or under a file, says so."""
    src = tmp_path / "nan-src"
    src.mkdir()
    original = float_checkpoint("llama")
    (src / "config.json").write_text((original / "config.json").read_text())
    tensors = load_file(original / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*NaN.*modules_to_not_convert"):
        convert(src, tmp_path / "out", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "out").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="is a file"):
            convert(original, a_file, HfQuantConfig(bits=8), overwrite=overwrite, progress=False)
    with pytest.raises(NotADirectoryError, match="notes.txt is a file"):
        convert(original, a_file / "dst", HfQuantConfig(bits=8), progress=False)
    assert a_file.read_text() == "x"
