"""Model cards for quantized checkpoints: metadata through huggingface_hub's `ModelCardData`, body from the Jinja
template `model_cards/hfquant.jinja`, rendered with `ModelCard.from_template`.

The card's YAML metadata has `base_model` (when known), `base_model_relation: quantized`, `library_name:
transformers`, tags (`hfquant`, each stored format: `iq4_xs`, `int8`, ...), and the license and languages of the base
model's own card when it is at hand. Its body shows the quantization config as a table, sizes against the float model
(`hfquant.inspection`), perplexity and decode speed when `hfquant eval` left `hfquant_eval.json` in the folder, and a
usage snippet. Every input is read from the checkpoint folder, so the card can be rendered again at any time (`hfquant
push` does, with the repo id in the snippet).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
from collections import Counter
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hfquant.checkpoint.files import EVAL_FILE, stays_inside
from hfquant.checkpoint.source import base_model_of
from hfquant.config import FIELD_NAMES, HfQuantConfig
from hfquant.core import blocks
from hfquant.core.format import format_name
from hfquant.core.text import terminal_safe
from hfquant.inspection import FOLDED_SINQ, bits_text, format_report, group_text, human_bytes, inspect_checkpoint
from hfquant.version import __version__

__all__ = [
    "CARD_MARKER",
    "TEMPLATE_PATH",
    "build_card",
    "write_card",
    "card_for_convert",
    "convert_command",
    "asked_settings",
    "install_lines",
    "previous_command",
    "is_hfquant_card",
    "read_base_model",
]

logger = logging.getLogger(__name__)


def _template_path() -> Path:
    package = Path(__file__).resolve().parents[1]
    installed = package / "model_cards" / "hfquant.jinja"  # a wheel carries model_cards/ inside the package
    return installed if installed.is_file() else package.parent / "model_cards" / "hfquant.jinja"


TEMPLATE_PATH = _template_path()
"""The card template: `model_cards/hfquant.jinja` at the root of the source tree (editable install), installed as
`hfquant/model_cards/hfquant.jinja` by a wheel."""
CARD_MARKER = "hfquant model card"
"""An HTML comment with this text marks a README.md that hfquant generated (and may therefore re-render)."""
_CARRIED_METADATA = ("license", "license_name", "license_link", "language")


def read_base_model(readme: Path) -> dict[str, Any]:
    """Metadata of an existing README.md card (empty dict when there is none or it cannot be parsed)."""

    if not readme.is_file() or not stays_inside(readme.parent, readme):
        return {}
    try:
        return ModelCard.load(readme, ignore_metadata_errors=True).data.to_dict()
    except (ValueError, OSError) as error:
        logger.info("cannot read the card metadata of %s: %s", readme, error)
        return {}


def is_hfquant_card(readme: Path) -> bool:
    """Whether `readme` is a card hfquant generated (those are re-rendered; a hand-written card is kept)."""
    if not stays_inside(readme.parent, readme):
        return False
    try:
        return CARD_MARKER in readme.read_text(encoding="utf-8")
    except OSError:
        return False


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|!&~#{}])")


def markdown_text(value: object) -> str:
    """`value` as literal text in the card's Markdown (prose, a table cell): `terminal_safe` (one line, controls as
    escapes), then every character Markdown or HTML acts on backslash-escaped (CommonMark shows `\\<` as `<`), so a
    name from the checkpoint cannot open a tag, a link, an image or a table cell. `"a<img src=x>|b"` ->
    `"a\\<img src=x\\>\\|b"`."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", terminal_safe(value))


def markdown_code(value: object) -> str:
    """`value` for a code span of the card (`` `NAME` ``), where backslashes show as typed: `terminal_safe`, with the
    backtick (which would end the span) and `|` (which would end a table cell) shown as `\\x60` and `\\x7c`."""
    return terminal_safe(value).replace("`", "\\x60").replace("|", "\\x7c")


def _python_string(value: str) -> str:
    """`value` for the inside of a double-quoted Python string in the card's usage snippet (one line)."""
    return terminal_safe(value).replace("\\", "\\\\").replace('"', '\\"')


