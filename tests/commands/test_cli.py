"""The `hfquant` command: every option documented, convert / inspect / eval as a user runs them, clear errors."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer

from hfquant import HfQuantConfig
from hfquant.commands.cli import build_parser, main
from hfquant.commands.options import config_from_args


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hfquant.commands.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


@pytest.fixture(scope="module")
def llama_with_tokenizer(float_checkpoint, tmp_path_factory):
    """A float tiny Llama whose 257-token vocabulary matches the byte-level test tokenizer."""
    path = float_checkpoint("llama", torch.bfloat16, vocab_size=257)
    tiny_tokenizer().save_pretrained(path)
    return path


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help():
    parser = build_parser()
    commands = _subparsers(parser)
    assert sorted(commands) == [
        "convert",
        "eval",
        "export",
        "import",
        "inspect",
        "push",
        "verify",
    ]  # the benchmark is scripts/benchmark.py
    for name, sub in commands.items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 15, f"{name} {action.option_strings or action.dest}"


def test_convert_options_cover_every_config_field():
    """One option per HfQuantConfig field, so the command follows the config as it grows."""
    import inspect

    convert = _subparsers(build_parser())["convert"]
    dests = {action.dest for action in convert._actions}
    fields = set(inspect.signature(HfQuantConfig.__init__).parameters) - {
        "self",
        "unknown",
        "quant_method",
        "format_version",
    }
    assert fields <= dests


def test_config_from_args_defaults_and_values():
    convert = _subparsers(build_parser())["convert"]
    assert config_from_args(convert.parse_args(["a", "b"])) == HfQuantConfig(bits=4)
    args = convert.parse_args(
        [
            "a",
            "b",
            "--bits",
            "8",
            "--group-size",
            "64",
            "--asymmetric",
            "--modules-to-not-convert",
            "lm_head",
            "model.layers.*.mlp.down_proj",
        ]
    )
    assert config_from_args(args) == HfQuantConfig(
        bits=8, group_size=64, symmetric=False, modules_to_not_convert=["lm_head", "model.layers.*.mlp.down_proj"]
    )
    assert config_from_args(convert.parse_args(["a", "b", "--group-size", "none"])).group_size is None
    assert convert.parse_args(["a", "b", "--max-shard-size", "50000000"]).max_shard_size == 50_000_000  # bytes
    assert convert.parse_args(["a", "b", "--max-shard-size", "50MB"]).max_shard_size == "50MB"
    args = convert.parse_args(["a", "b", "--method", "sinq", "--module-overrides", '{"v_proj": {"bits": 8}}'])
    assert config_from_args(args) == HfQuantConfig(bits=4, method="sinq", module_overrides={"v_proj": {"bits": 8}})


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["convert", "s", "d", "--bits", "3"], 2, "invalid choice: 3"),
        (["convert", "s", "d", "--group-size", "100"], 2, "group_size=100 is not allowed"),
        (["convert", "s", "d", "--group-size", "big"], 2, "--group-size 'big' is not an integer"),
        (["convert", "s", "d", "--method", "awq"], 2, "method='awq' is not allowed"),
        (["convert", "s", "d", "--module-overrides", "{v_proj"], 2, "--module-overrides '{v_proj' is not JSON"),
        (
            ["convert", "s", "d", "--module-overrides", '{"v_proj": {"bits": 3}}'],
            2,
            "module_overrides['v_proj']: bits=3",
        ),
        (["convert", "/nonexistent/model", "d"], 1, "not a folder"),
        (["inspect", "/nonexistent/model"], 1, "no config.json"),
    ],
)
def test_errors_are_one_line_with_the_fix(argv, code, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("made_into", [ValueError, OSError, RuntimeError])
def test_ctrl_c_that_a_c_extension_turned_into_another_error_exits_130(made_into, capsys, monkeypatch, tmp_path):
    """torch and safetensors sometimes catch the KeyboardInterrupt raised inside their C code and raise their own
    error instead (seen: "ValueError: could not determine the shape of object type 'torch.storage.UntypedStorage'");
    the command still reports an interruption, exit status 130, not a bad-input error."""
    import hfquant.commands.cli

    def interrupted_inside_c_code(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**6):
                pass
        except KeyboardInterrupt:
            raise made_into("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setitem(hfquant.commands.cli._COMMANDS, "inspect", interrupted_inside_c_code)
    with pytest.raises(SystemExit) as exit:
        main(["inspect", str(tmp_path)])
    assert exit.value.code == 130
    assert capsys.readouterr().err.startswith("hfquant: interrupted")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_without_ctrl_c_keeps_its_exit_status(capsys, monkeypatch, tmp_path):
    import hfquant.commands.cli

    def bad(args):
        raise ValueError("bits=3 is not allowed")

    monkeypatch.setitem(hfquant.commands.cli._COMMANDS, "inspect", bad)
    with pytest.raises(SystemExit) as exit:
        main(["inspect", str(tmp_path)])
    assert exit.value.code == 2 and capsys.readouterr().err == "hfquant: error: bits=3 is not allowed\n"


def test_convert_as_a_user_then_refuse_to_overwrite(llama_with_tokenizer, tmp_path, capsys):
    result = run(
        "convert",
        str(llama_with_tokenizer),
        "int4",
        "--bits",
        "4",
        "--group-size",
        "32",
        "--max-shard-size",
        "60KB",
        "--base-model",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--no-progress",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("wrote int4: 14 tensors quantized")
    out = tmp_path / "int4"
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in (out / "README.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]

    with pytest.raises(SystemExit) as refused:
        main(["convert", str(llama_with_tokenizer), str(out), "--no-progress"])
    assert refused.value.code == 1
    assert "int4 exists; pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(llama_with_tokenizer), str(out), "--bits", "8", "--overwrite", "--no-progress"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4"]


def test_eval_records_results_in_the_card(llama_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["convert", str(llama_with_tokenizer), str(out), "--bits", "8", "--no-progress"]) == 0
    capsys.readouterr()
    argv = [
        "eval",
        str(out),
        "--baseline",
        str(llama_with_tokenizer),
        "--max-tokens",
        "96",
        "--max-length",
        "32",
        "--new-tokens",
        "4",
        "--repeats",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((out / "hfquant_eval.json").read_text())
    assert printed == saved
    assert [row["label"] for row in saved["results"]] == [
        "this model (hfquant int8)",
        f"{llama_with_tokenizer.name} (bfloat16)",
    ]
    assert saved["tokens"] == 96
    for row in saved["results"]:
        assert row["perplexity"] > 1 and row["tokens_per_second"] > 0
    # a random model: about the vocabulary size, and int8 within 1% of the float model's perplexity
    quantized, baseline = (row["perplexity"] for row in saved["results"])
    assert abs(quantized / baseline - 1) < 0.01
    card = (out / "README.md").read_text()
    assert f"| this model (hfquant int8) | {quantized:.3f} |" in card
    # nothing machine-specific in a file meant for the Hub: folder names, not absolute paths
    assert [row["path"] for row in saved["results"]] == [out.name, llama_with_tokenizer.name]
    assert str(tmp_path) not in (out / "hfquant_eval.json").read_text()


def test_eval_never_writes_through_a_link_that_leaves_the_folder(llama_with_tokenizer, tmp_path, caplog):
    out = tmp_path / "int8"
    assert main(["convert", str(llama_with_tokenizer), str(out), "--bits", "8", "--no-progress"]) == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("hfquant_eval.json", "README.md"):
        (outside / name).write_text("precious\n")
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(outside / name)
    argv = ["eval", str(out), "--max-tokens", "64", "--max-length", "32", "--new-tokens", "2", "--repeats", "1"]
    assert main(argv) == 0
    assert [(outside / name).read_text() for name in ("hfquant_eval.json", "README.md")] == ["precious\n"] * 2
    assert "not writing hfquant_eval.json" in caplog.text and "not writing README.md" in caplog.text


@pytest.mark.slow
def test_smollm2_as_a_user_types_it(tmp_path, monkeypatch):
    """convert, inspect, eval and push on the real SmolLM2, each through the installed command."""
    import os

    from hub_server import HubServer

    from benchmarks.example_model import build_example_model

    src = build_example_model()
    hfquant = [sys.executable, "-m", "hfquant.commands.cli"]

    def user(*args: str, env=None) -> str:
        result = subprocess.run([*hfquant, *args], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    out = user(
        "convert",
        str(src),
        "SmolLM2-int4",
        "--bits",
        "4",
        "--group-size",
        "128",
        "--base-model",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "--no-progress",
    )
    assert out.startswith("wrote SmolLM2-int4: 210 tensors quantized")
    report = user("inspect", "SmolLM2-int4")
    # the 4-bit default's data-free mixed precision: down projections (K=1536) at group 64 instead of the asked 128,
    # the value projections of layers 15-29 in int8 (per-channel: group = K); SINQ's column scales folded into the
    # norms and projections, so every layer is stored as plain RTN with its complete format in module_overrides,
    # which the config line summarizes
    assert "model.layers.*.mlp.down_proj        30     4     64  no         rtn" in report
    assert "model.layers.*.self_attn.v_proj     15     8    576  yes        rtn" in report
    assert (
        "model.layers.*.self_attn.q_proj     30     4     64" in report
    )  # K=576: the largest power of two dividing it
    assert "fold_column_scales=True" in report and "method=sinq" in report
    assert (
        'module_overrides={210 layers: {"bits": 4, "group_size": 128, "method": "rtn", "symmetric": false}, '
        '{"bits": 4, "group_size": 64, "method": "rtn", "symmetric": false}, '
        '{"bits": 8, "group_size": null, "method": "rtn", "symmetric": true}; per layer in the table below}'
    ) in report
    assert "lm_head: tied to model.embed_tokens.weight" in report
    measured = user(
        "eval", "SmolLM2-int4", "--max-tokens", "128", "--max-length", "64", "--new-tokens", "3", "--repeats", "1"
    )  # the --baseline path is tested on the tiny model
    assert "this model (hfquant int4)" in measured
    card = (tmp_path / "SmolLM2-int4" / "README.md").read_text()
    assert "| this model (hfquant int4) |" in card and "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    with HubServer(lifetime=300, max_body=512 * 2**20) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test_token", "HF_HUB_DISABLE_XET": "1"}
        user("push", "SmolLM2-int4", "me/SmolLM2-135M-Instruct-hfquant-int4", "--private", env=env)
        remote = hub.state.files("me/SmolLM2-135M-Instruct-hfquant-int4")
    local = tmp_path / "SmolLM2-int4"
    assert sorted(remote) == sorted(p.name for p in local.iterdir())
    assert remote["model.safetensors"] == (local / "model.safetensors").read_bytes()


def test_the_library_functions_users_call_are_at_the_top_level():
    """The command line runs the library: its functions are importable from `hfquant` and from the modules named for
    them, never from `hfquant.commands`."""
    import hfquant
    from hfquant.conversion.convert import convert
    from hfquant.conversion.export import export_checkpoint
    from hfquant.conversion.importing import import_checkpoint
    from hfquant.evaluation import evaluate

    assert (hfquant.convert, hfquant.export_checkpoint, hfquant.import_checkpoint, hfquant.evaluate) == (
        convert,
        export_checkpoint,
        import_checkpoint,
        evaluate,
    )
    assert {"convert", "export_checkpoint", "import_checkpoint", "evaluate"} <= set(hfquant.__all__)
