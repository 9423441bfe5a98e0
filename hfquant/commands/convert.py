"""`hfquant convert SRC DST`: a float checkpoint quantized file to file (`hfquant.conversion.convert`), with the
model card written into the folder before it is published (`hfquant.publishing.cards`). The library is imported
by `run`, so that the parser is built without torch (`hfquant.commands.options`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hfquant.commands.options import (
    add_common_options,
    add_config_options,
    add_overwrite_option,
    add_shard_size_option,
    apply_progress_option,
    config_from_args,
)
from hfquant.core.text import terminal_safe

__all__ = ["HELP", "add_parser", "run"]

HELP = "quantize a float safetensors checkpoint into a new folder, tensor by tensor"
"""The line of the `hfquant --help` listing."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `convert` subcommand's parser, added to the subparsers `sub` and returned."""
    c = sub.add_parser(
        "convert",
        help=HELP,
        description="Read the safetensors of SRC one tensor at a time (only the model skeleton is built, on the meta "
        "device), quantize every Linear/Conv1D weight the quantizer plans, and write DST: shards and their index, "
        "config.json with quantization_config, the tokenizer and other small files of SRC, and a model card as "
        "README.md. The tensors are the ones from_pretrained(SRC, quantization_config=...) then save_pretrained "
        "writes. DST is written into a temporary folder beside it and renamed at the end.",
    )
    c.add_argument(
        "src",
        metavar="SRC",
        help="float checkpoint: a local folder (config.json + model.safetensors or shards), or a Hub repo "
        "id (org/name) when the Hub is reachable; or a .gguf file, whose Linear layers keep their llama.cpp block "
        "types (hfquant.convert_gguf; the quantization options do not apply)",
    )
    c.add_argument("dst", metavar="DST", help="output folder; must not exist unless --overwrite")
    add_config_options(c)
    out = c.add_argument_group("output")
    out.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="load dtype, as from_pretrained(dtype=...): float tensors are stored in it and weights are "
        "cast to it before quantizing; auto = config.json's dtype, else the checkpoint's (default auto)",
    )
    add_shard_size_option(
        out,
        note=". Memory peaks near one source tensor plus twice one shard (safetensors copies a shard to bytes as "
        "it writes it)",
    )
    out.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="quantize in N worker processes of one torch thread each, overlapped with the reading and "
        "writing done here; each process costs about 400 MB for its own torch and skeleton "
        "(default 0: quantize in this process with all torch threads)",
    )
    add_overwrite_option(out)
    out.add_argument(
        "--revision", default=None, help="branch, tag or commit of SRC when it is a Hub repo id (default main)"
    )
    out.add_argument(
        "--base-model",
        default=None,
        metavar="REPO_ID",
        help="Hub repo id of the float model, for the card's base_model (default: SRC when it is a repo "
        "id, or the repo of a Hub cache folder)",
    )
    out.add_argument("--no-card", dest="card", action="store_false", help="do not write README.md")
    add_common_options(c)
    return c


def run(args: argparse.Namespace) -> int:
    from hfquant.checkpoint.model_config import check_source_config
    from hfquant.conversion.convert import convert
    from hfquant.inspection import human_bytes
    from hfquant.publishing.cards import card_for_convert

    apply_progress_option(args)
    if args.src.endswith(".gguf"):
        return _run_gguf(args)
    config = config_from_args(args)
    if Path(args.src).expanduser().is_dir():
        check_source_config(args.src)
    result = convert(
        args.src,
        args.dst,
        config,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        workers=args.workers,
        overwrite=args.overwrite,
        revision=args.revision,
        progress=args.progress,
        before_publish=card_for_convert(args.src, args.dst, args.base_model, config, args.dtype)
        if args.card
        else None,
    )
    print(
        f"wrote {terminal_safe(result.dst)}: {result.quantized_layers} tensors quantized, {result.float_tensors} kept in float, "
        f"{len(result.shards)} shard(s), {human_bytes(result.weight_bytes)} of tensors "
        f"(source {human_bytes(result.source_weight_bytes)}) in {result.seconds:.1f} s"
    )
    return 0


def _run_gguf(args: argparse.Namespace) -> int:
    """`hfquant convert model.gguf DST`: the file's blocks kept (`hfquant.convert_gguf`), no model card."""
    from hfquant.config import FIELD_NAMES
    from hfquant.conversion.gguf_import import convert_gguf

    defaults = {"modules_to_not_convert": [], "symmetric": None}  # every other option is None unless given
    given = [name for name in FIELD_NAMES if name in vars(args) and getattr(args, name) != defaults.get(name)]
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{options}: a GGUF source keeps its own block types, so quantization options do not apply; remove them"
        )
    result = convert_gguf(
        args.src,
        args.dst,
        dtype=None if args.dtype == "auto" else args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
    )
    formats = ", ".join(f"{count} {name}" for name, count in sorted(result.formats.items())) or "none"
    print(f"wrote {terminal_safe(result.dst)}: layers kept in their GGUF blocks: {formats}, in {result.seconds:.1f} s")
    return 0