def _config_rows(qconfig: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, value) rows of the card's quantization table, in `hfquant.config.FIELDS` order. `module_overrides`
    is summarized: the entries naming one layer (`_names_a_layer`, which the quantizer writes to record each layer's
    stored format) are counted, the table of formats below gives them; patterns are shown as written."""
    rows = []
    order = [k for k in FIELD_NAMES if k in qconfig] + sorted(k for k in qconfig if k not in FIELD_NAMES)
    for key in order:
        value = qconfig[key]
        if key == "group_size" and value is None:
            value = "per-channel (one scale per output row)"
        elif key == "modules_to_not_convert" and not value:
            value = "none"
        elif key == "module_overrides":
            value = _overrides_text(value or {})
        elif isinstance(value, (list, tuple)):
            rows.append((markdown_code(key), ", ".join(f"`{markdown_code(v)}`" for v in value)))
            continue
        rows.append((markdown_code(key), markdown_text(value)))
    return rows


def _names_a_layer(pattern: str) -> bool:
    """Whether a `module_overrides` key names one layer by its full name (it has a layer index: `model.layers.3.
    mlp.down_proj`), as the quantizer's entries do, rather than a pattern (`v_proj`, `model.layers.*.mlp.*`)."""
    return not any(ch in pattern for ch in "*?[") and any(part.isdigit() for part in pattern.split("."))


def _overrides_text(overrides: dict[str, Any]) -> str:
    """`module_overrides` in a table cell: patterns as JSON, entries naming a layer counted."""
    named = [p for p in overrides if _names_a_layer(p)]
    patterns = {p: s for p, s in overrides.items() if p not in named}
    parts = [f"`{json.dumps(patterns)}`"] if patterns else []
    if named:
        parts.append(f"{len(named)} layers by name, each with the format it is stored in (table below)")
    return "; ".join(parts) or "none"


