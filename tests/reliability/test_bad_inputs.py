"""The catalogue of bad inputs: each one gives the exact error the user sees, its type and the words that name the bad
value and the fix, and leaves every existing file as it was. docs/reliability.md lists them with what the user sees.

Damaged checkpoints as `hfquant verify` reports them are in test_verify.py; interruptions in test_interruption.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import auto_class, input_ids, model_output
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig, QuantLinear
from hfquant.core.format import StoredFormat
from hfquant.core.rtn import dequantize_weight, quantize_weight
from hfquant.nn.float_linear import FloatLinear
from hfquant.verification import verify

GROUPS = "[32, 64, 128, 256, 512, 1024]"

# -- every invalid HfQuantConfig value: (field, value, error type, words naming the value and the fix) -------------

INVALID_CONFIG = [
    ("bits", 7, ValueError, ["bits=7", "[8, 6, 5, 4, 3, 2]"]),
    ("bits", 16, ValueError, ["bits=16", "[8, 6, 5, 4, 3, 2]"]),
    ("bits", 0, ValueError, ["bits=0", "[8, 6, 5, 4, 3, 2]"]),
    ("bits", "4", TypeError, ["bits", "'4'", "int", "[8, 6, 5, 4, 3, 2]"]),
    ("bits", 4.0, TypeError, ["bits", "4.0", "int"]),
    ("bits", True, TypeError, ["bits", "True", "int"]),
    ("bits", None, TypeError, ["bits", "None", "int"]),
    ("group_size", 16, ValueError, ["group_size=16", GROUPS, "None (per-channel)"]),
    ("group_size", 48, ValueError, ["group_size=48", GROUPS]),
    ("group_size", 2048, ValueError, ["group_size=2048", GROUPS]),
    ("group_size", 0, ValueError, ["group_size=0", GROUPS]),
    ("group_size", -128, ValueError, ["group_size=-128", GROUPS]),
    ("group_size", "128", TypeError, ["group_size", "'128'", "power of two from 32 to 1024"]),
    ("group_size", 128.0, TypeError, ["group_size", "128.0", "power of two"]),
    ("group_size", False, TypeError, ["group_size", "False", "power of two"]),
    ("symmetric", "yes", TypeError, ["symmetric", "'yes'", "True or False"]),
    ("symmetric", 1, TypeError, ["symmetric", "1", "True or False"]),
    (
        "modules_to_not_convert",
        "lm_head",
        TypeError,
        ["modules_to_not_convert", "'lm_head'", "list of non-empty strings"],
    ),
    ("modules_to_not_convert", [""], TypeError, ["modules_to_not_convert", "['']", "non-empty strings"]),
    ("modules_to_not_convert", ["lm_head", 3], TypeError, ["modules_to_not_convert", "['lm_head', 3]", "list of"]),
    ("format_version", 2, ValueError, ["format_version=2", "reads format version 1", "upgrade hfquant"]),
    ("format_version", "1", ValueError, ["format_version='1'", "upgrade hfquant"]),
    ("quant_method", "gptq", ValueError, ["quant_method='gptq'", "'hfquant'"]),
    ("embedding_dtype", "int2", ValueError, ["embedding_dtype='int2'", "'int8'", "'int4'", "'auto'"]),
    ("embedding_dtype", 8, TypeError, ["embedding_dtype", "8", "must be a string", "'int8'"]),
    ("norm_dtype", "int8", ValueError, ["norm_dtype='int8'", "'float32'", "'auto'"]),
    ("lm_head", "float", ValueError, ["lm_head='float'", "'keep'", "'int4'"]),
    ("lm_head", None, TypeError, ["lm_head", "None", "must be a string"]),
    ("compute_dtype", "fp16", ValueError, ["compute_dtype='fp16'", "'float16'", "'auto'"]),
    ("act_order", True, ValueError, ["'act_order'", "allowed fields", "'bits'"]),
]
CONFIG_IDS = [f"{field}={value!r}" for field, value, _, _ in INVALID_CONFIG]


def _check(info, error: type, words: list[str]) -> None:
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    missing = [w for w in words if w not in str(info.value)]
    assert not missing, f"{missing} not in: {info.value}"


@pytest.mark.parametrize("field, value, error, words", INVALID_CONFIG, ids=CONFIG_IDS)
def test_invalid_config_value_in_the_constructor(field, value, error, words):
    with pytest.raises(error) as info:
        HfQuantConfig(**{field: value})
    _check(info, error, words)


IN_CONFIG_JSON = [case for case in INVALID_CONFIG if case[0] != "quant_method"]  # another method: transformers picks
# that method's quantizer (test_other_quantization_method_in_the_checkpoint)


@pytest.mark.parametrize(
    "field, value, error, words", IN_CONFIG_JSON, ids=[f"{f}={v!r}" for f, v, _, _ in IN_CONFIG_JSON]
)
def test_invalid_config_value_in_config_json(float_checkpoint, tmp_path, field, value, error, words):
    """The same value read back from a checkpoint's config.json fails the same way at from_pretrained."""
    folder = tmp_path / "ckpt"
    shutil.copytree(float_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = HfQuantConfig(bits=4).to_dict() | {field: value}
    (folder / "config.json").write_text(json.dumps(config))
    before = _snapshot(folder)
    with pytest.raises(error) as info:
        auto_class("llama").from_pretrained(folder, device_map="cpu")
    _check(info, error, words)
    assert _snapshot(folder) == before


# -- checkpoints ----------------------------------------------------------------------------------------------------


def _snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path: "nothing was changed" is equality of two snapshots."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def quantized(float_checkpoint, tmp_path_factory):
    """(single-file folder, sharded folder) of the tiny Llama quantized to 4 bits, group 32, asymmetric."""
    model = auto_class("llama").from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=4, group_size=32), device_map="cpu"
    )
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    return single, sharded


