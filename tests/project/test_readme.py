"""The README is for users (issue #31): the two commands first, short, in sections, its measurements stated once (every
dated run lives in docs/performance.md); and what it shows is true: its links name files that exist, its `hfquant`
command lines use options the commands have, its configuration table lists `HfQuantConfig`'s fields, and the Python
names it shows are the package's public ones."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

import hfquant

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

COMMANDS = (
    "bash scripts/install.sh && python scripts/run_example.py",
    "bash scripts/install.sh && python -m pytest -p no:cacheprovider -n 2 --dist loadfile",
)
"""The README's two commands, in this order, before its first section; CI (`.ci/run`) runs the second one's pytest."""
DOCS = (
    "docs/performance.md",
    "docs/format.md",
    "docs/interop.md",
    "docs/reliability.md",
    "docs/architectures.md",
    "docs/architecture.md",
)
"""The documents a user is sent to for what the README leaves out."""
MAX_LINES = 200
MIN_SECTIONS = 8
MAX_DATES = 2

CODE_BLOCK = re.compile(r"^```[\w-]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SECTION = re.compile(r"^## ", re.MULTILINE)
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
CONFIG_ROW = re.compile(r"^\| `(\w+)` \|", re.MULTILINE)
CONFIG_CALL = re.compile(r"\bHfQuantConfig\(([^()]*)\)")
PACKAGE_NAME = re.compile(r"\bhfquant\.(\w+)(?:\.(\w+))?")
NOT_CONFIG_FIELDS = {"quant_method", "format_version"}  # fixed values, not choices a user makes


def readme() -> str:
    return README.read_text(encoding="utf-8")


def without_code_blocks(text: str) -> str:
    return CODE_BLOCK.sub("", text)


def section(text: str, title: str) -> str:
    """The body of the `## title` section of `text` (up to the next `## ` heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def test_the_two_commands_come_first_and_ci_runs_the_second():
    text = readme()
    before_sections = SECTION.split(text, maxsplit=1)[0]
    blocks = [block.strip() for block in CODE_BLOCK.findall(before_sections)]
    assert blocks == list(COMMANDS), "the README must open with exactly its two commands, each in its own code block"
    assert "python -m pytest -p no:cacheprovider -n 2 --dist loadfile" in (ROOT / ".ci" / "run").read_text(
        encoding="utf-8"
    )


def test_readme_is_short_in_sections_and_states_few_dates():
    text = readme()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"README has {len(lines)} lines; at most {MAX_LINES} (details go to docs/)"
    sections = SECTION.findall(without_code_blocks(text))
    assert len(sections) >= MIN_SECTIONS, f"README has {len(sections)} '## ' sections; at least {MIN_SECTIONS}"
    dates = DATE.findall(text)
    assert len(dates) <= MAX_DATES, (
        f"README states {dates}; at most {MAX_DATES} dates (dated runs: docs/performance.md)"
    )


def test_every_relative_link_names_a_file_that_exists_and_every_doc_is_linked():
    links = [target for target in LINK.findall(readme()) if not SCHEME.match(target) and not target.startswith("#")]
    unlinked = sorted(set(DOCS) - {target.split("#", 1)[0] for target in links})
    assert not unlinked, f"the README does not link {unlinked} (the details it leaves out live there)"
    missing = [target for target in links if not (ROOT / target.split("#", 1)[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_configuration_table_lists_every_field_of_hfquantconfig():
    rows = CONFIG_ROW.findall(section(readme(), "Configuration"))
    fields = set(hfquant.HfQuantConfig().to_dict()) - NOT_CONFIG_FIELDS
    assert len(rows) == len(set(rows)), f"a field has two rows: {rows}"
    assert set(rows) == fields, f"missing: {sorted(fields - set(rows))}; not fields: {sorted(set(rows) - fields)}"


def test_every_hfquantconfig_call_shown_is_valid():
    calls = CONFIG_CALL.findall(readme())
    assert calls, "the README shows no HfQuantConfig(...) call"
    for arguments in calls:
        config = eval(f"HfQuantConfig({arguments})", {"HfQuantConfig": hfquant.HfQuantConfig})  # raises when invalid
        assert isinstance(config, hfquant.HfQuantConfig)


def test_python_names_shown_are_public():
    """`hfquant.X` is a name of `hfquant.__all__` or the public `hfquant.peft` module's; no internal module is named
    (they move), and no path into the package either."""
    text = readme()
    assert not re.search(r"\bhfquant/", text), "the README names a path inside the package"
    for name, attribute in PACKAGE_NAME.findall(text):
        if name == "sha256":  # the checksum file hfquant.sha256.json
            continue
        if name == "peft":
            peft = pytest.importorskip("hfquant.peft", reason="hfquant.peft needs peft")
            assert not attribute or attribute in peft.__all__, f"hfquant.peft.{attribute} is not public"
            continue
        assert name in hfquant.__all__, f"hfquant.{name} is not in hfquant.__all__"


def _cli_main():
    """The function of the `hfquant` console script, as pyproject.toml names it."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    module, function = re.search(r'^hfquant\s*=\s*"([\w.]+):(\w+)"', pyproject, re.MULTILINE).groups()
    return getattr(importlib.import_module(module), function)


def _help(main, arguments: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*arguments, "--help"])
    assert exit_info.value.code == 0, f"hfquant {' '.join(arguments)} --help failed"
    return out.getvalue()


def _command_lines(text: str) -> list[str]:
    """Every `hfquant ...` command line of the README: lines of its code blocks and inline code spans."""
    lines = [line for block in CODE_BLOCK.findall(text) for line in block.splitlines()]
    lines += CODE_SPAN.findall(without_code_blocks(text))
    commands = [line.split("#", 1)[0].strip() for line in lines]
    return [line for line in commands if line.startswith("hfquant ")]


def test_hfquant_command_lines_shown_use_existing_commands_and_options():
    main = _cli_main()
    commands = _command_lines(readme())
    assert commands, "the README shows no hfquant command line"
    for line in commands:
        words = line.split()[1:]
        command = [words[0]] if words and re.fullmatch(r"[a-z][a-z-]*", words[0]) else []
        help_text = _help(main, command)
        for option in (word.split("=", 1)[0] for word in words if word.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text), (
                f"`{line}`: hfquant {' '.join(command)} has no option {option}"
            )
