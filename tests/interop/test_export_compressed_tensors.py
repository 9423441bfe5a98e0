"""`hfquant export --format compressed-tensors`: read back by compressed-tensors itself (its pack/unpack, its
dequantize, its `QuantizationConfig`) and by plain transformers in a subprocess that never imports hfquant.

Weights are compared with `torch.equal`: both sides compute (q - z) * scale of the same integers and bfloat16 scales,
rounded once to bfloat16. Logits of the transformers load equal those of the hfquant model after `dequantize()`
(same float weights, same float modules); against hfquant's own int kernels they differ by summation order only,
bounded below.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hfquant import HfQuantConfig, QuantEmbedding, QuantLinear
from hfquant.checkpoint.compressed_tensors import pack_words, pack_zero_point
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized import (  # noqa: E402
    PackedQuantizationCompressor,
    pack_to_int32,
    unpack_from_int32,
)
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from helpers import read_tensors  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def hfquant_config(**kwargs) -> HfQuantConfig:
    """An RTN config: `method` defaults to "rtn" (SINQ cannot be exported) and the data-free bit allocation, where this
    hfquant has it, is off unless asked (it mixes group sizes, which transformers' dequantize path cannot load)."""
    kwargs.setdefault("method", "rtn")
    if "mixed_precision" in HfQuantConfig().to_dict():
        kwargs.setdefault("mixed_precision", "none")
    return HfQuantConfig(**kwargs)


# -- the packing, against compressed-tensors' own --------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 7, 13, 64])
def test_words_and_zero_points_equal_pack_to_int32(bits, rows):
    gen = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 2**bits, (rows, 96), generator=gen, dtype=torch.uint8)
    signed = (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)  # compressed-tensors' q
    stored = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    assert torch.equal(pack_words(stored), pack_to_int32(signed, bits))
    zero = codes[:, :3].contiguous()  # (N, G)
    packed = pack_zero_point(zero, bits)
    assert torch.equal(packed, pack_to_int32(signed[:, :3].contiguous(), bits, packed_dim=0))
    assert torch.equal(unpack_from_int32(packed, bits, zero.shape, packed_dim=0), signed[:, :3])


# -- tiny Llama: every layer through compressed-tensors' decompress ---------------------------------------------

CASES = {
    "int4-g32-asym": dict(bits=4, group_size=32, symmetric=False),
    "int4-g64-sym": dict(bits=4, group_size=64, symmetric=True),
    "int8-channel": dict(bits=8),
    "int8-g32-asym": dict(bits=8, group_size=32, symmetric=False),
    "mixed-overrides-int4-embedding-int8-head": dict(
        bits=4,
        group_size=32,
        module_overrides={"v_proj": {"bits": 8}, "down_proj": {"group_size": 64, "symmetric": True}},
        embedding_dtype="int4",
        lm_head="int8",
    ),
}


@pytest.fixture(scope="module")
def llama_bf16(float_checkpoint):
    return float_checkpoint("llama", torch.bfloat16)


def _scheme_of(config: QuantizationConfig, name: str):
    for scheme in config.config_groups.values():
        if name in scheme.targets or "Linear" in scheme.targets:
            return scheme
    raise AssertionError(f"no config group targets {name}")


def _quantized_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}


