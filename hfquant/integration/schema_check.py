"""The schema check of an hfquant checkpoint folder, shared by `hfquant verify`, `inspect`, `export` and `convert`:
config.json (its base model type, method, formats and `module_overrides`) against every stored tensor, from JSON and
the safetensors headers only. A pre-quantized `from_pretrained` runs the same two checks on the skeleton it builds
(`hfquant.integration.checks.check_stored_tensors`): `base_type_problem` and `schema_problems`.

    check_checkpoint_schema(folder)        # raises ValueError(schema_error(...)), the load's message
    result = checkpoint_schema(folder, tensors, quant_config, config)   # verify: the problems, the skeleton
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from hfquant.checkpoint.files import CONFIG_NAME, TensorHeader, tensor_files
from hfquant.checkpoint.model_config import base_type_problem, read_quantization_config
from hfquant.checkpoint.schema import schema_error, schema_problems
from hfquant.config import HfQuantConfig
from hfquant.integration.checks import read_single_copies
from hfquant.integration.conversions import model_key_map
from hfquant.integration.skeleton import build_skeleton

__all__ = ["SchemaCheck", "checkpoint_schema", "check_checkpoint_schema"]


class SchemaCheck(NamedTuple):
    """What `checkpoint_schema` found: `problems` (one line each), the tensors compared, the prepared skeleton and the
    file -> model key map (None when the skeleton could not be built), and a note when the schema was not checked."""

    problems: list[str]
    compared: int
    model: nn.Module | None
    key_map: dict[str, str | None] | None
    note: str | None


def checkpoint_schema(
    folder: str | os.PathLike, tensors: dict[str, TensorHeader], quant_config: HfQuantConfig, config: dict[str, Any]
) -> SchemaCheck:
    """Compare the tensors (`tensors`: file name -> header) of the hfquant checkpoint `folder` with what its
    config.json (`config`, as `read_config` returns it; `quant_config` its `quantization_config`) says they are: the
    base model type against `architectures` (`base_type_problem`), then the skeleton built as a reload builds it
    (`build_skeleton(pre_quantized=True)`) against every tensor (`schema_problems`, verify's mode: every tensor
    compared, every file tensor the model lacks a problem).

    A model transformers cannot build from config.json is a problem (from_pretrained refuses it too), except one
    with custom code (`auto_map`), which hfquant never runs: its schema is not checked, and the note says so.
    """
    problems: list[str] = []
    base = base_type_problem(config)
    if base is not None:
        problems.append(base)
    try:
        model, _, quantizer = build_skeleton(folder, "auto", quant_config, pre_quantized=True)
    except (ValueError, OSError, KeyError, TypeError, ImportError, AttributeError) as error:
        if "auto_map" in config:
            return SchemaCheck(problems, 0, None, None, f"schema not checked (custom code is never run): {error}")
        problems.append(
            f"{CONFIG_NAME}: transformers cannot build this model ({error}), so from_pretrained refuses it too; restore "
            "config.json from the quantized checkpoint"
        )
        return SchemaCheck(problems, 0, None, None, None)
    key_map = model_key_map(model, tensors, quantizer)
    schema, compared = schema_problems(model, tensors, key_map, loading=False)
    return SchemaCheck(problems + schema, compared, model, key_map, None)


def check_checkpoint_schema(folder: str | os.PathLike) -> None:
    """Refuse the hfquant checkpoint `folder` when its tensors do not match config.json (`checkpoint_schema`), with
    the one-line message a pre-quantized `from_pretrained` gives (`schema_error`). Headers only, never a weight.

    Raises:
        ValueError: the schema does not match (naming the first tensor or layer and what was expected), a tensor is
            stored twice, or config.json is not an hfquant checkpoint's (`read_quantization_config`).
        FileNotFoundError: no config.json or no safetensors checkpoint.
    """
    folder = Path(folder)
    config, quant_config = read_quantization_config(folder)
    tensors = read_single_copies(dict.fromkeys(tensor_files(folder).values()))
    result = checkpoint_schema(folder, tensors, quant_config, config)
    if result.problems:
        raise ValueError(schema_error(result.problems))