def _format_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The quantized layers counted per stored format (bits, group, symmetric, method), most common first."""
    counts: Counter = Counter()
    for row in report["quantized"]:
        counts[(bits_text(row), group_text(row), row["symmetric"], row["method"])] += row["count"]
    return [
        {"bits": bits, "group": group, "symmetric": symmetric, "method": method, "count": count}
        for (bits, group, symmetric, method), count in counts.most_common()
    ]


_METHOD_TEXT = {
    "rtn": "round-to-nearest (integers: min/max scales; block types: each block's scales searched for the least "
    "error, as llama.cpp's quantizer does for its types)",
    "sinq": "SINQ (round-to-nearest after a per-input-column scale balanced by Sinkhorn iterations, arXiv "
    "2509.22944, stored as `weight_col_scale`)",
    FOLDED_SINQ: "SINQ with its column scales folded into the model (into the norms and the preceding projections, "
    "an exact identity), so the layers are stored in their plain format with no extra vector",
}


def _methods_text(report: dict[str, Any]) -> str:
    """The methods of the quantized layers, named as the tables name them (`sinq (folded)`: ...)."""
    methods = sorted({row["method"] for row in report["quantized"]}, key=list(_METHOD_TEXT).index)
    return "; ".join(f"`{m}`: {_METHOD_TEXT[m]}" for m in methods) or "none"


def _auto_class(architecture: str | None) -> str:
    if architecture and architecture.endswith(("ForCausalLM", "LMHeadModel")):
        return "AutoModelForCausalLM"
    return "AutoModel"


def _versions() -> dict[str, str]:

    return {
        "hfquant_version": __version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }


def build_card(
    folder: str | os.PathLike,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    base_card: str | os.PathLike | None = None,
    command: str | None = None,
    name: str | None = None,
    template_path: str | os.PathLike | None = None,
):
    """The `huggingface_hub.ModelCard` of the quantized checkpoint in `folder`.

    Args:
        folder: the quantized checkpoint (config.json with `quantization_config`, safetensors files).
        repo_id: Hub repo id for the usage snippet; default "<your-username>/<folder name>".
        base_model: Hub repo id of the float model; default: the `base_model` of the card already in `folder`.
        base_card: README.md of the float model; its license and languages are carried over.
        command: how the checkpoint was made, shown in the card; default: the command of the hfquant card already in
            `folder`, else the `hfquant convert` command that makes it from `base_model` with the settings of its
            config (`asked_settings`).
        name: the checkpoint's name (default: the folder's name; `convert` passes DST's while writing a temporary
            folder).
        template_path: Jinja template; default `model_cards/hfquant.jinja`.

    Raises:
        ValueError: `folder` holds no `quantization_config` of hfquant, or `base_model` is not a repo id.
        FileNotFoundError: the template is missing (hfquant installed without its `model_cards/` folder).
    """

    folder = Path(folder)
    name = name or folder.name
    report = inspect_checkpoint(folder)
    qconfig = report["quantization_config"]
    if not qconfig or qconfig.get("quant_method") != "hfquant":
        raise ValueError(f"{folder} is not an hfquant checkpoint (config.json has no hfquant quantization_config)")
    previous = read_base_model(folder / "README.md") if is_hfquant_card(folder / "README.md") else {}
    base_model = base_model if base_model is not None else previous.get("base_model")
    if base_model is not None:
        try:
            validate_repo_id(base_model)
        except HFValidationError as error:
            raise ValueError(f"base_model {base_model!r} is not a Hub repo id (org/name): {error}") from None
    template = Path(template_path) if template_path is not None else TEMPLATE_PATH
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} is missing; reinstall hfquant from its source tree")

    bits = sorted({row["bits"] for row in report["quantized"]}) or [qconfig["bits"]]
    formats = _stored_formats(report)
    carried = (
        {k: v for k, v in read_base_model(Path(base_card)).items() if k in _CARRIED_METADATA} if base_card else {}
    )
    carried.update({k: v for k, v in previous.items() if k in _CARRIED_METADATA and k not in carried})
    methods = sorted({row["method"].split()[0] for row in report["quantized"]})  # "sinq (folded)" is sinq
    names = [format_name(fmt, width) for fmt, width in formats]
    tags = ["hfquant", *sorted(names), *[f"{b}-bit" for b in bits], "quantized", "weight-only", *methods]
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation" if _auto_class(report["architecture"]) == "AutoModelForCausalLM" else None,
        tags=tags,
        base_model_relation="quantized" if base_model else None,
        **carried,
    )
    eval_path = folder / EVAL_FILE
    evaluation = json.loads(eval_path.read_text(encoding="utf-8")) if eval_path.is_file() else None
    if command is None:
        command = previous_command(folder / "README.md") or convert_command(
            base_model or "SRC", name, asked_settings(qconfig, recorded=True)
        )
    values = _template_values(report, formats, base_model, evaluation)
    values.update(
        model_name=markdown_text(repo_id.split("/")[-1] if repo_id else name),
        repo_id=_python_string(repo_id or f"<your-username>/{name}"),
        command=terminal_safe(command),
        command_language="python" if "from_pretrained" in command else "bash",
    )
    logger.debug("card for %s:\n%s", folder, format_report(report))
    return ModelCard.from_template(card_data, template_path=str(template), **values)


def _stored_formats(report: dict[str, Any]) -> list[tuple[str, int]]:
    """(format, bits) of the quantized layers, most stored bytes first: [("iq4_xs", 4), ("iq4_nl", 4), ("int", 8)]."""
    stored: Counter = Counter()
    for row in report["quantized"]:
        stored[(row.get("format", "int"), row["bits"])] += row["bytes"]
    return [key for key, _ in stored.most_common()]


def _formats_text(qconfig: dict[str, Any], report: dict[str, Any], formats: list[tuple[str, int]]) -> str:
    """What the card's first sentence says the weights were quantized to, format by format: "IQ4_XS (llama.cpp's
    block type: 4.25 bits per weight, its scales inside each block of 256 inputs) and 8-bit integers (one scale per
    output channel)"."""
    phrases = []
    for fmt, bits in formats:
        if fmt == "int":
            rows = [r for r in report["quantized"] if r.get("format", "int") == "int" and r["bits"] == bits]
            phrases.append(f"{bits}-bit integers ({_int_granularity(qconfig, rows)})")
            continue
        layout = blocks.LAYOUTS[fmt]
        owner = "llama.cpp's" if layout.gguf else "hfquant's"
        phrases.append(
            f"{fmt.upper()} ({owner} block type: {layout.bits_per_weight:g} bits per weight, its scales inside each "
            f"block of {layout.block_size} inputs)"
        )
    return " and ".join(phrases) if len(phrases) < 3 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def _int_granularity(qconfig: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """How many inputs share a scale in the integer layers `rows`: "groups of 128 inputs per scale; 64 in some
    layers; one scale per output channel in others" (the config's group size first where it is an integer one)."""
    groups = Counter(row["group_size"] for row in rows if not row.get("per_channel"))
    if not groups:
        return "one scale per output channel"
    asked = qconfig.get("group_size") if qconfig.get("format", "int") == "int" else None
    main = asked if asked in groups else groups.most_common(1)[0][0]
    text = f"groups of {main} inputs per scale"
    others = sorted(group for group in groups if group != main)
    if others:
        text += f"; {' or '.join(map(str, others))} in some layers"
    if any(row.get("per_channel") for row in rows):
        text += "; one scale per output channel in others"
    return text


def _template_values(
    report: dict[str, Any], formats: list[tuple[str, int]], base_model: str | None, evaluation: dict | None
) -> dict[str, Any]:
    """The template's values that come from the checkpoint's files (`inspect_checkpoint`'s report, the evaluation)."""
    qconfig = report["quantization_config"]
    totals = report["totals"]
    architecture = report["architecture"]
    return dict(
        marker=f"{CARD_MARKER}: generated from the files of this folder; edit freely, or re-render with hfquant",
        base_model=base_model,
        architecture=markdown_code(architecture),
        formats_text=_formats_text(qconfig, report, formats),
        formats_tag="/".join(format_name(fmt, bits) for fmt, bits in formats),
        integer_layers=any(fmt == "int" for fmt, _ in formats),
        block_layers=any(fmt != "int" for fmt, _ in formats),
        gguf_blocks=all(blocks.LAYOUTS[fmt].gguf for fmt, _ in formats if fmt != "int"),
        methods_text=_methods_text(report),
        format_rows=_format_rows(report),
        install=install_lines(),
        symmetric=all(row["symmetric"] for row in report["quantized"] if row.get("format", "int") == "int"),
        dtype=report["dtype"],
        config_rows=_config_rows(qconfig),
        float_size=human_bytes(totals["float_bytes"]),
        quantized_size=human_bytes(totals["tensor_bytes"]),
        ratio=f"{totals['ratio']:.2f}x" if totals["ratio"] else "n/a",
        file_size=human_bytes(totals["file_bytes"]),
        layer_rows=[
            {
                **row,
                "bits": bits_text(row),
                "group": group_text(row),
                "kind": markdown_code(row["kind"]),
                "bytes": human_bytes(row["bytes"]),
                "float_bytes": human_bytes(row["float_bytes"]),
            }
            for row in report["quantized"]
        ],
        float_layers=[
            {**row, "kind": markdown_code(row["kind"]), "reason": markdown_text(row["reason"])}
            for row in report["float_layers"]
        ],
        evaluation=_shown_evaluation(evaluation),
        auto_class=_auto_class(architecture),
        **_versions(),
    )


def _shown_evaluation(evaluation: dict | None) -> dict | None:
    """`hfquant_eval.json` (a file of the folder, so untrusted) with its strings made `markdown_text`."""
    if not isinstance(evaluation, dict):
        return None
    shown = {key: markdown_text(value) if isinstance(value, str) else value for key, value in evaluation.items()}
    shown["results"] = [
        {**row, "label": markdown_text(row.get("label", ""))}
        for row in evaluation.get("results") or []
        if isinstance(row, dict)
    ]
    return shown


def _defaults(settings: dict[str, Any]) -> dict[str, Any]:
    """What `HfQuantConfig` resolves every field to at `settings`' bit width and format (the defaults of the int
    format differ from the 4-bit default's), with the format `bits` alone picks: a format is asked when it differs."""
    picked = HfQuantConfig(bits=settings["bits"]).to_dict()
    fmt = settings.get("format", picked["format"])
    return {**HfQuantConfig(bits=settings["bits"], format=fmt).to_dict(), "format": picked["format"]}


def asked_settings(qconfig: dict[str, Any], recorded: bool = False) -> dict[str, Any]:
    """The fields of `qconfig` (an `HfQuantConfig.to_dict()`) that differ from the defaults at its bit width, `bits`
    always: what a user gives to make the same checkpoint. With `recorded` (the config of a quantized checkpoint), the
    `module_overrides` entries naming one layer are left out: the quantizer wrote them to record each layer's
    stored format (group fallbacks, the data-free rule, the folds), and makes them again from the other fields."""
    defaults = _defaults(qconfig)
    settings = {"bits": qconfig["bits"]}
    for key, value in qconfig.items():
        if key == "module_overrides" and recorded:
            value = {p: s for p, s in (value or {}).items() if not _names_a_layer(p)}
        if key not in ("quant_method", "format_version", "bits") and defaults.get(key) != value:
            settings[key] = value
    return settings


def convert_command(src: str, dst: str, settings: dict[str, Any], dtype: str = "auto") -> str:
    """The `hfquant convert SRC DST ...` command line making a checkpoint with `settings` (`asked_settings`, or an
    `HfQuantConfig.to_dict()`), shell-quoted (`shlex.join`): pasted into a POSIX shell, it runs as is. `dtype`: the
    `--dtype` option, left out when "auto"."""
    parts = ["hfquant", "convert", src, dst]
    defaults = _defaults(settings)
    for key, value in settings.items():
        if key in ("quant_method", "format_version") or (key != "bits" and defaults.get(key) == value):
            continue
        flag = "--" + key.replace("_", "-")
        if key == "symmetric":
            parts.append("--symmetric" if value else "--asymmetric")
        elif isinstance(value, bool):
            parts.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, list):
            parts += [flag, *value]
        elif isinstance(value, dict):
            parts += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            parts += [flag, "none" if value is None else str(value)]
    if dtype != "auto":
        parts += ["--dtype", dtype]
    return shlex.join(parts)