@pytest.mark.parametrize("case", CASES)
def test_every_layer_decompresses_to_hfquant_weights(llama_bf16, tmp_path, case):
    src, dst = tmp_path / "hfquant", tmp_path / "ct"
    convert(llama_bf16, src, hfquant_config(**CASES[case]), progress=False)
    # mixed q/k/v formats: engine "vllm" would write those sets in float (the test above), "transformers" keeps them
    engine = "transformers" if case.startswith("mixed") else "vllm"
    result = export_checkpoint(src, dst, format="compressed-tensors", engine=engine)
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qconfig)  # compressed-tensors' own schema accepts it
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    assert QuantizationConfig.model_validate(parsed.model_dump()) == parsed
    assert "lm_head" in parsed.ignore
    assert result.config_groups == len(parsed.config_groups)
    groups = {(s.weights.num_bits, s.weights.group_size, s.weights.symmetric) for s in parsed.config_groups.values()}
    assert len(groups) == len(parsed.config_groups)  # one group per distinct format

    model = AutoModelForCausalLM.from_pretrained(src, device_map="cpu")
    stored, exported = read_tensors(src), read_tensors(dst)
    modules = _quantized_modules(model)
    assert result.quantized_layers + result.dequantized_layers == len(modules)
    for name, module in modules.items():
        expected = module.dequantize(torch.bfloat16)
        if isinstance(module, QuantEmbedding) or name == "lm_head":  # written dequantized, in the compute dtype
            assert torch.equal(exported[f"{name}.weight"], expected), name
            assert f"{name}.weight_packed" not in exported
            continue
        scheme = _scheme_of(parsed, name)
        assert scheme.weights.strategy == ("channel" if module.group_size == module.in_features else "group")
        local = {k.removeprefix(f"{name}."): v for k, v in exported.items() if k.startswith(f"{name}.weight_")}
        assert sorted(local) == sorted(PackedQuantizationCompressor.compression_param_names(scheme)), name
        assert torch.equal(local["weight_shape"], torch.tensor([module.out_features, module.in_features]))
        assert torch.equal(local["weight_scale"], stored[f"{name}.weight_scale"])
        if module.bits == 4:  # the very bytes hfquant stores
            assert torch.equal(local["weight_packed"].view(torch.uint8), stored[f"{name}.weight"]), name
        weight = PackedQuantizationCompressor.decompress(dict(local), scheme)["weight"]
        assert weight.dtype == torch.bfloat16
        assert torch.equal(weight, expected), name
    float_tensors = {k for k in stored if not any(k.startswith(f"{n}.") for n in modules)}
    for key in float_tensors:
        assert torch.equal(exported[key], stored[key]), key


