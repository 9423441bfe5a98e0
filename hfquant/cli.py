"""The `hfquant` command.

    hfquant quantize SRC DST [--bits 4] [--group-size 128] [--symmetric | --asymmetric] ...

`quantize` loads SRC with the quantization applied on load (`from_pretrained(..., quantization_config=...)`),
then writes a quantized checkpoint with `save_pretrained` into a temporary folder beside DST, renamed to DST at
the end, so an interrupted run leaves DST as it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__ = ["main", "build_parser", "config_from_args"]

logger = logging.getLogger("hfquant")


def _group_size(text: str) -> int | None:
    if text.lower() in ("none", "per-channel", "channel"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--group-size {text!r} is not an integer; use a power of two from 32 to 1024 or 'none' (per-channel)"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfquant", description="Weight-only int8/int4 quantization for transformers.")
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser(
        "quantize",
        help="quantize a float checkpoint on load and save it as a quantized checkpoint",
        description="Load SRC (a local folder with safetensors and config.json) quantizing every Linear/Conv1D "
        "weight as it streams in, then save the quantized checkpoint to DST.",
    )
    q.add_argument("src", help="folder of the float checkpoint")
    q.add_argument("dst", help="output folder; must not exist unless --overwrite")
    q.add_argument("--bits", type=int, default=4, help="8 or 4 (default 4)")
    q.add_argument(
        "--group-size", type=_group_size, default=argparse.SUPPRESS,
        help="inputs per scale: a power of two from 32 to 1024, or 'none' for per-channel "
        "(default: per-channel at 8 bits, 128 at 4 bits)",
    )
    sym = q.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_true", default=None,
                     help="no zero point (default at 8 bits)")
    sym.add_argument("--asymmetric", dest="symmetric", action="store_false",
                     help="uint8 zero point per group (default at 4 bits)")
    q.add_argument(
        "--modules-to-not-convert", nargs="*", default=[], metavar="NAME",
        help="modules kept in float: dotted names, whole-component suffixes or fnmatch patterns",
    )
    q.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the layers left in float and of the activations (default bfloat16)")
    q.add_argument("--max-shard-size", default="5GB", help="largest shard file, e.g. 500MB (default 5GB)")
    q.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    return parser


def config_from_args(args: argparse.Namespace):
    """`HfQuantConfig` from parsed `quantize` arguments; raises the config's ValueError/TypeError on bad values."""
    from .config import HfQuantConfig

    kwargs = {"bits": args.bits, "symmetric": args.symmetric, "modules_to_not_convert": list(args.modules_to_not_convert)}
    if hasattr(args, "group_size"):
        kwargs["group_size"] = args.group_size
    return HfQuantConfig(**kwargs)


def _quantize(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from . import register

    register()
    src, dst = Path(args.src), Path(args.dst)
    config = config_from_args(args)
    if not (src / "config.json").is_file():
        raise SystemExit(f"hfquant: {src} has no config.json; SRC must be a folder holding a transformers checkpoint")
    if dst.exists() and not args.overwrite:
        raise SystemExit(f"hfquant: {dst} exists; pass --overwrite to replace it")
    model_config = AutoConfig.from_pretrained(src)
    auto = AutoModelForCausalLM if any(a.endswith("ForCausalLM") for a in model_config.architectures or []) else AutoModel
    model = auto.from_pretrained(src, quantization_config=config, dtype=getattr(torch, args.dtype), device_map="cpu")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=args.max_shard_size)
        try:
            AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
        except (OSError, ValueError) as error:
            logger.info("no tokenizer saved: %s", error)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {dst}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hfquant` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "quantize":
            return _quantize(args)
    except (ValueError, TypeError) as error:
        parser.exit(2, f"hfquant: error: {error}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
