"""The wheel carries what a non-editable install needs: the package, the model card template and the C source of the
native kernels; and no measurement tooling (benchmarks/ stays in the source checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _setuptools_version() -> tuple[int, ...]:
    try:
        from importlib.metadata import version

        return tuple(int(part) for part in version("setuptools").split(".")[:2] if part.isdigit())
    except Exception:  # not installed, or an unusual version string: use the isolated build
        return (0,)


def test_wheel_contains_the_package_and_the_card_template(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools writes build/ into the tree it builds
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "hfquant_cli.py"):
        shutil.copy(ROOT / name, source / name)
    for name in ("hfquant", "model_cards", "benchmarks"):  # benchmarks/ too: the build must leave it out
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    wheels = tmp_path / "wheels"
    # This environment's setuptools where it builds wheels by itself (>= 70.1), else pip's isolated build, which
    # fetches setuptools from PyPI as `pip install` does.
    isolation = [] if _setuptools_version() < (70, 1) else ["--no-build-isolation"]
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", *isolation, "-q", "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheels.glob("hfquant-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"hfquant/__init__.py", "hfquant/publishing/cards.py", "hfquant/integration/quantizer.py"} <= names
    # the console script's entry, beside the package (it parses the command line before the package root runs)
    assert "hfquant_cli.py" in names
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "hfquant = hfquant_cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # cards.TEMPLATE_PATH looks for it there first (the source tree's model_cards/ is not installed)
    template = zipfile.ZipFile(wheel).read("hfquant/model_cards/hfquant.jinja")
    assert template == (ROOT / "model_cards" / "hfquant.jinja").read_bytes()
    assert not any(name.startswith(("tests/", "model_cards/")) for name in names)
    # the native kernels are compiled from the shipped source on first use: without it a wheel install is slower
    from hfquant.ops import native_build

    for name in (path.name for path in (*native_build.SOURCES, *native_build.HEADERS, native_build.CPP_SOURCE)):
        source = zipfile.ZipFile(wheel).read(f"hfquant/ops/csrc/{name}")
        assert source == (ROOT / "hfquant" / "ops" / "csrc" / name).read_bytes()
    # benchmark code is not library code: no benchmark, random model or memory-measurement module anywhere
    tooling = {"benchmark.py", "random_model.py", "memory.py"}
    assert not [name for name in names if name.startswith("benchmarks/") or name.rsplit("/", 1)[-1] in tooling]
