"""`HfQuantConfig`: what to quantize and how, validated in one place.

The config is JSON-native so that it round-trips through `config.json` exactly: `to_dict()` writes every
field with its resolved value, and `from_dict()` feeds that dict back through the same validation.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from transformers.utils.quantization_config import QuantizationConfigMixin

from hfquant.core.allocation import MIXED_PRECISION, data_free_overrides
from hfquant.core.rtn import CLIPPING

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "EMBEDDING_DTYPES",
    "NORM_DTYPES",
    "LM_HEAD_POLICIES",
    "COMPUTE_DTYPES",
    "ConfigField",
    "FIELDS",
    "FIELD_NAMES",
    "HfQuantConfig",
    "validate_config_values",
    "matches_module",
    "default_group_size",
    "default_method",
    "default_mixed_precision",
    "METHODS",
    "MIXED_PRECISION",
]

QUANT_METHOD = "hfquant"
"""The `quant_method` string that transformers reads from `config.json` to pick our quantizer."""

FORMAT_VERSION = 1
"""Version of the on-disk layout described in `docs/format.md`. Checkpoints stamped with another version are refused."""

SUPPORTED_BITS = (8, 4)
MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 1024
_ALLOWED_GROUP_SIZES = tuple(2**p for p in range(5, 11))  # 32 .. 1024

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
EMBEDDING_DTYPES = ("auto",) + FLOAT_DTYPES + ("int8", "int4")
"""`embedding_dtype` values: "auto" (the compute dtype), a float dtype, or int8 / int4 (`QuantEmbedding`)."""
NORM_DTYPES = ("auto",) + FLOAT_DTYPES
"""`norm_dtype` values: "auto" (the compute dtype) or a float dtype."""
LM_HEAD_POLICIES = ("keep", "int8", "int4")
"""`lm_head` values: "keep" (float, unless tied to a quantized input embedding), or int8 / int4."""
COMPUTE_DTYPES = ("auto",) + FLOAT_DTYPES
"""`compute_dtype` values: "auto" (the `dtype` given to `from_pretrained`) or a float dtype."""
DECODE_ACTIVATIONS = ("float", "int8")
"""`decode_activations` values: "float" (the compute dtype) or "int8" (W4A8 one-token decode steps on CPU)."""
METHODS = ("rtn", "sinq")
"""`method` values: "rtn" (round-to-nearest) or "sinq" (RTN after a Sinkhorn-normalized column scale, arXiv 2509.22944;
the column scale is stored beside the layer)."""
LEGACY_DEFAULTS = {"method": "rtn", "mixed_precision": "none", "fold_column_scales": False, "clipping": "minmax"}
"""Values of fields a `config.json` written before they existed holds implicitly (what such a checkpoint stores)."""


class ConfigField(NamedTuple):
    """One field of `HfQuantConfig`: its name, a one-line description (the CLI's help, the card's table) and, for
    closed choices, the allowed values."""

    name: str
    help: str
    choices: tuple | None = None


FIELDS: tuple[ConfigField, ...] = (
    ConfigField("quant_method", f"always {QUANT_METHOD!r}: what transformers reads to pick this quantizer"),
    ConfigField("format_version", f"on-disk format version; only {FORMAT_VERSION} is read"),
    ConfigField("bits", "width of the stored integer weights", SUPPORTED_BITS),
    ConfigField(
        "method",
        "how Linear weights are quantized: 'rtn' (round-to-nearest, the default at 8 bits) or 'sinq' "
        "(round-to-nearest after a per-column scale balanced by Sinkhorn iterations, stored as weight_col_scale; "
        "calibration-free, more accurate; the default at 4 bits)",
        METHODS,
    ),
    ConfigField(
        "mixed_precision",
        "'auto' (the default at 4 bits): hfquant's data-free rule gives the value projections "
        "of the second half of the layers int8 and MLP down projections groups of at most 64, written into "
        "module_overrides when quantizing; 'none': every layer alike",
        MIXED_PRECISION,
    ),
    ConfigField(
        "clipping",
        "each group's range: 'minmax' (the default: nothing clipped) or 'mse' (16 shrink factors "
        "of the range tried, the one with the smallest squared weight error kept; about 16x the quantization "
        "time, same stored format)",
        CLIPPING,
    ),
    ConfigField(
        "fold_column_scales",
        "True: in Llama-family decoder blocks, SINQ column scales are folded into the "
        "norms and the preceding projections (an exact identity of the float model) and those layers are "
        "stored as plain RTN int4/int8, which compressed-tensors, vLLM and GGUF read; False: column scales of "
        "method 'sinq' are stored beside the layers (hfquant-only). Default: True with method 'sinq'",
        (False, True),
    ),
    ConfigField(
        "group_size",
        f"inputs sharing one scale: a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, or None for one scale "
        "per output channel (default: per-channel at 8 bits, 128 at 4 bits). A layer whose input width it does not "
        "divide uses the largest power of two >= 32 that does",
    ),
    ConfigField(
        "symmetric",
        "signed codes without zero point (default at 8 bits) or unsigned codes with a uint8 "
        "zero point per group (default at 4 bits)",
    ),
    ConfigField(
        "module_overrides",
        "per-module settings, {pattern: {bits, group_size, symmetric, method}} "
        "(any subset): Linear layers matching a pattern (the rules of modules_to_not_convert; the first "
        'matching pattern wins) use these values instead of the config\'s, e.g. {"v_proj": {"bits": 8}}; '
        "a bits override without group_size / symmetric takes that width's defaults",
    ),
    ConfigField(
        "modules_to_not_convert",
        "modules kept in float: whole dotted names (model.layers.0.mlp), "
        "whole-component suffixes (down_proj) or fnmatch patterns (model.layers.*.self_attn.o_proj); never "
        "substrings. The output embedding and weights tied to the input embedding are kept in float by default",
    ),
    ConfigField(
        "embedding_dtype",
        "storage of every nn.Embedding: 'auto' (the compute dtype), a float dtype, or int8 / int4 (per-row quantized)",
        EMBEDDING_DTYPES,
    ),
    ConfigField(
        "norm_dtype",
        "storage and compute dtype of LayerNorm / RMSNorm layers: 'auto' (the compute dtype) or a float dtype",
        NORM_DTYPES,
    ),
    ConfigField(
        "lm_head",
        "the output embedding: 'keep' (float, unless tied to a quantized input embedding) or int8 / int4",
        LM_HEAD_POLICIES,
    ),
    ConfigField(
        "compute_dtype",
        "dtype of the activations and of float weights without a setting of their own: "
        "'auto' (the dtype given to from_pretrained) or a float dtype",
        COMPUTE_DTYPES,
    ),
    ConfigField(
        "decode_activations",
        "activations of 4-bit layers in one-token decode steps on CPU: 'float' (the "
        "compute dtype) or 'int8' (quantized per block of 32 for integer dot products, W4A8: faster, "
        "slightly less accurate)",
        DECODE_ACTIVATIONS,
    ),
)
"""Every field of `HfQuantConfig`, in the order `to_dict` writes them: the one list the config, the CLI and the model
card read."""
FIELD_NAMES = tuple(field.name for field in FIELDS)

_UNSET = object()


def default_group_size(bits: int) -> int | None:
    """The group size used when none is given: per-channel (`None`) at 8 bits, 128 at 4 bits."""
    return None if bits == 8 else 128


def default_method(bits: int) -> str:
    """The method used when none is given: "sinq" at 4 bits (more accurate at little cost), "rtn" at 8 bits (already
    within 0.1% of bf16 perplexity)."""
    return "sinq" if bits == 4 else "rtn"


def default_mixed_precision(bits: int) -> str:
    """The `mixed_precision` used when none is given: "auto" at 4 bits, "none" at 8 bits (where the rule does nothing)."""
    return "auto" if bits == 4 else "none"


def default_symmetric(bits: int) -> bool:
    """The symmetry used when none is given: symmetric at 8 bits (the int8 kernel has no zero point), asymmetric at 4."""
    return bits == 8


OVERRIDE_KEYS = ("bits", "group_size", "symmetric", "method")
"""The settings a `module_overrides` entry may give."""


def matches_module(name: str, patterns: Iterable[str]) -> bool:
    """Whether module `name` (full dotted name) or one of its ancestors is selected by `patterns`.

    A pattern selects a module when it equals the full dotted name, equals a whole-component suffix of it
    ("down_proj" selects "model.layers.0.mlp.down_proj", never "model.layers.0.mlp.xdown_proj" or
    "lm_head_norm" for "lm_head"), or matches the full name as an fnmatch pattern ("model.layers.*.mlp.*").
    Substrings never match.
    """
    parts = name.split(".")
    candidates = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        for candidate in candidates:
            if candidate == pattern or candidate.endswith("." + pattern):
                return True
            if any(ch in pattern for ch in "*?[") and fnmatch.fnmatchcase(candidate, pattern):
                return True
    return False


def _check_choice(field: str, value: Any, allowed: tuple[str, ...], meaning: str) -> None:
    if not isinstance(value, str):
        raise TypeError(
            f"{field} must be a string, one of {list(allowed)} ({meaning}); got {value!r} ({type(value).__name__})."
        )
    if value not in allowed:
        raise ValueError(f"{field}={value!r} is not allowed; use one of {list(allowed)} ({meaning}).")


def validate_config_values(
    bits: Any,
    group_size: Any,
    symmetric: Any,
    modules_to_not_convert: Any,
    format_version: Any,
    embedding_dtype: Any = "auto",
    norm_dtype: Any = "auto",
    lm_head: Any = "keep",
    compute_dtype: Any = "auto",
    method: Any = "rtn",
    module_overrides: Any = None,
    mixed_precision: Any = "none",
    fold_column_scales: Any = False,
    clipping: Any = "minmax",
    decode_activations: Any = "float",
) -> None:
    """Check every field of an `HfQuantConfig`; used by the constructor, `from_dict` and the CLI.

    Raises:
        ValueError: a value is outside what is allowed; the message names the value and the allowed ones.
        TypeError: a value has the wrong type (for example `bits="4"`).
    """
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"bits must be an int, one of {list(SUPPORTED_BITS)}; got {bits!r} ({type(bits).__name__}).")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; allowed values are {list(SUPPORTED_BITS)}.")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int):
            raise TypeError(
                f"group_size must be None (one scale per output channel) or an int power of two from "
                f"{MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}; got {group_size!r} ({type(group_size).__name__})."
            )
        if group_size not in _ALLOWED_GROUP_SIZES:
            raise ValueError(
                f"group_size={group_size!r} is not allowed; use None (per-channel) or one of "
                f"{list(_ALLOWED_GROUP_SIZES)}."
            )
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be True or False; got {symmetric!r} ({type(symmetric).__name__}).")
    if not isinstance(modules_to_not_convert, list) or not all(
        isinstance(p, str) and p for p in modules_to_not_convert
    ):
        raise TypeError(
            "modules_to_not_convert must be a list of non-empty strings (whole dotted module names or fnmatch "
            f"patterns such as 'model.layers.*.mlp.down_proj'); got {modules_to_not_convert!r}."
        )
    if isinstance(format_version, bool) or not isinstance(format_version, int) or format_version != FORMAT_VERSION:
        raise ValueError(
            f"format_version={format_version!r} is not readable by this hfquant, which reads format version "
            f"{FORMAT_VERSION}; upgrade hfquant (pip install -U hfquant) or re-quantize the float checkpoint."
        )
    _check_choice(
        "embedding_dtype",
        embedding_dtype,
        EMBEDDING_DTYPES,
        "'auto' keeps embeddings in the compute dtype, int8/int4 quantize them per row",
    )
    _check_choice("norm_dtype", norm_dtype, NORM_DTYPES, "'auto' keeps norms in the compute dtype")
    _check_choice("lm_head", lm_head, LM_HEAD_POLICIES, "'keep' leaves the output embedding in float")
    _check_choice("compute_dtype", compute_dtype, COMPUTE_DTYPES, "'auto' uses the dtype given to from_pretrained")
    _check_choice("method", method, METHODS, "'rtn' is round-to-nearest, 'sinq' adds a per-column scale")
    _check_choice(
        "mixed_precision",
        mixed_precision,
        MIXED_PRECISION,
        "'auto' applies hfquant's data-free bit allocation at 4 bits, 'none' stores every layer alike",
    )
    _check_choice("clipping", clipping, CLIPPING, "'minmax' uses each group's range, 'mse' searches a clipped one")
    _check_choice(
        "decode_activations",
        decode_activations,
        DECODE_ACTIVATIONS,
        "'float' keeps decode activations in the compute dtype, 'int8' quantizes them for W4A8 decoding",
    )
    if not isinstance(fold_column_scales, bool):
        raise TypeError(
            f"fold_column_scales must be True or False; got {fold_column_scales!r} "
            f"({type(fold_column_scales).__name__})."
        )
    _check_overrides({} if module_overrides is None else module_overrides)


def _check_overrides(overrides: Any) -> None:
    example = '{"v_proj": {"bits": 8}}'
    if not isinstance(overrides, dict):
        raise TypeError(f"module_overrides must map module patterns to settings, e.g. {example}; got {overrides!r}.")
    for pattern, settings in overrides.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(
                f"module_overrides keys must be non-empty module patterns, e.g. {example}; got {pattern!r}."
            )
        if not isinstance(settings, dict) or not set(settings) <= set(OVERRIDE_KEYS):
            found = sorted(settings) if isinstance(settings, dict) else settings
            raise ValueError(
                f"module_overrides[{pattern!r}] must be a dict with some of the keys {list(OVERRIDE_KEYS)}; got {found!r}."
            )
        try:
            bits = settings.get("bits", 8)
            validate_config_values(
                bits,
                settings.get("group_size", default_group_size(bits) if bits in SUPPORTED_BITS else None),
                settings.get("symmetric", True),
                [],
                FORMAT_VERSION,
                method=settings.get("method", "rtn"),
            )
        except (TypeError, ValueError) as error:
            raise type(error)(f"module_overrides[{pattern!r}]: {error}") from None


class HfQuantConfig(QuantizationConfigMixin):
    """Weight-only, calibration-free quantization of Linear and GPT-2 `Conv1D` layers to int8 or int4.

    The defaults at 4 bits are the most accurate calibration-free setting measured within 4.5 bits per weight
    (README, `scripts/accuracy.py`): `method="sinq"`, group 128, asymmetric, `mixed_precision="auto"`. At 8 bits:
    round-to-nearest (RTN), per-channel, symmetric.

    Args:
        bits: 8 or 4. Stored integers are int8 / packed 4-bit.
        group_size: number of consecutive input features sharing one `scale` (and `zero_point`). `None` means
            per-channel (one scale per output feature); otherwise a power of two from 32 to 1024. Defaults to
            per-channel at 8 bits and 128 at 4 bits. A layer whose `in_features` is not divisible by the asked
            group size uses the largest power of two >= 32 that divides it (its group size can be read back from
            the stored scale shape); a layer with no such divisor stays in float and is logged.
        symmetric: `True` stores signed integers with an implicit zero point; `False` (asymmetric) stores an
            unsigned integer zero point per group. Defaults to `True` at 8 bits and `False` at 4 bits.
        modules_to_not_convert: modules kept in float, as whole dotted names (`"lm_head"`,
            `"model.layers.0.mlp"`), a whole-component suffix (`"down_proj"` matches `"...mlp.down_proj"` but not
            `"...mlp.xdown_proj"`), or fnmatch patterns matched against the full dotted name
            (`"model.layers.*.self_attn.o_proj"`). A match on a module also keeps its children in float. The output
            embedding (lm_head) and weights tied to the input embedding stay in float unless `embedding_dtype` or
            `lm_head` asks otherwise.
        embedding_dtype: storage of every `nn.Embedding` (input, position and token-type tables): "auto" (the compute
            dtype, today's behaviour), "float32" / "float16" / "bfloat16", or "int8" / "int4" (`QuantEmbedding`:
            per-row scales; int4 and int8 use the layers' `group_size` and `symmetric` when `bits` matches, else
            that width's defaults). Lookups always return the compute dtype.
        norm_dtype: storage and compute dtype of LayerNorm / RMSNorm layers (found by type: `nn.LayerNorm`,
            `nn.RMSNorm` and the families' own `*LayerNorm` / `*RMSNorm` classes): "auto" or a float dtype. Their
            output is cast back to the compute dtype.
        lm_head: the output embedding: "keep" (float) or "int8" / "int4" (`QuantLinear`). When it is tied to the input
            embedding both are one tensor: it is quantized if either field asks for it (asking two different formats
            is an error) and is stored once.
        compute_dtype: dtype of the activations and of float weights without a setting of their own (biases,
            layers kept in float): "auto" (the `dtype` given to `from_pretrained`) or a float dtype, which then
            overrides that `dtype`. When embeddings or norms are stored in another float dtype, a quantizer records
            the resolved compute dtype here so that a reload restores every dtype.
        module_overrides: per-module settings, {pattern: {"bits", "group_size", "symmetric", "method"}} with any subset
            of those keys: a Linear / Conv1D layer selected by a pattern (the rules of `modules_to_not_convert`; the
            first matching pattern wins) is stored with these values instead of the config's; a `bits` differing from
            the config's without `group_size` / `symmetric` takes that width's defaults. Example:
            `{"v_proj": {"bits": 8}}` keeps every value projection in int8 (per-channel, symmetric). See
            `layer_settings`. Embeddings, the lm_head and MoE experts follow their own fields.
        method: how Linear / Conv1D weights are quantized: "rtn" (round-to-nearest; the default at 8 bits) or "sinq"
            (`hfquant.core.sinq`: the weight divided by a per-input-column scale from Sinkhorn-normalized balancing,
            Müller et al. 2025, arXiv 2509.22944, then RTN; the column scale is stored as `weight_col_scale`; the
            default at 4 bits). Embeddings, a quantized lm_head and MoE experts always use RTN.
        mixed_precision: "auto" (the default at 4 bits) applies hfquant's data-free bit allocation
            (`hfquant.core.allocation`: value projections of the second half of the layers in int8, MLP down
            projections at groups of at most 64) when a model is quantized, by appending its entries to
            `module_overrides` (after the user's, which win), so the saved config names every layer's format; "none"
            (the default at 8 bits, where the rule does nothing) stores every layer alike.
        fold_column_scales: True folds SINQ column scales into the model instead of storing them (`hfquant.core.folding`,
            `hfquant.integration.folding`): in the decoder blocks of Llama, Mistral, Qwen2 and Qwen3, the column scale
            of q/k/v and of gate/up moves into the norm before them, that of o_proj into v_proj's rows and that of
            down_proj into up_proj's rows; those layers are then stored with plain RTN (entries `{"method": "rtn"}`
            put first in `module_overrides` when quantizing), a checkpoint that `hfquant export` writes for vLLM and
            llama.cpp. Needs a float safetensors checkpoint (it reads each block's weights once before the streaming
            load). The default is True with method "sinq" (so at 4 bits), False with "rtn"; False stores method "sinq"'s
            column scales beside the layers. Measured on SmolLM2-135M (docs/performance.md): the 4-bit default gives
            1.155x bf16 perplexity folded and 1.154x with stored column scales.
        clipping: how each group's range is chosen for Linear / Conv1D weights (after SINQ's column scale or a fold):
            "minmax" (the default; nothing clipped) or "mse" (`hfquant.core.rtn.search_scale_zero_point`: the range
            shrunk by 16 factors from 1.0 to 0.70, the one with the smallest squared weight error kept per group).
            The stored format is the same. Measured on SmolLM2-135M (README): it lowers the weight error, not the
            perplexity, so it is not the default.
        decode_activations: the activations of 4-bit layers in one-token decode steps (one activation row, bfloat16,
            on x86-64 CPUs with AVX512-VNNI, or AVX2): "float" (the default: the compute dtype, as in every other
            product) or "int8": quantized to int8 per block of 32 inputs (llama.cpp's Q8_0 activation blocks) so that
            the codes multiply them with integer dot products (`hfquant.ops.native.int4_gemv_a8`, W4A8). Faster
            decoding (on AVX2 CPUs, where hfquant has no other kernel of its own, about 2x); prefill, training and int8
            layers are unchanged. Runtime only: the stored weights are the same, and the choice is
            saved with the config so a reload decodes the same way. Measured on SmolLM2-135M and a 1.2B Llama
            (docs/performance.md, "W4A8 decode").
        format_version: on-disk format version; only `FORMAT_VERSION` is accepted.

    Raises:
        ValueError / TypeError: through `validate_config_values`, naming the bad value and what is allowed.
    """

    def __init__(
        self,
        bits: int = 4,
        group_size: int | None = _UNSET,  # type: ignore[assignment]
        symmetric: bool | None = None,
        modules_to_not_convert: list[str] | None = None,
        format_version: int = FORMAT_VERSION,
        quant_method: str = QUANT_METHOD,
        embedding_dtype: str = "auto",
        norm_dtype: str = "auto",
        lm_head: str = "keep",
        compute_dtype: str = "auto",
        method: str | None = None,
        module_overrides: dict[str, dict[str, Any]] | None = None,
        mixed_precision: str | None = None,
        fold_column_scales: bool | None = None,
        clipping: str = "minmax",
        decode_activations: str = "float",
        **unknown: Any,
    ):
        if quant_method != QUANT_METHOD:
            raise ValueError(
                f"quant_method={quant_method!r} is not handled by HfQuantConfig, which reads only "
                f"quant_method={QUANT_METHOD!r}."
            )
        if unknown:
            raise ValueError(
                f"Unknown HfQuantConfig field(s) {sorted(unknown)}; allowed fields are {sorted(FIELD_NAMES)}."
            )
        if isinstance(bits, int) and not isinstance(bits, bool) and bits in SUPPORTED_BITS:
            if group_size is _UNSET:
                group_size = default_group_size(bits)
            if symmetric is None:
                symmetric = default_symmetric(bits)
            if method is None:
                method = default_method(bits)
            if mixed_precision is None:
                mixed_precision = default_mixed_precision(bits)
        if fold_column_scales is None:
            fold_column_scales = method == "sinq"
        elif group_size is _UNSET:
            group_size = None
        modules = [] if modules_to_not_convert is None else modules_to_not_convert
        if isinstance(modules, tuple):
            modules = list(modules)
        validate_config_values(
            bits,
            group_size,
            symmetric,
            modules,
            format_version,
            embedding_dtype,
            norm_dtype,
            lm_head,
            compute_dtype,
            method,
            module_overrides,
            mixed_precision,
            fold_column_scales,
            clipping,
            decode_activations,
        )
        self.quant_method = QUANT_METHOD
        self.bits = bits
        self.group_size = group_size
        self.symmetric = symmetric
        self.modules_to_not_convert = list(modules)
        self.format_version = format_version
        self.embedding_dtype = embedding_dtype
        self.norm_dtype = norm_dtype
        self.lm_head = lm_head
        self.compute_dtype = compute_dtype
        self.method = method
        self.module_overrides = {p: dict(s) for p, s in (module_overrides or {}).items()}
        self.mixed_precision = mixed_precision
        self.fold_column_scales = fold_column_scales
        self.clipping = clipping
        self.decode_activations = decode_activations

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """The config of a `config.json`'s `quantization_config`, validated like the constructor. A field written
        before it existed takes the value such a checkpoint holds (`LEGACY_DEFAULTS`: "rtn", no mixed precision),
        never today's defaults. `kwargs` override the dict's values."""
        values = {**LEGACY_DEFAULTS, **config_dict, **kwargs}
        config = cls(**values)
        return (config, {}) if return_unused_kwargs else config

    def apply_mixed_precision(self, layer_names: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Append the data-free rule's `module_overrides` entries for a model's Linear layers `layer_names` (full
        dotted names) when `mixed_precision` is "auto" (`hfquant.core.allocation.data_free_overrides`).

        Layers already selected by a `module_overrides` pattern keep the user's settings. Called once per model,
        when it is quantized (never when a quantized checkpoint is reloaded: its config already lists the entries).
        Returns the entries added (empty when the rule does not apply).
        """
        if self.mixed_precision != "auto":
            return {}
        names = [n for n in layer_names if not any(matches_module(n, [p]) for p in self.module_overrides)]
        added = data_free_overrides(names, self.bits, self.group_size)
        self.module_overrides.update(added)
        return added

    def prepend_overrides(self, entries: dict[str, dict[str, Any]]) -> None:
        """Put `entries` before the existing `module_overrides` (the first matching pattern wins, so they decide the
        layers they name); used by `fold_column_scales`, whose entries state a layer's complete format."""
        self.module_overrides = {**entries, **{p: s for p, s in self.module_overrides.items() if p not in entries}}

    def layer_settings(self, name: str) -> tuple[int, int | None, bool, str]:
        """(bits, asked group size, symmetric, method) of the Linear layer `name` (full dotted name): the first
        `module_overrides` entry whose pattern selects it, completed by the config's own values (at the config's bit
        width) or that width's defaults (`default_group_size`, `default_symmetric`); the config's values when no
        pattern selects it. The group size is the asked one: a layer resolves it for its width
        (`rtn.effective_group_size`)."""
        for pattern, settings in self.module_overrides.items():
            if matches_module(name, [pattern]):
                bits = settings.get("bits", self.bits)
                same = bits == self.bits
                group_size = settings.get("group_size", self.group_size if same else default_group_size(bits))
                symmetric = settings.get("symmetric", self.symmetric if same else default_symmetric(bits))
                return bits, group_size, symmetric, settings.get("method", self.method)
        return self.bits, self.group_size, self.symmetric, self.method

    def validate(self) -> None:
        """Re-check the fields (after a user changed attributes in place); raises like the constructor."""
        if self.quant_method != QUANT_METHOD:
            raise ValueError(
                f"quant_method={self.quant_method!r} is not handled by HfQuantConfig, which reads only "
                f"quant_method={QUANT_METHOD!r}."
            )
        validate_config_values(**{name: getattr(self, name) for name in FIELD_NAMES if name != "quant_method"})

    def to_dict(self) -> dict[str, Any]:
        """Every field with its resolved value; `HfQuantConfig.from_dict(c.to_dict()) == c`."""
        return {name: copy.deepcopy(getattr(self, name)) for name in FIELD_NAMES}

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def __iter__(self):
        yield from copy.deepcopy(self.to_dict()).items()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HfQuantConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))
