"""`hfquant eval PATH [--baseline SRC]`: perplexity and decode speed (`hfquant.evaluation.evaluate`), saved as
`hfquant_eval.json` in PATH and shown in its model card, which is re-rendered when hfquant wrote it."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from hfquant.commands.options import add_common_options, apply_progress_option
from hfquant.core.text import terminal_safe

logger = logging.getLogger(__name__)

__all__ = ["HELP", "add_parser", "run"]

HELP = "measure perplexity and decode speed, next to a float baseline"
"""The line of the `hfquant --help` listing."""

DEFAULT_MAX_CHARS = 24_000
"""`--max-chars` by default: `hfquant.evaluation.DEFAULT_REFERENCE_CHARS`, written out here so that the parser (and
`--help`) is built without importing torch; a test holds the two equal."""


def add_parser(sub) -> argparse.ArgumentParser:
    """The `eval` subcommand's parser, added to the subparsers `sub` and returned."""
    e = sub.add_parser(
        "eval",
        help=HELP,
        description="Load PATH (and --baseline) with from_pretrained on the CPU and measure perplexity on a text "
        f"(default: the first {DEFAULT_MAX_CHARS} characters of CPython's own pydoc_data.topics, no download, about "
        "5.6k tokens; --full-text scores all of its ~465k characters, some 20 times longer) and greedy batch-1 "
        "decode speed. The results are saved as hfquant_eval.json in PATH and shown in its model card (README.md, "
        "if hfquant wrote it). Progress bars (per perplexity window and generated token) go to stderr.",
    )
    e.add_argument("path", metavar="PATH", help="quantized checkpoint folder (a causal LM)")
    e.add_argument("--baseline", metavar="SRC", help="float checkpoint to measure the same way (folder or repo id)")
    e.add_argument(
        "--tokenizer",
        metavar="FOLDER_OR_REPO",
        help="read the tokenizer from here (a folder or repo id) instead of from PATH and SRC",
    )
    e.add_argument(
        "--text-file", type=Path, metavar="FILE", help="UTF-8 text for the perplexity instead of the built-in one"
    )
    length = e.add_mutually_exclusive_group()
    length.add_argument(
        "--max-chars",
        type=int,
        default=DEFAULT_MAX_CHARS,
        metavar="N",
        help=f"score the first N characters of the text (default {DEFAULT_MAX_CHARS}: with SmolLM2's tokenizer, "
        "11 windows of 512 tokens per model)",
    )
    length.add_argument(
        "--full-text",
        dest="max_chars",
        action="store_const",
        const=None,
        help="score the whole text (the built-in one: ~465k characters, about 20x --max-chars's default)",
    )
    e.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="then score only the first N tokens of those characters (default all)",
    )
    e.add_argument(
        "--max-length", type=int, default=512, metavar="N", help="perplexity window in tokens (default 512)"
    )
    e.add_argument(
        "--new-tokens", type=int, default=64, metavar="N", help="tokens generated per speed run (default 64)"
    )
    e.add_argument("--repeats", type=int, default=3, metavar="N", help="speed runs; the best counts (default 3)")
    e.add_argument(
        "--prompt", default=None, help="prompt of the speed runs (default: hfquant.evaluation.DEFAULT_PROMPT)"
    )
    e.add_argument(
        "--no-save", dest="save", action="store_false", help="do not write hfquant_eval.json nor update README.md"
    )
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    add_common_options(e)
    return e


def _print_table(measured: dict) -> None:
    labels = [terminal_safe(row["label"]) for row in measured["results"]]
    width = max(len(label) for label in labels)
    print(
        f"perplexity on {terminal_safe(measured['text'])}, {measured['tokens']} tokens; decode: {measured['new_tokens']} new tokens, batch 1"
    )
    print(f"{'model':<{width}}  {'perplexity':>10}  {'decode tok/s':>12}")
    for label, row in zip(labels, measured["results"], strict=True):
        print(f"{label:<{width}}  {row['perplexity']:>10.3f}  {row['tokens_per_second']:>12.1f}")


def _save(folder: Path, measured: dict) -> None:
    """`EVAL_FILE` written into `folder` and its card re-rendered (when hfquant wrote it or there is none), never
    through a link that leaves the folder (logged)."""
    from hfquant.checkpoint.files import EVAL_FILE, stays_inside
    from hfquant.publishing.cards import is_hfquant_card, write_card

    outside = {name for name in (EVAL_FILE, "README.md") if not stays_inside(folder, folder / name)}
    for name in sorted(outside):
        logger.warning(
            "not writing %s: it is a link to %s, outside %s (links that leave it are never followed)",
            name,
            (folder / name).resolve(),
            folder,
        )
    if EVAL_FILE not in outside:
        (folder / EVAL_FILE).write_text(json.dumps(measured, indent=2) + "\n", encoding="utf-8")
        logger.info("saved %s", folder / EVAL_FILE)
    readme = folder / "README.md"
    if "README.md" not in outside and (not readme.exists() or is_hfquant_card(readme)):
        write_card(folder)
        logger.info("updated the card %s", readme)


def run(args: argparse.Namespace) -> int:
    from hfquant.evaluation import DEFAULT_PROMPT, evaluate

    apply_progress_option(args)
    measured = evaluate(
        args.path,
        args.baseline,
        args.text_file,
        args.max_tokens,
        args.max_length,
        args.new_tokens,
        args.repeats,
        DEFAULT_PROMPT if args.prompt is None else args.prompt,
        tokenizer=args.tokenizer,
        max_chars=args.max_chars,
        progress=args.progress,
    )
    if args.json:
        print(json.dumps(measured, indent=2))
    else:
        _print_table(measured)
    folder = Path(args.path)
    if args.save and folder.is_dir():
        _save(folder, measured)
    return 0
