"""`hfquant inspect model.gguf`: a GGUF file's tensor types, bits per weight, and what hfquant keeps of each.

The report reads the file's header and tensor table only (gguf-py's memory-mapped reader; no tensor is decoded).
Everything the file names (architecture, tensor names) is untrusted text: `format_gguf_report` shows it through
`terminal_safe`.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from hfquant.core.text import terminal_safe
from hfquant.inspection import _natural, _table, human_bytes

__all__ = ["format_gguf_report", "inspect_gguf"]


def _status(tensor, block_name, float_types) -> str:
    """What `from_gguf` does with a tensor of this type: kept in its blocks, float, or decoded to float."""
    if block_name(tensor) is not None:
        return "blocks"
    return "float" if tensor.ggml_type in float_types else "unsupported"


def inspect_gguf(path: str | os.PathLike) -> dict[str, Any]:
    """What the GGUF file `path` holds: {"path", "architecture", "file_bytes", "tensors": [{"name", "type",
    "shape", "bytes", "bits_per_weight", "hfquant"}], "types": [{"type", "count", "weights", "bytes",
    "bits_per_weight", "hfquant"}], "weights", "tensor_bytes", "bits_per_weight"}. "hfquant" is "blocks" (a block
    format hfquant stores: a Linear layer keeps it), "float" (F32/F16/BF16) or "unsupported" (a Linear weight of that
    type is refused by `from_gguf`; an embedding or norm is decoded to float).

    Raises:
        ValueError: not a GGUF file gguf-py can read.
        ImportError: the gguf package is missing (with its pip command).
    """
    from hfquant.checkpoint import gguf_import  # imports gguf, an optional dependency

    path = Path(path)
    reader = gguf_import.open_gguf(path)
    architecture = gguf_import.file_architecture(reader)
    tensors = list(gguf_import.read_tensors(reader).values())
    del reader
    rows, types = [], {}
    for tensor in tensors:
        weights = 1
        for n in tensor.shape:
            weights *= n
        status = _status(tensor, gguf_import.block_name, gguf_import.FLOAT_TYPES)
        rows.append(
            {
                "name": tensor.name,
                "type": tensor.type_name,
                "shape": list(tensor.shape),
                "bytes": tensor.nbytes,
                "bits_per_weight": round(tensor.nbytes * 8 / weights, 4) if weights else 0.0,
                "hfquant": status,
            }
        )
        entry = types.setdefault(
            tensor.type_name, {"type": tensor.type_name, "count": 0, "weights": 0, "bytes": 0, "hfquant": status}
        )
        entry["count"] += 1
        entry["weights"] += weights
        entry["bytes"] += tensor.nbytes
    for entry in types.values():
        entry["bits_per_weight"] = round(entry["bytes"] * 8 / entry["weights"], 4) if entry["weights"] else 0.0
    weights = sum(entry["weights"] for entry in types.values())
    total = sum(entry["bytes"] for entry in types.values())
    return {
        "path": str(path),
        "architecture": architecture,
        "file_bytes": path.stat().st_size,
        "tensors": rows,
        "types": sorted(types.values(), key=lambda e: -e["bytes"]),
        "weights": weights,
        "tensor_bytes": total,
        "bits_per_weight": round(total * 8 / weights, 4) if weights else 0.0,
    }


def format_gguf_report(report: dict[str, Any]) -> str:
    """The text `hfquant inspect` prints for `inspect_gguf`'s report, every line `terminal_safe`."""
    out = [
        f"{report['path']}: GGUF, architecture {report['architecture'] or '(none)'}, "
        f"{len(report['tensors'])} tensors, {human_bytes(report['file_bytes'])}, "
        f"{report['bits_per_weight']:.3f} bits per weight overall"
    ]
    out.append("")
    out += _table(
        ["type", "tensors", "weights", "bytes", "bits/weight", "hfquant"],
        [
            [e["type"], e["count"], e["weights"], human_bytes(e["bytes"]), f"{e['bits_per_weight']:.3f}", e["hfquant"]]
            for e in report["types"]
        ],
        {1, 2, 3, 4},
    )
    out.append("")
    tensors = sorted(report["tensors"], key=lambda r: _natural(r["name"]))
    out += _table(
        ["tensor", "type", "shape", "bits/weight"],
        [[r["name"], r["type"], "x".join(str(n) for n in r["shape"]), f"{r['bits_per_weight']:.3f}"] for r in tensors],
        {3},
    )
    counts = Counter(r["hfquant"] for r in report["tensors"])
    out.append("")
    out.append(
        f"hfquant: {counts.get('blocks', 0)} tensor(s) in block types it stores (Linear layers keep their blocks, "
        f"embeddings are decoded to float), {counts.get('float', 0)} float, {counts.get('unsupported', 0)} in types "
        "without an hfquant layout (refused for a Linear layer)"
    )
    return "\n".join(terminal_safe(line) for line in out)
