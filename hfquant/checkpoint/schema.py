"""The stored-tensor schema: do the tensors of checkpoint files match what a prepared model skeleton expects?

A prepared skeleton is a model on the meta device whose layers hfquant already swapped (`QuantLinear`,
`QuantEmbedding`, `QuantExperts`): its `state_dict()` names every tensor the files must hold, and for hfquant's
stored tensors (their registered buffers: weight codes, weight_scale, weight_zero_point; docs/format.md) the exact
dtype and shape. Float tensors (parameters) must have the model's shape; their dtype is cast on load.

The file names of tensors are mapped to model names by the caller (transformers renames keys on load: the
integration layer computes that mapping), so this module needs only torch and the files' headers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from hfquant.checkpoint.files import TensorHeader, shape_text
from hfquant.core.dtypes import dtype_name

__all__ = ["Expected", "is_hfquant_module", "expected_tensors", "schema_problems", "value_problem", "problem_text"]

_FIX = (
    "the file does not match quantization_config in config.json: it was written by another tool or version, or "
    "config.json was edited; quantize the float checkpoint again (hfquant convert) or restore config.json"
)


class Expected(NamedTuple):
    """What one model tensor must be in the files."""

    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    exact: bool  # an hfquant stored tensor: dtype and shape must match exactly
    layer: str  # "4-bit QuantLinear (group size 32, asymmetric)" for hfquant tensors, else ""


def is_hfquant_module(module: nn.Module) -> bool:
    """Whether `module` is one of hfquant's quantized modules (its registered buffers are stored tensors)."""
    return type(module).__module__.split(".")[0] == "hfquant"


def _layer_text(module: nn.Module) -> str:
    """'4-bit QuantLinear (group size 32, asymmetric)': what a stored tensor's dtype and shape follow from."""
    details = []
    if getattr(module, "group_size", None) is not None:
        details.append(f"group size {module.group_size}")
    if isinstance(getattr(module, "symmetric", None), bool):
        details.append("symmetric" if module.symmetric else "asymmetric")
    bits = getattr(module, "bits", None)
    text = f"{bits}-bit {type(module).__name__}" if bits is not None else type(module).__name__
    return text + (f" ({', '.join(details)})" if details else "")


def expected_tensors(model: nn.Module) -> tuple[dict[str, Expected], dict[str, set[str]]]:
    """Every tensor `model.state_dict()` holds, and for each name the names sharing its tensor (tied weights)."""
    expected: dict[str, Expected] = {}
    state = model.state_dict()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        hfquant = is_hfquant_module(module)
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = prefix + name
            if key not in state:
                continue
            exact = hfquant and not isinstance(tensor, nn.Parameter)
            expected[key] = Expected(
                dtype_name(tensor.dtype), tuple(tensor.shape), exact, _layer_text(module) if exact else ""
            )
    aliases: dict[int, set[str]] = {}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        aliases.setdefault(id(tensor), set()).add(name)
    tied: dict[str, set[str]] = {}
    for names in aliases.values():
        for name in names:
            tied[name] = names - {name}
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.setdefault(target, set()).add(source)
    return expected, tied


def _ignored(model: nn.Module, key: str, attribute: str) -> bool:
    patterns = getattr(model, attribute, None) or []
    return any(re.search(pattern, key) for pattern in patterns)