def test_sinq_is_refused_naming_the_layer_and_dst_is_untouched(llama_bf16, tmp_path):
    src, dst = tmp_path / "sinq", tmp_path / "ct"
    convert(
        llama_bf16,
        src,
        hfquant_config(bits=4, group_size=32, method="sinq", fold_column_scales=False, modules_to_not_convert=["mlp"]),
        progress=False,
    )
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj.*weight_col_scale.*method='rtn'"):
        export_checkpoint(src, dst)
    assert not dst.exists()
    dst.mkdir()
    (dst / "keep.txt").write_text("precious\n")
    with pytest.raises(ValueError, match="sinq"):
        export_checkpoint(src, dst, overwrite=True)
    assert [p.name for p in dst.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_fused_layers_with_different_schemes_are_written_in_float_for_vllm(float_checkpoint, tmp_path, caplog):
    """The 4-bit default's rule puts late v_proj in int8 beside int4 q/k_proj: vLLM fuses q/k/v into one layer with
    one scheme, so for engine "vllm" the export writes those sets in float (hfquant's dequantized weights, listed in
    `ignore`) with one warning naming them; for engine "transformers", and for a uniform config, all stays
    quantized without a warning."""
    src = float_checkpoint("llama", torch.bfloat16, num_hidden_layers=4)
    for name, config in {
        "default": HfQuantConfig(bits=4, group_size=32),
        "uniform": HfQuantConfig(bits=4, group_size=32, mixed_precision="none"),
    }.items():
        convert(src, tmp_path / name, config, progress=False)
        for engine in ("vllm", "transformers"):
            caplog.clear()
            dst = tmp_path / f"{name}-{engine}"
            with caplog.at_level("WARNING", logger="hfquant.checkpoint.compressed_tensors"):
                result = export_checkpoint(tmp_path / name, dst, engine=engine)
            warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            ignore = json.loads((dst / "config.json").read_text())["quantization_config"]["ignore"]
            if name == "default" and engine == "vllm":
                assert len(warnings) == 1 and "vLLM" in warnings[0] and "2 set(s)" in warnings[0]
                assert (
                    "model.layers.2.self_attn.{q_proj,k_proj,v_proj}: 4-bit group 32 asymmetric, 4-bit group 32 "
                    "asymmetric, 8-bit per-channel symmetric"
                ) in warnings[0]
                assert "6 quantized layers are written in float" in warnings[0]
                # and the 4-bit default's int8 lm_head, which vLLM reads in float only: written dequantized
                assert result.dequantized_layers == 6 + 1 and result.config_groups == 1
                floats = {f"model.layers.{i}.self_attn.{p}" for i in (2, 3) for p in ("q_proj", "k_proj", "v_proj")}
                assert floats <= set(ignore)
                model = AutoModelForCausalLM.from_pretrained(tmp_path / name, device_map="cpu")
                exported = read_tensors(dst)
                for layer in floats:
                    assert f"{layer}.weight_packed" not in exported
                    want = model.get_submodule(layer).dequantize(torch.bfloat16)
                    assert torch.equal(exported[f"{layer}.weight"], want), layer
            else:
                assert warnings == []
                assert ignore == ["lm_head"] and result.dequantized_layers == 1  # the int8 lm_head, in float


def test_engine_transformers_lays_zero_points_out_as_transformers_allocates_them(llama_bf16, tmp_path):
    """Engine "transformers": an asymmetric layer's zero point is (N, G) int32, its first ceil(N * bits / 32) rows
    the packed words of engine "vllm" and zeros below, and its group says zp_dtype int32; compressed-tensors'
    decompress gives the same weights from either; every other tensor is the same."""
    src = tmp_path / "hfquant"
    convert(llama_bf16, src, hfquant_config(bits=4, group_size=32, symmetric=False), progress=False)
    export_checkpoint(src, tmp_path / "vllm")
    export_checkpoint(src, tmp_path / "tf", engine="transformers")
    packed, padded = read_tensors(tmp_path / "vllm"), read_tensors(tmp_path / "tf")
    assert sorted(packed) == sorted(padded)
    qconfig = QuantizationConfig.model_validate(
        json.loads((tmp_path / "tf" / "config.json").read_text())["quantization_config"]
    )
    (scheme,) = qconfig.config_groups.values()
    assert scheme.weights.zp_dtype == torch.int32 and not scheme.weights.symmetric
    zero_points = [k for k in packed if k.endswith("weight_zero_point")]
    assert zero_points
    for key in packed:
        if key not in zero_points:
            assert torch.equal(packed[key], padded[key]), key
            continue
        layer = key.removesuffix(".weight_zero_point")
        n = int(packed[f"{layer}.weight_shape"][0])
        words = packed[key].shape[0]
        assert padded[key].shape == (n, packed[key].shape[1]) and padded[key].dtype == torch.int32
        assert torch.equal(padded[key][:words], packed[key]) and not padded[key][words:].any()
        local = {k.removeprefix(f"{layer}."): padded[k] for k in padded if k.startswith(f"{layer}.weight_")}
        want = {k.removeprefix(f"{layer}."): packed[k] for k in packed if k.startswith(f"{layer}.weight_")}
        got = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert torch.equal(got, PackedQuantizationCompressor.decompress(want, scheme)["weight"]), layer
    with pytest.raises(ValueError, match=r"engine='sglang'.*\['vllm', 'transformers'\]"):
        export_checkpoint(src, tmp_path / "x", engine="sglang")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_links_leaving_src_are_refused(llama_bf16, tmp_path, name):
    src, outside = tmp_path / "hfquant", tmp_path / "outside"
    convert(llama_bf16, src, hfquant_config(bits=8), progress=False)
    outside.mkdir()
    (src / name).rename(outside / name)
    (src / name).symlink_to(outside / name)
    with pytest.raises(ValueError, match=f"{name} in .* is a link to .*outside the checkpoint folder"):
        export_checkpoint(src, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_refusals_name_the_value(llama_bf16, tmp_path):
    with pytest.raises(ValueError, match=r"format='onnx'.*\['compressed-tensors', 'gguf'\]"):
        export_checkpoint(llama_bf16, tmp_path / "x", format="onnx")
    with pytest.raises(ValueError, match="no quantization_config"):
        export_checkpoint(llama_bf16, tmp_path / "x")
    src = tmp_path / "q"
    convert(llama_bf16, src, hfquant_config(bits=8), progress=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(src, tmp_path / "exists")


# -- plain transformers, without hfquant -------------------------------------------------------------------------

_READER = textwrap.dedent(
    """
    import sys
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder, out = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[int(t) for t in sys.argv[3].split(",")]])
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True), device_map="cpu"
    ).eval()
    assert not [m for m in sys.modules if m.split(".")[0] == "hfquant"], "hfquant was imported"
    tensors = {n + ".weight": m.weight.detach().clone() for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    with torch.no_grad():
        tensors["logits"] = model(input_ids=ids).logits.contiguous()
    save_file(tensors, out)
    """
)


def load_without_hfquant(folder: Path, ids: torch.Tensor, out: Path) -> dict[str, torch.Tensor]:
    """Weights of every Linear / Embedding and the logits of `ids`, as plain transformers loads `folder`."""
    result = subprocess.run(
        [sys.executable, "-c", _READER, str(folder), str(out), ",".join(str(int(t)) for t in ids.flatten())],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return load_file(out)


def assert_transformers_reads_it(src: Path, dst: Path, ids: torch.Tensor, tmp_path: Path) -> dict[str, float]:
    """The export of `src` in plain transformers: weights equal hfquant's dequantized ones, logits equal the hfquant
    model's after dequantize(). Returns how its logits compare with hfquant's own int kernels (which sum in another
    order): max_abs (largest |difference|), max_logit (largest |logit|), cosine, top1 (share of equal argmaxes)."""
    loaded = load_without_hfquant(dst, ids, tmp_path / "read.safetensors")
    model = AutoModelForCausalLM.from_pretrained(src, device_map="cpu").eval()
    with torch.no_grad():
        kernel_logits = model(input_ids=ids).logits
    modules = _quantized_modules(model)
    assert modules
    for name, module in modules.items():
        assert torch.equal(loaded[f"{name}.weight"], module.dequantize(torch.bfloat16)), name
    model.dequantize()
    with torch.no_grad():
        assert torch.equal(loaded["logits"], model(input_ids=ids).logits)
    got, want = loaded["logits"].double(), kernel_logits.double()
    numbers = {
        "max_abs": (got - want).abs().max().item(),
        "max_logit": want.abs().max().item(),
        "cosine": torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item(),
        "top1": (got.argmax(-1) == want.argmax(-1)).double().mean().item(),
    }
    print(f"{src.name}: transformers vs hfquant kernels {numbers}")
    return numbers


@pytest.mark.parametrize("case", ["int4-g64-sym", "int4-g64-asym", "int8-channel"])
def test_plain_transformers_loads_the_export(llama_bf16, tmp_path, case):
    kwargs = {
        "int4-g64-sym": dict(bits=4, group_size=64, symmetric=True),
        "int4-g64-asym": dict(bits=4, group_size=64, symmetric=False),
        "int8-channel": dict(bits=8),
    }[case]
    src, dst = tmp_path / "hfquant", tmp_path / "ct"
    convert(llama_bf16, src, hfquant_config(**kwargs), progress=False)
    export_checkpoint(src, dst)
    ids = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    numbers = assert_transformers_reads_it(src, dst, ids, tmp_path)
    assert numbers["cosine"] > 0.9999, numbers


def test_cli_export(llama_bf16, tmp_path):
    src = tmp_path / "hfquant"
    convert(llama_bf16, src, hfquant_config(bits=4, group_size=32), progress=False)
    command = [
        sys.executable,
        "-m",
        "hfquant.commands.cli",
        "export",
        str(src),
        str(tmp_path / "ct"),
        "--format",
        "compressed-tensors",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "14 layers quantized in 1 config group(s)" in result.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    bad = subprocess.run(command[:-1] + ["onnx"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "compressed-tensors" in bad.stderr


# -- SmolLM2-135M (real model) ---------------------------------------------------------------------------------


# int8 per channel and int4 with folded SINQ scales: one case per compressed-tensors scheme (channel, group). The plain
# int4 g64 symmetric and asymmetric configs, once here too, are checked bit for bit on the tiny Llama above
# (test_plain_transformers_loads_the_export: the same export code, weights and logits equal); the real model adds the
# layer count, several shards and real weights, which these two cases cover.
@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bits=8),
        dict(bits=4, group_size=64, symmetric=True, method="sinq"),  # SINQ with its column scales folded (the default)
    ],
    ids=["int8-channel", "int4-g64-sym-sinq-folded"],
)
def test_smollm2_export_loads_in_plain_transformers(tmp_path, kwargs):
    from benchmarks.example_model import build_example_model

    src, dst = tmp_path / "hfquant", tmp_path / "ct"
    convert(build_example_model(), src, hfquant_config(**kwargs), progress=False)
    result = export_checkpoint(src, dst, max_shard_size="100MB")
    assert result.quantized_layers == 210 and result.config_groups == 1 and len(result.shards) > 1
    ids = torch.randint(3, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    numbers = assert_transformers_reads_it(src, dst, ids, tmp_path)
    # same weights, but hfquant's int kernels sum bfloat16 activations in another order (not the same rounding), so
    # logits of ~35 differ by a few bfloat16 steps (measured: max 1.5, cosine >= 0.99992; near-tied argmaxes of
    # random token ids may flip)
    assert numbers["cosine"] > 0.9995, numbers
