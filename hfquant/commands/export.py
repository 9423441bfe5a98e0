"""`hfquant export SRC DST [--format compressed-tensors|gguf]`: an hfquant checkpoint in another engine's format
(`hfquant.conversion.export`); a DST ending in .gguf needs no --format. The library is imported by `run`, so that
the parser is built without torch."""

from __future__ import annotations

import argparse

from hfquant.commands.options import (
    add_common_options,
    add_overwrite_option,
    add_shard_size_option,
    apply_progress_option,
)
from hfquant.core.text import terminal_safe

__all__ = ["ENGINES", "FORMATS", "HELP", "add_parser", "check_args", "run"]

HELP = "write an hfquant checkpoint in another engine's format (compressed-tensors: vLLM, transformers)"
"""The line of the `hfquant --help` listing."""

ENGINES = ("vllm", "transformers")
"""The choices of --engine: `hfquant.checkpoint.compressed_tensors.ENGINES` (tests/commands/test_cli.py)."""

FORMATS = ("compressed-tensors", "gguf")
"""The choices of --format: `hfquant.conversion.export.FORMATS`, spelt here so that the parser does not import the
exporters (tests/commands/test_cli.py checks that the two agree)."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `export` subcommand's parser, added to the subparsers `sub` and returned."""
    x = sub.add_parser(
        "export",
        help=HELP,
        description="Write the hfquant checkpoint SRC as a compressed-tensors pack-quantized checkpoint DST, which "
        "vLLM serves and transformers loads with the compressed-tensors package, without hfquant. Codes and scales "
        "are copied bit for bit; quantized embeddings and a quantized lm_head are written dequantized; layers "
        "quantized with method sinq are refused. DST is written into a temporary folder and renamed at the end. "
        "--format gguf (implied by a DST ending in .gguf) writes DST as one .gguf file for llama.cpp (Llama-family "
        "models): int8 as Q8_0, int4 symmetric as Q4_0, int4 asymmetric as Q4_1, re-blocked from the stored codes.",
    )
    x.add_argument("src", metavar="SRC", help="hfquant checkpoint folder")
    x.add_argument(
        "dst", metavar="DST", help="output folder (a .gguf file with --format gguf); must not exist unless --overwrite"
    )
    x.add_argument(
        "--format",
        default=None,
        choices=list(FORMATS),
        help="the format to write (default: gguf when DST ends in .gguf, else required)",
    )
    x.add_argument(
        "--engine",
        default="vllm",
        choices=list(ENGINES),
        help="compressed-tensors only: the reader to lay the files out for; they differ in asymmetric layers' zero "
        "points (docs/interop.md). vllm (default): packed, as compressed-tensors writes them; transformers: the "
        "layout transformers 5 with compressed-tensors 0.20 loads quantized, which vLLM refuses",
    )
    add_shard_size_option(x)
    add_overwrite_option(x)
    add_common_options(x)
    return x


def check_args(args: argparse.Namespace) -> None:
    """Fill in `args.format` from a DST ending in .gguf when --format was left out.

    Raises:
        ValueError: --format left out and DST does not end in .gguf (the message names the choices).
    """
    if args.format is not None:
        return
    if args.dst.lower().endswith(".gguf"):
        args.format = "gguf"
        return
    raise ValueError(
        f"--format is required unless DST ends in .gguf ({args.dst!r} does not); choose one of {', '.join(FORMATS)}"
    )


def run(args: argparse.Namespace) -> int:
    from hfquant.conversion.export import export_checkpoint

    apply_progress_option(args)
    if args.format == "gguf":
        result = export_checkpoint(args.src, args.dst, args.format, overwrite=args.overwrite)
    else:
        result = export_checkpoint(
            args.src,
            args.dst,
            args.format,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
            engine=args.engine,
        )
    if args.format == "gguf":
        types = ", ".join(f"{count} {kind}" for kind, count in sorted(result.types.items()))
        print(f"wrote {terminal_safe(result.dst)} (gguf): {types} tensors in {result.seconds:.1f} s")
        return 0
    print(
        f"wrote {terminal_safe(result.dst)} ({args.format}): {result.quantized_layers} layers quantized in "
        f"{result.config_groups} config group(s), {result.dequantized_layers} written dequantized, "
        f"{len(result.shards)} shard(s) in {result.seconds:.1f} s"
    )
    return 0
