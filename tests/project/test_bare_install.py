"""A bare install (`pip install hfquant`, no extras) imports, quantizes, saves and reloads; each extra's feature,
used without its package, raises an ImportError that names the package and its pip command (issue #28).

This environment has every extra installed, so a fresh Python process hides them first: a finder put in place of
the standard path finder, before anything imports, answers "not installed" for the top-level modules and the
distribution metadata of every package named in pyproject.toml's optional-dependencies (`importlib.util.find_spec`
returns None and `import` raises ModuleNotFoundError, as in a venv without them). The package list comes from
pyproject.toml, so an extra added later is hidden too. `test_fresh_venv_without_extras` (slow) does the same in a
real venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import torch
from helpers import TOKENIZER_VOCAB, run_python, tiny_model, tiny_tokenizer

from hfquant.core.optional import GGUF, PEFT, OptionalDependency, require

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized ("compressed-tensors>=0.20" -> "compressed_tensors")."""
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("-", "_").replace(".", "_")


def optional_distributions() -> set[str]:
    """Every distribution some extra names and `dependencies` does not (hfquant's own self-references excluded)."""
    core = {_name(requirement) for requirement in PYPROJECT["dependencies"]}
    extras = {_name(requirement) for group in PYPROJECT["optional-dependencies"].values() for requirement in group}
    return extras - core - {"hfquant"}


def hidden_modules(distributions: set[str]) -> set[str]:
    """The top-level import names of the installed `distributions` (a missing one has nothing to hide)."""
    return {
        module
        for module, owners in packages_distributions().items()
        if any(_name(owner) in distributions for owner in owners)
    }


HIDE = """
import sys
from importlib.machinery import PathFinder
from importlib.metadata import DistributionFinder

HIDDEN_MODULES, HIDDEN_DISTRIBUTIONS = {modules!r}, {distributions!r}


class HideOptional:
    '''The path finder, blind to the optional packages and to their metadata.'''

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN_MODULES:
            return None
        return PathFinder.find_spec(name, path, target)

    @staticmethod
    def find_distributions(context=DistributionFinder.Context()):
        for distribution in PathFinder.find_distributions(context):
            name = (distribution.metadata["Name"] or "").lower().replace("-", "_").replace(".", "_")
            if name not in HIDDEN_DISTRIBUTIONS:
                yield distribution

    @staticmethod
    def invalidate_caches():
        PathFinder.invalidate_caches()


assert not HIDDEN_MODULES & set(sys.modules), "imported before the finder"
sys.meta_path[:] = [HideOptional if finder is PathFinder else finder for finder in sys.meta_path]
"""

BARE_SESSION = """
import contextlib, importlib.util, io, json, sys
from pathlib import Path

import torch

results = {{"hfquant_file": None}}
import hfquant
from hfquant import HfQuantConfig
from transformers import AutoModelForCausalLM

results["hfquant_file"] = hfquant.__file__
results["hidden_found"] = sorted(m for m in HIDDEN_MODULES if importlib.util.find_spec(m) is not None)

from hfquant.commands.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        main(["--help"])
    except SystemExit as exit:
        results["help_exit"] = exit.code
results["help"] = out.getvalue()

src, work = Path({src!r}), Path({work!r})
ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
config = HfQuantConfig(bits=4, group_size=32, method="rtn")
model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, device_map="cpu").eval()
results["quantized_layers"] = sum(isinstance(m, hfquant.QuantLinear) for m in model.modules())
model.save_pretrained(work / "saved")
again = AutoModelForCausalLM.from_pretrained(work / "saved", device_map="cpu").eval()
with torch.no_grad():
    results["reload_equal"] = torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)

# the command, as a user runs it: its model card needs jinja2 (a dependency, not an extra)
convert = ["convert", str(src), str(work / "converted"), "--bits", "4", "--group-size", "32", "--method", "rtn"]
results["convert_exit"] = main([*convert, "--workers", "0", "--no-progress"])
results["card"] = (work / "converted" / "README.md").is_file()
hfquant.export_checkpoint(work / "converted", work / "ct")  # compressed-tensors: hfquant's own code, no extra
hfquant.import_checkpoint(work / "ct", work / "back")
results["compressed_tensors_round_trip"] = (work / "back" / "config.json").is_file()

def error_of(call):
    try:
        call()
    except ImportError as error:
        return str(error)
    return None

results["gguf_error"] = error_of(lambda: hfquant.export_checkpoint(work / "converted", work / "m.gguf", format="gguf"))
results["gguf_written"] = (work / "m.gguf").exists()
results["peft_error"] = error_of(lambda: __import__("hfquant.peft"))
results["hidden_imported"] = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN_MODULES)
print("RESULTS " + json.dumps(results))
"""


def run_hidden(code: str, distributions: set[str]) -> subprocess.CompletedProcess:
    """`code` in a fresh Python process that sees this worktree's hfquant and none of `distributions`."""
    hide = HIDE.format(modules=hidden_modules(distributions), distributions=distributions)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return run_python(hide + code, timeout=600, PYTHONPATH=path)


def results_of(process: subprocess.CompletedProcess) -> dict:
    lines = [line for line in process.stdout.splitlines() if line.startswith("RESULTS ")]
    assert process.returncode == 0 and lines, process.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.fixture(scope="module")
