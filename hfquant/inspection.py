"""`hfquant inspect`: what a checkpoint folder holds, read from the safetensors headers (no tensor is loaded).

A stored tensor `X` is quantized when the files also hold `X_scale` or, for a layer weight `P.weight`,
`P.weight_scale` (docs/format.md); its bit width and group size follow from the stored shapes and the float shape of
`X`, which the model skeleton built on the meta device from config.json gives. Tensors are grouped by kind: the
dotted name with layer indices replaced by `*` (`model.layers.*.mlp.down_proj`). A layer's method is "sinq" when it
stores a column scale, "sinq (folded)" when the config folded SINQ's column scales into the model
(`fold_column_scales`) and the layer, in a folded block, stores plain codes, else "rtn"; its group is "per-channel"
when one group spans its inputs.

`inspect_checkpoint(path)` returns a JSON-native report; `format_report(report)` renders it as text.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from hfquant.checkpoint.files import CONFIG_NAME, TensorHeader, read_config, read_headers, tensor_files
from hfquant.checkpoint.schema import block_layers
from hfquant.config import QUANT_METHOD, HfQuantConfig, matches_module
from hfquant.core import blocks
from hfquant.core.dtypes import dtype_name, torch_dtype
from hfquant.core.format import Method
from hfquant.core.text import terminal_safe
from hfquant.integration.folding import find_blocks
from hfquant.integration.quantizer import plan_model
from hfquant.integration.schema_check import check_checkpoint_schema
from hfquant.integration.skeleton import build_skeleton
from hfquant.nn.replace import linear_shape, output_embedding

__all__ = [
    "FOLDED_SINQ",
    "inspect_checkpoint",
    "format_report",
    "layer_kind",
    "human_bytes",
    "bits_text",
    "group_text",
]

FOLDED_SINQ = "sinq (folded)"
"""The method of a layer quantized with SINQ whose column scales were folded into the model (`fold_column_scales`):
stored as plain round-to-nearest codes, computed from the rescaled weights."""

logger = logging.getLogger(__name__)


def layer_kind(name: str) -> str:
    """`model.layers.12.mlp.down_proj` -> `model.layers.*.mlp.down_proj` (every all-digit component becomes `*`)."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _read_headers(folder: Path) -> tuple[dict[str, TensorHeader], int]:
    """{tensor name: header} from every shard's header, and the files' total size in bytes."""
    files = tensor_files(folder)
    tensors = {}
    for path in dict.fromkeys(files.values()):
        tensors.update(read_headers(path))
    return tensors, sum(p.stat().st_size for p in set(files.values()))


def _float_skeleton(folder: Path):
    """The float model on the meta device (no weights), or None when the architecture cannot be built here."""
    try:
        model, _, _ = build_skeleton(folder, "auto", None)
    except (ValueError, OSError, ImportError, TypeError, KeyError, AttributeError) as error:
        logger.warning(
            "cannot build the model skeleton of %s (%s); layer shapes come from the config only", folder, error
        )
        return None
    return model


_OVERRIDES_SHOWN = 4
"""module_overrides with more entries than this are summarized on the config line (the table lists every format)."""


def _shown(field: str, value) -> str:
    """A config value as the report's first line shows it: long `module_overrides` (the data-free rule writes one entry
    per layer it changes) as a count with their distinct settings."""
    if field != "module_overrides" or not isinstance(value, dict) or len(value) <= _OVERRIDES_SHOWN:
        return str(value)
    settings = sorted({json.dumps(v, sort_keys=True) for v in value.values()})
    return f"{{{len(value)} layers: {', '.join(settings)}; per layer in the table below}}"


def bits_text(row: dict) -> str:
    """A quantized row's stored width as a reader says it: "4" for an integer format, "4 (iq4_xs)" for a block type."""
    return str(row["bits"]) if row.get("format", "int") == "int" else f"{row['bits']} ({row['format']})"


def group_text(row: dict) -> str:
    """A quantized row's group as a reader says it: "per-channel" (one group spans the inputs), else its size."""
    return "per-channel" if row.get("per_channel") else str(row["group_size"])


