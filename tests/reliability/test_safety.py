"""Loading or checking a checkpoint never runs code from it: hfquant reads only safetensors and JSON, has no pickle
and no eval, parses metadata against an allowlist, and never turns on `trust_remote_code` by itself."""

from __future__ import annotations

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import auto_class
from safetensors.torch import save_file

import hfquant
from hfquant import HfQuantConfig
from hfquant.checkpoint.files import read_headers
from hfquant.verification import verify

PACKAGE = Path(hfquant.__file__).parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "breakpoint"}


def _sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, files  # the scan must see the package
    return files


def _violations(path: Path) -> list[str]:
    """Forbidden imports and calls in one module, found on its syntax tree (strings and comments do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_BUILTINS:
                found.append(f"{where} calls {func.id}()")
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "load"
                and isinstance(func.value, ast.Name)
                and (func.value.id == "torch")
            ):
                found.append(f"{where} calls torch.load (pickle)")
            for keyword in node.keywords:
                value = keyword.value
                # passing the user's own choice through is fine; a constant other than False is not
                if keyword.arg == "trust_remote_code" and isinstance(value, ast.Constant) and value.value is not False:
                    found.append(f"{where} passes trust_remote_code={value.value!r}")
                if keyword.arg == "weights_only" and isinstance(value, ast.Constant) and value.value is False:
                    found.append(f"{where} passes weights_only=False (pickle)")
        elif isinstance(node, ast.Assign):  # os.environ["HF_TRUST_REMOTE_CODE"] = ...
            for target in node.targets:
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.slice, ast.Constant)
                    and ("TRUST_REMOTE_CODE" in str(target.slice.value))
                ):
                    found.append(f"{where} sets {target.slice.value}")
    return found


def test_the_scan_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import pickle\nfrom dill import loads\nimport torch\nimport os\n"
        "x = eval('1')\nexec('y = 2')\ntorch.load('w.pt')\ntorch.load('w.pt', weights_only=False)\n"
        "f(trust_remote_code=True)\nos.environ['HF_TRUST_REMOTE_CODE'] = '1'\n"
        "model.eval()\ns = 'eval(x) trust_remote_code=True'\nf(trust_remote_code=False)\n"
    )
    found = _violations(bad)
    assert len(found) == 9, found
    for words in (
        "imports pickle",
        "imports from dill",
        "calls eval()",
        "calls exec()",
        "torch.load (pickle)",
        "weights_only=False",
        "trust_remote_code=True",
        "HF_TRUST_REMOTE_CODE",
    ):
        assert any(words in v for v in found), words


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_has_no_pickle_eval_or_remote_code(path):
    assert _violations(path) == []


# -- behaviour on hostile checkpoints -----------------------------------------------------------------------------


class _Payload:
    """Unpickling this writes a sentinel file: proof that a pickle was loaded."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.write_text, (self.sentinel, "pickle ran"))


@pytest.fixture(scope="module")
def quantized_folder(float_checkpoint, tmp_path_factory) -> Path:
    model = auto_class("llama").from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=4, group_size=32), device_map="cpu"
    )
    path = tmp_path_factory.mktemp("q4")
    model.save_pretrained(path)
    return path


def _hostile(folder: Path, tmp_path: Path, keep_safetensors: bool) -> tuple[Path, list[Path]]:
    """A copy of `folder` with a pickle payload and custom code (both writing sentinels) and an auto_map to the code."""
    target = tmp_path / "hostile"
    shutil.copytree(folder, target)
    if not keep_safetensors:
        for shard in target.glob("*.safetensors"):
            shard.unlink()
    sentinels = [tmp_path / "PICKLE_RAN", tmp_path / "CODE_RAN"]
    with open(target / "pytorch_model.bin", "wb") as handle:
        pickle.dump({"model.embed_tokens.weight": _Payload(sentinels[0])}, handle)
    (target / "modeling_evil.py").write_text(
        f"open({str(sentinels[1])!r}, 'w').write('code ran')\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilForCausalLM\n"
    )
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "modeling_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (target / "config.json").write_text(json.dumps(config))
    return target, sentinels


def test_verify_reads_neither_pickle_nor_code(quantized_folder, tmp_path):
    folder, sentinels = _hostile(quantized_folder, tmp_path, keep_safetensors=False)
    problems = verify(folder).problems
    assert any("pytorch_model.bin" in p and "never reads" in p for p in problems), problems
    assert not any(s.exists() for s in sentinels)
    folder, sentinels = _hostile(quantized_folder, tmp_path / "kept", keep_safetensors=True)
    assert verify(folder).problems == []
    assert not any(s.exists() for s in sentinels)


def test_from_pretrained_of_a_quantized_checkpoint_runs_no_code_from_it(quantized_folder, tmp_path):
    folder, sentinels = _hostile(quantized_folder, tmp_path, keep_safetensors=True)
    model = auto_class("llama").from_pretrained(folder, device_map="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantLinear"
    assert not any(s.exists() for s in sentinels)


def test_metadata_strings_are_never_interpreted(tmp_path):
    sentinel = tmp_path / "METADATA_RAN"
    code = f"__import__('pathlib').Path({str(sentinel)!r}).write_text('x')"
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 2)}, path, metadata={"format": "pt", "hfquant.note": code, "__init__": code})
    tensors = read_headers(path)
    assert set(tensors) == {"w"}
    assert not sentinel.exists()


def test_json_constants_and_duplicates_are_refused(tmp_path):
    from hfquant.checkpoint.files import read_json

    for text, words in (
        ('{"a": NaN}', "NaN"),
        ('{"a": Infinity}', "Infinity"),
        ('{"a": 1, "a": 2}', "'a' appears twice"),
    ):
        path = tmp_path / "x.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="x.json is not valid JSON") as info:
            read_json(path)
        assert words in str(info.value)
    path.write_text(" " * 100)
    with pytest.raises(ValueError, match="more than the 10"):
        read_json(path, limit=10)
