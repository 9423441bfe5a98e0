"""The options several subcommands share, each defined once: the quantization options of `hfquant convert` (one per
field of `HfQuantConfig`, with its help and allowed values) and the `HfQuantConfig` they make, `--max-shard-size`,
`--overwrite`, and the options every command takes (`--no-progress`, `-v/--verbose`).

Only the standard library is imported at module level, so that the parser of every command is built, and `--help`
or an argument error answered, without torch or transformers; `hfquant.config` (which imports transformers'
`QuantizationConfigMixin`) is imported by the two functions that read its `FIELDS`."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = [
    "add_common_options",
    "add_config_options",
    "add_overwrite_option",
    "add_shard_size_option",
    "apply_progress_option",
    "config_from_args",
    "shard_size",
]

_OPTIONS_OF_THEIR_OWN = (
    "quant_method",
    "format_version",
    "bits",
    "group_size",
    "symmetric",
    "modules_to_not_convert",
    "module_overrides",
    "fold_column_scales",
)
"""Config fields that are not plain `--field VALUE` options: fixed, or spelled --symmetric/--asymmetric, or several
values; every other field of `hfquant.config.FIELDS` becomes `--field-name VALUE` with its help and choices."""


def _group_size(text: str) -> int | None:
    if text.lower() in ("none", "per-channel", "channel"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--group-size {text!r} is not an integer; use a power of two from 32 to 1024 or 'none' (per-channel)"
        ) from None


def _bits(text: str) -> int | float:
    """`--bits`: an int width, or a bits budget of `hfquant.config.BUDGET_BITS` ("3.5")."""
    from hfquant.config import ALL_BITS, BUDGET_BITS

    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and value.is_integer() and int(value) in ALL_BITS:
        return int(value)
    if value in BUDGET_BITS:
        return value
    allowed = ", ".join(str(bits) for bits in (*ALL_BITS, *BUDGET_BITS))
    raise argparse.ArgumentTypeError(f"--bits {text!r} is not supported; use one of {allowed}")


def shard_size(text: str) -> int | str:
    """A number of bytes ("50000000") or a size with a unit ("50MB"), as `save_pretrained(max_shard_size=...)`."""
    return int(text) if text.strip().isdigit() else text


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f'--module-overrides {text!r} is not JSON ({error}); write e.g. \'{{"v_proj": {{"bits": 8}}}}\''
        ) from None


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """The options every subcommand takes: `--no-progress` (`args.progress`, default True) and `-v/--verbose`, also
    accepted before the command (`hfquant -v convert ...`); the subcommand's `--verbose` is left out of `args` when
    not given (argparse.SUPPRESS), so that it does not reset the top-level one."""
    common = parser.add_argument_group("common options")
    common.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bars (hfquant's, transformers' and the Hub's; they go to stderr)",
    )
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log what hfquant does (INFO level)"
    )


def apply_progress_option(args: argparse.Namespace) -> None:
    """Turn transformers' and huggingface_hub's progress bars off for this process when `--no-progress` was given
    (the bars of loading, downloading and uploading that hfquant does not draw itself)."""
    if args.progress:
        return
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    disable_progress_bars()
    hf_logging.disable_progress_bar()


def add_overwrite_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--overwrite` of the commands that write a DST (`args.overwrite`, default False)."""
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (only once DST is complete)"
    )


def add_shard_size_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, note: str = "") -> None:
    """`--max-shard-size SIZE` (`args.max_shard_size`, default "2GB"), with `note` added to its help."""
    parser.add_argument(
        "--max-shard-size",
        type=shard_size,
        default="2GB",
        metavar="SIZE",
        help=f"largest output shard, e.g. 500MB or 5GB{note} (default 2GB)",
    )


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """`--bits`, `--group-size`, `--symmetric/--asymmetric`, `--modules-to-not-convert`, and `--NAME VALUE` for every
    other field of `hfquant.config.FIELDS`, with its help and allowed values. A value left out keeps the config's
    default (argparse.SUPPRESS), so `HfQuantConfig` applies its own defaults and validation."""
    from hfquant.config import FIELDS, HfQuantConfig

    field = {f.name: f for f in FIELDS}
    group = parser.add_argument_group("quantization (the fields of HfQuantConfig)")
    group.add_argument(
        "--bits",
        type=_bits,
        default=None,  # 4, but None tells a given --bits 4 apart (a GGUF source refuses any quantization option)
        metavar="BITS",
        help=f"{field['bits'].help} (8, 6, 5, 4, 3, 2 or 3.5; default 4)",
    )
    group.add_argument(
        "--group-size",
        type=_group_size,
        default=argparse.SUPPRESS,
        metavar="N",
        help=field["group_size"].help.replace("None", "'none'"),
    )
    sym = group.add_mutually_exclusive_group()
    sym.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_true",
        default=None,
        help="signed codes, no zero point (default at 8 bits, the only form the int8 kernel runs)",
    )
    sym.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_false",
        help="unsigned codes with a uint8 zero point per group (default at 4 bits)",
    )
    group.add_argument(
        "--modules-to-not-convert", nargs="*", default=[], metavar="NAME", help=field["modules_to_not_convert"].help
    )
    group.add_argument(
        "--fold-column-scales",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help=field["fold_column_scales"].help,
    )
    group.add_argument(
        "--module-overrides",
        type=_json_object,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help=field["module_overrides"].help + " (a JSON object)",
    )
    defaults = HfQuantConfig().to_dict()
    for row in FIELDS:
        if row.name in _OPTIONS_OF_THEIR_OWN:
            continue
        group.add_argument(
            "--" + row.name.replace("_", "-"),
            dest=row.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{row.help}; one of {', '.join(map(str, row.choices))} (default {defaults[row.name]})",
        )


def config_from_args(args: argparse.Namespace):
    """`HfQuantConfig` from parsed `convert` arguments; raises the config's ValueError/TypeError on bad values."""
    from hfquant.config import FIELD_NAMES, HfQuantConfig

    kwargs: dict[str, Any] = {
        "bits": 4 if args.bits is None else args.bits,
        "symmetric": args.symmetric,
        "modules_to_not_convert": list(args.modules_to_not_convert),
    }
    for name in FIELD_NAMES:
        if name not in kwargs and hasattr(args, name):
            kwargs[name] = getattr(args, name)
    return HfQuantConfig(**kwargs)
