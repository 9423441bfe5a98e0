"""The `hfquant` command.

    hfquant convert SRC DST [--bits 4] [--group-size 128] [--symmetric | --asymmetric] ... [--workers N]
    hfquant inspect PATH [--json]
    hfquant eval PATH [--baseline SRC] [--text-file FILE]
    hfquant push PATH REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--timeout SECONDS]
    hfquant verify PATH [--write-checksums]
    hfquant export SRC DST --format compressed-tensors [--overwrite] [--max-shard-size SIZE]
    hfquant import SRC DST [--overwrite] [--max-shard-size SIZE]

`convert` quantizes a float safetensors checkpoint file to file (`hfquant.commands.convert`), writing into a temporary folder
beside DST renamed at the end. `inspect` reports what a checkpoint holds (`hfquant.commands.inspection`). `eval` measures
perplexity and decode speed, and records them for the model card (`hfquant.commands.cards`). `push` uploads a folder to the
Hub in one commit (`hfquant.commands.hub`). The quantization options are the fields of `HfQuantConfig`, with its
docstring as their help.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hfquant.checkpoint.checksums import write_checksums
from hfquant.checkpoint.files import CONFIG_NAME, stays_inside
from hfquant.commands.cards import EVAL_FILE, is_hfquant_card, write_card
from hfquant.commands.convert import convert, resolve_source
from hfquant.commands.evaluation import DEFAULT_REFERENCE_CHARS, decode_tokens_per_second, perplexity, reference_text
from hfquant.commands.export import FORMATS, export_checkpoint
from hfquant.commands.hub import DEFAULT_HUB_TIMEOUT, HUB_TIMEOUT_ENV, HubError, push_folder
from hfquant.commands.importing import import_checkpoint
from hfquant.commands.inspection import format_report, human_bytes, inspect_checkpoint
from hfquant.commands.verify import read_model_config, verify
from hfquant.config import FIELD_NAMES, FIELDS, ConfigField, HfQuantConfig
from hfquant.core.dtypes import dtype_name

__all__ = ["main", "build_parser", "config_from_args", "evaluate", "check_source_config"]

logger = logging.getLogger("hfquant")

DEFAULT_PROMPT = "The Python language reference describes"
"""Prompt of the decode-speed measurement of `hfquant eval`."""

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


def _shard_size(text: str) -> int | str:
    """A number of bytes ("50000000") or a size with a unit ("50MB"), as `save_pretrained(max_shard_size=...)`."""
    return int(text) if text.strip().isdigit() else text


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f'--module-overrides {text!r} is not JSON ({error}); write e.g. \'{{"v_proj": {{"bits": 8}}}}\''
        ) from None


def _add_config_options(parser: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfquant",
        description="Weight-only int8/int4 round-to-nearest quantization for Hugging Face transformers: convert "
        "checkpoints, inspect them, measure them, publish them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hfquant does (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser(
        "convert",
        help="quantize a float safetensors checkpoint into a new folder, tensor by tensor",
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
        "id (org/name) when the Hub is reachable",
    )
    c.add_argument("dst", metavar="DST", help="output folder; must not exist unless --overwrite")
    _add_config_options(c)
    out = c.add_argument_group("output")
    out.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float16", "float32"],
        help="load dtype, as from_pretrained(dtype=...): float tensors are stored in it and weights are "
        "cast to it before quantizing; auto = config.json's dtype, else the checkpoint's (default auto)",
    )
    out.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default="2GB",
        metavar="SIZE",
        help="largest output shard, e.g. 500MB or 5GB. Memory peaks near one source tensor plus twice "
        "one shard (safetensors copies a shard to bytes as it writes it) (default 2GB)",
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
    out.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once DST is complete)")
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
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")

    i = sub.add_parser(
        "inspect",
        help="show what a checkpoint holds: quantized layers, float tensors, sizes, config",
        description="Read the safetensors headers of PATH (no tensor is loaded) and report, per layer kind, the bits, "
        "group size and bytes of the quantized layers, the float tensors, totals against the float size, the "
        "quantization config, and every Linear/Conv1D layer left in float with the reason.",
    )
    i.add_argument("path", metavar="PATH", help="checkpoint folder")
    i.add_argument("--json", action="store_true", help="print the report as JSON (for scripts)")

    v = sub.add_parser(
        "verify",
        help="check a quantized checkpoint against its config without loading it; exit 1 listing the problems",
        description="Read config.json, the index and the safetensors headers of PATH (never a weight, never code) "
        "and check that every shard the index names exists and holds its tensors, that every tensor has the name, "
        "dtype and shape quantization_config gives it, and the sha256 sums recorded in hfquant.sha256.json.",
    )
    v.add_argument("path", metavar="PATH", help="checkpoint folder")
    v.add_argument(
        "--write-checksums",
        action="store_true",
        help="when no problem is found, record the sha256 of config.json, the index and the shards in "
        "hfquant.sha256.json (for a folder written by save_pretrained)",
    )

    e = sub.add_parser(
        "eval",
        help="measure perplexity and decode speed, next to a float baseline",
        description="Load PATH (and --baseline) with from_pretrained on the CPU and measure perplexity on a text "
        "(default: CPython's own pydoc_data.topics, no download) and greedy batch-1 decode speed. The results are "
        "saved as hfquant_eval.json in PATH and shown in its model card (README.md, if hfquant wrote it).",
    )
    e.add_argument("path", metavar="PATH", help="quantized checkpoint folder (a causal LM)")
    e.add_argument("--baseline", metavar="SRC", help="float checkpoint to measure the same way (folder or repo id)")
    e.add_argument(
        "--text-file", type=Path, metavar="FILE", help="UTF-8 text for the perplexity instead of the built-in one"
    )
    e.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="score only the first N tokens (default all)"
    )
    e.add_argument(
        "--max-length", type=int, default=512, metavar="N", help="perplexity window in tokens (default 512)"
    )
    e.add_argument(
        "--new-tokens", type=int, default=64, metavar="N", help="tokens generated per speed run (default 64)"
    )
    e.add_argument("--repeats", type=int, default=3, metavar="N", help="speed runs; the best counts (default 3)")
    e.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the speed runs")
    e.add_argument(
        "--no-save", dest="save", action="store_false", help="do not write hfquant_eval.json nor update README.md"
    )
    e.add_argument("--json", action="store_true", help="print the results as JSON")

    p = sub.add_parser(
        "push",
        help="upload a checkpoint folder to the Hugging Face Hub in one commit",
        description="Create REPO_ID if needed and commit every file of PATH to it in a single commit, with the "
        "model card rendered for REPO_ID (a README.md that hfquant did not write is uploaded unchanged). Uses the "
        "token of `hf auth login` or HF_TOKEN, and HF_ENDPOINT when set.",
    )
    p.add_argument("path", metavar="PATH", help="checkpoint folder (from hfquant convert or save_pretrained)")
    p.add_argument("repo_id", metavar="REPO_ID", help="model repo, org/name")
    p.add_argument(
        "--private",
        action="store_true",
        default=None,
        help="create the repo private (an existing repo keeps its visibility)",
    )
    p.add_argument(
        "--revision", default=None, metavar="BRANCH", help="branch to commit to, created if missing (default main)"
    )
    p.add_argument(
        "--commit-message",
        default=None,
        metavar="MSG",
        help="commit title (default: Upload NAME quantized with hfquant)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up when the Hub does not answer a connection, read or write within SECONDS (default: "
        f"${HUB_TIMEOUT_ENV} or {DEFAULT_HUB_TIMEOUT:g})",
    )

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
        type=_shard_size,
        default="2GB",
        metavar="SIZE",
        help="largest output shard, e.g. 500MB or 5GB (default 2GB)",
    )
    x.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once DST is complete)")

    m = sub.add_parser(
        "import",
        help="turn a compressed-tensors pack-quantized checkpoint (llm-compressor W4A16 / W8A16) into an hfquant one",
        description="Write the compressed-tensors pack-quantized checkpoint SRC (int4 or int8 weights, symmetric or "
        "asymmetric, group or channel scales) as the hfquant checkpoint DST, bit for bit, so that it runs on "
        "hfquant's kernels. Activation or kv-cache quantization, actorder / g_idx and other formats are refused "
        "with the reason. DST is written into a temporary folder and renamed at the end.",
    )
    m.add_argument("src", metavar="SRC", help="compressed-tensors checkpoint folder")
    m.add_argument("dst", metavar="DST", help="output folder; must not exist unless --overwrite")
    m.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default="2GB",
        metavar="SIZE",
        help="largest output shard, e.g. 500MB or 5GB (default 2GB)",
    )
    m.add_argument("--overwrite", action="store_true", help="replace DST if it exists (only once DST is complete)")
    return parser


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


# -- commands ------------------------------------------------------------------------------------------------------


def check_source_config(folder: str | Path) -> None:
    """Refuse, in one line naming the file and the fix, a local SRC whose config.json transformers would fail on with a
    traceback or a page of text (`read_model_config`). A folder without config.json is left to `convert` to report."""
    folder = Path(folder).expanduser()
    if (folder / CONFIG_NAME).is_file():
        read_model_config(folder)


def _convert(args: argparse.Namespace) -> int:
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
        base_model=args.base_model,
        progress=args.progress,
        card=args.card,
    )
    print(
        f"wrote {result.dst}: {result.quantized_layers} tensors quantized, {result.float_tensors} kept in float, "
        f"{len(result.shards)} shard(s), {human_bytes(result.weight_bytes)} of tensors "
        f"(source {human_bytes(result.source_weight_bytes)}) in {result.seconds:.1f} s"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def evaluate(
    path: str,
    baseline: str | None = None,
    text_file: Path | None = None,
    max_tokens: int | None = None,
    max_length: int = 512,
    new_tokens: int = 64,
    repeats: int = 3,
    prompt: str = DEFAULT_PROMPT,
) -> dict[str, Any]:
    """Perplexity and decode tokens/s of `path` (and of `baseline`), one model in memory at a time.

    Returns a JSON-native dict: text (what was scored), tokens, max_length, new_tokens, device, and results (one row
    per model: label, path, perplexity, tokens_per_second).

    Raises:
        ValueError: a model is not a causal LM, or the text is too short.
        OSError: a path or the text file cannot be read.
    """
    if text_file is not None:
        text = Path(text_file).read_text(encoding="utf-8")
        text_name = f"`{Path(text_file).name}` ({len(text)} characters)"
    else:
        text = reference_text()
        text_name = (
            f"CPython's `pydoc_data.topics` (Python {platform.python_version()}, first "
            f"{DEFAULT_REFERENCE_CHARS} characters)"
        )
    rows, tokens = [], None
    for role, source in (("quantized", path), ("baseline", baseline)):
        if source is None:
            continue
        folder = resolve_source(source)
        config = AutoConfig.from_pretrained(folder)
        if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or []):
            raise ValueError(f"{source} is a {config.architectures}, not a causal LM; eval measures causal LMs only")
        qconfig = getattr(config, "quantization_config", None)
        qconfig = qconfig if isinstance(qconfig, dict) else (qconfig.to_dict() if qconfig is not None else None)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()
        if tokens is None:
            tokens = int(tokenizer(text, return_tensors="pt")["input_ids"].shape[1])
            tokens = min(tokens, max_tokens) if max_tokens else tokens
        dtype = dtype_name(model.dtype)
        kind = f"hfquant int{qconfig['bits']}" if qconfig and qconfig.get("quant_method") == "hfquant" else dtype
        label = f"{'this model' if role == 'quantized' else Path(str(source)).name} ({kind})"
        logger.info("measuring %s", label)
        rows.append(
            {
                "label": label,
                # a folder's name, never its absolute path: this file is meant for the Hub, not machine-specific
                "path": Path(str(source)).expanduser().name
                if Path(str(source)).expanduser().exists()
                else str(source),
                "perplexity": perplexity(
                    model, tokenizer, text, max_length=max_length, stride=max_length, max_tokens=max_tokens
                ),
                "tokens_per_second": decode_tokens_per_second(
                    model, tokenizer, prompt, new_tokens=new_tokens, repeats=repeats
                ),
            }
        )
        del model
        gc.collect()
    return {
        "text": text_name,
        "tokens": tokens,
        "max_length": max_length,
        "new_tokens": new_tokens,
        "device": f"CPU ({torch.get_num_threads()} threads, torch {torch.__version__})",
        "results": rows,
    }


def _eval(args: argparse.Namespace) -> int:
    measured = evaluate(
        args.path,
        args.baseline,
        args.text_file,
        args.max_tokens,
        args.max_length,
        args.new_tokens,
        args.repeats,
        args.prompt,
    )
    if args.json:
        print(json.dumps(measured, indent=2))
    else:
        width = max(len(row["label"]) for row in measured["results"])
        print(
            f"perplexity on {measured['text']}, {measured['tokens']} tokens; decode: {measured['new_tokens']} new tokens, batch 1"
        )
        print(f"{'model':<{width}}  {'perplexity':>10}  {'decode tok/s':>12}")
        for row in measured["results"]:
            print(f"{row['label']:<{width}}  {row['perplexity']:>10.3f}  {row['tokens_per_second']:>12.1f}")
    folder = Path(args.path)
    if args.save and folder.is_dir():
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
    return 0


def _push(args: argparse.Namespace) -> int:
    info = push_folder(
        args.path,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        commit_message=args.commit_message,
        timeout=args.timeout,
    )
    print(f"pushed {args.path} to {args.repo_id}: {info.commit_url}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    result = verify(args.path)
    for note in result.notes:
        print(f"note: {note}")
    if result.problems:
        print(f"hfquant: {args.path}: {len(result.problems)} problem(s):", file=sys.stderr)
        for problem in result.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    if args.write_checksums:
        print(f"recorded sha256 sums in {write_checksums(args.path)}")
    print(
        f"ok: {args.path}: {result.tensors} tensors in {result.files} file(s) match the config"
        + (f", {result.checksums} sha256 sums match" if result.checksums else "")
    )
    return 0


def _export(args: argparse.Namespace) -> int:
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


def _import(args: argparse.Namespace) -> int:
    result = import_checkpoint(args.src, args.dst, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(
        f"wrote {result.dst}: {result.quantized_layers} layers imported in {result.config_groups} format(s), "
        f"{len(result.shards)} shard(s) in {result.seconds:.1f} s"
    )
    return 0


_COMMANDS = {
    "convert": _convert,
    "inspect": _inspect,
    "eval": _eval,
    "push": _push,
    "verify": _verify,
    "export": _export,
    "import": _import,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hfquant` console script; returns the exit code."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.getLogger("hfquant").setLevel(logging.INFO)
    interrupted: list[int] = []
    previous = _record_sigint(interrupted)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        parser.exit(130, _INTERRUPTED)
    except MemoryError as error:
        if interrupted:
            parser.exit(130, _INTERRUPTED)
        parser.exit(
            1,
            f"hfquant: error: out of memory{f' ({error})' if str(error) else ''}; close other programs or "
            f"use a machine with more memory{_MEMORY_HINTS.get(args.command, '')} (an unfinished DST is "
            "removed; an existing one is left as it was)\n",
        )
    except Exception as error:
        # Ctrl-C inside some C extensions (torch, safetensors) surfaces as another exception; it is still Ctrl-C
        if interrupted:
            parser.exit(130, _INTERRUPTED)
        if isinstance(error, (ValueError, TypeError)):
            parser.exit(2, f"hfquant: error: {error}\n")
        if isinstance(error, (OSError, HubError)):
            parser.exit(1, f"hfquant: error: {error}\n")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 2


_MEMORY_HINTS = {
    "convert": ", or lower the peak: a smaller --max-shard-size, --workers 0 (each worker holds its own tensors)",
    "eval": ", or a smaller --max-length",
}
"""What lowers the peak memory of each command, for the out-of-memory message."""

_INTERRUPTED = "hfquant: interrupted (an unfinished DST is removed; an existing one is left as it was)\n"


def _record_sigint(received: list[int]):
    """Replace the default SIGINT handler by one that raises KeyboardInterrupt as it does and also appends to
    `received`, so that an exception a C extension made out of the interrupt is still reported as one (exit status
    130). Returns the handler to restore, or None when nothing was changed (not the main thread, or a custom
    handler is installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        return None

    def handler(signum, frame):
        received.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, handler)
    return previous


if __name__ == "__main__":
    sys.exit(main())
