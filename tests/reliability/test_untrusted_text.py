"""Text from a checkpoint never acts where hfquant shows it, and its patterns never hang hfquant (docs/reliability.md,
issue #28 item 4).

A tensor name, a config string or a folder name can hold ESC sequences (retitle the window, clear the screen, move
the cursor over earlier lines), C1 controls and bidirectional overrides; `verify` and `inspect` used to print them
raw. Every line hfquant prints or logs on the command line goes through `hfquant.core.text.terminal_safe`, and the
model card escapes Markdown and HTML too. A compressed-tensors config's "re:" patterns are checked before any
matching: nested or alternating repeats and backreferences (catastrophic backtracking) are refused naming the
pattern.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOKENIZER_VOCAB, tiny_model, tiny_tokenizer
from safetensors.torch import load_file, save_file

from hfquant import HfQuantConfig
from hfquant.checkpoint.compressed_tensors_import import matches_target, target_regex
from hfquant.conversion.convert import convert
from hfquant.conversion.export import export_checkpoint
from hfquant.conversion.importing import import_checkpoint
from hfquant.core.text import terminal_safe
from hfquant.publishing.cards import build_card, markdown_code, markdown_text

HOSTILE = "evil\x1b]0;pwned\x07\x1b[2J\x9b1A\u202egnp.exe\r\n"
"""Retitle the window (OSC), clear the screen (CSI), move up (C1 CSI), a right-to-left override, CR and LF."""
RAW = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


@pytest.fixture(scope="module")
def origins(tmp_path_factory) -> dict[str, Path]:
    """A float tiny Llama with its tokenizer, its hfquant int8 convert, and that exported to compressed-tensors."""
    root = tmp_path_factory.mktemp("origins")
    float_folder = root / "float"
    tiny_model("llama", dtype=torch.bfloat16, **TOKENIZER_VOCAB).save_pretrained(float_folder)
    tiny_tokenizer().save_pretrained(float_folder)
    convert(float_folder, root / "hfquant", HfQuantConfig(bits=8, method="rtn"), progress=False)
    export_checkpoint(root / "hfquant", root / "ct")
    return {"float": float_folder, "hfquant": root / "hfquant", "ct": root / "ct"}


def test_terminal_safe_shows_every_control_as_an_escape():
    shown = terminal_safe(HOSTILE)
    assert shown == "evil\\x1b]0;pwned\\x07\\x1b[2J\\x9b1A\\u202egnp.exe\\r\\n"
    assert not any(char in shown for char in RAW + ("\n",))
    assert terminal_safe("modèle.layers.0 ü 東京") == "modèle.layers.0 ü 東京"  # other text unchanged


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hfquant.commands.cli", *argv], capture_output=True, text=True, timeout=600
    )


def _no_raw_controls(text: str) -> None:
    assert not any(char in text for char in RAW), repr(text[-2000:])


def test_verify_and_inspect_show_a_hostile_tensor_name_escaped(origins, tmp_path):
    """A checkpoint with an extra tensor named with ESC sequences: `verify` lists it as a problem, escaped, on one
    line; `inspect` prints its table escaped (was: the raw sequences, which cleared the screen)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(origins["hfquant"], folder)
    (folder / "hfquant.sha256.json").unlink()
    tensors = load_file(folder / "model.safetensors")
    tensors[HOSTILE] = torch.zeros(2)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    verified = _cli("verify", str(folder))
    assert verified.returncode == 1
    _no_raw_controls(verified.stdout + verified.stderr)
    assert terminal_safe(HOSTILE) in verified.stderr
    assert [line for line in verified.stderr.splitlines() if terminal_safe(HOSTILE) in line]  # one line holds it
    inspected = _cli("inspect", str(folder))
    _no_raw_controls(inspected.stdout + inspected.stderr)


def test_error_lines_and_log_messages_of_the_command_are_escaped(tmp_path):
    """A path with ESC sequences in an error line (`convert` of a missing SRC named so), and in a log message."""
    missing = tmp_path / HOSTILE.replace("\n", "").replace("/", "")
    result = _cli("convert", str(missing), str(tmp_path / "dst"))
    assert result.returncode != 0
    _no_raw_controls(result.stderr)
    assert "\\x1b]0;pwned" in result.stderr

    from hfquant.commands import cli

    record = logging.LogRecord("hfquant.x", logging.WARNING, __file__, 1, "not copying %s", (HOSTILE,), None)
    line = cli._TerminalSafeFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == f"WARNING hfquant.x: not copying {terminal_safe(HOSTILE)}"


