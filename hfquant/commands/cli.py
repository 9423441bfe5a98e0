"""The `hfquant` command.

    hfquant convert SRC DST [--bits 4] [--group-size 128] [--symmetric | --asymmetric] ... [--workers N]
    hfquant inspect PATH [--json]
    hfquant eval PATH [--baseline SRC] [--text-file FILE]
    hfquant push PATH REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--timeout SECONDS]
    hfquant verify PATH [--write-checksums]
    hfquant export SRC DST [--format compressed-tensors|gguf] [--overwrite] [--max-shard-size SIZE]
    hfquant import SRC DST [--overwrite] [--max-shard-size SIZE]

Each subcommand's parser and what it runs live in a module of `hfquant.commands` named for it (`convert`,
`inspect_`, `verify`, `eval_`, `push`, `export`, `import_`), calling the library: `convert` quantizes a float
safetensors checkpoint file to file (`hfquant.conversion.convert`) and writes its model card
(`hfquant.publishing.cards`) before the folder is published; `inspect` reports what a checkpoint holds
(`hfquant.inspection`); `eval` measures perplexity and decode speed (`hfquant.evaluation`) and records them for the
card; `push` uploads a folder to the Hub in one commit (`hfquant.publishing.hub`). The quantization options are the
fields of `HfQuantConfig`, with its docstring as their help (`hfquant.commands.options`). This module builds the
parser, runs the subcommand and turns its errors into one line and an exit status.

Every subcommand also takes the common options (`--no-progress`, `-v/--verbose`: `hfquant.commands.options`), and
`hfquant --version` prints the version. A subcommand's argument error prints that subcommand's usage, with the
closest option names for a misspelt one. Building the parser and parsing imports the standard library and
`hfquant.commands` only (their `run` imports the library), and only the chosen subcommand gets its arguments (those
of `convert` read `hfquant.config`): with the console script's entry (`hfquant_cli`, which defers the package root),
`--help`, `--version` and argument errors answer without importing torch or transformers.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import signal
import sys
import threading
from collections.abc import Iterable

from hfquant.commands import convert, eval_, export, import_, inspect_, push, verify
from hfquant.core.text import terminal_safe
from hfquant.version import __version__

__all__ = ["main", "build_parser", "parse_args", "run"]

logger = logging.getLogger("hfquant")

_SUBCOMMANDS = {
    "convert": convert,
    "inspect": inspect_,
    "verify": verify,
    "eval": eval_,
    "push": push,
    "export": export,
    "import": import_,
}
"""Subcommand -> its module (`HELP`, `add_parser(sub) -> its parser`, `run(args) -> exit status`, and optionally
`check_args(args)` for checks across arguments, raising ValueError), in the order of the help."""
_COMMANDS = {name: module.run for name, module in _SUBCOMMANDS.items()}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The `hfquant` parser. `commands`: the subcommands given their arguments (default all); the others are listed
    by name and `HELP` only, so that parsing one command does not build (and import what builds) the others."""
    full = set(_SUBCOMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(
        prog="hfquant",
        description="Weight-only int8/int4 quantization for Hugging Face transformers (SINQ at 4 bits, "
        "round-to-nearest at 8, by default): convert checkpoints, inspect them, measure them, publish them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hfquant does (INFO level)")
    parser.add_argument("--version", action="version", version=f"hfquant {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _SUBCOMMANDS.items():
        if name in full:
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named in `argv`: its first word that is not an option (no top-level option takes a value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's message for the arguments `parser` does not know, with the closest option names it does know."""
    known = [option for action in parser._actions for option in action.option_strings]
    guesses = {
        match
        for word in extras
        if word.startswith("--")
        for match in difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
    }
    hint = f"; did you mean {', '.join(sorted(guesses))}?" if guesses else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`argv` (default `sys.argv[1:]`) parsed. An error exits with status 2 and the usage of the subcommand it
    concerns (argparse alone gives the top-level usage for an unknown option of a subcommand); an unknown subcommand
    is answered with the closest names."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command_in(argv)
    parser = build_parser([command] if command in _SUBCOMMANDS else [])
    if command is not None and command not in _SUBCOMMANDS:
        close = difflib.get_close_matches(command, list(_SUBCOMMANDS), n=1)
        parser.error(
            f"argument COMMAND: invalid choice: {command!r} (choose from {', '.join(_SUBCOMMANDS)})"
            + (f"; did you mean {close[0]}?" if close else "")
        )
    args, extras = parser.parse_known_args(argv)
    subparser = _subparsers(parser)[args.command]
    if extras:
        subparser.error(_unrecognized(extras, subparser))
    check_args = getattr(_SUBCOMMANDS[args.command], "check_args", None)
    if check_args is not None:
        try:
            check_args(args)
        except ValueError as error:
            subparser.error(str(error))
    return args


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m hfquant.commands.cli` (the console script's is `hfquant_cli.main`); returns the
    exit code."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; its errors become one line on stderr and an exit status: 2 for ValueError/TypeError
    (bad values), 1 for OSError, Hub errors and a missing optional package (ImportError, naming its pip command), 130
    for Ctrl-C and 143 for SIGTERM (what `kill`, `timeout`, `docker stop` and systemd send), both handled alike: the
    command's temporary files are removed; other exceptions propagate."""
    from hfquant.publishing.hub import HubError

    _configure_logging()
    if args.verbose:
        logging.getLogger("hfquant").setLevel(logging.INFO)
    interrupted: list[int] = []
    previous = _record_interrupts(interrupted)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        _exit_interrupted(interrupted)
    except MemoryError as error:
        if interrupted:
            _exit_interrupted(interrupted)
        _exit(
            1,
            f"hfquant: error: out of memory{f' ({error})' if str(error) else ''}; close other programs or "
            f"use a machine with more memory{_MEMORY_HINTS.get(args.command, '')} (an unfinished DST is "
            "removed; an existing one is left as it was)\n",
        )
    except Exception as error:
        # Ctrl-C inside some C extensions (torch, safetensors) surfaces as another exception; it is still Ctrl-C
        if interrupted:
            _exit_interrupted(interrupted)
        if isinstance(error, (ValueError, TypeError)):
            _exit(2, f"hfquant: error: {error}\n")
        if isinstance(error, (OSError, HubError, ImportError)):
            _exit(1, f"hfquant: error: {error}\n")
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 2


def _exit(status: int, message: str) -> None:
    """`message` on stderr as one line, with what a file put in it (a tensor or file name, a config string) unable to
    act on the terminal (`terminal_safe`), then exit with `status` (as argparse's `parser.exit`)."""
    sys.stderr.write(terminal_safe(message.rstrip("\n")) + "\n")
    sys.exit(status)


class _TerminalSafeFormatter(logging.Formatter):
    """A log line whose message cannot act on the terminal (`terminal_safe`): messages embed names from checkpoints."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().formatMessage(record))


def _configure_logging() -> None:
    """What `logging.basicConfig(level=WARNING, format=...)` does (nothing when the root logger has a handler), with
    messages made `terminal_safe`."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(_TerminalSafeFormatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)


_MEMORY_HINTS = {
    "convert": ", or lower the peak: a smaller --max-shard-size, --workers 0 (each worker holds its own tensors)",
    "eval": ", or a smaller --max-length",
}
"""What lowers the peak memory of each command, for the out-of-memory message."""

_INTERRUPTED = "an unfinished DST is removed; an existing one is left as it was"


def _exit_interrupted(received: list[int]) -> None:
    """Exit as an interrupted command: 130 after Ctrl-C (or an interrupt raised without a signal), 143 after SIGTERM
    (128 + the signal's number, as a shell reports a process that signal ended), with one line saying so."""
    if received and received[0] == signal.SIGTERM:
        _exit(128 + signal.SIGTERM, f"hfquant: terminated (SIGTERM; {_INTERRUPTED})\n")
    _exit(130, f"hfquant: interrupted ({_INTERRUPTED})\n")


def _record_interrupts(received: list[int]) -> dict[int, object]:
    """Handle SIGINT and SIGTERM alike: each raises KeyboardInterrupt, so that the command's cleanup runs (temporary
    folders and files are removed, `hfquant.checkpoint.publish` holds both back over its publishing step), and
    appends its number to `received`, so that the exit status tells them apart and an exception a C extension made
    out of the interrupt is still reported as one; a second SIGTERM ends the process at once. Only a signal whose handler is Python's default is taken over
    (SIGINT's `default_int_handler`, SIGTERM's `SIG_DFL`), in the main thread. Returns {signal: handler to restore}."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

    def handler(signum, frame):
        if signum == signal.SIGTERM and signum in received:  # a second SIGTERM while cleaning up: end now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        received.append(signum)
        raise KeyboardInterrupt

    previous = {}
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, handler)
    return previous


if __name__ == "__main__":
    sys.exit(main())
