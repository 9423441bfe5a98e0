"""No writer destroys its source, and what a writer publishes follows the umask (docs/reliability.md, issues #28 and
#27).

Every writer that has a source (`convert`, `export` to compressed-tensors and to a GGUF file, `import`, the staged
`save_pretrained` of a model hfquant loaded) refuses, before any work, a destination that is the source, lies inside
it or contains it, also through a symlink or `..` in either path: one `ValueError` line naming both paths, exit 2 on
the command line, and every file under the test's folder byte for byte and mode for mode as it was. The motivating
case: `hfquant convert models/src models --overwrite` swapped the new folder into `models` and deleted the source.

Files used to be published owner-only (`-rw-------`: safetensors and `tempfile` write them so, and the atomic rename
kept the mode); now every file and folder a writer publishes gets 0666 / 0777 & ~umask.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import MERGES_VOCAB, auto_class, tiny_model, tiny_tokenizer

from hfquant import HfQuantConfig
from hfquant.checkpoint import publish
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint
from hfquant.conversion.importing import import_checkpoint


def _config() -> HfQuantConfig:
    """int8 per channel, RTN: a checkpoint that both export formats take."""
    extra = {"mixed_precision": "none"} if "mixed_precision" in HfQuantConfig().to_dict() else {}
    return HfQuantConfig(bits=8, method="rtn", **extra)


@pytest.fixture(scope="module")
def origins(tmp_path_factory) -> dict[str, Path]:
    """One source per kind of writer: a float tiny Llama with its tokenizer, its hfquant int8 convert, and that
    exported to compressed-tensors."""
    root = tmp_path_factory.mktemp("origins")
    float_folder = root / "float"
    tiny_model("llama", dtype=torch.bfloat16, **MERGES_VOCAB).save_pretrained(float_folder)
    tiny_tokenizer(merges=True).save_pretrained(float_folder)  # a merge list: the GGUF export needs one
    convert(float_folder, root / "hfquant", _config(), progress=False)
    export_checkpoint(root / "hfquant", root / "ct")
    return {"float": float_folder, "hfquant": root / "hfquant", "ct": root / "ct"}


def _save_pretrained(src: Path, dst: Path) -> None:
    """A model hfquant loaded from `src` (pre-quantized, or quantized on load from a float `src`), saved to `dst`."""
    quantize = {} if (src / "hfquant.sha256.json").exists() else {"quantization_config": _config()}
    model = auto_class("llama").from_pretrained(src, device_map="cpu", **quantize)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "QuantLinear"
    model.save_pretrained(dst)


WRITERS: dict[str, tuple[str, Callable[[Path, Path], object], bool]] = {
    # name: (source kind, write(src, dst) with overwrite where the writer takes it, writes one file)
    "convert": ("float", lambda src, dst: convert(src, dst, _config(), overwrite=True, progress=False), False),
    "export compressed-tensors": ("hfquant", lambda src, dst: export_checkpoint(src, dst, overwrite=True), False),
    "export gguf": ("hfquant", lambda src, dst: export_checkpoint(src, dst, "gguf", overwrite=True), True),
    "import": ("ct", lambda src, dst: import_checkpoint(src, dst, overwrite=True), False),
    "save_pretrained": ("hfquant", _save_pretrained, False),
    "save_pretrained quantized on load": ("float", _save_pretrained, False),
}


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target, target_is_directory=True)
    return link


CASES: dict[str, Callable[[Path], tuple[Path, Path, str]]] = {
    # name: root -> (SRC as given, DST as given, the relation the message names); SRC is root/models/src
    "DST is SRC": lambda root: (root / "models/src", root / "models/src", "is"),
    "DST inside SRC": lambda root: (root / "models/src", root / "models/src/out", "is inside"),
    "DST contains SRC (a missing sub-folder name)": lambda root: (root / "models/src", root / "models", "contains"),
    "DST a link to SRC": lambda root: (root / "models/src", _link(root / "link", root / "models/src"), "is"),
    "DST a link to SRC's folder": lambda root: (root / "models/src", _link(root / "up", root / "models"), "contains"),
    "DST is SRC/..": lambda root: (root / "models/src", root / "models/src/..", "contains"),
    "DST is x/../src": lambda root: (root / "models/src", root / "models/x/../src", "is"),
    "SRC through a link": lambda root: (_link(root / "alias", root / "models") / "src", root / "models", "contains"),
    "SRC with ..": lambda root: (_folder(root / "models/x") / "../src", root / "models", "contains"),
}


def _tree(root: Path) -> dict[str, tuple]:
    """Relative path -> (kind, sha256 or link target, mode) of every entry under `root`."""
    found = {}
    for path in sorted(root.rglob("*")):
        mode = stat.S_IMODE(path.lstat().st_mode)
        if path.is_symlink():
            found[str(path.relative_to(root))] = ("link", os.readlink(path), mode)
        elif path.is_file():
            found[str(path.relative_to(root))] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), mode)
        else:
            found[str(path.relative_to(root))] = ("folder", None, mode)
    return found


def _place_source(origins: dict[str, Path], kind: str, root: Path) -> None:
    (root / "models").mkdir()
    shutil.copytree(origins[kind], root / "models/src", symlinks=True)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("writer", list(WRITERS))
def test_no_writer_writes_into_around_or_over_its_source(origins, tmp_path, writer, case):
    kind, write, one_file = WRITERS[writer]
    if "gguf" in writer:
        pytest.importorskip("gguf")
    _place_source(origins, kind, tmp_path)
    src, dst, relation = CASES[case](tmp_path)
    if one_file and relation == "is inside":  # a new file inside SRC is allowed for the GGUF (see below)
        dst, relation = src / "model.safetensors", "is an existing file in"
    before = _tree(tmp_path)
    with pytest.raises(ValueError) as raised:
        write(src, dst)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"DST {dst}") and f" {relation} SRC {src}" in message, message
    assert "outside SRC" in message
    assert _tree(tmp_path) == before  # nothing written, nothing deleted, no mode changed


def test_gguf_may_be_a_new_file_inside_its_source_folder(origins, tmp_path):
    """transformers loads a GGUF from the checkpoint folder (`from_pretrained(folder, gguf_file=...)`): a new file
    there destroys nothing, so the one-file writer allows it; every file of the source stays as it was."""
    _place_source(origins, "hfquant", tmp_path)
    src = tmp_path / "models/src"
    before = _tree(src)
    export_checkpoint(src, src / "model.gguf", "gguf")
    after = _tree(src)
    assert after.pop("model.gguf")[0] == "file" and after == before
    with pytest.raises(ValueError, match="is an existing file in SRC"):
        export_checkpoint(src, src / "model.gguf", "gguf", overwrite=True)
    with pytest.raises(ValueError, match="is an existing file in SRC"):  # `..` through a folder not there yet
        export_checkpoint(src, src / "new/../config.json", "gguf", overwrite=True)
    assert not (src / "new").exists()


def test_apart_folders_with_a_common_prefix_are_not_confused(tmp_path):
    """`models/src2` is neither inside nor around `models/src`: paths are compared by component, not by text."""
    (tmp_path / "models/src").mkdir(parents=True)
    publish.check_apart_from_source(tmp_path / "models/src2", tmp_path / "models/src")
    publish.check_apart_from_source(tmp_path / "models/sr", tmp_path / "models/src")
    publish.check_apart_from_source(tmp_path / "other", tmp_path / "models/src", file=True)


PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The tree under test: the command runs in another folder, where `python -m` would import the installed copy."""

