"""Convert several checkpoints with several option sets, then print a summary table.

    python scripts/batch_convert.py --source SRC [--source SRC2 ...] \\
        --options "--bits 8" --options "--bits 4 --group-size 128" --options "--bits 4 --group-size 32" \\
        --out-dir out/batch [--perplexity] [--json out/batch/summary.json]

Each option set is written exactly as the quantization options of `hfquant convert` (same parser, same checks). Every
(source, option set) pair is converted with `hfquant.conversion.convert.convert` into OUT_DIR/<source name>-<options
slug>, e.g. `smollm2-135m-instruct-bf16-int4-g128`, with the model card `hfquant convert` writes
(`hfquant.publishing.cards.card_for_convert`). `--perplexity` also measures each output and each float source on the
built-in text (`hfquant.evaluation.reference_text`). A failed conversion is reported in the table and the others go
on; the exit code is 1 when any failed.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

from hfquant.checkpoint.source import resolve_source
from hfquant.commands.cli import build_parser
from hfquant.commands.options import config_from_args
from hfquant.conversion.convert import convert
from hfquant.inspection import human_bytes
from hfquant.publishing.cards import card_for_convert


def slug(config) -> str:
    """Short name of an `HfQuantConfig`: int4-g128, int8-pc, int4-g32-sym, ... (non-default extras appended)."""
    from hfquant.config import HfQuantConfig

    defaults = HfQuantConfig(bits=config.bits).to_dict()
    parts = [f"int{config.bits}", "pc" if config.group_size is None else f"g{config.group_size}"]
    if config.symmetric != defaults["symmetric"]:
        parts.append("sym" if config.symmetric else "asym")
    if config.modules_to_not_convert:
        parts.append(f"skip{len(config.modules_to_not_convert)}")
    for key, value in config.to_dict().items():
        if key not in ("bits", "group_size", "symmetric", "modules_to_not_convert") and value != defaults.get(key):
            parts.append(f"{key.replace('_', '')}-{value}")
    return "-".join(parts)


def perplexity_of(path: Path) -> float:
    """Perplexity of the causal LM in `path` on the built-in reference text (CPU, its saved dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfquant  # noqa: F401  (registers the quantizer for the quantized checkpoints)
    from hfquant.evaluation import perplexity, reference_text

    model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    value = perplexity(model, tokenizer, reference_text())
    del model
    gc.collect()
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="SRC",
        help="float checkpoint folder or Hub repo id; repeat for several",
    )
    parser.add_argument(
        "--options",
        action="append",
        default=None,
        metavar='"--bits 4 ..."',
        help="one option set, as hfquant convert's quantization options; repeat for several "
        "(default: --bits 8 and --bits 4)",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=Path("out/batch"), help="where the outputs go (default out/batch)"
    )
    parser.add_argument("--max-shard-size", default="2GB", help="as hfquant convert (default 2GB)")
    parser.add_argument("--workers", type=int, default=0, help="as hfquant convert (default 0)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="convert again when an output exists (default: keep it and only measure it)",
    )
    parser.add_argument("--perplexity", action="store_true", help="measure each output and each float source")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    convert_parser = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "convert"
    ]
    option_sets = args.options or ["--bits 8", "--bits 4"]
    configs = []
    for text in option_sets:
        try:
            configs.append((text, config_from_args(convert_parser.parse_args(["SRC", "DST", *shlex.split(text)]))))
        except (ValueError, TypeError) as error:
            parser.error(f"--options {text!r}: {error}")

    rows = []
    for source in args.source:
        folder = resolve_source(source)
        name = folder.name if Path(source).expanduser().exists() else source.replace("/", "--")
        source_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        baseline = perplexity_of(folder) if args.perplexity else None
        rows.append(
            {
                "source": source,
                "options": "(float)",
                "output": str(folder),
                "bytes": source_bytes,
                "ratio": 1.0,
                "seconds": None,
                "perplexity": baseline,
                "error": None,
            }
        )
        for text, config in configs:
            dst = args.out_dir / f"{name}-{slug(config)}"
            row = {
                "source": source,
                "options": text,
                "output": str(dst),
                "bytes": None,
                "ratio": None,
                "seconds": None,
                "perplexity": None,
                "error": None,
            }
            if dst.exists() and not args.overwrite:
                print(f"keeping {dst} (exists; --overwrite converts again)", file=sys.stderr, flush=True)
            else:
                print(f"converting {source} with {text} -> {dst}", file=sys.stderr, flush=True)
                start = time.perf_counter()
                try:
                    convert(
                        folder,
                        dst,
                        config,
                        max_shard_size=args.max_shard_size,
                        workers=args.workers,
                        overwrite=args.overwrite,
                        before_publish=card_for_convert(source, dst),  # the card `hfquant convert` writes
                    )
                except (ValueError, TypeError, OSError) as error:
                    row["error"] = str(error)
                    rows.append(row)
                    continue
                row["seconds"] = time.perf_counter() - start
            row["bytes"] = sum(p.stat().st_size for p in dst.glob("*.safetensors"))
            row["ratio"] = row["bytes"] / source_bytes if source_bytes else None
            if args.perplexity:
                row["perplexity"] = perplexity_of(dst)
            rows.append(row)

    header = ["source", "options", "output", "size", "vs float", "seconds", "perplexity"]
    table = [header, ["---"] * len(header)]
    for row in rows:
        table.append(
            [
                row["source"],
                row["options"],
                Path(row["output"]).name if not row["error"] else f"FAILED: {row['error']}",
                human_bytes(row["bytes"]) if row["bytes"] is not None else "",
                f"{row['ratio']:.2f}x" if row["ratio"] is not None else "",
                f"{row['seconds']:.1f}" if row["seconds"] is not None else "",
                f"{row['perplexity']:.3f}" if row["perplexity"] is not None else "",
            ]
        )
    for line in table:
        print("| " + " | ".join(str(cell) for cell in line) + " |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