@pytest.fixture
def damaged(quantized, tmp_path):
    """Factory: a copy of the single-file (or sharded) checkpoint to damage."""

    def make(sharded: bool = False) -> Path:
        target = tmp_path / ("sharded" if sharded else "single")
        shutil.copytree(quantized[sharded], target)
        return target

    return make


SCALE = "model.layers.0.mlp.down_proj.weight_scale"
WEIGHT = "model.layers.0.mlp.down_proj.weight"
INDEX = "model.safetensors.index.json"


def _rewrite(shard: Path, key: str, change) -> None:
    tensors = load_file(shard)
    tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})


def _load(folder: Path, **kwargs):
    return auto_class("llama").from_pretrained(folder, device_map="cpu", **kwargs)


def _format_version_2(folder):
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["format_version"] = 2
    (folder / "config.json").write_text(json.dumps(config))


def _truncated(folder):
    shard = folder / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])


def _corrupt_header(folder):
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[9:13] = b"\xff\xfe\x00!"
    shard.write_bytes(bytes(data))


def _missing_shard(folder):
    (folder / "model-00002-of-00003.safetensors").unlink()


def _scale_shape(folder):
    _rewrite(folder / "model.safetensors", SCALE, lambda t: t[:, :3])


def _scale_dtype(folder):
    _rewrite(folder / "model.safetensors", SCALE, lambda t: t.half())


def _weight_dtype(folder):
    _rewrite(folder / "model.safetensors", WEIGHT, lambda t: t.view(torch.int8))


def _weight_unquantized(folder):
    _rewrite(folder / "model.safetensors", WEIGHT, lambda t: torch.randn(64, 128))


