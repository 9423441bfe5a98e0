"""The compressed-tensors export of the default 4-bit config, loaded quantized by plain transformers +
compressed-tensors in a virtual environment that has no hfquant installed (issue #27 item 1).

The venv is built once per (python, torch, transformers, compressed-tensors) versions, the versions this test runs
with, under ~/.cache/hfquant/engines/ct-venv/ (about 90 s and 1.2 GB the first time; PyPI must be reachable: a
failed build fails the test, it is not skipped), and reused afterwards.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint

pytestmark = pytest.mark.slow


def _versions() -> dict[str, str]:
    return {
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "compressed-tensors": importlib.metadata.version("compressed-tensors"),
    }


def ct_venv() -> Path:
    """The python of a venv with this test's torch, transformers and compressed-tensors versions and no hfquant,
    built on first use (into a temporary folder renamed when complete) and reused."""
    versions = _versions()
    key = f"py{sys.version_info[0]}{sys.version_info[1]}-" + "-".join(f"{k}{v}" for k, v in versions.items())
    root = Path(os.environ.get("HFQUANT_CACHE", Path.home() / ".cache" / "hfquant")) / "engines" / "ct-venv"
    venv = root / key
    python = venv / "bin" / "python"
    if (venv / "complete").is_file():
        return python
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True, timeout=300)
    pins = [f"{name}=={version}" for name, version in versions.items()]
    result = subprocess.run(
        [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *pins],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if result.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"pip install {' '.join(pins)} into a fresh venv failed:\n{result.stderr[-3000:]}")
    (tmp / "complete").write_text(json.dumps(versions) + "\n")
    try:
        tmp.rename(venv)  # only bin/python is run, which finds its venv from where it lies
    except OSError:  # another run finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return python


_READER = textwrap.dedent(
    """
    import sys
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder, out = sys.argv[1], sys.argv[2]
    ids = torch.tensor([[int(t) for t in sys.argv[3].split(",")]])
    try:
        import hfquant  # noqa: F401
        raise SystemExit("hfquant is importable in the venv")
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    packed = sorted(n for n, m in model.named_modules() if hasattr(m, "weight_packed"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.contiguous()
    save_file({"logits": logits}, out, metadata={"packed": ",".join(packed)})
    """
)


def test_int_default_config_export_loads_quantized_in_plain_transformers(float_checkpoint, tmp_path):
    """The int format's 4-bit defaults (sinq with folded column scales, asymmetric, the data-free rule's int8 late v_proj: two
    config groups) exported with engine="transformers": the venv's transformers keeps every quantized layer
    packed after loading, and its float32 logits are hfquant's float32 logits within 1e-2."""
    python = ct_venv()
    model_dir = float_checkpoint("llama", torch.bfloat16, num_hidden_layers=4)
    src, dst = tmp_path / "q4", tmp_path / "q4-ct"
    convert(model_dir, src, HfQuantConfig(bits=4, format="int"), progress=False)
    result = export_checkpoint(src, dst, engine="transformers")
    qconfig = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert result.config_groups == len(qconfig["config_groups"]) >= 2  # int4 asymmetric and int8 v_proj
    assert any(not g["weights"]["symmetric"] for g in qconfig["config_groups"].values())

    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    out = tmp_path / "logits.safetensors"
    run = subprocess.run(
        [str(python), "-c", _READER, str(dst), str(out), ",".join(str(int(t)) for t in ids.flatten())],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # not the source tree: `python -c` puts its working folder first on sys.path
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    from safetensors import safe_open

    with safe_open(out, "pt") as f:
        packed = set(f.metadata()["packed"].split(","))
    assert packed == {f"{n}" for n in _quantized_names(dst)}, "a quantized layer was not loaded packed"
    logits = load_file(out)["logits"]

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, device_map="cpu").eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    diff = (logits.double() - want.double()).abs().max().item()
    print(f"default export in plain transformers vs hfquant (float32): max |logit difference| {diff:.2e}")
    assert diff < 1e-2, diff


def _quantized_names(folder: Path) -> list[str]:
    """The layers of the export stored packed (a `weight_packed` tensor)."""
    from safetensors import safe_open

    names = []
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names += [k.removesuffix(".weight_packed") for k in f.keys() if k.endswith(".weight_packed")]
    assert names
    return names