def float_source(tmp_path_factory) -> Path:
    """A tiny float Llama with its tokenizer, saved by this process (the bare one then only reads it)."""
    folder = tmp_path_factory.mktemp("bare_src")
    tiny_model("llama", dtype=torch.bfloat16, **TOKENIZER_VOCAB).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_require_imports_or_names_the_pip_command(tmp_path, monkeypatch):
    """`require`: the module when installed; a missing package -> ImportError with the feature and the pip command;
    a module missing inside an installed package is that package's own error, not reported as the package missing."""
    assert require(OptionalDependency("json", "json", "none", "Reading JSON")) is json
    with pytest.raises(ImportError) as missing:
        require(OptionalDependency("hfquant_test_absent", "absent-pkg", "absent", "The absent feature"))
    assert str(missing.value) == "The absent feature needs absent-pkg: pip install 'hfquant[absent]'"
    (tmp_path / "hfquant_test_broken").mkdir()
    (tmp_path / "hfquant_test_broken" / "__init__.py").write_text("import hfquant_test_inner_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as inner:
        require(OptionalDependency("hfquant_test_broken", "broken", "broken", "The broken feature"))
    assert inner.value.name == "hfquant_test_inner_missing"
    monkeypatch.delitem(sys.modules, "hfquant_test_broken", raising=False)


def test_every_optional_package_is_an_extra_and_hidden_here():
    """The packages `hfquant.core.optional` names are extras of their own (the pip command in their error works) and
    are among those the bare session hides; the hidden set is not empty here (else the test below proves nothing)."""
    extras = PYPROJECT["optional-dependencies"]
    for dependency in (GGUF, PEFT):
        assert dependency.extra in extras, dependency
        assert dependency.package in {_name(requirement) for requirement in extras[dependency.extra]}
        assert dependency.package in optional_distributions()
    assert {"gguf", "peft", "compressed_tensors"} <= hidden_modules(optional_distributions())


def test_the_finder_hides_an_installed_package():
    """The hiding itself: gguf is installed in this environment, yet the bare session finds neither it nor its
    metadata, and importing it fails as a missing package does."""
    pytest.importorskip("gguf")
    code = """
import importlib.metadata, importlib.util, json
try:
    import gguf
    imported = True
except ModuleNotFoundError as error:
    imported = error.name
try:
    importlib.metadata.version("gguf")
    metadata = True
except importlib.metadata.PackageNotFoundError:
    metadata = False
print("RESULTS " + json.dumps({"spec": importlib.util.find_spec("gguf") is None, "import": imported, "metadata": metadata}))
"""
    assert results_of(run_hidden(code, {"gguf"})) == {"spec": True, "import": "gguf", "metadata": False}


def test_bare_install_imports_quantizes_and_names_each_extra(float_source, tmp_path):
    distributions = optional_distributions()
    results = results_of(run_hidden(BARE_SESSION.format(src=str(float_source), work=str(tmp_path)), distributions))
    assert Path(results["hfquant_file"]).is_relative_to(ROOT), results["hfquant_file"]  # this worktree's package
    assert results["hidden_found"] == []
    assert results["help_exit"] == 0 and "convert" in results["help"] and "export" in results["help"]
    assert results["quantized_layers"] == 15  # 2 layers x 7 Linear, and the 4-bit default's int8 lm_head
    assert results["reload_equal"] is True
    assert results["convert_exit"] == 0 and results["card"] is True
    assert results["compressed_tensors_round_trip"] is True
    assert results["gguf_error"] == "GGUF export needs gguf: pip install 'hfquant[gguf]'"
    assert results["gguf_written"] is False
    assert results["peft_error"] == "LoRA adapters (hfquant.peft) needs peft: pip install 'hfquant[peft]'"
    assert results["hidden_imported"] == []


@pytest.mark.slow
def test_fresh_venv_without_extras(tmp_path):
    """The real thing: `pip install <source>` without extras into a new venv (torch from this machine's pip cache or
    index), then `import hfquant` and the two extras' errors.

    The venv gets no pip of its own (`--without-pip`: ensurepip took 10-25 s): this interpreter's pip installs into it
    (`pip --python`), and without byte-compiling what it installs (`--no-compile`: compiling torch and transformers
    was about half of the install's time and of the folder's removal; a module is compiled when imported anyway)."""
    venv = tmp_path / "venv"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    torch_version = torch.__version__.split("+")[0]
    for args in ([f"torch=={torch_version}"], [str(ROOT)]):
        install = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--disable-pip-version-check"]
            + ["--no-compile", *args],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert install.returncode == 0, install.stderr[-3000:]
    code = """
import importlib.util, json, sys
import hfquant
def error_of(module):
    try:
        __import__(module)
    except ImportError as error:
        return str(error)
print("RESULTS " + json.dumps({
    "file": hfquant.__file__.startswith(sys.prefix),
    "gguf": importlib.util.find_spec("gguf") is None,
    "peft": error_of("hfquant.peft"),
    "export_gguf": error_of("hfquant.conversion.export_gguf"),
}))
"""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # the venv's packages only
    run = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert results_of(run) == {
        "file": True,
        "gguf": True,
        "peft": "LoRA adapters (hfquant.peft) needs peft: pip install 'hfquant[peft]'",
        "export_gguf": "GGUF export needs gguf: pip install 'hfquant[gguf]'",
    }
    print(f"fresh venv: {time.perf_counter() - start:.0f} s")