# (name, damage, sharded copy?, error type, words of the message)
LOAD_CASES = [
    ("unknown format version", _format_version_2, False, ValueError, ["format_version=2", "upgrade hfquant"]),
    (
        "truncated shard",
        _truncated,
        False,
        ValueError,
        [
            "model.safetensors",
            "not a readable safetensors file",
            "file not fully covered",
            "copy or download it again",
        ],
    ),
    (
        "corrupt safetensors header",
        _corrupt_header,
        False,
        ValueError,
        [
            "model.safetensors",
            "not a readable safetensors file",
            "invalid UTF-8 in header",
            "copy or download it again",
        ],
    ),
    (
        "shard named in the index missing",
        _missing_shard,
        True,
        FileNotFoundError,
        ["model-00002-of-00003.safetensors"],
    ),
    (
        "quantized tensor of the wrong shape",
        _scale_shape,
        False,
        ValueError,
        [
            SCALE,
            "bfloat16 (64, 3)",
            "expected bfloat16 (64, 4)",
            "4-bit QuantLinear (group size 32, asymmetric)",
            "quantize the float checkpoint again",
        ],
    ),
    (
        "quantized tensor of the wrong dtype",
        _scale_dtype,
        False,
        ValueError,
        [SCALE, "float16 (64, 4)", "expected bfloat16 (64, 4)"],
    ),
    (
        "quantized weight of the wrong dtype",
        _weight_dtype,
        False,
        ValueError,
        [WEIGHT, "int8 (64, 64)", "expected uint8 (64, 64)"],
    ),
    (
        "float weight where a quantized one belongs",
        _weight_unquantized,
        False,
        ValueError,
        [WEIGHT, "float32 (64, 128)", "expected uint8 (64, 64)"],
    ),
]


@pytest.mark.parametrize("name, damage, sharded, error, words", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_damaged_checkpoint_fails_to_load_naming_it(damaged, name, damage, sharded, error, words):
    folder = damaged(sharded)
    damage(folder)
    before = _snapshot(folder)
    with pytest.raises(error) as info:
        _load(folder)
    _check(info, error, words)
    assert _snapshot(folder) == before
    assert verify(folder).problems  # hfquant verify reports it too (its messages: test_verify.py)


def test_index_entry_for_a_tensor_not_in_its_shard_loads_and_verify_reports_it(damaged, quantized):
    """transformers reads the tensors each shard holds, so a wrong index entry is harmless when loading; it still
    means the files were mixed up, which verify reports."""
    folder = damaged(sharded=True)
    index = json.loads((folder / INDEX).read_text())
    shard = index["weight_map"][SCALE]
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != shard)
    index["weight_map"][SCALE] = wrong
    (folder / INDEX).write_text(json.dumps(index))
    reference = model_output(_load(quantized[True]), input_ids())
    assert torch.equal(model_output(_load(folder), input_ids()), reference)
    problems = verify(folder).problems
    assert len(problems) == 1
    assert all(w in problems[0] for w in (INDEX, SCALE, wrong, "different saves"))


def test_other_quantization_method_in_the_checkpoint(float_checkpoint, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(float_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as info:  # transformers refuses to mix two methods
        _load(folder, quantization_config=HfQuantConfig(bits=4))
    _check(info, ValueError, ["GPTQConfig", "HfQuantConfig"])
    with pytest.raises(ValueError) as info:
        HfQuantConfig.from_dict(config["quantization_config"])
    _check(info, ValueError, ["quant_method='gptq'", "'hfquant'"])
    problems = verify(folder).problems
    assert any("quant_method='gptq'" in p and "another method" in p for p in problems)


def test_tied_lm_head_and_embedding_asked_in_two_formats(float_checkpoint):
    config = HfQuantConfig(bits=4, group_size=32, lm_head="int8", embedding_dtype="int4")
    with pytest.raises(ValueError) as info:
        auto_class("llama_tied").from_pretrained(float_checkpoint("llama_tied"), quantization_config=config)
    _check(info, ValueError, ["lm_head='int8'", "embedding_dtype='int4'", "tied", "tie_word_embeddings=False"])


# -- float weights that cannot be quantized -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nan_or_inf_weight_is_refused_by_the_math(value):
    weight = torch.randn(4, 64)
    weight[2, 17] = value
    for bits, symmetric in ((4, False), (8, True)):
        with pytest.raises(ValueError) as info:
            quantize_weight(weight, bits, 32, symmetric)
        _check(info, ValueError, ["NaN or Inf"])
        with pytest.raises(ValueError):
            QuantLinear.from_float(weight, None, StoredFormat(bits, 32, symmetric))


def test_nan_weight_when_quantizing_on_load_names_the_tensor(float_checkpoint, tmp_path):
    folder = tmp_path / "nan"
    shutil.copytree(float_checkpoint("llama"), folder)
    key = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(
        folder / "model.safetensors",
        key,
        lambda t: t.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"))),
    )
    with pytest.raises(ValueError) as info:
        _load(folder, quantization_config=HfQuantConfig(bits=4, group_size=32))
    _check(info, ValueError, [key, "NaN"])


def test_nan_weight_when_quantizing_on_load_fails(float_checkpoint, tmp_path):
    """Inf instead of NaN: the same ValueError naming the tensor, and the checkpoint is left untouched."""
    folder = tmp_path / "nan"
    shutil.copytree(float_checkpoint("llama"), folder)
    key = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(
        folder / "model.safetensors",
        key,
        lambda t: t.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("inf"))),
    )
    before = _snapshot(folder)
    with pytest.raises(ValueError) as info:
        _load(folder, quantization_config=HfQuantConfig(bits=4, group_size=32))
    _check(info, ValueError, [key, "Inf", "modules_to_not_convert"])
    assert _snapshot(folder) == before