_COMMAND = re.compile(r"^## How it was made$.*?^```(?:bash|python)\n(.*?)\n```", re.MULTILINE | re.DOTALL)


def previous_command(readme: Path) -> str | None:
    """The command of the "How it was made" section of the hfquant card `readme`, or None."""
    if not is_hfquant_card(readme):
        return None
    found = _COMMAND.search(readme.read_text(encoding="utf-8"))
    return found.group(1) if found else None


def install_lines() -> list[str]:
    """How a downloader installs hfquant, as shell lines: hfquant is not on PyPI; from its source repository when the
    installed package names one (`Project-URL` / `Home-page` metadata), else from a checkout of its source."""
    try:
        meta = metadata.metadata("hfquant")
        urls = [u.split(",", 1)[-1].strip() for u in meta.get_all("Project-URL") or []] + [meta.get("Home-page")]
    except metadata.PackageNotFoundError:
        urls = []
    url = next((u for u in urls if u and u.startswith("https://")), None)
    if url:
        return [f"pip install {shlex.quote(f'hfquant @ git+{url}')}"]
    return [
        "# hfquant is not on PyPI and names no public repository: install it from a copy of its source tree",
        "pip install ./hfquant    # the folder holding hfquant's pyproject.toml",
    ]


def write_card(folder: str | os.PathLike, **kwargs) -> Path:
    """Render the card of `folder` (arguments as `build_card`) and write it as `folder/README.md`; returns the path."""
    card = build_card(folder, **kwargs)
    path = Path(folder) / "README.md"
    card.save(path)
    return path


def card_for_convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    base_model: str | None = None,
    config: HfQuantConfig | None = None,
    dtype: str = "auto",
) -> Callable[[Path, Path], Path]:
    """`convert(src, dst, config, ..., before_publish=card_for_convert(src, dst, config=config))`: writes the card
    into the finished folder before it is published, as `hfquant convert` does. The card is named for `dst`, carries
    the license and languages of SRC's README.md, and names `base_model`, else SRC when it is a Hub repo id or a Hub
    cache folder (`base_model_of`). Its command is `convert_command` with the options `config` and `dtype` as the
    user gave them, from the base model when known, else from `src` as given; without `config`, the card's
    default."""
    name = Path(dst).expanduser().name

    def write(folder: Path, source: Path) -> Path:
        base = base_model if base_model is not None else base_model_of(src, source)
        command = None
        if config is not None:
            command = convert_command(base or str(src), name, asked_settings(config.to_dict()), dtype)
        return write_card(folder, base_model=base, base_card=source / "README.md", name=name, command=command)

    return write
