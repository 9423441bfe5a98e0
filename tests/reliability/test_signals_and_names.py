"""SIGTERM, long destination names and errors that name their real cause (docs/reliability.md, issue #28 item 7).

SIGTERM is what `kill`, `timeout`, `docker stop` and systemd send. It used to end `hfquant convert`/`import`/`export`
at once (Python's default), leaving the hidden `.DST.tmp-*` folder behind without a word; the command now handles it
as Ctrl-C: temporary folders and files removed, DST as it was, one line, exit 143. The signal comes from another
process while the command is paused just before publishing (its temporary folder, or GGUF file, complete): a
deterministic moment, with no timing in the assertions.

A 250-character destination name (legal: NAME_MAX is 255 bytes) used to fail on the temporary name
`.NAME.tmp-XXXXXXXX` (264 bytes): temporary names are now shortened to fit.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import MERGES_VOCAB, auto_class, tiny_model, tiny_tokenizer

from hfquant import HfQuantConfig
from hfquant.checkpoint import publish
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint
from hfquant.conversion.importing import import_checkpoint

WAIT = 180  # seconds a child may take to reach its pause; a bound on a hang, not a timing assertion

CHILD = r"""
import sys, time
from pathlib import Path

import hfquant.commands.cli as cli
from hfquant.checkpoint import publish
from hfquant.conversion import export_gguf

READY = Path(sys.argv[1])


def pause():
    READY.touch()
    time.sleep(600)  # SIGTERM arrives here


original_publish = publish.publish_folder


def publish_folder(tmp, dst, overwrite):
    pause()
    return original_publish(tmp, dst, overwrite)


publish.publish_folder = publish_folder
original_replace = export_gguf._replace_atomically


def replace_atomically(dst, write):
    def write_then_pause(path):
        write(path)
        pause()

    return original_replace(dst, write_then_pause)


export_gguf._replace_atomically = replace_atomically
sys.exit(cli.main(sys.argv[2:]))
"""


def _config() -> HfQuantConfig:
    return HfQuantConfig(bits=8, method="rtn")


@pytest.fixture(scope="module")
def origins(tmp_path_factory) -> dict[str, Path]:
    """A float tiny Llama with its tokenizer, its hfquant int8 convert, and that exported to compressed-tensors."""
    root = tmp_path_factory.mktemp("origins")
    float_folder = root / "float"
    tiny_model("llama", dtype=torch.bfloat16, **MERGES_VOCAB).save_pretrained(float_folder)
    tiny_tokenizer(merges=True).save_pretrained(float_folder)  # GGUF needs a merge list
    convert(float_folder, root / "hfquant", _config(), progress=False)
    export_checkpoint(root / "hfquant", root / "ct")
    return {"float": float_folder, "hfquant": root / "hfquant", "ct": root / "ct"}


def _snapshot(path: Path) -> dict[str, str] | None:
    """{relative name: sha256} of every file under `path` (a folder or one file); None when absent."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in path.rglob("*") if p.is_file()
    }


COMMANDS = {
    # name: (source kind, arguments after SRC DST, DST name)
    "convert": ("float", ["--bits", "8", "--method", "rtn", "--no-progress"], "dst"),
    "import": ("ct", [], "dst"),
    "export compressed-tensors": ("hfquant", ["--format", "compressed-tensors"], "dst"),
    "export gguf": ("hfquant", ["--format", "gguf"], "dst.gguf"),
}


def _previous_version(kind: str, src: Path, dst: Path) -> None:
    """Something at `dst` for `--overwrite` to replace: a complete output of the same command."""
    if kind == "convert":
        convert(src, dst, _config(), progress=False)
    elif kind == "import":
        import_checkpoint(src, dst)
    else:
        export_checkpoint(src, dst, "gguf" if dst.suffix == ".gguf" else "compressed-tensors")


