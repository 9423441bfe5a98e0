"""The `hfquant` command.

    hfquant convert SRC DST [--bits 4] [--group-size 128] [--symmetric | --asymmetric] ... [--workers N]
    hfquant inspect PATH [--json]
    hfquant eval PATH [--baseline SRC] [--text-file FILE]
    hfquant push PATH REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--timeout SECONDS]
    hfquant verify PATH [--write-checksums]
    hfquant export SRC DST --format compressed-tensors [--overwrite] [--max-shard-size SIZE]
    hfquant import SRC DST [--overwrite] [--max-shard-size SIZE]

Each subcommand's parser and what it runs live in a module of `hfquant.commands` named for it (`convert`,
`inspect_`, `verify`, `eval_`, `push`, `export`, `import_`), calling the library: `convert` quantizes a float
safetensors checkpoint file to file (`hfquant.conversion.convert`) and writes its model card
(`hfquant.publishing.cards`) before the folder is published; `inspect` reports what a checkpoint holds
(`hfquant.inspection`); `eval` measures perplexity and decode speed (`hfquant.evaluation`) and records them for the
card; `push` uploads a folder to the Hub in one commit (`hfquant.publishing.hub`). The quantization options are the
fields of `HfQuantConfig`, with its docstring as their help (`hfquant.commands.options`). This module builds the
parser, runs the subcommand and turns its errors into one line and an exit status.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from hfquant.commands import convert, eval_, export, import_, inspect_, push, verify
from hfquant.publishing.hub import HubError

__all__ = ["main", "build_parser"]

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
"""Subcommand -> its module (`add_parser(sub)`, `run(args) -> exit status`), in the order of the help."""
_COMMANDS = {name: module.run for name, module in _SUBCOMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfquant",
        description="Weight-only int8/int4 round-to-nearest quantization for Hugging Face transformers: convert "
        "checkpoints, inspect them, measure them, publish them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hfquant does (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _SUBCOMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hfquant` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.getLogger("hfquant").setLevel(logging.INFO)
    interrupted: list[int] = []
    previous = _record_sigint(interrupted)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        parser.exit(130, _INTERRUPTED)
    except MemoryError as error:
        if interrupted:
            parser.exit(130, _INTERRUPTED)
        parser.exit(
            1,
            f"hfquant: error: out of memory{f' ({error})' if str(error) else ''}; close other programs or "
            f"use a machine with more memory{_MEMORY_HINTS.get(args.command, '')} (an unfinished DST is "
            "removed; an existing one is left as it was)\n",
        )
    except Exception as error:
        # Ctrl-C inside some C extensions (torch, safetensors) surfaces as another exception; it is still Ctrl-C
        if interrupted:
            parser.exit(130, _INTERRUPTED)
        if isinstance(error, (ValueError, TypeError)):
            parser.exit(2, f"hfquant: error: {error}\n")
        if isinstance(error, (OSError, HubError)):
            parser.exit(1, f"hfquant: error: {error}\n")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 2


_MEMORY_HINTS = {
    "convert": ", or lower the peak: a smaller --max-shard-size, --workers 0 (each worker holds its own tensors)",
    "eval": ", or a smaller --max-length",
}
"""What lowers the peak memory of each command, for the out-of-memory message."""

_INTERRUPTED = "hfquant: interrupted (an unfinished DST is removed; an existing one is left as it was)\n"


def _record_sigint(received: list[int]):
    """Replace the default SIGINT handler by one that raises KeyboardInterrupt as it does and also appends to
    `received`, so that an exception a C extension made out of the interrupt is still reported as one (exit status
    130). Returns the handler to restore, or None when nothing was changed (not the main thread, or a custom
    handler is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None

    def handler(signum, frame):
        received.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, handler)
    return previous


if __name__ == "__main__":
    sys.exit(main())