def schema_problems(
    model: nn.Module, tensors: dict[str, TensorHeader], key_map: dict[str, str | None], loading: bool
) -> tuple[list[str], int]:
    """Compare the file tensors with the prepared skeleton `model`; returns (problems, tensors compared).

    Args:
        tensors: file tensor name -> header, for every tensor of the checkpoint.
        key_map: file tensor name -> model state_dict name as the loader renames it, None when a transformers
            weight converter fuses it (then it has no per-tensor shape to compare, and missing tensors are not judged).
        loading: True for a pre-quantized `from_pretrained`: only hfquant's stored tensors are compared (a float
            tensor of another shape is transformers' own business, e.g. with `ignore_mismatched_sizes=True`);
            False (verify): every tensor's shape, and file tensors the model lacks are problems too.
    """
    expected, tied = expected_tensors(model)
    problems: list[str] = []
    present: set[str] = set()
    fused = False
    compared = 0
    for file_key, header in tensors.items():
        model_key = key_map[file_key]
        if model_key is None:
            fused = True
            continue
        want = expected.get(model_key)
        if want is None:
            if not loading and not _ignored(model, file_key, "_keys_to_ignore_on_load_unexpected"):
                problems.append(
                    f"{file_key} (in {header.file}) is not a tensor of {type(model).__name__}; from_pretrained ignores "
                    "it: the files are from another model or config.json was changed"
                )
            continue
        present.add(model_key)
        if loading and not want.exact:
            continue
        compared += 1
        if want.exact:
            if dtype_name(header.dtype) != want.dtype or header.shape != want.shape:
                problems.append(
                    f"{file_key} in {header.file} is {header.describe()}, expected {want.dtype} "
                    f"{shape_text(want.shape)} for a {want.layer}; {_FIX}"
                )
        elif header.shape != want.shape:
            problems.append(
                f"{file_key} in {header.file} has shape {shape_text(header.shape)}, expected "
                f"{shape_text(want.shape)} for {type(model).__name__} as config.json describes it; {_FIX}"
            )
    if fused:
        return problems, compared
    tied_keys = getattr(model, "all_tied_weights_keys", None) or {}
    for model_key, want in expected.items():
        if model_key in present or (loading and not want.exact):
            continue
        if any(alias in present for alias in tied.get(model_key, ())):
            continue
        module_name, _, _ = model_key.rpartition(".")
        if any(alias in present for alias in tied.get(f"{module_name}.weight", ())):
            continue
        if model_key in tied_keys or _ignored(model, model_key, "_keys_to_ignore_on_load_missing"):
            continue
        what = f"{want.dtype} {shape_text(want.shape)}" + (f" of a {want.layer}" if want.exact else "")
        problems.append(
            f"{model_key} ({what}) is missing from the checkpoint files; it would be left uninitialized: copy the "
            "complete checkpoint again, or quantize the float checkpoint again"
        )
    return problems, compared


_VALUES_FIX = (
    "the file is damaged or was edited (a layer computing with it would give NaN or garbage): copy it again, or "
    "quantize the float checkpoint again"
)


def value_problem(key: str, tensor: torch.Tensor, bits: int) -> str | None:
    """What is impossible in the stored tensor `key` of a `bits`-bit hfquant layer, or None when nothing is.

    A scale (a name ending in "scale": `weight_scale`, SINQ's `weight_col_scale`, the experts' `*_scale`) must be
    finite and > 0; a zero point (a name ending in "zero_point") must lie in [0, 2**bits - 1]. Scales are a small
    fraction of a checkpoint's bytes, so this is cheap next to loading it.
    """
    if key.endswith("scale") and tensor.is_floating_point():
        bad = ~(torch.isfinite(tensor) & (tensor > 0))
        kind = "scale value(s); scales must be finite and > 0"
    elif key.endswith("zero_point"):
        bad = tensor.to(torch.int32) > 2**bits - 1
        kind = f"zero point(s) above {2**bits - 1}, the largest code at {bits} bits"
    else:
        return None
    if not bad.any():
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    first = tensor[index].item()
    return f"{key} holds {int(bad.sum())} impossible {kind} (first: {first} at index {index}); {_VALUES_FIX}"


def problem_text(problems: Iterable[str], limit: int = 20, what: str = "does not match its config") -> str:
    """One error message listing at most `limit` problems: "the hfquant checkpoint {what} (N problems): ..."."""
    problems = list(problems)
    lines = problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"the hfquant checkpoint {what} ({count}):\n  " + "\n  ".join(lines)
