"""`hfquant import SRC DST`: a compressed-tensors pack-quantized checkpoint as an hfquant one
(`hfquant.conversion.importing`)."""

from __future__ import annotations

import argparse

from hfquant.commands.options import (
    add_common_options,
    add_overwrite_option,
    add_shard_size_option,
    apply_progress_option,
)
from hfquant.core.text import terminal_safe

__all__ = ["HELP", "add_parser", "run"]

HELP = "turn a compressed-tensors pack-quantized checkpoint (llm-compressor W4A16 / W8A16) into an hfquant one"
"""The line of the `hfquant --help` listing."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `import` subcommand's parser, added to the subparsers `sub` and returned."""
    m = sub.add_parser(
        "import",
        help=HELP,
        description="Write the compressed-tensors pack-quantized checkpoint SRC (int4 or int8 weights, symmetric or "
        "asymmetric, group or channel scales) as the hfquant checkpoint DST, bit for bit, so that it runs on "
        "hfquant's kernels. Activation or kv-cache quantization, actorder / g_idx and other formats are refused "
        "with the reason. DST is written into a temporary folder and renamed at the end.",
    )
    m.add_argument("src", metavar="SRC", help="compressed-tensors checkpoint folder")
    m.add_argument("dst", metavar="DST", help="output folder; must not exist unless --overwrite")
    add_shard_size_option(m)
    add_overwrite_option(m)
    add_common_options(m)
    return m


def run(args: argparse.Namespace) -> int:
    from hfquant.conversion.importing import import_checkpoint

    apply_progress_option(args)
    result = import_checkpoint(args.src, args.dst, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(
        f"wrote {terminal_safe(result.dst)}: {result.quantized_layers} layers imported in {result.config_groups} format(s), "
        f"{len(result.shards)} shard(s) in {result.seconds:.1f} s"
    )
    return 0