def test_finite_weights_spanning_the_float32_range_are_not_called_nan():
    weight = torch.zeros(1, 32)
    weight[0, 0], weight[0, 1] = 3e38, -3e38
    qt = quantize_weight(weight, 4, 32, False)
    w_hat = dequantize_weight(qt.q, qt.scale, qt.zero_point, 4, False)
    assert bool(((weight - w_hat).abs() <= qt.scale.float() / 2 * (1 + 1e-6)).all())


def test_all_zero_group_has_scale_one_and_dequantizes_to_zeros(float_checkpoint, tmp_path):
    folder = tmp_path / "zeros"
    shutil.copytree(float_checkpoint("llama"), folder)
    key = "model.layers.0.self_attn.o_proj.weight"
    _rewrite(folder / "model.safetensors", key, lambda t: torch.cat([torch.zeros(t.shape[0], 32), t[:, 32:]], dim=1))
    _rewrite(folder / "model.safetensors", "model.layers.1.mlp.up_proj.weight", torch.zeros_like)  # a whole layer
    for bits, symmetric in ((4, False), (4, True), (8, True), (8, False)):
        model = _load(folder, quantization_config=HfQuantConfig(bits=bits, group_size=32, symmetric=symmetric))
        layer = model.model.layers[0].self_attn.o_proj
        scale = layer.weight_scale.float()
        assert bool(torch.isfinite(scale).all()) and bool((scale[:, 0] == 1).all())
        assert bool((layer.dequantize()[:, :32] == 0).all())
        up = model.model.layers[1].mlp.up_proj
        assert bool((up.weight_scale.float() == 1).all()) and bool((up.dequantize() == 0).all())
        assert bool(torch.isfinite(model_output(model, input_ids())).all())


# -- layers the group size does not fit ---------------------------------------------------------------------------


