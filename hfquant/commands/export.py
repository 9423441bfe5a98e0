"""`hfquant export SRC DST --format compressed-tensors|gguf`: an hfquant checkpoint in another engine's format
(`hfquant.conversion.export`)."""

from __future__ import annotations

import argparse

from hfquant.commands.options import shard_size
from hfquant.conversion.export import FORMATS, export_checkpoint

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """The `export` subcommand's parser, added to the subparsers `sub`."""
    x = sub.add_parser(
        "export",
        help="write an hfquant checkpoint in another engine's format (compressed-tensors: vLLM, transformers)",
        description="Write the hfquant checkpoint SRC as a compressed-tensors pack-quantized checkpoint DST, which "
        "vLLM serves and transformers loads with the compressed-tensors package, without hfquant. Codes and scales "
        "are copied bit for bit; quantized embeddings and a quantized lm_head are written dequantized; layers "
        "quantized with method sinq are refused. DST is written into a temporary folder and renamed at the end. "
        "--format gguf writes DST as one .gguf file for llama.cpp (Llama-family models): int8 as Q8_0, int4 "
        "symmetric as Q4_0, int4 asymmetric as Q4_1, re-blocked from the stored codes.",
    )
    x.add_argument("src", metavar="SRC", help="hfquant checkpoint folder")
    x.add_argument(
        "dst", metavar="DST", help="output folder (a .gguf file with --format gguf); must not exist unless --overwrite"
    )
    x.add_argument("--format", required=True, choices=list(FORMATS), help="the format to write")
    x.add_argument(
        "--max-shard-size",
        type=shard_size,
        default="2GB",
        metavar="SIZE",
        help="largest output shard, e.g. 500MB or 5GB (default 2GB)",
    )
    x.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once DST is complete)")


def run(args: argparse.Namespace) -> int:
    result = export_checkpoint(
        args.src, args.dst, args.format, max_shard_size=args.max_shard_size, overwrite=args.overwrite
    )
    if args.format == "gguf":
        types = ", ".join(f"{count} {kind}" for kind, count in sorted(result.types.items()))
        print(f"wrote {result.dst} (gguf): {types} tensors in {result.seconds:.1f} s")
        return 0
    print(
        f"wrote {result.dst} ({args.format}): {result.quantized_layers} layers quantized in "
        f"{result.config_groups} config group(s), {result.dequantized_layers} written dequantized, "
        f"{len(result.shards)} shard(s) in {result.seconds:.1f} s"
    )
    return 0