COMMANDS = {
    # name: (source kind, arguments, how the message ends)
    "convert": (
        "float",
        ["convert", "{src}", "{dst}", "--bits", "8", "--overwrite", "--no-progress"],
        "write the quantized checkpoint to another folder, outside SRC",
    ),
    "export compressed-tensors": (
        "hfquant",
        ["export", "{src}", "{dst}", "--format", "compressed-tensors"],
        "write the new checkpoint to another folder, outside SRC",
    ),
    "export gguf": (
        "hfquant",
        ["export", "{src}", "{dst}", "--format", "gguf", "--overwrite"],
        "write the GGUF file under a new name or outside SRC",
    ),
    "import": (
        "ct",
        ["import", "{src}", "{dst}", "--overwrite"],
        "write the new checkpoint to another folder, outside SRC",
    ),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_command_refuses_a_dst_containing_src_in_one_line_exit_2(origins, tmp_path, command):
    """`hfquant convert models/src models --overwrite` (a sub-folder name forgotten) used to delete models/src and
    exit 0; every writing command now refuses as it refuses DST == SRC: one line, exit 2, nothing changed."""
    kind, args, fix = COMMANDS[command]
    _place_source(origins, kind, tmp_path)
    before = _tree(tmp_path)
    argv = [a.format(src="models/src", dst="models") for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "hfquant.commands.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"hfquant: error: DST models contains SRC models/src; writing there would change or delete SRC: {fix}"
    ), done.stderr
    assert "wrote" not in done.stdout
    assert _tree(tmp_path) == before


# -- modes: what is published follows the umask (#27) -------------------------------------------------------------


def _modes(folder: Path) -> dict[str, int]:
    """Relative path -> permission bits of `folder` and everything under it (links left out)."""
    found = {".": stat.S_IMODE(folder.stat().st_mode)}
    for path in folder.rglob("*"):
        if not path.is_symlink():
            found[str(path.relative_to(folder))] = stat.S_IMODE(path.lstat().st_mode)
    return found


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    """The process's umask set for the test, then restored."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def _expected(folder: Path, mask: int, root: bool = True) -> dict[str, int]:
    found = {".": 0o777 & ~mask} if root else {}
    for path in folder.rglob("*"):
        if not path.is_symlink():
            found[str(path.relative_to(folder))] = (0o777 if path.is_dir() else 0o666) & ~mask
    return found


def test_every_published_file_follows_the_umask(origins, tmp_path, umask):
    assert publish.process_umask() == umask
    written = {
        "convert": tmp_path / "convert",
        "export": tmp_path / "export",
        "import": tmp_path / "import",
        "convert over an existing folder": tmp_path / "existing",
    }
    convert(origins["float"], written["convert"], _config(), max_shard_size="100KB", progress=False)
    export_checkpoint(origins["hfquant"], written["export"], max_shard_size="100KB")
    import_checkpoint(origins["ct"], written["import"])
    (tmp_path / "existing").mkdir(mode=0o700)
    convert(origins["float"], written["convert over an existing folder"], _config(), overwrite=True, progress=False)
    for name, folder in written.items():
        assert any(path.suffix == ".safetensors" for path in folder.iterdir()), name
        assert _modes(folder) == _expected(folder, umask), name
    gguf_file = tmp_path / "model.gguf"
    export_checkpoint(origins["hfquant"], gguf_file, "gguf")
    assert stat.S_IMODE(gguf_file.stat().st_mode) == 0o666 & ~umask


def test_save_pretrained_files_follow_the_umask(origins, tmp_path, umask):
    """The direct save into an absent folder and the staged save over an existing checkpoint; files carried over
    from the previous version keep their own mode (they are hard links to the user's files)."""
    model = auto_class("llama").from_pretrained(origins["hfquant"], device_map="cpu")
    direct, staged = tmp_path / "direct", tmp_path / "staged"
    model.save_pretrained(direct)
    assert any(path.suffix == ".safetensors" for path in direct.iterdir())
    assert _modes(direct) == _expected(direct, umask)
    shutil.copytree(origins["hfquant"], staged)
    for path in staged.iterdir():
        path.chmod(0o600)
    model.save_pretrained(staged, max_shard_size="100KB")
    saved = {"config.json", "generation_config.json", "model.safetensors.index.json"}
    modes = _modes(staged)
    shards = [name for name in modes if name.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors" not in shards
    assert {name: mode for name, mode in modes.items() if name in saved or name in shards or name == "."} == {
        name: mode for name, mode in _expected(staged, umask).items() if name in saved or name in shards or name == "."
    }
    carried = {name: mode for name, mode in modes.items() if name not in saved and name not in shards and name != "."}
    assert carried and set(carried.values()) == {0o600}, carried


def test_save_pretrained_through_a_link_gives_the_umask_to_the_weights_only(origins, tmp_path, umask):
    """A destination that is a link is written through by transformers (into whatever folder it names, which may
    hold other files): the weight files it wrote get the umask's modes, the folder's other files keep theirs."""
    model = auto_class("llama").from_pretrained(origins["hfquant"], device_map="cpu")
    target = tmp_path / "target"
    target.mkdir()
    (target / "private.txt").write_text("mine")
    (target / "private.txt").chmod(0o600)
    model.save_pretrained(_link(tmp_path / "link", target))
    modes = _modes(target)
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert modes["private.txt"] == 0o600