def test_layer_too_small_or_oddly_shaped_stays_in_float_and_is_logged(float_checkpoint, caplog):
    """hidden 48 (= 16 x 3): no power-of-two group >= 32 divides it, so q/k/v/o, gate and up stay float (FloatLinear; logged
    with the reason); down_proj (in 96 = 32 x 3) is quantized with group 32 instead of the 128 asked."""
    folder = float_checkpoint(
        "llama", hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    with caplog.at_level(logging.INFO, logger="hfquant"):
        model = _load(folder, quantization_config=HfQuantConfig(bits=4, group_size=128))
    layer = model.model.layers[0]
    assert type(layer.self_attn.q_proj) is FloatLinear and type(layer.mlp.gate_proj) is FloatLinear
    assert isinstance(layer.mlp.down_proj, QuantLinear) and layer.mlp.down_proj.group_size == 32
    assert any(
        "model.layers.0.self_attn.q_proj" in r.getMessage() and "in_features=48" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    "make, error, words",
    [
        (
            lambda: QuantLinear(33, 8, StoredFormat(4, 33, True)),
            ValueError,
            ["4-bit layers need an even in_features", "33"],
        ),
        (lambda: QuantLinear(48, 8, StoredFormat(4, 32, True)), ValueError, ["group_size=32", "in_features=48"]),
        (lambda: quantize_weight(torch.randn(4, 48), 8, 32, True), ValueError, ["group_size=32", "in_features=48"]),
        (lambda: quantize_weight(torch.randn(4, 48), 8, 0, True), ValueError, ["group_size=0", "in_features=48"]),
        (lambda: quantize_weight(torch.randn(10), 8, 10, True), ValueError, ["2-D", "(10,)"]),
        (lambda: quantize_weight(torch.randn(2, 3, 32), 8, 32, True), ValueError, ["2-D", "(2, 3, 32)"]),
        (lambda: quantize_weight(torch.ones(2, 32, dtype=torch.int32), 8, 32, True), ValueError, ["float", "int32"]),
    ],
    ids=["odd-in-4bit", "group-not-dividing", "rtn-group-not-dividing", "rtn-group-zero", "1-D", "3-D", "int-weight"],
)
def test_shape_the_group_size_cannot_fit_is_refused_by_the_modules(make, error, words):
    with pytest.raises(error) as info:
        make()
    _check(info, error, words)


# -- hfquant convert (the Python API; the command's messages and exit codes are below) ------------------------------


def _convert(src, dst, **kwargs):
    from hfquant.conversion.convert import convert

    config = kwargs.pop("config", HfQuantConfig(bits=4, group_size=32))
    return convert(src, dst, config, progress=False, **kwargs)


def _siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def float_copy(float_checkpoint, tmp_path):
    def make(name: str = "src", sharded: bool = False) -> Path:
        target = tmp_path / name
        if sharded:
            auto_class("llama").from_pretrained(float_checkpoint("llama")).save_pretrained(
                target, max_shard_size="40KB"
            )
        else:
            shutil.copytree(float_checkpoint("llama"), target)
        return target

    return make


def _nan_source(folder: Path) -> str:
    key = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(
        folder / "model.safetensors",
        key,
        lambda t: t.index_put((torch.tensor([3]), torch.tensor([5])), torch.tensor(float("nan"))),
    )
    return key


CONVERT_CASES = [
    # (name, prepare(src folder, out folder) -> (dst, kwargs), error type, words)
    (
        "SRC missing",
        lambda src, out: (out / "dst", {"src": out / "absent"}),
        FileNotFoundError,
        ["is not a folder", "local checkpoint folder"],
    ),
    (
        "SRC is a file",
        lambda src, out: (out / "dst", {"src": src / "config.json"}),
        NotADirectoryError,
        ["is a file", "folder that holds config.json"],
    ),
    ("SRC already quantized", None, ValueError, ["already quantized", "'hfquant'", "float checkpoint"]),
    ("SRC quantized by another method", None, ValueError, ["already quantized", "'gptq'"]),
    ("SRC shard named in the index missing", None, FileNotFoundError, ["model-00002-of-", "not in"]),
    ("dtype not a float", lambda src, out: (out / "dst", {"dtype": "int8"}), ValueError, ["'int8'", "bfloat16"]),
    (
        "max_shard_size not a size",
        lambda src, out: (out / "dst", {"max_shard_size": "lots"}),
        ValueError,
        ["'lots'", "500MB"],
    ),
    ("workers negative", lambda src, out: (out / "dst", {"workers": -1}), ValueError, ["workers=-1", ">= 0"]),
    ("DST exists", lambda src, out: (_existing(out), {}), FileExistsError, ["exists", "--overwrite"]),
    ("DST is SRC", lambda src, out: (src, {"overwrite": True}), ValueError, ["is SRC", "another folder"]),
]


def _existing(out: Path) -> Path:
    (out / "dst").mkdir()
    (out / "dst" / "keep.txt").write_text("previous")
    return out / "dst"


@pytest.mark.parametrize("name, prepare, error, words", CONVERT_CASES, ids=[c[0] for c in CONVERT_CASES])
def test_convert_refuses_bad_input_and_changes_nothing(float_copy, quantized, tmp_path, name, prepare, error, words):
    src = float_copy()
    out = tmp_path / "out"
    out.mkdir()
    kwargs = {}
    if name == "SRC already quantized":
        src, dst = quantized[0], out / "dst"
    elif name == "SRC quantized by another method":
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
        (src / "config.json").write_text(json.dumps(config))
        dst = out / "dst"
    elif name == "SRC shard named in the index missing":
        src = float_copy("sharded", sharded=True)
        next(src.glob("model-00002-of-*.safetensors")).unlink()
        dst = out / "dst"
    else:
        dst, kwargs = prepare(src, out)
    src = kwargs.pop("src", src)
    before = {"src": _snapshot(src) if Path(src).is_dir() else None, "out": _snapshot(out), "siblings": _siblings(out)}
    with pytest.raises(error) as info:
        _convert(src, dst, **kwargs)
    _check(info, error, words)
    after = {"src": _snapshot(src) if Path(src).is_dir() else None, "out": _snapshot(out), "siblings": _siblings(out)}
    assert after == before


def test_convert_nan_weight_fails_and_leaves_nothing(float_copy, tmp_path):
    src = float_copy()
    _nan_source(src)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="NaN or Inf"):
        _convert(src, out / "dst")
    assert _siblings(out) == []


