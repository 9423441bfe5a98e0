"""`hfquant inspect PATH [--json]`: what a checkpoint holds (`hfquant.inspection`)."""

from __future__ import annotations

import argparse
import json

from hfquant.commands.options import add_common_options

__all__ = ["HELP", "add_parser", "run"]

HELP = "show what a checkpoint holds: quantized layers, float tensors, sizes, config"
"""The line of the `hfquant --help` listing."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `inspect` subcommand's parser, added to the subparsers `sub` and returned."""
    i = sub.add_parser(
        "inspect",
        help=HELP,
        description="Read the safetensors headers of PATH (no tensor is loaded) and report, per layer kind, the bits, "
        "group size and bytes of the quantized layers, the float tensors, totals against the float size, the "
        "quantization config, and every Linear/Conv1D layer left in float with the reason.",
    )
    i.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint folder, or a .gguf file (its tensor types, bits per weight, and which ones hfquant keeps)",
    )
    i.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")
    add_common_options(i)
    return i


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hfquant.conversion.gguf_inspect import format_gguf_report, inspect_gguf
    from hfquant.inspection import format_report, inspect_checkpoint

    if Path(args.path).is_file() and args.path.endswith(".gguf"):
        report = inspect_gguf(args.path)
        print(json.dumps(report, indent=2) if args.json else format_gguf_report(report))
        return 0
    report = inspect_checkpoint(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
