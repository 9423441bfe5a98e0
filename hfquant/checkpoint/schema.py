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
from hfquant.config import HfQuantConfig
from hfquant.core.dtypes import dtype_name, torch_dtype

__all__ = [
    "Expected",
    "is_hfquant_module",
    "expected_tensors",
    "schema_problems",
    "block_layers",
    "schema_error",
    "value_problem",
    "problem_text",
]

_FIX = (
    "the file does not match quantization_config in config.json: it was written by another tool or version, or "
    "config.json was edited; quantize the float checkpoint again (hfquant convert) or restore config.json"
)


def block_layers(config: HfQuantConfig, headers: dict[str, TensorHeader]) -> dict[str, str]:
    """{module: block format} of the layers stored in llama.cpp's block formats among the tensors `headers` (name ->
    header): a `P.weight` of uint8 blocks with no `P.weight_scale`, whose format `config.layer_settings(P)` names
    (docs/format.md, "Block formats"). The one reading of which stored layers are blocks (inspect, both exports)."""
    found = {}
    for name, header in headers.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and header.dtype == torch.uint8 and module + ".weight_scale" not in headers:
            fmt = config.layer_settings(module).format
            if fmt != "int":
                found[module] = fmt
    return found


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
    text += f" ({', '.join(details)})" if details else ""
    method = getattr(getattr(module, "format", None), "method", None)
    return text + (f", method {method}" if method is not None else "")


def _unused_problem(model: nn.Module, file_key: str, model_key: str, header: TensorHeader) -> str | None:
    """The problem of the file tensor `file_key` (`model_key` once renamed) that no tensor of `model` takes although
    its module is in `model` (a SINQ column scale of a layer config.json plans as RTN, a scale of a layer it keeps in
    float), or None when that module is not in `model` or the tensor names one of its non-persistent buffers (which a
    float model recomputes)."""
    module_name, _, attribute = model_key.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    if not is_hfquant_module(module) and attribute in module._non_persistent_buffers_set:
        return None
    where = f"{file_key} (in {header.file}) is not a tensor of {type(model).__name__} as config.json describes it"
    if is_hfquant_module(module):
        stored = [
            n for n, b in module._buffers.items() if b is not None and n not in module._non_persistent_buffers_set
        ]
        return (
            f"{where}: it makes {module_name or 'the model'} a {_layer_text(module)}, which stores {', '.join(stored)} "
            f"and no {attribute}, so from_pretrained would compute without it; {_FIX}"
        )
    return (
        f"{where}: it keeps {module_name or 'the model'} a float {type(module).__name__}, which has no {attribute}, "
        f"so from_pretrained would ignore it; {_FIX}"
    )


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

    The one schema check of an hfquant checkpoint: a pre-quantized `from_pretrained` calls it before any weight is read
    (`hfquant.integration.checks.check_stored_tensors`), `hfquant verify`, `inspect`, `export` and `convert` of a
    quantized SRC through `hfquant.integration.schema_check`; all but verify (which lists the problems) raise
    `schema_error`'s one line. Each layer's format
    as config.json resolves it (method, bits, group size, symmetry, `module_overrides`) is in the skeleton's hfquant
    modules, and every file tensor must be a tensor of them: in both modes a file tensor that no tensor of a module of
    `model` takes (a SINQ `weight_col_scale` of a layer the config plans as RTN, a scale of a layer it keeps in float)
    is a problem, and so is an integer tensor where the model has a float one (a layer's codes loaded as weights).

    Args:
        tensors: file tensor name -> header, for every tensor of the checkpoint.
        key_map: file tensor name -> model state_dict name as the loader renames it, None when a transformers
            weight converter fuses it (then it has no per-tensor shape to compare, and missing tensors are not judged).
        loading: True for a pre-quantized `from_pretrained`: float tensors' shapes are not compared (a float tensor
            of another shape is transformers' own business, e.g. with `ignore_mismatched_sizes=True`), nor are file
            tensors of modules the model does not have or float tensors it lacks (a task head the class drops or
            adds); False (verify): every tensor's shape, and every file tensor the model lacks.
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
            if _ignored(model, file_key, "_keys_to_ignore_on_load_unexpected"):
                continue
            problem = _unused_problem(model, file_key, model_key, header)
            if problem is None and not loading:
                problem = (
                    f"{file_key} (in {header.file}) is not a tensor of {type(model).__name__}; from_pretrained ignores "
                    "it: the files are from another model or config.json was changed"
                )
            if problem is not None:
                problems.append(problem)
            continue
        present.add(model_key)
        if not want.exact and torch_dtype(want.dtype).is_floating_point and not header.dtype.is_floating_point:
            problems.append(
                f"{file_key} in {header.file} is {header.describe()}, integer codes where {type(model).__name__} as "
                f"config.json describes it has a float tensor {shape_text(want.shape)} (a layer config.json keeps "
                f"in float); {_FIX}"
            )
            continue
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
    if not fused:
        problems += _missing_problems(model, expected, tied, present, loading)
    return problems, compared


def _missing_problems(model: nn.Module, expected: dict, tied: dict, present: set[str], loading: bool) -> list[str]:
    """One problem per tensor of `expected` (the skeleton's, see `expected_tensors`) that no file tensor gave
    (`present`, model names) and nothing else fills: not a tied alias of a present one, not tied by transformers, not
    one the model ignores when missing; when `loading`, float tensors are transformers' business."""
    problems = []
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
    return problems


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


def schema_error(problems: list[str]) -> str:
    """The one-line error of a checkpoint whose tensors do not match its config.json (`schema_problems`,
    `hfquant.checkpoint.model_config.base_type_problem`): the first problem in full, the tensors of the next three
    named, "hfquant verify" for the full list. `problems` must not be empty."""
    text = "the hfquant checkpoint does not match its config"
    if len(problems) == 1:
        return f"{text}: {problems[0]}"
    others = [problem.split(" ", 1)[0] for problem in problems[1:]]
    named = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    return (
        f"{text} ({len(problems)} problems): {problems[0]} (and {len(others)} more: {named}; hfquant verify lists all)"
    )


def problem_text(problems: Iterable[str], limit: int = 20, what: str = "does not match its config") -> str:
    """One error message listing at most `limit` problems: "the hfquant checkpoint {what} (N problems): ..."."""
    problems = list(problems)
    lines = problems[:limit] + ([f"... and {len(problems) - limit} more"] if len(problems) > limit else [])
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    return f"the hfquant checkpoint {what} ({count}):\n  " + "\n  ".join(lines)
