"""Issue #11, last classes: shards of two saves, a Hub that never answers or answers HTML, malformed SRC files and out
of memory in the command, and an hfquant checkpoint loaded by plain transformers (docs/reliability.md)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.files import checkpoint_ids, read_checkpoint_id
from hfquant.conversion.convert import convert
from hfquant.integration.checks import confirm_checkpoint_unchanged
from hfquant.publishing.hub import HubError, hub_timeout, push_folder
from hfquant.verification import verify

SHARD_SIZE = "20KB"


@pytest.fixture(scope="module")
def two_saves(float_checkpoint, tmp_path_factory):
    """A tiny Llama converted at 8 bits (a), and the same with one weight doubled (b): the same tensor names and shapes
    in the same shards, other values, so two checkpoint ids."""
    root = tmp_path_factory.mktemp("two-saves")
    src = float_checkpoint("llama")
    edited = root / "edited"
    shutil.copytree(src, edited)
    tensors = load_file(edited / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"] * 2
    save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})
    for name, source in (("a", src), ("b", edited)):
        convert(source, root / name, HfQuantConfig(bits=8), max_shard_size=SHARD_SIZE, progress=False)
    return root / "a", root / "b"


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _load(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


# -- shards of two saves ---------------------------------------------------------------------------------------


def test_every_shard_of_a_convert_carries_one_checkpoint_id(two_saves, float_checkpoint, tmp_path):
    """One id per save, derived from the bytes: another convert of the same source gives the same files."""
    a, b = two_saves
    again = tmp_path / "again"
    convert(float_checkpoint("llama"), again, HfQuantConfig(bits=8), max_shard_size=SHARD_SIZE, progress=False)
    assert all(path.read_bytes() == (again / path.name).read_bytes() for path in _shards(a))
    ids_a = {read_checkpoint_id(p) for p in _shards(a)}
    ids_b = {read_checkpoint_id(p) for p in _shards(b)}
    assert len(_shards(a)) > 2 and len(ids_a) == 1 and len(ids_b) == 1 and ids_a != ids_b
    assert None not in ids_a


def test_shards_of_two_save_pretrained_calls_are_told_apart(two_saves, tmp_path):
    """save_pretrained of a model hfquant loaded stamps its shards like convert: one id per save, from the bytes."""
    models = [_load(folder) for folder in two_saves]
    for i, model in enumerate(models):
        model.save_pretrained(tmp_path / f"s{i}", max_shard_size=SHARD_SIZE)
    models[0].save_pretrained(tmp_path / "s0-again", max_shard_size=SHARD_SIZE)
    ids = [set(checkpoint_ids(_shards(tmp_path / name)).values()) for name in ("s0", "s1", "s0-again")]
    assert all(len(one) == 1 and None not in one for one in ids), ids
    assert ids[0] == ids[2] and ids[0] != ids[1]
    odd = _shards(tmp_path / "s1")[-1].name
    shutil.copyfile(tmp_path / "s1" / odd, tmp_path / "s0" / odd)
    with pytest.raises(ValueError, match=rf"checkpoint changed while loading \({odd} belongs to another save"):
        _load(tmp_path / "s0")


def test_shards_of_two_saves_are_refused_at_load_and_by_verify(two_saves, tmp_path):
    a, b = two_saves
    mixed = tmp_path / "mixed"
    shutil.copytree(a, mixed)
    odd = _shards(b)[1].name
    shutil.copyfile(b / odd, mixed / odd)  # what a reader sees when convert --overwrite swaps the folder mid-load
    with pytest.raises(ValueError, match=rf"checkpoint changed while loading \({odd} belongs to another save.*retry"):
        _load(mixed)
    problems = verify(mixed).problems
    assert any("changed while loading" in p and odd in p for p in problems), problems
    assert verify(a).ok and verify(b).ok


def test_a_checkpoint_without_ids_still_loads(two_saves, tmp_path):
    a, _ = two_saves
    old = tmp_path / "old"
    shutil.copytree(a, old)
    for path in _shards(old):  # as written before checkpoint ids existed
        save_file(load_file(path), path, metadata={"format": "pt"})
    (old / "hfquant.sha256.json").unlink()
    assert set(checkpoint_ids(_shards(old)).values()) == {None}
    reference, reloaded = _load(a), _load(old)
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(reference(ids).logits, reloaded(ids).logits)


def test_shards_replaced_while_the_weights_load_are_caught_after(two_saves, tmp_path):
    """The ids read before the weights are compared again after (`confirm_checkpoint_unchanged`, a loaded-model hook)."""
    a, b = two_saves
    folder = tmp_path / "racing"
    shutil.copytree(a, folder)
    model = _load(folder)
    model._hfquant_checkpoint_ids = checkpoint_ids(_shards(folder))  # as check_stored_tensors records them
    odd = _shards(b)[-1].name
    shutil.copyfile(b / odd, folder / odd)
    with pytest.raises(ValueError, match=rf"changed while loading \({odd} belongs to another save now.*retry"):
        confirm_checkpoint_unchanged(model)
    confirm_checkpoint_unchanged(model)  # recorded once: nothing left to compare


def test_from_pretrained_says_retry_when_a_shard_is_replaced_during_the_load(two_saves, tmp_path, monkeypatch):
    """End to end: a shard of the other save copied in after the headers were read (here: once the weights are in)."""
    import hfquant.integration.checks as checks

    a, b = two_saves
    folder = tmp_path / "racing"
    shutil.copytree(a, folder)
    odd = _shards(b)[-1].name
    value_check = checks.stored_value_problems

    def replace_a_shard_then_check(model):
        shutil.copyfile(b / odd, folder / odd)
        return value_check(model)

    monkeypatch.setattr(checks, "stored_value_problems", replace_a_shard_then_check)
    with pytest.raises(ValueError, match=rf"changed while loading \({odd} belongs to another save now.*retry"):
        _load(folder)
    monkeypatch.setattr(checks, "stored_value_problems", value_check)
    shutil.copytree(a, tmp_path / "calm")
    _load(tmp_path / "calm")  # no replacement: loads


# -- push: a Hub that never answers, or answers something else than JSON ------------------------------------------


class _RawServer:
    """A local TCP endpoint that either accepts and never answers ("hang") or answers every request with an HTML page
    ("html"). Stops by itself after `lifetime` seconds."""

    def __init__(self, mode: str, lifetime: float = 60.0):
        self.mode, self.lifetime = mode, lifetime
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        self.stop = threading.Event()

    def _serve(self) -> None:
        end = time.monotonic() + self.lifetime
        while not self.stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.mode == "hang":
                self.held.append(conn)
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    body = b"<html><body>Sign in to the network</body></html>"
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n"
                        b"Connection: close\r\n\r\n%s" % (len(body), body)
                    )
                except OSError:
                    pass

    def __enter__(self) -> _RawServer:
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        for conn in self.held:
            conn.close()
        self.sock.close()


@pytest.fixture(scope="module")
def small_folder(two_saves):
    return two_saves[0]


def test_push_to_a_hub_that_never_answers_times_out_and_says_how_to_wait_longer(small_folder):
    with _RawServer("hang") as server:
        start = time.monotonic()
        with pytest.raises(HubError, match=r"did not answer within 1 s.*--timeout SECONDS.*HFQUANT_HUB_TIMEOUT"):
            push_folder(small_folder, "me/x", endpoint=server.url, token="hf_test", timeout=1)
        assert time.monotonic() - start < 30


def test_push_of_an_answer_that_is_not_json_is_a_clear_error(small_folder):
    with _RawServer("html") as server:
        with pytest.raises(HubError, match=r"answered something that is not JSON.*HF_ENDPOINT"):
            push_folder(small_folder, "me/x", endpoint=server.url, token="hf_test", timeout=5)


@pytest.mark.parametrize("mode,words", [("hang", "did not answer within 1 s"), ("html", "not JSON")])
def test_cli_push_to_a_silent_or_html_endpoint_is_one_line_exit_1(small_folder, mode, words):
    import os

    with _RawServer(mode) as server:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1"}
        command = [sys.executable, "-m", "hfquant.commands.cli", "push", str(small_folder), "me/x", "--timeout", "1"]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("hfquant: error:")]
    assert len(lines) == 1 and words in lines[0], result.stderr[-2000:]


def test_hub_timeout_from_the_argument_the_environment_or_the_default(monkeypatch):
    monkeypatch.delenv("HFQUANT_HUB_TIMEOUT", raising=False)
    assert hub_timeout() == 60.0 and hub_timeout(5) == 5.0
    monkeypatch.setenv("HFQUANT_HUB_TIMEOUT", "2.5")
    assert hub_timeout() == 2.5
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("HFQUANT_HUB_TIMEOUT", bad)
        with pytest.raises(ValueError, match=rf"HFQUANT_HUB_TIMEOUT={bad!r} is not a number of seconds > 0"):
            hub_timeout()


# -- malformed SRC files and out of memory in the command -----------------------------------------------------------


def _edit_config(folder: Path, change) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def _with(key, value):
    def change(config):
        config[key] = value
        return config

    return change


SRC_DAMAGES = {
    "config a list": (lambda f: _edit_config(f, lambda c: [c]), r"config.json must hold a JSON object, not a list"),
    "config truncated": (
        lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:40]),
        r"config.json is not valid JSON",
    ),
    "dtype float17": (
        lambda f: _edit_config(f, _with("dtype", "float17")),
        r"config.json: dtype='float17' is not a float torch dtype",
    ),
    "dtype a number": (
        lambda f: _edit_config(f, _with("dtype", 16)),
        r"config.json: dtype=16 is not a float torch dtype",
    ),
    "architectures a string": (
        lambda f: _edit_config(f, _with("architectures", "LlamaForCausalLM")),
        r"config.json: architectures='LlamaForCausalLM' is not a list of class names",
    ),
    "unknown model_type": (
        lambda f: _edit_config(f, _with("model_type", "llama9")),
        r"config.json: model_type='llama9' is not a model type transformers \S+ knows; upgrade",
    ),
    "index a list": (
        lambda f: (f / "model.safetensors.index.json").write_text("[]"),
        r"model.safetensors.index.json must be an object .* found list",
    ),
    "index without weight_map": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        r"model.safetensors.index.json must be an object .* found \['metadata'\]",
    ),
    "index truncated": (
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": {'),
        r"model.safetensors.index.json is not valid JSON",
    ),
}


@pytest.fixture(scope="module")
def sharded_source(tmp_path_factory):
    from helpers import tiny_model

    folder = tmp_path_factory.mktemp("sharded-src")
    tiny_model("llama", dtype=torch.float32).save_pretrained(folder, max_shard_size="40KB")
    return folder


@pytest.mark.parametrize("damage", sorted(SRC_DAMAGES))
def test_malformed_source_files_are_one_line_naming_the_file(sharded_source, tmp_path, capsys, damage):
    from hfquant.commands.cli import main

    make, message = SRC_DAMAGES[damage]
    src = tmp_path / "src"
    shutil.copytree(sharded_source, src)
    make(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(src), str(tmp_path / "dst"), "--bits", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("hfquant: error: ") and str(src) in lines[-1], err
    assert __import__("re").search(message, lines[-1]), lines[-1]
    assert "Traceback" not in err and not (tmp_path / "dst").exists()
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    if damage != "unknown model_type" and not damage.startswith("architectures"):  # inspect reads no class
        with pytest.raises(SystemExit) as exit_info:
            main(["inspect", str(src)])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err and str(src) in err, err


@pytest.mark.parametrize("damage", ["config a list", "dtype float17", "unknown model_type"])
def test_convert_from_python_refuses_a_malformed_config_in_one_value_error(sharded_source, tmp_path, damage):
    """The same check as the CLI's, in `convert` itself (a list config.json was an AttributeError from Python)."""
    from hfquant.conversion.convert import convert

    src = tmp_path / "src"
    shutil.copytree(sharded_source, src)
    SRC_DAMAGES[damage][0](src)
    with pytest.raises(ValueError, match=SRC_DAMAGES[damage][1]):
        convert(src, tmp_path / "dst", HfQuantConfig(bits=8), progress=False)
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("damage", ["config a list", "dtype float17", "unknown model_type"])
def test_verify_lists_a_malformed_config_as_a_problem(two_saves, tmp_path, damage):
    folder = tmp_path / "q"
    shutil.copytree(two_saves[0], folder)
    SRC_DAMAGES[damage][0](folder)
    problems = verify(folder).problems
    assert any(__import__("re").search(SRC_DAMAGES[damage][1], p) for p in problems), problems