def test_convert_nan_weight_names_the_tensor(float_copy, tmp_path):
    src = float_copy()
    key = _nan_source(src)
    with pytest.raises(ValueError) as info:
        _convert(src, tmp_path / "dst")
    _check(info, ValueError, [key, "NaN", "modules_to_not_convert"])


def _truncate_source(src: Path) -> None:
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])


def _corrupt_source(src: Path) -> None:
    shard = src / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[9:13] = b"\xff\xfe\x00!"
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate_source, _corrupt_source], ids=["truncated", "corrupt-header"])
def test_convert_damaged_source_names_the_file_and_leaves_nothing(float_copy, tmp_path, damage):
    src = float_copy()
    damage(src)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError) as info:
        _convert(src, out / "dst")
    _check(info, ValueError, [str(src / "model.safetensors"), "damaged", "again"])
    assert _siblings(out) == []


def test_convert_into_a_file_keeps_the_file(float_copy, tmp_path):
    src = float_copy()
    target = tmp_path / "model.bin"
    target.write_text("not a folder")
    with pytest.raises(FileExistsError):
        _convert(src, target)
    assert target.read_text() == "not a folder"


@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_into_a_file_says_it_is_a_file(float_copy, tmp_path, overwrite):
    src = float_copy()
    target = tmp_path / "model.bin"
    target.write_text("not a folder")
    try:
        with pytest.raises((NotADirectoryError, FileExistsError, ValueError)) as info:
            _convert(src, target, overwrite=overwrite)
        _check(info, type(info.value), [str(target), "is a file"])
    finally:
        assert target.is_file() and target.read_text() == "not a folder"


def test_convert_under_a_file_says_the_parent_is_a_file(float_copy, tmp_path):
    src = float_copy()
    parent = tmp_path / "notes.txt"
    parent.write_text("x")
    with pytest.raises((NotADirectoryError, FileExistsError)) as info:
        _convert(src, parent / "dst")
    _check(info, type(info.value), [str(parent), "is a file"])


# -- what `hfquant convert` prints: one line "hfquant: error: ..." and an exit status (its entry point, in-process) --

COMMAND_CASES = [
    # (name, arguments after SRC DST (or replacing them), exit status, words on stderr)
    ("bits not allowed", ["--bits", "7"], 2, ["--bits", "'7'", "not supported", "8, 6, 5, 4, 3, 2, 3.5"]),
    ("group size not a power of two", ["--group-size", "48"], 2, ["group_size=48", GROUPS]),
    ("group size not a number", ["--group-size", "big"], 2, ["--group-size", "'big'", "power of two"]),
    ("max shard size not a size", ["--max-shard-size", "lots"], 2, ["'lots'", "500MB"]),
    ("SRC quantized already", "quantized", 2, ["already quantized", "float checkpoint"]),
    ("SRC missing", "missing", 1, ["is not a folder", "local checkpoint folder"]),
    ("DST exists", "exists", 1, ["exists", "--overwrite"]),
]