def test_model_card_escapes_markdown_html_and_the_shell(origins, tmp_path):
    """A checkpoint folder named with HTML, Markdown, a backtick, shell syntax and ESC sequences: its card holds none
    of them raw: the title escaped, the usage snippet's string and the convert command quoted."""
    name = "x<img src=x onerror=alert(1)>`|[a](https:e)$(rm -rf ~)\x1b[2J\u202e"
    folder = tmp_path / name
    shutil.copytree(origins["hfquant"], folder)
    text = str(build_card(folder))
    _no_raw_controls(text)
    command = next(line for line in text.splitlines() if line.startswith("hfquant convert"))
    assert f" '{terminal_safe(name)}'" in command  # one shell word, in single quotes: nothing in it runs
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # what Markdown renders (code blocks show text as typed)
    for raw in ("<img", "[a](", "`|", "|[a]"):
        assert not re.search(r"(?<!\\)" + re.escape(raw), prose), raw
    assert f"# {markdown_text(name)}" in prose
    assert markdown_text("a<b>|`c`") == "a\\<b\\>\\|\\`c\\`"
    assert markdown_code("a`b|c") == "a\\x60b\\x7cc"


@pytest.mark.parametrize(
    "pattern, what",
    [
        ("re:(a+)+$", "a repeat inside a repeat"),
        ("re:(.*a){20}", "a repeat inside a repeat"),
        ("re:(a|aa)*$", "an alternation inside a repeat"),
        ("re:(a)\\1", "a backreference"),
        ("re:.*.*.*.*x", "4 unbounded repeats"),
        ("re:" + "a" * 300, "300 characters long"),
    ],
)
def test_a_pattern_that_could_hang_is_refused_naming_it(pattern, what):
    with pytest.raises(ValueError, match="compressed-tensors target") as error:
        target_regex(pattern)
    assert what in str(error.value) and repr(pattern[:40])[:-1] in str(error.value)


def test_ordinary_patterns_still_match():
    assert matches_target("model.layers.3.self_attn.q_proj", [], "re:.*self_attn\\.(q|k|v)_proj$")
    assert matches_target("model.layers.3.mlp.up_proj", [], "re:model\\.layers\\.\\d+\\.mlp\\..*")
    assert not matches_target("lm_head", [], "re:.*mlp.*")
    with pytest.raises(ValueError, match="characters long"):
        matches_target("a" * 1000, [], "re:.*a")


def test_import_refuses_a_catastrophic_pattern_before_any_work(origins, tmp_path):
    """A compressed-tensors config whose ignore list holds `re:(a+)+$` (which takes 2^n steps on a name of n a's
    and no match): `import` refuses it in one line naming it, and writes nothing."""
    src = tmp_path / "ct"
    shutil.copytree(origins["ct"], src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["ignore"] = [*config["quantization_config"].get("ignore", []), "re:(a+)+$"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target 're:\(a\+\)\+\$' has a repeat inside a repeat"):
        import_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct"]


def test_eval_without_a_tokenizer_names_the_real_cause(origins, tmp_path):
    """`eval` of a checkpoint folder without tokenizer files: one line naming the folder, the files looked for and
    the fix (was: transformers' page about sentencepiece and tiktoken); with --tokenizer it measures."""
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(origins["hfquant"], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    result = _cli("eval", str(folder), "--max-tokens", "32", "--repeats", "1", "--new-tokens", "2", "--no-save")
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"hfquant: error: no tokenizer files in {folder} (none of tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, vocab.json, spiece.model); pass --tokenizer FOLDER_OR_REPO (tokenizer= from Python) naming "
        "the tokenizer of the model it was made from, or copy those files into it"
    ]
    assert "sentencepiece" not in result.stderr
    given = _cli(
        "eval", str(folder), "--tokenizer", str(origins["float"]), "--max-tokens", "32", "--repeats", "1",
        "--new-tokens", "2", "--no-save",
    )  # fmt: skip
    assert given.returncode == 0, given.stderr[-2000:]
    assert "perplexity" in given.stdout