def test_out_of_memory_while_quantizing_is_one_line_and_leaves_nothing(sharded_source, tmp_path, capsys, monkeypatch):
    import hfquant.integration.quantize_weights as quantize_weights
    from hfquant.commands.cli import main

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(quantize_weights, "quantize_to_buffers", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", str(sharded_source), str(tmp_path / "dst"), "--bits", "8", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1, err
    assert "hfquant: error: out of memory" in err and "--max-shard-size" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_out_of_memory_while_quantizing_on_load_is_a_memory_error_naming_the_tensor(sharded_source, monkeypatch):
    """transformers turns any error in a conversion into a generic RuntimeError with a traceback text: hfquant keeps
    the MemoryError and says what to do."""
    from transformers import AutoModelForCausalLM

    import hfquant.integration.quantize_weights as quantize_weights

    def out_of_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(quantize_weights, "quantize_to_buffers", out_of_memory)
    with pytest.raises(
        MemoryError, match=r"out of memory while quantizing model\.layers\.\d+\..*weight .*hfquant convert"
    ):
        AutoModelForCausalLM.from_pretrained(
            sharded_source, quantization_config=HfQuantConfig(bits=8), device_map="cpu"
        )


# -- an hfquant checkpoint loaded without hfquant -------------------------------------------------------------------

_PLAIN_LOAD = """
import sys
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
except Exception as error:
    print("ERROR", type(error).__name__, error)
else:
    print("LOADED")
assert "hfquant" not in sys.modules
"""


@pytest.fixture(scope="module")
def saves_of_every_kind(float_checkpoint, tmp_path_factory):
    """{name: folder} of hfquant checkpoints written each way hfquant writes one: convert, save_pretrained of a model
    quantized on load, save_pretrained over an existing folder (the staged save), and save_pretrained of a reloaded
    model; at 8 and 4 bits."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("kinds")
    src = float_checkpoint("llama")
    folders = {}
    for bits in (8, 4):
        folders[f"convert-{bits}"] = root / f"convert-{bits}"
        convert(src, folders[f"convert-{bits}"], HfQuantConfig(bits=bits, group_size=32), progress=False)
        model = AutoModelForCausalLM.from_pretrained(src, quantization_config=HfQuantConfig(bits=bits, group_size=32))
        folders[f"on-load-{bits}"] = root / f"on-load-{bits}"
        model.save_pretrained(folders[f"on-load-{bits}"])
        folders[f"over-existing-{bits}"] = root / f"over-existing-{bits}"
        shutil.copytree(src, folders[f"over-existing-{bits}"])
        model.save_pretrained(folders[f"over-existing-{bits}"])
        folders[f"reloaded-{bits}"] = root / f"reloaded-{bits}"
        AutoModelForCausalLM.from_pretrained(folders[f"convert-{bits}"]).save_pretrained(folders[f"reloaded-{bits}"])
    return folders


@pytest.mark.parametrize(
    "kind",
    [
        "convert-8",
        "on-load-8",
        "over-existing-8",
        "reloaded-8",
        "convert-4",
        "on-load-4",
        "over-existing-4",
        "reloaded-4",
    ],
)
def test_plain_transformers_refuses_an_hfquant_checkpoint_naming_hfquant(saves_of_every_kind, kind):
    """Without hfquant, AutoModelForCausalLM raises naming hfquant (config.json's model_type is "hfquant"), where
    transformers alone loaded the int8 codes as float weights with a warning. Fails if any way of saving leaves the
    model's own model_type in config.json."""
    result = subprocess.run(
        [sys.executable, "-c", _PLAIN_LOAD, str(saves_of_every_kind[kind])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ERROR ValueError") and "model type `hfquant`" in result.stdout, result.stdout


@pytest.mark.parametrize("kind", ["convert-8", "on-load-4", "reloaded-4"])
def test_marked_config_reloads_with_hfquant_as_the_base_config(saves_of_every_kind, kind):
    """With hfquant, the marked config.json parses to the base config class (LlamaConfig, model_type "llama"), through
    AutoConfig and through the model class itself, and the checkpoint's hfquant readers see the base type."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from hfquant.checkpoint.files import read_config
    from hfquant.checkpoint.model_type import BASE_MODEL_TYPE_KEY

    folder = saves_of_every_kind[kind]
    on_disk = json.loads((folder / "config.json").read_text())
    assert on_disk["model_type"] == "hfquant" and on_disk[BASE_MODEL_TYPE_KEY] == "llama"
    assert type(AutoConfig.from_pretrained(folder)) is LlamaConfig
    assert read_config(folder)["model_type"] == "llama" and BASE_MODEL_TYPE_KEY not in read_config(folder)
    tokens = torch.tensor([[1, 5, 9, 2]])
    by_auto, by_class = AutoModelForCausalLM.from_pretrained(folder), LlamaForCausalLM.from_pretrained(folder)
    for model in (by_auto, by_class):
        assert model.config.model_type == "llama" and BASE_MODEL_TYPE_KEY not in model.config.to_dict()
    assert torch.equal(by_auto(tokens).logits, by_class(tokens).logits)


def test_unmark_refuses_a_marked_config_without_its_base_type():
    from hfquant.checkpoint.model_type import mark, unmark

    quantized = {"model_type": "llama", "quantization_config": {"quant_method": "hfquant"}, "hidden_size": 8}
    assert unmark(mark(quantized)) == quantized
    assert mark({"model_type": "llama", "hidden_size": 8}) == {"model_type": "llama", "hidden_size": 8}  # float: kept
    with pytest.raises(ValueError, match=r"x/config.json: model_type is 'hfquant' but hfquant_base_model_type=None"):
        unmark({"model_type": "hfquant", "quantization_config": {"quant_method": "hfquant"}}, "x/config.json")