@pytest.mark.parametrize("name, extra, status, words", COMMAND_CASES, ids=[c[0] for c in COMMAND_CASES])
def test_command_says_what_is_wrong_in_one_line(
    float_checkpoint, quantized, tmp_path, capsys, name, extra, status, words
):
    from hfquant.commands.cli import main

    src, dst = float_checkpoint("llama"), tmp_path / "dst"
    if extra == "quantized":
        src, extra = quantized[0], []
    elif extra == "missing":
        src, extra = tmp_path / "absent", []
    elif extra == "exists":
        dst.mkdir()
        extra = []
    with pytest.raises(SystemExit) as info:
        main(["convert", str(src), str(dst), "--no-progress", *extra])
    assert info.value.code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hfquant: error:") or err[-1].startswith("hfquant convert: error:"), err
    assert all(w in err[-1] for w in words), err[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["dst"] if name == "DST exists" else [])


# -- a float checkpoint missing the weight of a layer hfquant quantizes ---------------------------------------------


@pytest.mark.parametrize(
    "arch,key",
    [
        ("llama", "model.layers.1.mlp.up_proj.weight"),
        ("gpt2", "transformer.h.0.attn.c_attn.weight"),
    ],
)
def test_quantize_on_load_and_convert_refuse_a_missing_weight(float_checkpoint, tmp_path, arch, key):
    """Its buffers would keep the uninitialized memory they were allocated with: both paths name the tensor."""
    from hfquant.conversion.convert import convert

    src = tmp_path / "src"
    shutil.copytree(float_checkpoint(arch), src)
    tensors = load_file(src / "model.safetensors")
    del tensors[key]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    module = key.removesuffix(".weight")
    with pytest.raises(ValueError) as info:
        auto_class(arch).from_pretrained(
            src, quantization_config=HfQuantConfig(bits=4, group_size=32), device_map="cpu"
        )
    assert key in str(info.value) and "uninitialized" in str(info.value) and module in str(info.value)
    with pytest.raises(ValueError, match=f"has no tensor for {module}.weight") as info:
        convert(src, tmp_path / "dst", HfQuantConfig(bits=4, group_size=32), progress=False)
    assert f"--modules-to-not-convert {module}" in str(info.value)
    assert not (tmp_path / "dst").exists()
    # keeping it in float loads (transformers initializes the missing float weight and warns, as without hfquant)
    config = HfQuantConfig(bits=4, group_size=32, modules_to_not_convert=[module])
    auto_class(arch).from_pretrained(src, quantization_config=config, device_map="cpu")


@pytest.mark.parametrize("quantized", [False, True], ids=["float-source", "quantized-checkpoint"])
def test_a_tensor_stored_in_two_shards_is_refused_naming_both(float_checkpoint, tmp_path, quantized):
    """transformers loads one of the two copies, not necessarily the one the index names: refused before loading."""
    folder = tmp_path / "ckpt"
    source = auto_class("llama").from_pretrained(
        float_checkpoint("llama"),
        device_map="cpu",
        **({"quantization_config": HfQuantConfig(bits=4, group_size=32)} if quantized else {}),
    )
    source.save_pretrained(folder, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.down_proj.weight"
    shards = sorted(set(index.values()))
    other = next(s for s in shards if s != index[key])
    tensors = load_file(folder / other)
    tensors[key] = load_file(folder / index[key])[key] + 1  # an un-indexed, different copy
    save_file(tensors, folder / other, metadata={"format": "pt"})
    kwargs = {} if quantized else {"quantization_config": HfQuantConfig(bits=4, group_size=32)}
    with pytest.raises(ValueError) as info:
        auto_class("llama").from_pretrained(folder, device_map="cpu", **kwargs)
    assert all(w in str(info.value) for w in (key, "stored twice", index[key], other)), str(info.value)
