"""`hfquant verify PATH [--write-checksums]`: a checkpoint against its config (`hfquant.verification`); exit 1
listing the problems."""

from __future__ import annotations

import argparse
import sys

from hfquant.commands.options import add_common_options
from hfquant.core.text import terminal_safe

__all__ = ["HELP", "add_parser", "run"]

HELP = "check a quantized checkpoint against its config without loading it; exit 1 listing the problems"
"""The line of the `hfquant --help` listing."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `verify` subcommand's parser, added to the subparsers `sub` and returned."""
    v = sub.add_parser(
        "verify",
        help=HELP,
        description="Read config.json, the index and the safetensors headers of PATH (never a weight, never code) "
        "and check that every shard the index names exists and holds its tensors, that every tensor has the name, "
        "dtype and shape quantization_config gives it, and the sha256 sums recorded in hfquant.sha256.json.",
    )
    v.add_argument("path", metavar="PATH", help="checkpoint folder")
    v.add_argument(
        "--write-checksums",
        action="store_true",
        help="when no problem is found, record the sha256 of config.json, the index and the shards in "
        "hfquant.sha256.json (for a folder written by save_pretrained)",
    )
    add_common_options(v)
    return v


def run(args: argparse.Namespace) -> int:
    from hfquant.checkpoint.checksums import write_checksums
    from hfquant.verification import verify

    result = verify(args.path)
    for note in result.notes:
        print(f"note: {terminal_safe(note)}")
    if result.problems:
        print(f"hfquant: {terminal_safe(args.path)}: {len(result.problems)} problem(s):", file=sys.stderr)
        for problem in result.problems:
            print(f"  - {terminal_safe(problem)}", file=sys.stderr)
        return 1
    if args.write_checksums:
        print(f"recorded sha256 sums in {terminal_safe(write_checksums(args.path))}")
    print(
        f"ok: {terminal_safe(args.path)}: {result.tensors} tensors in {result.files} file(s) match the config"
        + (f", {result.checksums} sha256 sums match" if result.checksums else "")
    )
    return 0
