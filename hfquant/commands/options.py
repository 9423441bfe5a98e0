"""The quantization options of `hfquant convert` (one per field of `HfQuantConfig`, with its help and allowed values),
the `HfQuantConfig` they make, and the size options (`--max-shard-size`) shared by convert, export and import."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hfquant.config import FIELD_NAMES, FIELDS, ConfigField, HfQuantConfig

__all__ = ["add_config_options", "config_from_args", "shard_size"]

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


def _field(name: str) -> ConfigField:
    return next(field for field in FIELDS if field.name == name)


def _group_size(text: str) -> int | None:
    if text.lower() in ("none", "per-channel", "channel"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--group-size {text!r} is not an integer; use a power of two from 32 to 1024 or 'none' (per-channel)"
        ) from None


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


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """`--bits`, `--group-size`, `--symmetric/--asymmetric`, `--modules-to-not-convert`, and `--NAME VALUE` for every
    other field of `hfquant.config.FIELDS`, with its help and allowed values. A value left out keeps the config's
    default (argparse.SUPPRESS), so `HfQuantConfig` applies its own defaults and validation."""
    group = parser.add_argument_group("quantization (the fields of HfQuantConfig)")
    group.add_argument(
        "--bits", type=int, default=4, choices=list(_field("bits").choices), help=f"{_field('bits').help} (default 4)"
    )
    group.add_argument(
        "--group-size",
        type=_group_size,
        default=argparse.SUPPRESS,
        metavar="N",
        help=_field("group_size").help.replace("None", "'none'"),
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
        "--modules-to-not-convert", nargs="*", default=[], metavar="NAME", help=_field("modules_to_not_convert").help
    )
    group.add_argument(
        "--fold-column-scales",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help=_field("fold_column_scales").help,
    )
    group.add_argument(
        "--module-overrides",
        type=_json_object,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help=_field("module_overrides").help + " (a JSON object)",
    )
    defaults = HfQuantConfig().to_dict()
    for field in FIELDS:
        if field.name in _OPTIONS_OF_THEIR_OWN:
            continue
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            default=argparse.SUPPRESS,
            metavar="VALUE",
            help=f"{field.help}; one of {', '.join(map(str, field.choices))} (default {defaults[field.name]})",
        )


def config_from_args(args: argparse.Namespace) -> HfQuantConfig:
    """`HfQuantConfig` from parsed `convert` arguments; raises the config's ValueError/TypeError on bad values."""
    kwargs: dict[str, Any] = {
        "bits": args.bits,
        "symmetric": args.symmetric,
        "modules_to_not_convert": list(args.modules_to_not_convert),
    }
    for name in FIELD_NAMES:
        if name not in kwargs and hasattr(args, name):
            kwargs[name] = getattr(args, name)
    return HfQuantConfig(**kwargs)
