"""The `model_type` an hfquant checkpoint's `config.json` carries: "hfquant", so that transformers without hfquant
refuses it by name instead of loading integer codes as float weights.

transformers reads `quantization_config` with an unknown `quant_method` as a warning and loads the checkpoint as a
float model (`quantizers/auto.py`, `supports_quant_method`): the int8 codes of an 8-bit checkpoint then become float
weights and the model generates garbage. The one field every `Auto*.from_pretrained` must understand before it
builds anything is `model_type` (`AutoConfig.from_pretrained`), and its refusal quotes the value. So a saved hfquant
checkpoint stores

    {"model_type": "hfquant", "hfquant_base_model_type": "llama", ...every other field as the model's config...}

and without hfquant `AutoModelForCausalLM.from_pretrained` raises "The checkpoint you are trying to load has model
type `hfquant` but Transformers does not recognize this architecture". `import hfquant` registers "hfquant" with
`AutoConfig`, whose parsing hands the dict back to the base type's config class (`hfquant.integration.config_type`):
the model in memory has the base config (`LlamaConfig`, `model_type == "llama"`), as any other quantized model.

Only config dicts whose `quantization_config` has `quant_method == "hfquant"` are marked, and not those of models
with custom code (`auto_map`): `AutoConfig` prefers a registered local class to the checkpoint's remote one, so the
model's own config class would never run. Checkpoints saved before
this marking (`model_type` of the base) load as before. Readers of `config.json` in hfquant go through
`files.read_config`, which returns the unmarked dict.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hfquant.config import QUANT_METHOD

__all__ = ["MODEL_TYPE", "BASE_MODEL_TYPE_KEY", "is_marked", "mark", "unmark", "mark_config_file"]

MODEL_TYPE = QUANT_METHOD
"""`model_type` of a saved hfquant checkpoint: "hfquant", the `quant_method` itself."""

BASE_MODEL_TYPE_KEY = "hfquant_base_model_type"
"""Key of `config.json` that holds the model's own `model_type` ("llama", "qwen2", ...) in a marked config."""


def _is_hfquant_quantized(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == QUANT_METHOD


def is_marked(config: dict[str, Any]) -> bool:
    """Whether `config` (a parsed config.json) carries `model_type == "hfquant"`."""
    return config.get("model_type") == MODEL_TYPE


def mark(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with `model_type` "hfquant" and the base type under `BASE_MODEL_TYPE_KEY` (a new dict; key order
    kept, the two keys first), when it is an hfquant-quantized config with a base `model_type`; else `config`
    unchanged. Marking a marked config changes nothing."""
    base = config.get("model_type")
    if is_marked(config) or not _is_hfquant_quantized(config) or not isinstance(base, str) or not base:
        return config
    if "auto_map" in config:  # custom (remote) code: AutoConfig would prefer hfquant's class to the model's own
        return config
    rest = {key: value for key, value in config.items() if key not in ("model_type", BASE_MODEL_TYPE_KEY)}
    return {"model_type": MODEL_TYPE, BASE_MODEL_TYPE_KEY: base, **rest}


def unmark(config: dict[str, Any], source: str | os.PathLike = "config.json") -> dict[str, Any]:
    """The inverse of `mark`: `model_type` back to the base type, `BASE_MODEL_TYPE_KEY` removed (a new dict). A config
    that is not marked is returned unchanged.

    Raises:
        ValueError: a marked config whose base type is missing or not a non-empty string, naming `source`.
    """
    if not is_marked(config):
        return config
    base = config.get(BASE_MODEL_TYPE_KEY)
    if not isinstance(base, str) or not base or base == MODEL_TYPE:
        raise ValueError(
            f"{source}: model_type is {MODEL_TYPE!r} but {BASE_MODEL_TYPE_KEY}={base!r} is not the "
            'model\'s own type (such as "llama"); restore config.json from the quantized checkpoint'
        )
    rest = {key: value for key, value in config.items() if key not in ("model_type", BASE_MODEL_TYPE_KEY)}
    return {"model_type": base, **rest}


def mark_config_file(folder: str | os.PathLike) -> bool:
    """Mark `folder/config.json` in place (`mark`), written as transformers writes it (2-space indent, sorted keys,
    trailing newline) through a temporary file and a rename. Returns whether the file changed.

    Raises:
        OSError: the file could not be read or written (the old file is then unchanged).
        ValueError: config.json is not JSON.
    """
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    marked = mark(config) if isinstance(config, dict) else config
    if marked is config:
        return False
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # as files.write_json writes JSON (files imports this module, so not through it)
        temporary.write_text(json.dumps(marked, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return True
