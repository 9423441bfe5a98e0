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
from hfquant.commands import export
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
    budget = config_from_args(convert.parse_args(["a", "b", "--bits", "3.5"]))  # the README's bits=3.5
    assert budget == HfQuantConfig(bits=3.5) and budget.format == "hq3_r" and budget.bits == 3


@pytest.mark.parametrize(
    "argv,code,message",
    [
        (["convert", "s", "d", "--bits", "7"], 2, "--bits '7' is not supported; use one of 8, 6, 5, 4, 3, 2, 3.5"),
        (["convert", "s", "d", "--bits", "3.7"], 2, "--bits '3.7' is not supported"),
        (["convert", "s", "d", "--group-size", "100"], 2, "group_size=100 is not allowed"),
        (["convert", "s", "d", "--group-size", "big"], 2, "--group-size 'big' is not an integer"),
        (["convert", "s", "d", "--method", "awq"], 2, "method='awq' is not allowed"),
        (["convert", "s", "d", "--module-overrides", "{v_proj"], 2, "--module-overrides '{v_proj' is not JSON"),
        (
            ["convert", "s", "d", "--module-overrides", '{"v_proj": {"bits": 7}}'],
            2,
            "module_overrides['v_proj']: bits=7",
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


def test_a_missing_optional_package_is_one_line_exit_1(capsys, monkeypatch, tmp_path):
    import hfquant.commands.cli
    from hfquant.core.optional import GGUF

    def needs_gguf(args):
        raise GGUF.missing()

    monkeypatch.setitem(hfquant.commands.cli._COMMANDS, "export", needs_gguf)
    with pytest.raises(SystemExit) as exit:
        main(["export", str(tmp_path), str(tmp_path / "model.gguf")])
    err = capsys.readouterr().err
    assert exit.value.code == 1 and err.count("\n") == 1 and "pip install 'hfquant[gguf]'" in err, err


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
    assert result.stdout.startswith("wrote int4: 15 tensors quantized")
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


def _eval_argv(path: Path, *extra: str) -> list[str]:
    """`hfquant eval` of `path` with tiny windows and speed runs, results printed as JSON, nothing saved."""
    small = ["--max-length", "32", "--new-tokens", "3", "--repeats", "1", "--no-save", "--json"]
    return ["eval", str(path), *small, *extra]


def test_eval_scores_a_stated_slice_by_default_and_the_whole_text_on_request(llama_with_tokenizer, capsys):
    """The default text is the first DEFAULT_REFERENCE_CHARS characters of the pydoc topics, as the help and the
    output say; --full-text scores all of it, --max-chars N the first N (--max-tokens then cuts the tokens)."""
    from hfquant.commands.eval_ import DEFAULT_MAX_CHARS
    from hfquant.evaluation import DEFAULT_REFERENCE_CHARS, _reference_corpus

    assert DEFAULT_MAX_CHARS == DEFAULT_REFERENCE_CHARS  # the parser's copy, kept free of torch
    corpus = len(_reference_corpus())
    assert f"first {DEFAULT_MAX_CHARS} characters" in _subparsers(build_parser())["eval"].format_help()

    runs = {}
    for name, extra in {
        "default": ["--max-tokens", "64"],
        "full": ["--full-text", "--max-tokens", "64"],
        "sliced": ["--max-chars", "100"],
    }.items():
        assert main(_eval_argv(llama_with_tokenizer, "--no-progress", *extra)) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    assert runs["default"]["characters"] == DEFAULT_REFERENCE_CHARS
    assert f"first {DEFAULT_REFERENCE_CHARS} of {corpus} characters" in runs["default"]["text"]
    assert runs["full"]["characters"] == corpus and f"all {corpus} characters" in runs["full"]["text"]
    # the byte-level tokenizer: one token per byte of ASCII text
    assert (runs["sliced"]["characters"], runs["sliced"]["tokens"]) == (100, 100)
    assert runs["default"]["tokens"] == runs["full"]["tokens"] == 64
    with pytest.raises(SystemExit):
        main(_eval_argv(llama_with_tokenizer, "--full-text", "--max-chars", "100"))
    assert "not allowed with argument" in capsys.readouterr().err


def test_eval_progress_bars_on_stderr_and_none_with_no_progress(llama_with_tokenizer, capsys):
    """A bar per perplexity window and per generated token, on stderr (stdout keeps the JSON); --no-progress: none."""
    argv = _eval_argv(llama_with_tokenizer, "--max-chars", "200")
    assert main(argv) == 0
    shown = capsys.readouterr()
    json.loads(shown.out)
    assert "perplexity, this model" in shown.err and "/7 [" in shown.err  # 200 tokens in windows of 32 (tqdm may
    # not redraw 7/7 before a fast bar closes: the total is what it always shows)
    assert "decode speed, this model" in shown.err
    assert main([*argv, "--no-progress"]) == 0
    quiet = capsys.readouterr()
    assert json.loads(quiet.out)["results"][0]["perplexity"] == json.loads(shown.out)["results"][0]["perplexity"]
    assert "perplexity" not in quiet.err and "decode speed" not in quiet.err and "%|" not in quiet.err


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
    assert out.startswith("wrote SmolLM2-int4: 211 tensors quantized")
    report = user("inspect", "SmolLM2-int4")
    # the 4-bit default's data-free mixed precision: down projections (K=1536) at group 64 instead of the asked 128,
    # the value projections of layers 15-29 in int8 (per-channel: one group of K); SINQ's column scales folded into
    # the norms and projections, so every layer is stored as plain RTN codes ("sinq (folded)") with its complete
    # stored format in module_overrides (K=576 at group 64), which the config line summarizes
    rows = {tuple(line.split()[:4]): line.split()[4:7] for line in report.splitlines() if line.startswith("model.")}
    assert rows[("model.layers.*.mlp.down_proj", "30", "4", "64")][:3] == ["no", "sinq", "(folded)"]
    assert rows[("model.layers.*.self_attn.v_proj", "15", "8", "per-channel")][:3] == ["yes", "sinq", "(folded)"]
    assert ("model.layers.*.self_attn.q_proj", "30", "4", "64") in rows  # K=576: the largest power of two dividing it
    assert "fold_column_scales=True" in report and "method=sinq" in report
    assert (
        'module_overrides={210 layers: {"bits": 4, "group_size": 64, "method": "rtn", "symmetric": false}, '
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


# -- answering without the library: --help, --version and argument errors -------------------------------------------

ROOT = Path(__file__).resolve().parents[2]

_HEAVY = ("torch", "transformers", "safetensors", "huggingface_hub")
"""What the parser must not import: torch and transformers take seconds (the whole cost of a slow --help)."""


def entry(*args: str) -> subprocess.CompletedProcess:
    """The console script's entry (`hfquant_cli.main`, as pyproject.toml's [project.scripts] runs it), in a process of
    its own, printing on exit which of `_HEAVY` were imported."""
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print('imported:', *[m for m in {_HEAVY!r} if m in sys.modules], file=sys.stderr))\n"
        "import hfquant_cli\n"
        f"sys.exit(hfquant_cli.main({list(args)!r}))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _imported(result: subprocess.CompletedProcess) -> list[str]:
    return result.stderr.rsplit("imported:", 1)[1].split()


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        [],
        ["conver", "a", "b"],
        ["inspect", "--help"],
        ["inspect", "x", "--jsn"],
        ["verify", "--help"],
        ["eval", "x", "--max-tokenz", "3"],
        ["push", "--help"],
        ["export", "a", "b"],
        ["import", "a"],
    ],
)
def test_help_version_and_argument_errors_import_neither_torch_nor_transformers(argv):
    """The property behind `hfquant --help` answering at once (times in docs/performance.md, "The command line's
    answers"): until a command runs, nothing heavier than the standard library is imported, not even the package
    root (which registers with transformers)."""
    result = entry(*argv)
    assert result.returncode in (0, 2), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert _imported(result) == []


def test_convert_help_imports_the_config_only():
    """`convert`'s options are the config's FIELDS, so its parser imports hfquant.config (and transformers with it);
    the other subcommands' parsers, the library and the package root are still not imported."""
    code = (
        "import sys, hfquant_cli\n"
        "try:\n    hfquant_cli.main(['convert', 'a', 'b', '--bitz', '4'])\n"
        "except SystemExit:\n"
        "    print(*sorted(m for m in sys.modules if m.startswith('hfquant.') and not m.startswith("
        "('hfquant.commands', 'hfquant.core', 'hfquant.version'))))\n"
        "    print(hasattr(sys.modules['hfquant'], 'HfQuantConfig'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.stdout.split() == ["hfquant.config", "False"], result.stderr[-2000:]


def test_version():
    from hfquant.version import __version__

    result = entry("--version")
    assert result.returncode == 0 and result.stdout == f"hfquant {__version__}\n"
    assert run("--version").stdout == f"hfquant {__version__}\n"


def test_a_command_run_through_the_entry_has_the_whole_package(tmp_path):
    """After parsing, the entry runs the package root: the command sees `import hfquant`'s registration."""
    code = (
        "import sys, hfquant_cli\n"
        "import hfquant.commands.cli as cli\n"
        "def probe(args):\n"
        "    import hfquant\n"
        "    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING\n"
        "    print(AUTO_QUANTIZER_MAPPING['hfquant'] is hfquant.HfQuantQuantizer, hfquant.__version__)\n"
        "    return 0\n"
        "cli._COMMANDS['inspect'] = probe\n"
        f"sys.exit(hfquant_cli.main(['inspect', {str(tmp_path)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[0] == "True"


@pytest.mark.parametrize(
    "argv,usage,message",
    [
        (
            ["convert", "a", "b", "--bitz", "4"],
            "usage: hfquant convert",
            "unrecognized arguments: --bitz 4; did you mean --bits?",
        ),
        (["inspect", "x", "--jsn"], "usage: hfquant inspect", "unrecognized arguments: --jsn; did you mean --json?"),
        (["export", "a", "b.gguf", "--overwirte"], "usage: hfquant export", "did you mean --overwrite?"),
        (["verify", "x", "--nonsense-option"], "usage: hfquant verify", "unrecognized arguments: --nonsense-option\n"),
        (
            ["conver", "a", "b"],
            "usage: hfquant [-h]",
            "invalid choice: 'conver' (choose from convert, inspect, verify, eval, push, export, import); did you mean convert?",
        ),
    ],
)
def test_an_argument_error_shows_its_subcommands_usage_and_the_close_option(argv, usage, message):
    for result in (entry(*argv), run(*argv)):
        assert result.returncode == 2
        assert result.stderr.startswith(usage), result.stderr
        assert message in result.stderr


def test_every_command_takes_the_common_options():
    """--no-progress and -v/--verbose on every subcommand (before or after it for -v), defined once."""
    parser = build_parser()
    positionals = {"push": ["p", "o/r"], "export": ["s", "d.gguf"], "import": ["s", "d"], "convert": ["s", "d"]}
    for name in _subparsers(parser):
        argv = [name, *positionals.get(name, ["p"])]
        assert parser.parse_args(argv).progress is True and parser.parse_args(argv).verbose is False
        args = parser.parse_args([*argv, "--no-progress", "-v"])
        assert args.progress is False and args.verbose is True, name
        assert parser.parse_args(["-v", *argv]).verbose is True
    for name in ("convert", "export", "import"):
        assert parser.parse_args([name, "s", "d.gguf", "--overwrite"]).overwrite is True


def test_no_progress_reaches_import_and_export(tmp_path):
    """The commands that refused --no-progress take it and run (to the library's own error on a missing SRC)."""
    for command in ("import", "export"):
        result = run(command, str(tmp_path / "missing"), str(tmp_path / "out.gguf"), "--no-progress")
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith("hfquant: error:") and "missing" in result.stderr


def test_export_format_from_a_gguf_destination():
    from hfquant.commands.cli import parse_args
    from hfquant.conversion.export import FORMATS

    assert export.FORMATS == FORMATS  # the parser's choices are the exporter's
    from hfquant.checkpoint.compressed_tensors import ENGINES

    assert export.ENGINES == ENGINES
    assert parse_args(["export", "s", "d", "--format", "compressed-tensors"]).engine == "vllm"
    assert parse_args(["export", "s", "d", "--format", "compressed-tensors", "--engine", "transformers"]).engine == (
        "transformers"
    )
    assert parse_args(["export", "s", "model.gguf"]).format == "gguf"
    assert parse_args(["export", "s", "Model.GGUF"]).format == "gguf"
    assert parse_args(["export", "s", "d", "--format", "compressed-tensors"]).format == "compressed-tensors"
    assert parse_args(["export", "s", "d.gguf", "--format", "compressed-tensors"]).format == "compressed-tensors"
    result = run("export", "s", "d")
    assert result.returncode == 2 and result.stderr.startswith("usage: hfquant export")
    assert "--format is required unless DST ends in .gguf ('d' does not); choose one of compressed-tensors, gguf" in (
        result.stderr
    )


def test_push_timeout_help_names_the_hubs_defaults():
    """push's help spells the timeout's variable and default so that its parser does not import the Hub client."""
    from hfquant.publishing.hub import DEFAULT_HUB_TIMEOUT, HUB_TIMEOUT_ENV

    push = _subparsers(build_parser())["push"]
    (timeout,) = [action for action in push._actions if "--timeout" in action.option_strings]
    assert f"${HUB_TIMEOUT_ENV} or {DEFAULT_HUB_TIMEOUT:g})" in timeout.help


def test_help_names_the_default_method():
    words = " ".join(entry("--help").stdout.split())  # argparse wraps lines to the terminal's width
    assert "round-to-nearest quantization" not in words
    assert "(SINQ at 4 bits, round-to-nearest at 8, by default)" in words