@pytest.mark.parametrize("overwrite", [False, True], ids=["absent DST", "--overwrite"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_sigterm_mid_run_removes_temporaries_and_exits_143(origins, tmp_path, name, overwrite):
    """The real command, paused with its temporary folder (or GGUF file) complete, gets SIGTERM from another process:
    exit 143, its last line `hfquant: terminated (SIGTERM; ...)`, DST as it was (absent, or the previous version byte
    for byte) and nothing else beside it. Was: killed at once, the hidden temporary left behind, no word."""
    kind, extra, dst_name = COMMANDS[name]
    if "gguf" in name:
        pytest.importorskip("gguf")
    command = name.split()[0]
    out = tmp_path / "out"
    out.mkdir()
    dst = out / dst_name
    if overwrite:
        _previous_version(command, origins[kind], dst)
        extra = [*extra, "--overwrite"]
    before = _snapshot(dst)
    ready = tmp_path / "ready"
    argv = [command, str(origins[kind]), str(dst), *extra]
    process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ready), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    try:
        deadline = time.monotonic() + WAIT
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), process.communicate()
        assert sorted(p.name for p in out.iterdir()) != sorted([dst_name] if overwrite else [])  # a temporary exists
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=WAIT)
    finally:
        if process.poll() is None:
            process.kill()
            print(process.communicate())
    assert process.returncode == 143, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "hfquant: terminated (SIGTERM; an unfinished DST is removed; an existing one is left as it was)"
    ), stderr[-2000:]
    assert _snapshot(dst) == before
    assert sorted(p.name for p in out.iterdir()) == ([dst_name] if overwrite else [])


def test_sigterm_is_held_back_over_a_publishing_step_like_ctrl_c():
    """Within `deferred_interrupts` (the creation of the temporary folder, the publishing rename, the cleanup) a
    SIGTERM, like a SIGINT, is delivered to the command's handler only when the block ends."""
    received = []

    def handler(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    steps = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with publish.deferred_interrupts():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the Python-level handler would run at one of these bytecodes
                    steps.append(len(received))
                steps.append("end")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps[-1] == "end" and set(steps[:-1]) == {0}
    assert received == [signal.SIGTERM]


# -- long destination names ------------------------------------------------------------------------------------------

LONG = "m" * 250


def test_hidden_names_fit_name_max_and_stay_distinct():
    """Every temporary name fits in 255 bytes, also for a 255-byte multi-byte name, and two long names that share
    their first 240 characters get different temporary names."""
    names = [LONG, "é" * 127, "a" * 255, LONG[:-1] + "x", "dst"]
    siblings = [publish.hidden_sibling(Path("/x") / name, "tmp").name for name in names]
    assert all(len(os.fsencode(name)) <= publish.NAME_MAX for name in siblings), siblings
    assert siblings[-1].startswith(".dst.tmp-")
    stems = [name.rsplit(".tmp-", 1)[0] for name in siblings]
    assert len(set(stems)) == len(stems)


WRITERS = {
    "convert": ("float", lambda src, dst: convert(src, dst, _config(), overwrite=True, progress=False)),
    "export compressed-tensors": ("hfquant", lambda src, dst: export_checkpoint(src, dst, overwrite=True)),
    "export gguf": ("hfquant", lambda src, dst: export_checkpoint(src, dst, "gguf", overwrite=True)),
    "import": ("ct", lambda src, dst: import_checkpoint(src, dst, overwrite=True)),
}


@pytest.mark.parametrize("overwrite", [False, True], ids=["absent DST", "over a previous version"])
@pytest.mark.parametrize("name", list(WRITERS))
def test_a_250_character_destination_name_works(origins, tmp_path, name, overwrite):
    """convert, export (both formats) and import write a DST whose name is 250 characters (a new one, and over a
    previous version: the staging and the aside names), and leave nothing else beside it. Was: `OSError: [Errno 36]
    File name too long` on `.NAME.tmp-XXXXXXXX`."""
    kind, write = WRITERS[name]
    if "gguf" in name:
        pytest.importorskip("gguf")
    dst = tmp_path / (LONG[:-5] + ".gguf" if "gguf" in name else LONG)
    if overwrite:
        write(origins[kind], dst)
    write(origins[kind], dst)
    assert [p.name for p in tmp_path.iterdir()] == [dst.name]
    assert dst.is_file() if "gguf" in name else (dst / "config.json").is_file()


def test_save_pretrained_over_a_checkpoint_with_a_250_character_name(origins, tmp_path):
    """The staged `save_pretrained` (a model hfquant loaded, saved over a non-empty folder) into a 250-character
    folder: saved, reloadable with the same logits, nothing left beside it."""
    dst = tmp_path / LONG
    model = auto_class("llama").from_pretrained(origins["hfquant"], device_map="cpu")
    model.save_pretrained(dst)
    model.save_pretrained(dst)  # over the previous version: staged beside it
    assert [p.name for p in tmp_path.iterdir()] == [LONG]
    ids = torch.tensor([[1, 2, 3, 4]])
    reloaded = auto_class("llama").from_pretrained(dst, device_map="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)