def _folded_layers(model, qconfig: dict | None) -> set[str]:
    """The Linear layers of `model`'s foldable blocks (`find_blocks`) whose method, as asked, is SINQ, when the config
    folded column scales: those stored without a column scale are SINQ folded into the model. The asked method is
    the config's, or a pattern's of `module_overrides`; the entries naming such a layer exactly state its stored
    format (RTN once folded), so they are left out."""
    if model is None or not qconfig or qconfig.get("fold_column_scales") is not True:
        return set()
    layers = {name for block in find_blocks(model) for name in block._asdict().values() if not name.endswith("norm")}
    try:
        overrides = {p: s for p, s in (qconfig.get("module_overrides") or {}).items() if p not in layers}
        config = HfQuantConfig.from_dict({**qconfig, "module_overrides": overrides})
    except (TypeError, ValueError):
        return set()
    return {name for name in layers if config.layer_settings(name)[3] is Method.SINQ}


def _float_layer_reasons(model, qconfig: dict | None, quantized_modules: set[str], stored: set[str]) -> list[dict]:
    """Linear / Conv1D layers of `model` that are not quantized in the files, each with the reason."""
    plans = {}
    user_skip: list[str] = []
    if qconfig is not None:
        config = HfQuantConfig.from_dict(qconfig)
        user_skip = list(config.modules_to_not_convert)
        _, layer_plans = plan_model(model, config)
        plans = {plan.name: plan for plan in layer_plans}
    tied = {t.removesuffix(".weight"): s for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()}
    head = None
    output = output_embedding(model)
    for name, module in model.named_modules():
        if module is output:
            head = name
    rows = []
    for name, module in model.named_modules():
        if linear_shape(module) is None or name in quantized_modules:
            continue
        source = tied.get(name)
        if source is not None and f"{name}.weight" not in stored:
            source_module = source.removesuffix(".weight")
            state = "quantized" if source_module in quantized_modules else "float"
            rows.append({"name": name, "reason": f"tied to {source}: stored once, {state}"})
            continue
        plan = plans.get(name)
        if matches_module(name, user_skip):
            reason = "listed in modules_to_not_convert"
        elif name == head:
            reason = "output embedding (lm_head), kept in float"
        elif plan is not None and plan.group_size is None and plan.reason != "modules_to_not_convert":
            reason = plan.reason
        elif plan is not None and plan.group_size is None:
            reason = "kept in float by transformers (_keep_in_fp32_modules or the model's own skip list)"
        else:
            reason = "stored in float although the config plans it quantized (written by another tool?)"
        rows.append({"name": name, "reason": reason})
    return rows


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Report on the checkpoint folder `path`: quantized and float tensors per kind, totals, config, float layers.

    Returns a JSON-native dict with keys: path, architecture, dtype, quantization_config (or None), quantized (one
    row per kind / bits / group / symmetry / method: count, bits, group_size, per_channel (one group spans the
    inputs), symmetric, method ("rtn", "sinq" or `FOLDED_SINQ`), bytes, float_bytes), float_tensors (one row per kind / dtype),
    float_layers (Linear / Conv1D layers not quantized, grouped by kind and reason, with a count), totals
    (tensor_bytes, file_bytes, float_bytes, ratio).

    Raises:
        FileNotFoundError: `path` has no config.json or no safetensors checkpoint.
        ValueError: config.json or the index malformed (`read_config`, `read_index`), naming the file and the fix; an
            hfquant checkpoint whose tensors do not match its config.json (`check_checkpoint_schema`: the message a
            pre-quantized load and `hfquant verify` give).
    """
    folder = Path(path).expanduser()
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{folder} has no config.json; PATH must be a transformers checkpoint folder")
    config_json = read_config(folder)
    qconfig = config_json.get("quantization_config")
    if qconfig is not None and qconfig.get("quant_method") == QUANT_METHOD:
        check_checkpoint_schema(folder)  # a report of tensors config.json does not describe would mislead
    tensors, file_bytes = _read_headers(folder)
    float_dtype = str(config_json.get("dtype") or config_json.get("torch_dtype") or "float32")
    try:
        float_itemsize = torch_dtype(float_dtype).itemsize
    except ValueError:
        float_itemsize = 4

    model = _float_skeleton(folder)
    float_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()} if model is not None else {}
    folded = _folded_layers(model, qconfig)
    quantized, quantized_modules, consumed = _quantized_rows(tensors, float_shapes, qconfig, float_itemsize, folded)
    float_rows = _float_rows(tensors, consumed)
    layers: dict[tuple, dict] = {}
    if model is not None and qconfig is not None:
        for item in _float_layer_reasons(model, qconfig, quantized_modules, set(tensors)):
            key = (layer_kind(item["name"]), item["reason"])
            layers.setdefault(key, {"kind": key[0], "count": 0, "reason": key[1]})["count"] += 1

    tensor_bytes = sum(header.nbytes for header in tensors.values())
    float_bytes = sum(r["float_bytes"] for r in quantized) + sum(r["bytes"] for r in float_rows)
    return {
        "path": str(folder),
        "architecture": (config_json.get("architectures") or [None])[0],
        "dtype": float_dtype,
        "quantization_config": qconfig,
        "quantized": sorted(quantized, key=lambda r: _natural(r["kind"])),
        "float_tensors": sorted(float_rows, key=lambda r: _natural(r["kind"])),
        "float_layers": sorted(layers.values(), key=lambda r: _natural(r["kind"])),
        "totals": {
            "tensors": len(tensors),
            "quantized_layers": sum(r["count"] for r in quantized),
            "tensor_bytes": tensor_bytes,
            "file_bytes": file_bytes,
            "float_bytes": float_bytes,
            "ratio": tensor_bytes / float_bytes if float_bytes else None,
        },
    }


def _quantized_rows(
    tensors: dict[str, TensorHeader],
    float_shapes: dict[str, tuple],
    qconfig: dict | None,
    float_itemsize: int,
    folded: set[str],
) -> tuple[list[dict], set[str], set[str]]:
    """(one row per kind / bits / group / symmetry / method of the quantized tensors: count, bytes, float_bytes; the
    quantized modules; every stored tensor that belongs to a quantized one). A tensor `X` is quantized when `X_scale`
    or, for `P.weight`, `P.weight_scale` is stored; its bits follow from the float shape (`float_shapes`, else the
    config's bits); its method is "sinq" with a stored column scale, `FOLDED_SINQ` for a layer of `folded` without
    one, else "rtn"."""
    quantized: dict[tuple, dict] = {}
    quantized_modules: set[str] = set()
    consumed: set[str] = set()
    hfquant = bool(qconfig) and qconfig.get("quant_method") == QUANT_METHOD
    blocks_of = block_layers(HfQuantConfig.from_dict(qconfig), tensors) if hfquant else {}
    block_of = {module + ".weight": fmt for module, fmt in blocks_of.items()}
    for name, header in tensors.items():
        if name in block_of:
            _add_block_row(quantized, name, header, tensors, block_of[name], folded, float_itemsize)
            module = name.rpartition(".")[0]
            quantized_modules.add(module)
            consumed.update(n for n in (name, module + ".weight_col_scale") if n in tensors)
            continue
        scale_name = name[: -len("weight")] + "weight_scale" if name.endswith("weight") else None
        if scale_name not in tensors:
            scale_name = f"{name}_scale"
            if scale_name not in tensors:
                continue
        module = name.rpartition(".")[0] if name.endswith(".weight") else name
        quantized_modules.add(module)
        consumed.update(
            _add_int_row(quantized, name, scale_name, module, tensors, float_shapes, qconfig, folded, float_itemsize)
        )
    return list(quantized.values()), quantized_modules, consumed


def _add_int_row(
    quantized: dict,
    name: str,
    scale_name: str,
    module: str,
    tensors: dict[str, TensorHeader],
    float_shapes: dict[str, tuple],
    qconfig: dict | None,
    folded: set[str],
    itemsize: int,
) -> list[str]:
    """Count the int-format weight `name` (with its `scale_name`) into its row of `quantized` (kind, bits, group,
    symmetry, method); returns the stored tensors that belong to it."""
    zero_name = scale_name.removesuffix("scale") + "zero_point"
    col_name = scale_name.removesuffix("scale") + "col_scale"  # SINQ's column scale
    parts = [name, scale_name] + [n for n in (zero_name, col_name) if n in tensors]
    scale_shape = tensors[scale_name].shape
    groups = scale_shape[-1]
    rows = math.prod(scale_shape) // groups
    float_numel = math.prod(float_shapes[name]) if name in float_shapes else None
    stored_numel = math.prod(tensors[name].shape)
    if float_numel:
        bits = 8 if stored_numel == float_numel else 4
    else:
        bits = int((qconfig or {}).get("bits", 8))
        float_numel = stored_numel * 8 // bits
    in_features = float_numel // rows
    if col_name in tensors:
        method = Method.SINQ.value
    else:
        method = FOLDED_SINQ if module in folded else Method.RTN.value
    key = (layer_kind(module), bits, in_features // groups, zero_name not in tensors, method)
    row = quantized.setdefault(
        key,
        {
            "kind": key[0],
            "count": 0,
            "bits": bits,
            "group_size": key[2],
            "per_channel": groups == 1,
            "symmetric": key[3],
            "method": method,
            "format": "int",
            "bytes": 0,
            "float_bytes": 0,
        },
    )
    row["count"] += 1
    row["bytes"] += sum(tensors[p].nbytes for p in parts)
    row["float_bytes"] += float_numel * itemsize
    return parts


def _add_block_row(quantized: dict, name: str, header: TensorHeader, tensors, fmt: str, folded, itemsize) -> None:
    """Count the block-format weight `name` into its row of `quantized` (kind, format, method)."""
    layout = blocks.layout(fmt)
    module = name.rpartition(".")[0]
    col_name = module + ".weight_col_scale"
    method = Method.SINQ.value if col_name in tensors else FOLDED_SINQ if module in folded else Method.RTN.value
    key = (layer_kind(module), layout.name, method)
    row = quantized.setdefault(
        key,
        {
            "kind": key[0],
            "count": 0,
            "bits": layout.bits,
            "group_size": layout.block_size,
            "per_channel": False,
            "symmetric": layout.symmetric,
            "method": method,
            "format": layout.name,
            "bytes": 0,
            "float_bytes": 0,
        },
    )
    rows, row_bytes = header.shape
    row["count"] += 1
    row["bytes"] += header.nbytes + (tensors[col_name].nbytes if col_name in tensors else 0)
    row["float_bytes"] += rows * layout.in_features_of(row_bytes) * itemsize


def _float_rows(tensors: dict[str, TensorHeader], consumed: set[str]) -> list[dict]:
    """One row per kind / dtype of the stored tensors not in `consumed`: count, dtype, bytes."""
    float_rows: dict[tuple, dict] = {}
    for name, header in tensors.items():
        if name in consumed:
            continue
        key = (layer_kind(name), dtype_name(header.dtype))
        row = float_rows.setdefault(key, {"kind": key[0], "count": 0, "dtype": key[1], "bytes": 0})
        row["count"] += 1
        row["bytes"] += header.nbytes
    return list(float_rows.values())


def _natural(text: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text)]


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return [line(header)] + [line(r) for r in rows]


def format_report(report: dict[str, Any]) -> str:
    """The text `hfquant inspect` prints for a report of `inspect_checkpoint`: each line `terminal_safe`, so that what
    the checkpoint names (tensors, classes, config strings) shows as escapes (`\\x1b`) rather than acting."""
    out = [f"{report['path']}: {report['architecture']}, float dtype {report['dtype']}"]
    qconfig = report["quantization_config"]
    if qconfig is None:
        out.append("quantization_config: none (a float checkpoint)")
    else:
        out.append("quantization_config: " + ", ".join(f"{k}={_shown(k, v)}" for k, v in qconfig.items()))
    if report["quantized"]:
        out.append("")
        rows = [
            [
                r["kind"],
                r["count"],
                bits_text(r),
                group_text(r),
                "yes" if r["symmetric"] else "no",
                r["method"],
                human_bytes(r["bytes"]),
                human_bytes(r["float_bytes"]),
            ]
            for r in report["quantized"]
        ]
        header = [
            "quantized layers",
            "count",
            "bits",
            "group",
            "symmetric",
            "method",
            "bytes",
            f"as {report['dtype']}",
        ]
        out += _table(header, rows, {1, 2, 3, 6, 7})
    if report["float_tensors"]:
        out.append("")
        rows = [[r["kind"], r["count"], r["dtype"], human_bytes(r["bytes"])] for r in report["float_tensors"]]
        out += _table(["float tensors", "count", "dtype", "bytes"], rows, {1, 3})
    totals = report["totals"]
    out.append("")
    line = (
        f"total: {totals['tensors']} tensors, {human_bytes(totals['tensor_bytes'])} "
        f"({human_bytes(totals['file_bytes'])} on disk)"
    )
    if totals["ratio"] is not None and qconfig is not None:
        line += (
            f" vs {human_bytes(totals['float_bytes'])} in {report['dtype']}: {totals['ratio']:.2f}x the float "
            f"size ({1 / totals['ratio']:.2f}x smaller)"
        )
    out.append(line)
    if report["float_layers"]:
        out.append("")
        out.append("Linear/Conv1D layers not quantized:")
        for r in report["float_layers"]:
            count = f" (x{r['count']})" if r["count"] > 1 else ""
            out.append(f"  {r['kind']}{count}: {r['reason']}")
    return "\n".join(terminal_safe(line) for line in out)
