"""Model cards for quantized checkpoints: metadata through huggingface_hub's `ModelCardData`, body from the Jinja
template `model_cards/hfquant.jinja`, rendered with `ModelCard.from_template`.

The card's YAML metadata has `base_model` (when known), `base_model_relation: quantized`, `library_name:
transformers`, tags (`hfquant`, `int4` or `int8`, ...), and the license and languages of the base model's own card
when it is at hand. Its body shows the quantization config as a table, sizes against the float model
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hfquant.checkpoint.files import EVAL_FILE, stays_inside
from hfquant.checkpoint.source import base_model_of
from hfquant.config import FIELD_NAMES, HfQuantConfig
from hfquant.core.text import terminal_safe
from hfquant.inspection import format_report, human_bytes, inspect_checkpoint
from hfquant.version import __version__

__all__ = [
    "CARD_MARKER",
    "TEMPLATE_PATH",
    "build_card",
    "write_card",
    "card_for_convert",
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
    """(field, value) rows of the card's quantization table, in `hfquant.config.FIELDS` order."""
    rows = []
    order = [k for k in FIELD_NAMES if k in qconfig] + sorted(k for k in qconfig if k not in FIELD_NAMES)
    for key in order:
        value = qconfig[key]
        if key == "group_size" and value is None:
            value = "per-channel (one scale per output row)"
        elif key == "modules_to_not_convert" and not value:
            value = "none"
        elif isinstance(value, (list, tuple)):
            rows.append((markdown_code(key), ", ".join(f"`{markdown_code(v)}`" for v in value)))
            continue
        rows.append((markdown_code(key), markdown_text(value)))
    return rows


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
        command: how the checkpoint was made, shown in the card; default: the `hfquant convert` command that makes
            it from `base_model`.
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
    carried = (
        {k: v for k, v in read_base_model(Path(base_card)).items() if k in _CARRIED_METADATA} if base_card else {}
    )
    carried.update({k: v for k, v in previous.items() if k in _CARRIED_METADATA and k not in carried})
    tags = ["hfquant", *[f"int{b}" for b in bits], *[f"{b}-bit" for b in bits], "quantized", "weight-only", "rtn"]
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
        command = _convert_command(base_model or "SRC", name, qconfig)
    values = _template_values(report, bits, base_model, evaluation)
    values.update(
        model_name=markdown_text(repo_id.split("/")[-1] if repo_id else name),
        repo_id=_python_string(repo_id or f"<your-username>/{name}"),
        command=terminal_safe(command),
        command_language="python" if "from_pretrained" in command else "bash",
    )
    logger.debug("card for %s:\n%s", folder, format_report(report))
    return ModelCard.from_template(card_data, template_path=str(template), **values)


def _granularity(qconfig: dict[str, Any], report: dict[str, Any]) -> str:
    """How many inputs share a scale, as the card says it ("groups of 128 inputs per scale (...)")."""
    if qconfig.get("group_size") is None:
        return "one scale per output channel"
    groups = sorted({row["group_size"] for row in report["quantized"]})
    granularity = f"groups of {qconfig['group_size']} inputs per scale"
    fallback = [g for g in groups if g != qconfig["group_size"]]
    if fallback:
        granularity += (
            f" ({' or '.join(map(str, fallback))} in the layers whose input width "
            f"{qconfig['group_size']} does not divide)"
        )
    return granularity


def _template_values(
    report: dict[str, Any], bits: list[int], base_model: str | None, evaluation: dict | None
) -> dict[str, Any]:
    """The template's values that come from the checkpoint's files (`inspect_checkpoint`'s report, the evaluation)."""
    qconfig = report["quantization_config"]
    totals = report["totals"]
    architecture = report["architecture"]
    return dict(
        marker=f"{CARD_MARKER}: generated from the files of this folder; edit freely, or re-render with hfquant",
        base_model=base_model,
        architecture=markdown_code(architecture),
        bits_text=" / ".join(f"{b}-bit integers" for b in bits),
        bits_tag="/".join(f"int{b}" for b in bits),
        granularity=_granularity(qconfig, report),
        symmetric=all(row["symmetric"] for row in report["quantized"]),
        dtype=report["dtype"],
        config_rows=_config_rows(qconfig),
        float_size=human_bytes(totals["float_bytes"]),
        quantized_size=human_bytes(totals["tensor_bytes"]),
        ratio=f"{totals['ratio']:.2f}x" if totals["ratio"] else "n/a",
        file_size=human_bytes(totals["file_bytes"]),
        layer_rows=[
            {
                **row,
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


def _convert_command(src: str, dst: str, qconfig: dict[str, Any]) -> str:
    """The `hfquant convert` command line that makes a checkpoint with `qconfig`."""
    defaults = HfQuantConfig(bits=qconfig["bits"]).to_dict()
    parts = ["hfquant convert", shlex.quote(src), shlex.quote(dst)]  # names that a shell pasted into cannot run
    for key, value in qconfig.items():
        if key in ("quant_method", "format_version") or defaults.get(key) == value and key != "bits":
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--" + ("asymmetric" if key == "symmetric" else f"no-{key}"))
        elif isinstance(value, list):
            parts += [flag, *value]
        else:
            parts += [flag, "none" if value is None else str(value)]
    return " ".join(parts)


def write_card(folder: str | os.PathLike, **kwargs) -> Path:
    """Render the card of `folder` (arguments as `build_card`) and write it as `folder/README.md`; returns the path."""
    card = build_card(folder, **kwargs)
    path = Path(folder) / "README.md"
    card.save(path)
    return path


def card_for_convert(
    src: str | os.PathLike, dst: str | os.PathLike, base_model: str | None = None
) -> Callable[[Path, Path], Path]:
    """`convert(src, dst, ..., before_publish=card_for_convert(src, dst))`: writes the card into the finished folder
    before it is published, as `hfquant convert` does. The card is named for `dst`, carries the license and
    languages of SRC's README.md, and names `base_model`, else SRC when it is a Hub repo id or a Hub cache folder
    (`base_model_of`)."""
    name = Path(dst).expanduser().name

    def write(folder: Path, source: Path) -> Path:
        base = base_model if base_model is not None else base_model_of(src, source)
        return write_card(folder, base_model=base, base_card=source / "README.md", name=name)

    return write
