"""`HfQuantConfig`: what to quantize and how, every field described once in `FIELDS`.

`FIELDS` is the one table of the config's fields: name, allowed values (a `str` enum for a closed choice), default,
help and check. The constructor takes its defaults from it, `validate_fields` checks values against it (used by the
constructor, `from_dict`, `HfQuantConfig.validate` and the CLI, which builds its options and help from the table too),
`to_dict()` writes the fields in its order, and the class docstring lists it.

A closed choice is stored as its enum member (`config.method is Method.SINQ`); the members are `str`s equal to their
values, so plain strings work everywhere (`HfQuantConfig(method="sinq")`, `config.method == "sinq"`) and `to_dict()`
writes plain strings: the config round-trips through `config.json` exactly.
"""

from __future__ import annotations

import copy
import enum
import fnmatch
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from transformers.utils.quantization_config import QuantizationConfigMixin

from hfquant.core import blocks
from hfquant.core.allocation import BUDGET_FORMATS, block_overrides, budget_overrides, data_free_overrides
from hfquant.core.choice import Choice
from hfquant.core.format import SUPPORTED_BITS, Method

__all__ = [
    "FORMAT_VERSION",
    "QUANT_METHOD",
    "Choice",
    "Method",
    "QuantFormat",
    "ALL_BITS",
    "BUDGET_BITS",
    "LayerSettings",
    "MixedPrecision",
    "Clipping",
    "Iq4SearchMode",
    "Importance",
    "check_importance",
    "FloatDtype",
    "EmbeddingDtype",
    "LmHead",
    "DecodeActivations",
    "EMBEDDING_DTYPES",
    "NORM_DTYPES",
    "LM_HEAD_POLICIES",
    "COMPUTE_DTYPES",
    "METHODS",
    "MIXED_PRECISION",
    "ConfigField",
    "FIELDS",
    "FIELD_NAMES",
    "HfQuantConfig",
    "validate_fields",
    "validate_config_values",
    "matches_module",
    "default_group_size",
    "default_format",
    "resolve_format",
    "default_method",
    "default_mixed_precision",
    "default_lm_head",
]

QUANT_METHOD = "hfquant"
"""The `quant_method` string that transformers reads from `config.json` to pick our quantizer."""

FORMAT_VERSION = 1
"""Version of the on-disk layout described in `docs/format.md`. Checkpoints stamped with another version are refused."""

MIN_GROUP_SIZE = 32
MAX_GROUP_SIZE = 1024
_ALLOWED_GROUP_SIZES = tuple(2**p for p in range(5, 11))  # 32 .. 1024


# -- closed choices ------------------------------------------------------------------------------------------------


QuantFormat = Choice(
    "QuantFormat", [("AUTO", "auto"), ("INT", "int")] + [(name.upper(), name) for name in blocks.LAYOUTS]
)
QuantFormat.__doc__ = """`format`: "auto" (by `bits`, `default_format`), "int" (uniform integer codes with a bfloat16 scale per
group, 4 or 8 bits) or one of llama.cpp's block types (`hfquant.core.blocks.LAYOUTS`: "q4_k", "q3_k", "iq4_xs", ...)."""

ALL_BITS = (8, 6, 5, 4, 3, 2)
"""Bit widths a config may ask for: 4 and 8 in the uniform integer format or a block format, 2, 3, 5 and 6 in block
formats only."""

_DEFAULT_BLOCK = {2: "q2_k", 3: "q3_k", 4: "iq4_xs", 5: "q5_k", 6: "q6_k"}

INT_ONLY_FIELDS = ("group_size", "symmetric", "clipping", "decode_activations")
"""Fields only the uniform integer format has: a config or `module_overrides` entry that gives one with format "auto"
asks for "int" at 4 and 8 bits (`default_format`)."""

BUDGET_BITS = {3.5: "hq3_r"}
"""Non-integer `bits` a config accepts: a bits budget in bits per weight over the quantized layers, with the budget
format it means (`HfQuantConfig(bits=3.5)` is `HfQuantConfig(bits=3, format="hq3_r", mixed_precision="auto")`,
`hfquant.core.allocation.budget_overrides`), which is also what the config stores."""


def _budget_bits(given: dict[str, Any]) -> dict[str, Any]:
    """`given` (the constructor's keywords) with a budget `bits` (`BUDGET_BITS`) spelled as its budget format.

    Raises:
        ValueError: a non-integer `bits` that is no budget, or a budget with another explicit format.
    """
    bits = given.get("bits", _DEFAULT)
    if not isinstance(bits, float) or (bits.is_integer() and bits not in BUDGET_BITS):
        return given  # ints, and 4.0 and the like: `_check_bits` names them
    fmt = BUDGET_BITS.get(bits)
    if fmt is None:
        raise ValueError(
            f"bits={bits!r} is not supported; use an int from {list(ALL_BITS)} or a bits budget from "
            f"{list(BUDGET_BITS)} (3.5: format='hq3_r' with mixed_precision='auto')."
        )
    asked = given.get("format", _DEFAULT)
    if asked not in (_DEFAULT, None, QuantFormat.AUTO, "auto", fmt):
        raise ValueError(f"bits={bits!r} is the {fmt} bits budget; it takes format={fmt!r} or none, got {asked!r}.")
    mixed = given.get("mixed_precision", _DEFAULT)
    mixed = MixedPrecision.AUTO if mixed in (_DEFAULT, None) else mixed
    return {**given, "bits": blocks.LAYOUTS[fmt].bits, "format": fmt, "mixed_precision": mixed}


class LayerSettings(NamedTuple):
    """What the config asks for one Linear layer (`HfQuantConfig.layer_settings`): `format` is resolved ("int" or a
    block type, never "auto"); `group_size` and `symmetric` apply to "int" only (a block type has its own)."""

    bits: int
    group_size: int | None
    symmetric: bool
    method: Method
    format: str


class MixedPrecision(Choice):
    """`mixed_precision`: the values of `hfquant.core.allocation.MIXED_PRECISION`."""

    AUTO = "auto"
    NONE = "none"


class Clipping(Choice):
    """`clipping`: the values of `hfquant.core.rtn.CLIPPING`."""

    MINMAX = "minmax"
    MSE = "mse"


class Importance(Choice):
    """`importance`: each input column's weight in the block formats' search of folded Llama-family layers."""

    AUTO = "auto"
    WEIGHTS = "weights"
    BOS_ACTIVATIONS = "bos_activations"


Iq4SearchMode = Choice("Iq4SearchMode", [(name.upper(), name) for name in blocks.iq4.SEARCHES])
Iq4SearchMode.__doc__ = """`iq4_search`: the values of `hfquant.core.blocks.iq4.SEARCHES` (decided there)."""


class FloatDtype(Choice):
    """`norm_dtype` and `compute_dtype`: "auto" or a float dtype of `hfquant.core.dtypes.FLOAT_DTYPES`."""

    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"


class EmbeddingDtype(Choice):
    """`embedding_dtype`: "auto", a float dtype, or a quantized storage ("int8" / "int4", `QuantEmbedding`)."""

    AUTO = "auto"
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"


class LmHead(Choice):
    """`lm_head`: "keep" (float), a quantized storage ("int8" / "int4", `QuantLinear`) or "q6_k" (llama.cpp's Q6_K
    blocks, `q8_0` where 256 does not divide the rows)."""

    KEEP = "keep"
    INT8 = "int8"
    INT4 = "int4"
    Q6_K = "q6_k"


class DecodeActivations(Choice):
    """`decode_activations`: "float" (the compute dtype) or "int8" (W4A8 one-token decode steps on CPU, on int4 layers
    where `hfquant.ops.kernels.int8_decode_activations_available()`, per block of 32); also each layer's
    `KernelPlan.activations`."""

    FLOAT = "float"
    INT8 = "int8"

    @classmethod
    def _missing_(cls, value):
        allowed = [member.value for member in cls]
        raise ValueError(f"decode_activations={value!r} is not supported; use one of {allowed}")


def _values(choices: type[enum.Enum]) -> tuple:
    return tuple(member.value for member in choices)


EMBEDDING_DTYPES = _values(EmbeddingDtype)
"""`embedding_dtype` values, as plain strings."""
NORM_DTYPES = _values(FloatDtype)
"""`norm_dtype` values, as plain strings."""
COMPUTE_DTYPES = _values(FloatDtype)
"""`compute_dtype` values, as plain strings."""
LM_HEAD_POLICIES = _values(LmHead)
"""`lm_head` values, as plain strings."""
DECODE_ACTIVATIONS = _values(DecodeActivations)
"""`decode_activations` values, as plain strings."""
METHODS = _values(Method)
"""`method` values, as plain strings."""
MIXED_PRECISION = _values(MixedPrecision)
"""`mixed_precision` values, as plain strings."""


# -- defaults that depend on the bit width -------------------------------------------------------------------------


def default_format(bits: int, uniform: bool = False) -> str:
    """The stored format `format="auto"` means at `bits` (the one place that decides it): "int" at 8 bits, and at 4
    bits when `uniform` (a field of `INT_ONLY_FIELDS` was given: it describes the integer format); else llama.cpp's
    block type of that width: "iq4_xs" at 4 bits, the k-quants "q2_k", "q3_k", "q5_k", "q6_k" at 2, 3, 5 and 6.

    Why iq4_xs at 4 bits: at 4.25 bits per weight (4.44 on SmolLM2, whose 576-wide rows take IQ4_NL) it is the most
    accurate 4-bit type per byte without calibration data here: SmolLM2 perplexity 1.108x bf16's with the default
    `importance`, `iq4_search` and int8 lm_head against the int format's 1.148x (4.43 bits), MiniLM cosine 0.9859
    against 0.9773 (issue #30's 1.12x / 0.983); it decodes at least as fast (docs/performance.md, "The 4-bit default
    becomes IQ4_XS"). "int" stays what compressed-tensors and vLLM read: `format="int"` or `group_size=` asks for it."""
    if uniform and bits in SUPPORTED_BITS:
        return QuantFormat.INT
    return _DEFAULT_BLOCK.get(bits, "int")


def resolve_format(format: str, bits: int) -> str:
    """`format` with "auto" replaced by `default_format(bits)`."""
    return default_format(bits) if format == QuantFormat.AUTO else str(format)


def asks_uniform(given: Mapping[str, Any]) -> bool:
    """Whether `given` (a config's keywords or a `module_overrides` entry) gives a field of `INT_ONLY_FIELDS`
    (`symmetric=None` means its default, so it does not count)."""
    for name in INT_ONLY_FIELDS:
        value = given.get(name, _DEFAULT)
        if value is not _DEFAULT and (value is not None or name == "group_size"):  # group_size=None: per-channel
            return True
    return False


def _int_format(resolved: Mapping[str, Any]) -> bool:
    """Whether the resolved fields so far store the uniform integer format (its defaults of method and
    mixed_precision depend on the bit width; block formats default to SINQ folded and no mixing)."""
    return resolve_format(resolved["format"], resolved["bits"]) == QuantFormat.INT


def default_bits(format: str) -> int:
    """The bit width used when none is given: a block format's own, else 4."""
    return blocks.LAYOUTS[format].bits if format in blocks.LAYOUTS else 4


def default_group_size(bits: int) -> int | None:
    """The group size used when none is given: per-channel (`None`) at 8 bits, 128 at 4 bits."""
    return None if bits == 8 else 128


def default_method(bits: int, format: str = "int") -> Method:
    """The method used when none is given. Format "int": SINQ at 4 bits (more accurate at little cost), RTN at 8 bits
    (already about as accurate as bf16: docs/performance.md, "Figures from the config's docstrings"). A block format
    (llama.cpp's types, hq3_r, hq3_nl, hq3_0): SINQ at every width, so that `fold_column_scales` (True with SINQ) folds the column
    scales into Llama-family blocks before the block search, whose layers are then stored as plain RTN blocks that a
    GGUF export copies (SmolLM2 IQ4_NL: 1.117x bf16's perplexity against 1.225x without the fold and llama.cpp's
    1.182x; docs/performance.md, "Block formats: the data-free importance")."""
    if format != QuantFormat.INT:
        return Method.SINQ
    return Method.SINQ if bits == 4 else Method.RTN


def default_mixed_precision(bits: int) -> MixedPrecision:
    """The `mixed_precision` used when none is given: "auto" at 4 bits, "none" at 8 bits (where the rule does nothing)."""
    return MixedPrecision.AUTO if bits == 4 else MixedPrecision.NONE


def default_lm_head(bits: Any, format: Any, embedding_dtype: Any = EmbeddingDtype.AUTO) -> LmHead:
    """The `lm_head` used when none is given (the one place that decides it), when `embedding_dtype` is "auto": "int8"
    (per-channel, `QuantLinear`) with the 4-bit default (format "auto" at 4 bits: iq4_xs) and the 4-bit int format,
    "q6_k" (llama.cpp's Q6_K blocks, 6.5625 bits per weight;
    q8_0 where 256 does not divide the rows) with hfquant's 3-bit budget formats (`BUDGET_FORMATS`: `bits=3.5`'s
    hq3_r, hq3_nl, hq3_0); else "keep".

    Why int8: the bf16 output layer was the largest weight a 4-bit decode step read (llama.cpp keeps its output layer
    in 6-8 bits beside 4-bit layers); int8 decodes the 1.2B benchmark model 1.18x faster eager, 1.15x compiled (paired
    rounds) for SmolLM2 perplexity 1.147x -> 1.148x bf16's (docs/performance.md, "An int8 lm_head for the 4-bit
    default"). A tied model with the defaults stores its one tensor in int8 (tied: quantized if either field asks).
    Why q6_k at 3.5 bits: llama.cpp's Q3_K_M stores its output layer in Q6_K; on the 1.2B benchmark model the bf16
    lm_head (49152 x 2048, untied) was a third of the bytes of a `bits=3.5` decode step; with an int8 head a step reads
    about 88% of the 4-bit default's bytes (694 / 784 MiB), with Q6_K about 83% (45 MiB less). SmolLM2 perplexity of
    `bits=3.5` is 1.569x bf16's with the bf16 head, 1.570x with int8, 1.568x with q8_0 (its rows of 576 take q8_0);
    the 1.2B's bits=3.5 / bits=4 decode went from 0.85x to 0.91-0.96x (CPU time per token, with the faster HQ3_R
    GEMV) (docs/performance.md, "Issue #30: a faster HQ3_R GEMV, IQ4_NL at Q4_0's GB/s, a Q6_K lm_head for
    bits=3.5").
    Why "keep" when the user gives `embedding_dtype`: a tied lm_head then follows the embedding as it always did (an
    int8 default would be a second format for one tied tensor, an error, with "int4" and with a float dtype alike),
    and explicit configs behave as before. An explicit `lm_head` always wins; a config.json without the field reloads
    as "keep" (`LEGACY_DEFAULTS`).

    Args:
        bits: the resolved `bits` (an int).
        format: the `format` ("auto" or resolved; a string or `QuantFormat`).
        embedding_dtype: the `embedding_dtype` (a string or `EmbeddingDtype`).
    """
    if embedding_dtype != EmbeddingDtype.AUTO:
        return LmHead.KEEP
    resolved = resolve_format(format, bits)
    if resolved in BUDGET_FORMATS:
        return LmHead.Q6_K
    four_bit_default = format == QuantFormat.AUTO or resolved == QuantFormat.INT
    return LmHead.INT8 if bits == 4 and four_bit_default else LmHead.KEEP


def default_symmetric(bits: int) -> bool:
    """The symmetry used when none is given: symmetric at 8 bits (the int8 kernel has no zero point), asymmetric at 4."""
    return bits == 8


# -- the checks of the table's rows: each raises ValueError / TypeError naming the value and what is allowed --------


def _check_quant_method(field: ConfigField, value: Any) -> None:
    if value != QUANT_METHOD:
        hint = " (hfquant import SRC DST makes an hfquant checkpoint of it)" if value == "compressed-tensors" else ""
        raise ValueError(
            f"quant_method={value!r} is not handled by HfQuantConfig, which reads only quant_method={QUANT_METHOD!r}"
            f"{hint}."
        )


def _check_format_version(field: ConfigField, value: Any) -> None:
    # True == 1 and 1.0 == 1: a plain `!=` check would accept them and write `true` / `1.0` to config.json
    if isinstance(value, bool) or not isinstance(value, int) or value != FORMAT_VERSION:
        raise ValueError(
            f"format_version={value!r} is not readable by this hfquant, which reads format version "
            f"{FORMAT_VERSION}; upgrade hfquant (pip install -U hfquant) or re-quantize the float checkpoint."
        )


def _check_bits(field: ConfigField, value: Any) -> None:
    allowed = list(field.choices)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field.name} must be an int, one of {allowed}; got {value!r} ({type(value).__name__}).")
    if value not in allowed:
        raise ValueError(f"{field.name}={value!r} is not supported; allowed values are {allowed}.")


def _check_bool(field: ConfigField, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{field.name} must be True or False; got {value!r} ({type(value).__name__}).")


def _check_choice(field: ConfigField, value: Any) -> None:
    allowed = list(_values(field.choices))
    if not isinstance(value, str):
        raise TypeError(
            f"{field.name} must be a string, one of {allowed} ({field.subject}); got {value!r} ({type(value).__name__})."
        )
    if value not in allowed:
        raise ValueError(f"{field.name}={value!r} is not allowed; use one of {allowed} ({field.subject}).")


def _check_group_size(field: ConfigField, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"group_size must be None (one scale per output channel) or an int power of two from "
            f"{MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}; got {value!r} ({type(value).__name__})."
        )
    if value not in _ALLOWED_GROUP_SIZES:
        raise ValueError(
            f"group_size={value!r} is not allowed; use None (per-channel) or one of {list(_ALLOWED_GROUP_SIZES)}."
        )


def _check_module_names(field: ConfigField, value: Any) -> None:
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise TypeError(
            "modules_to_not_convert must be a list of non-empty strings (whole dotted module names or fnmatch "
            f"patterns such as 'model.layers.*.mlp.down_proj'); got {value!r}."
        )


OVERRIDE_KEYS = ("format", "bits", "group_size", "symmetric", "method")
"""The settings a `module_overrides` entry may give."""


def _check_overrides(field: ConfigField, value: Any) -> None:
    overrides = {} if value is None else value
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
            validate_fields(settings)
            check_format_bits(settings)
        except (TypeError, ValueError) as error:
            raise type(error)(f"module_overrides[{pattern!r}]: {error}") from None


def check_format_bits(values: Mapping[str, Any]) -> None:
    """Refuse a `format` and `bits` that disagree (checked when both are given): "int" stores 4 or 8 bits, a block type
    its own width, "auto" any of `ALL_BITS`.

    Raises:
        ValueError: naming both values and what would agree.
    """
    if "format" not in values or "bits" not in values:
        return
    fmt, bits = str(values["format"]), values["bits"]
    if fmt == QuantFormat.INT and bits not in SUPPORTED_BITS:
        raise ValueError(
            f"format='int' stores {list(SUPPORTED_BITS)} bits, not bits={bits!r}; use format='auto' (which picks "
            f"{default_format(bits)!r} at {bits} bits) or a block format of that width"
        )
    if fmt in blocks.LAYOUTS and bits != blocks.LAYOUTS[fmt].bits:
        raise ValueError(
            f"format={fmt!r} stores {blocks.LAYOUTS[fmt].bits}-bit codes, not bits={bits!r}; leave bits out or use "
            f"bits={blocks.LAYOUTS[fmt].bits}"
        )


def check_importance(values: Mapping[str, Any]) -> None:
    """Refuse `importance="bos_activations"` where no block search would use it (checked on the fields given): the
    format "int" (round-to-nearest takes no importance; "auto" at 4 or 8 bits is "int") or `fold_column_scales=False`
    (the BOS forward runs in the fold pre-pass).

    Raises:
        ValueError: naming the value and why.
    """
    if str(values.get("importance", Importance.WEIGHTS)) != Importance.BOS_ACTIVATIONS:
        return
    if "format" in values and isinstance(values.get("bits", 4), int):
        fmt = resolve_format(str(values["format"]), values.get("bits", 4))
        if fmt == QuantFormat.INT:
            raise ValueError(
                f"importance='bos_activations' weighs a block format's search; format={fmt!r} is round-to-nearest, "
                "which takes no importance: use a block format (e.g. format='iq4_xs') or importance='weights'"
            )
    if values.get("fold_column_scales") is False:
        raise ValueError(
            "importance='bos_activations' runs in the fold pre-pass; use fold_column_scales=True (or None) or "
            "importance='weights'"
        )


# -- the table -----------------------------------------------------------------------------------------------------


class _Default:
    """The constructor's default for a keyword left out: the value `FIELDS` gives."""

    def __repr__(self) -> str:
        return "DEFAULT"


_DEFAULT: Any = _Default()


class ConfigField(NamedTuple):
    """One field of `HfQuantConfig`: a row of `FIELDS`.

    Attributes:
        name: the constructor keyword, the attribute and the `config.json` key.
        help: what the field is, then after the first ": " what its values mean, said once: the CLI's help and the
            class docstring's entry; a choice's error message quotes the part before the ": " (`subject`).
        choices: the allowed values of a closed field: a `Choice` / `Method` enum for strings (the attribute holds
            the member), or a tuple (`bits`, the booleans); None for an open one (its `check` states the rule).
        default: the value when the keyword is left out: a value, or a function of the fields resolved before it (in
            `FIELDS` order) for the defaults that depend on `bits` or `method`.
        check: `check(field, value)` raises ValueError / TypeError naming the bad value and what is allowed.
        none_is_default: an explicit None means the default (for `group_size` None is a value: per-channel).
        legacy: the value a `config.json` written before the field existed holds implicitly, when it differs from
            `default` (`from_dict` fills it in); `_DEFAULT` when it does not.
    """

    name: str
    help: str
    choices: Any
    default: Any
    check: Callable[[ConfigField, Any], None]
    none_is_default: bool = False
    legacy: Any = _DEFAULT

    @property
    def subject(self) -> str:
        """What the field is: its help up to the first ": " ("each group's range for Linear / Conv1D weights, ...")."""
        return self.help.split(": ", 1)[0]

    def default_for(self, resolved: Mapping[str, Any]) -> Any:
        """The default, given the fields resolved before this one (`resolved`, by name)."""
        return self.default(resolved) if callable(self.default) else self.default


FIELDS: tuple[ConfigField, ...] = (
    ConfigField(
        "quant_method",
        f"what transformers reads to pick this quantizer: always {QUANT_METHOD!r}",
        None,
        QUANT_METHOD,
        _check_quant_method,
    ),
    ConfigField(
        "format_version",
        f"on-disk format version: only {FORMAT_VERSION} is read",
        None,
        FORMAT_VERSION,
        _check_format_version,
    ),
    ConfigField(
        "format",
        "how codes and scales are laid out: 'auto' (the default: 'iq4_xs' at 4 bits, 'int' when group_size, "
        "symmetric, clipping or decode_activations is given, 'int' at 8 bits, llama.cpp's k-quant of that width at 2, "
        "3, 5 and 6 bits; the config stores the format it picked), 'int' (uniform integer codes with a bfloat16 "
        "scale per group and an "
        "optional zero point: what compressed-tensors and vLLM read) or one of llama.cpp's block types, stored "
        "byte for byte as GGUF stores them (docs/format.md): " + ", ".join(repr(n) for n in blocks.LAYOUTS) + ". "
        "A block type's rows must be whole blocks (32 weights, 256 for q2_k-q6_k and iq4_xs); other layers take "
        "llama.cpp's fallback type (q3_k -> iq4_nl, q4_k -> q5_0, q6_k -> q8_0, ...); 'hq3_nl' and 'hq3_0' are "
        "hfquant's own 3-bit 32-weight blocks (3.5 bits per weight, not GGUF types; hq3_nl's codes on a non-uniform "
        "grid with a zero); 'hq3_r' is hfquant's own 3-bit rows (hq3_nl's codes, a 6-bit scale per 16 weights under "
        "a float16 per row: 3.375 + 16 / K bits per weight; rows 64 does not divide take hq3_nl). group_size and symmetric "
        "apply to 'int' only",
        QuantFormat,
        QuantFormat.AUTO,
        _check_choice,
        none_is_default=True,
        legacy=QuantFormat.INT,
    ),
    ConfigField(
        "bits",
        "width of the stored integer codes: 4 or 8 in format 'int', 2 to 6 in block formats (default: the block "
        "format's own, else 4); the float 3.5 asks for the 3.5-bit budget (BUDGET_BITS: format 'hq3_r' with "
        "mixed_precision 'auto', stored as bits 3)",
        ALL_BITS,
        lambda resolved: default_bits(resolved["format"]),
        _check_bits,
    ),
    ConfigField(
        "method",
        "how Linear / Conv1D weights are quantized: 'rtn' (round-to-nearest, the default at 8 bits) or 'sinq' "
        "(round-to-nearest after a per-input-column scale balanced by Sinkhorn iterations, hfquant.core.sinq, "
        "arXiv 2509.22944, stored as weight_col_scale; calibration-free, more accurate; the default at 4 bits and "
        "with block formats, where fold_column_scales folds it into Llama-family blocks). "
        "Embeddings, a quantized lm_head and MoE experts always use RTN",
        Method,
        lambda resolved: default_method(resolved["bits"], resolve_format(resolved["format"], resolved["bits"])),
        _check_choice,
        none_is_default=True,
        legacy=Method.RTN,
    ),
    ConfigField(
        "mixed_precision",
        "which layers get more bits than the config gives: 'auto' (the default at 4 bits): hfquant's data-free "
        "rule (hfquant.core.allocation) gives the value projections of the second half of the layers int8 and MLP "
        "down projections groups of at most 64; with a block format (opt-in: 'none' is its default) a llama.cpp "
        "Q3_K_M / Q4_K_M-style mix (block_overrides): value and down projections one or two block types up, more in "
        "the first and last eighth of the layers, attention outputs one up at 2-3 bits; with format 'hq3_r', 'hq3_nl' or 'hq3_0' a "
        "bits budget of 3.5 bits per weight (budget_overrides: Q3_K where 256 divides a row, else that format, then value and "
        "down projections raised in that order while the total stays within 3.5); the entries are appended to "
        "module_overrides when a model is quantized (after the user's entries, which win), so the saved config names "
        "every layer's format; 'none' (the default at 8 bits and with block formats): every layer alike",
        MixedPrecision,
        lambda resolved: default_mixed_precision(resolved["bits"]) if _int_format(resolved) else MixedPrecision.NONE,
        _check_choice,
        none_is_default=True,
        legacy=MixedPrecision.NONE,
    ),
    ConfigField(
        "clipping",
        "each group's range for Linear / Conv1D weights, after SINQ's column scale or a fold: 'minmax' (the "
        "default: nothing clipped) or 'mse' (hfquant.core.rtn.search_scale_zero_point: 16 shrink factors of the "
        "range from 1.0 to 0.70 tried, the one with the smallest squared weight error kept; 16 times the rounding "
        "work, same stored format; not the default: it lowers the weight error, not the perplexity, "
        "docs/performance.md)",
        Clipping,
        Clipping.MINMAX,
        _check_choice,
        legacy=Clipping.MINMAX,
    ),
    ConfigField(
        "iq4_search",
        "how iq4_xs and iq4_nl blocks are searched when quantizing (not stored; the bytes differ, not the format): "
        "'lean' (the default: 14 scales per block, one super-block scale per grid end, the 6-bit level nearest each "
        "iq4_xs block's scale; SmolLM2 perplexity 1.103x bf16, MiniLM cosine 0.9857), 'fast' (lean with three 6-bit "
        "levels per iq4_xs block: 24 passes over each weight instead of 18, the quantize-on-load CPU 1.19x lean's, "
        "0.9975x its squared error, SmolLM2 1.107x, MiniLM 0.9859; iq4_nl bytes the same), 'thorough' (the "
        "exhaustive search's candidates in C, 42 scales per block of 32 and 10 super-block scales: about 2.6x slower "
        "than fast, 0.996x its squared error, SmolLM2 1.102x), 'exact' (thorough's "
        "super-block stage after an exact breakpoint sweep of each block's scale: at most 1.00003x less error, "
        "slower) or 'exhaustive' (the torch codec's search, in C: the bytes hfquant writes without its native "
        "library; about 9x slower than thorough); docs/performance.md",
        Iq4SearchMode,
        Iq4SearchMode.LEAN,
        _check_choice,
        legacy=Iq4SearchMode.THOROUGH,
    ),
    ConfigField(
        "importance",
        "each input column's weight in the block formats' search (not stored; the bytes differ, not the format): "
        "'weights' (each type's data-free rule from the weights alone), 'bos_activations' (the "
        "float model run on its BOS token alone, a length-1 sequence, in the fold pre-pass: the squared input of "
        "q/k/v and gate/up, in the folded space, normalised by its mean, weighs their columns; no text, a few "
        "vectors of memory; hfquant.integration.bos_importance; SmolLM2 iq4_xs 1.120x -> 1.102x bf16, "
        "docs/performance.md; needs a block format and fold_column_scales: Llama, Mistral, Qwen2, Qwen3 blocks, "
        "other models keep 'weights', a warning says so) or 'auto' (the default: 'bos_activations' where a block "
        "format's layers are folded and the model has a bos_token_id, else 'weights', silently)",
        Importance,
        Importance.AUTO,
        _check_choice,
        legacy=Importance.WEIGHTS,
    ),
    ConfigField(
        "fold_column_scales",
        "where SINQ's column scales live: True: in the decoder blocks of Llama, Mistral, Qwen2 and Qwen3, they "
        "are folded into the model (an exact identity of the float model; hfquant.core.folding): those of q/k/v "
        "and gate/up into the norm before them, o_proj's into v_proj's rows, down_proj's into up_proj's rows; "
        "those layers are then "
        "stored as plain RTN int4/int8 or blocks (entries {'method': 'rtn'} put first in module_overrides when quantizing), "
        "which compressed-tensors, vLLM and GGUF read. Needs a float safetensors checkpoint (each block's weights "
        "are read once before the load). False: column scales of method 'sinq' are stored beside the layers "
        "(hfquant-only). Default: True with method 'sinq'",
        (False, True),
        lambda resolved: resolved["method"] == Method.SINQ,
        _check_bool,
        none_is_default=True,
        legacy=False,
    ),
    ConfigField(
        "group_size",
        f"inputs sharing one scale: a power of two from {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE}, or None for one scale "
        "per output channel (default: per-channel at 8 bits, 128 at 4 bits). A layer whose input width it does not "
        "divide uses the largest power of two >= 32 that does (read back from its stored scale's shape); a layer "
        "with no such divisor stays in float and is logged",
        None,
        lambda resolved: default_group_size(resolved["bits"]),
        _check_group_size,
    ),
    ConfigField(
        "symmetric",
        "the codes' zero point: True: signed codes with an implicit zero point (the default at 8 bits); False: "
        "unsigned codes with a uint8 zero point per group (the default at 4 bits)",
        (False, True),
        lambda resolved: default_symmetric(resolved["bits"]),
        _check_bool,
        none_is_default=True,
    ),
    ConfigField(
        "module_overrides",
        "per-module settings: {pattern: {format, bits, group_size, symmetric, method}} "
        "(any subset): Linear layers matching a pattern (the rules of modules_to_not_convert; an exact module "
        "name wins, then the first matching pattern) use these values instead of the config's, e.g. "
        '{"v_proj": {"bits": 8}}; a bits override without group_size / symmetric takes that width\'s defaults. '
        "Embeddings, the lm_head and MoE experts follow their own fields, except an exact-name entry with a block "
        "format, which stores that embedding or lm_head in its blocks (what a GGUF import writes, e.g. "
        '{"model.embed_tokens": {"format": "q8_0"}})',
        None,
        lambda resolved: {},
        _check_overrides,
        none_is_default=True,
    ),
    ConfigField(
        "modules_to_not_convert",
        "modules kept in float: whole dotted names (model.layers.0.mlp), "
        "whole-component suffixes (down_proj) or fnmatch patterns (model.layers.*.self_attn.o_proj); never "
        "substrings; a match on a module keeps its children in float too. The output embedding and weights tied "
        "to the input embedding are kept in float unless embedding_dtype or lm_head asks otherwise",
        None,
        lambda resolved: [],
        _check_module_names,
        none_is_default=True,
    ),
    ConfigField(
        "embedding_dtype",
        "storage of every nn.Embedding (input, position and token-type tables): 'auto' (the compute dtype), a "
        "float dtype, or int8 / int4 (QuantEmbedding, per-row quantized with the layers' group_size and symmetric "
        "when bits matches, else that width's defaults); lookups return the compute dtype",
        EmbeddingDtype,
        EmbeddingDtype.AUTO,
        _check_choice,
    ),
    ConfigField(
        "norm_dtype",
        "storage and compute dtype of LayerNorm / RMSNorm layers (found by type, the families' own *LayerNorm / "
        "*RMSNorm classes too): 'auto' (the compute dtype) or a float dtype; their output is cast to the compute "
        "dtype",
        FloatDtype,
        FloatDtype.AUTO,
        _check_choice,
    ),
    ConfigField(
        "lm_head",
        "the output embedding: 'keep' (float, unless tied to a quantized input embedding), int8 / int4 "
        "(QuantLinear: int8 per channel, int4 in groups) or q6_k (llama.cpp's Q6_K blocks; q8_0 where 256 does not "
        "divide the rows). Default (default_lm_head), with embedding_dtype 'auto': int8 at 4 bits in the int format, "
        "q6_k with the 3-bit budget formats (bits=3.5), else keep; a config.json without the field means keep. "
        "Tied to the input embedding, both are one tensor, stored once and quantized if either field asks for it "
        "(two different formats are an error)",
        LmHead,
        lambda resolved: default_lm_head(resolved["bits"], resolved["format"], resolved["embedding_dtype"]),
        _check_choice,
        legacy=LmHead.KEEP,
    ),
    ConfigField(
        "compute_dtype",
        "dtype of the activations and of float weights without a setting of their own (biases, layers kept in "
        "float): 'auto' (the dtype given to from_pretrained) or a float dtype, which then replaces that dtype. When "
        "embeddings or norms are stored in another float dtype, quantizing records the resolved dtype here so that "
        "a reload restores every dtype",
        FloatDtype,
        FloatDtype.AUTO,
        _check_choice,
    ),
    ConfigField(
        "decode_activations",
        "activations of 4-bit layers in one-token decode steps on CPU (x86-64 with AVX512-VNNI or AVX2): 'float' "
        "(the compute dtype) or 'int8' (quantized per block of 32 inputs, as llama.cpp's Q8_0, for integer dot "
        "products, hfquant.ops.native.int4_gemv_a8, W4A8: slightly less accurate; faster or not by CPU and layer "
        "shape, docs/performance.md). Runtime only: the stored weights are the same, prefill, training and int8 "
        "layers are unchanged, and the choice is saved with the config so that a reload decodes the same way",
        DecodeActivations,
        DecodeActivations.FLOAT,
        _check_choice,
    ),
)
"""Every field of `HfQuantConfig`, in the order `to_dict` writes them (and defaults resolve: `bits` before the fields
whose default depends on it): the one list the config, the CLI and the model card read."""
FIELD_NAMES = tuple(field.name for field in FIELDS)

_BY_NAME = {field.name: field for field in FIELDS}

_CHOICES = {field.name: field.choices for field in FIELDS if isinstance(field.choices, enum.EnumMeta)}
"""{field name: enum} of the closed string choices, whose attributes hold enum members."""

LEGACY_DEFAULTS = {field.name: field.legacy for field in FIELDS if field.legacy is not _DEFAULT}
"""Values of fields a `config.json` written before they existed holds implicitly (what such a checkpoint stores)."""


def validate_fields(values: Mapping[str, Any]) -> None:
    """Check the fields in `values` (any subset of `FIELD_NAMES`, by name) against `FIELDS`: the one validation of
    the constructor, `from_dict`, `HfQuantConfig.validate`, `module_overrides` entries and the CLI.

    `quant_method` is checked first (another quantizer's config is named as such, not by its unknown fields), then the
    names, then every value in `FIELDS` order.

    Raises:
        ValueError: a value is outside what is allowed, or a name is not a field; the message names the value and the
            allowed ones.
        TypeError: a value has the wrong type (for example `bits="4"`).
    """
    if "quant_method" in values:
        field = _BY_NAME["quant_method"]
        field.check(field, values["quant_method"])
    unknown = set(values) - set(FIELD_NAMES)
    if unknown:
        raise ValueError(
            f"Unknown HfQuantConfig field(s) {sorted(unknown)}; allowed fields are {sorted(FIELD_NAMES)}."
        )
    for field in FIELDS:
        if field.name in values:
            field.check(field, values[field.name])
    check_format_bits(values)
    check_importance(values)


def validate_config_values(
    bits: Any, group_size: Any, symmetric: Any, modules_to_not_convert: Any, format_version: Any, **fields: Any
) -> None:
    """`validate_fields` of these values and of any other fields given by keyword (e.g. `method="sinq"`).

    Raises:
        ValueError, TypeError: as `validate_fields`.
    """
    validate_fields(
        {
            "bits": bits,
            "group_size": group_size,
            "symmetric": symmetric,
            "modules_to_not_convert": modules_to_not_convert,
            "format_version": format_version,
            **fields,
        }
    )


def resolve_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every field's value, in `FIELDS` order: the given one, or the field's default when it is left out (or None
    for a `none_is_default` field); `format` "auto" becomes the format it picks (`resolve_format`). A tuple given for a list field (`modules_to_not_convert`) becomes a list. Nothing
    is checked: a default computed from an invalid `bits` is never used, `validate_fields` refuses the `bits` first.
    A `format` left "auto" with a field of `INT_ONLY_FIELDS` given (`asks_uniform`) means "int" at 4 and 8 bits."""
    resolved: dict[str, Any] = {}
    if given.get("format", _DEFAULT) in (_DEFAULT, None, QuantFormat.AUTO) and asks_uniform(given):
        bits = given.get("bits", _DEFAULT)
        given = {**given, "format": default_format(bits if isinstance(bits, int) else 4, uniform=True)}
    for field in FIELDS:
        value = given.get(field.name, _DEFAULT)
        if value is _DEFAULT or (value is None and field.none_is_default):
            value = field.default_for(resolved)
        elif isinstance(value, tuple) and isinstance(field.default_for(resolved), list):
            value = list(value)
        resolved[field.name] = value
    if isinstance(resolved["format"], str) and isinstance(resolved["bits"], int):
        resolved["format"] = resolve_format(resolved["format"], resolved["bits"])  # "auto" is stored as what it means
    return resolved


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


def _plain(value: Any) -> Any:
    """A field's value as JSON writes it: an enum member as its string, anything else as a deep copy."""
    return value.value if isinstance(value, enum.Enum) else copy.deepcopy(value)


class HfQuantConfig(QuantizationConfigMixin):
    """Weight-only, calibration-free quantization of Linear and GPT-2 `Conv1D` layers to int8 or int4.

    The defaults at 4 bits are the most accurate calibration-free setting measured within 4.5 bits per weight
    (`scripts/accuracy.py`; the figures are in docs/performance.md): `method="sinq"`, group 128, asymmetric,
    `mixed_precision="auto"`. At 8 bits: round-to-nearest (RTN), per-channel, symmetric.

    Every keyword is a field of `FIELDS`, listed below from that table; a keyword left out takes the field's default.
    A closed choice accepts its enum member or the plain string ("sinq") and is stored as the member.

    Runtime switches outside the config (nothing stored, the weights unchanged): a loaded bfloat16 model's RMSNorms of
    LlamaRMSNorm's arithmetic compute one-token decode rows in one C call, bit for bit as transformers does
    (`hfquant.nn.row_norm`; `restore_rms_norms(model)` turns it off, `model.dequantize()` too); a model whose
    attention is "sdpa" and was not named in `from_pretrained(attn_implementation=...)` attends one decode query row
    in one C call (`hfquant.nn.row_attention`: faster eager decode; an output may differ from PyTorch's SDPA by one
    bfloat16 step, so greedy tokens may differ at near-ties as between "eager" and "sdpa"; prefill unchanged).
    `attn_implementation="sdpa"` at load, `restore_row_attention(model)` or `model.dequantize()` turn it off;
    `use_row_attention(model)` turns it on; config.json is saved as without it. While that attention is on, the
    attention, MLP and decoder layers of Llama, Mistral and Qwen2 run a one-token decode step's rotary embedding,
    SwiGLU product and residual add + norm in one C call each (`hfquant.nn.row_decode`: the SwiGLU may differ from
    torch's by one bfloat16 step in about one output in 10^4); `restore_row_decode(model)` or `model.dequantize()`
    turn it off.

    Raises:
        ValueError / TypeError: through `validate_fields`, naming the bad value and what is allowed; ValueError for
            a keyword that is not a field.
    """

    def __init__(
        self,
        bits: int | float = _DEFAULT,
        group_size: int | None = _DEFAULT,
        symmetric: bool | None = _DEFAULT,
        modules_to_not_convert: list[str] | None = _DEFAULT,
        format_version: int = _DEFAULT,
        quant_method: str = _DEFAULT,
        format: str | QuantFormat | None = _DEFAULT,
        embedding_dtype: str | EmbeddingDtype = _DEFAULT,
        norm_dtype: str | FloatDtype = _DEFAULT,
        lm_head: str | LmHead = _DEFAULT,
        compute_dtype: str | FloatDtype = _DEFAULT,
        method: str | Method | None = _DEFAULT,
        module_overrides: dict[str, dict[str, Any]] | None = _DEFAULT,
        mixed_precision: str | MixedPrecision | None = _DEFAULT,
        fold_column_scales: bool | None = _DEFAULT,
        clipping: str | Clipping = _DEFAULT,
        iq4_search: str | Iq4SearchMode = _DEFAULT,
        importance: str | Importance = _DEFAULT,
        decode_activations: str | DecodeActivations = _DEFAULT,
        **unknown: Any,
    ):
        given = {name: value for name, value in locals().items() if name in FIELD_NAMES}  # the keywords above
        given = _budget_bits(given)  # bits=3.5: the hq3_r budget
        values = resolve_defaults(given)
        validate_fields({**values, **unknown})
        for name, value in values.items():
            setattr(self, name, copy.deepcopy(value))

    def __setattr__(self, name: str, value: Any) -> None:
        """A valid string set on a closed choice is stored as its enum member (`config.clipping = "mse"` gives
        `Clipping.MSE`); any other value is stored as given, for `validate` to name."""
        choices = _CHOICES.get(name)
        if choices is not None and isinstance(value, str) and value in _values(choices):
            value = choices(value)
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any):
        """The config of a `config.json`'s `quantization_config`, validated like the constructor. A field written
        before it existed takes the value such a checkpoint holds (`LEGACY_DEFAULTS`: "rtn", no mixed precision),
        never today's defaults. `kwargs` override the dict's values."""
        values = {**LEGACY_DEFAULTS, **config_dict, **kwargs}
        config = cls(**values)
        return (config, {}) if return_unused_kwargs else config

    def apply_mixed_precision(
        self,
        layer_names: Iterable[str],
        shapes: Mapping[str, tuple[int, int]] | None = None,
        overhead: Mapping[str, float] | None = None,
    ) -> dict[str, dict[str, Any]]:
        """Append the data-free rule's `module_overrides` entries for a model's Linear layers `layer_names` (full
        dotted names) when `mixed_precision` is "auto" (`hfquant.core.allocation.data_free_overrides` in the integer
        format, `block_overrides` with a block format, `budget_overrides` with a bits-budget format such as "hq3_r",
        which needs `shapes`: {name: (in_features, out_features)} and counts `overhead`: {name: bits per weight
        stored beside the blocks}, such as a SINQ column scale).

        Layers already selected by a `module_overrides` pattern keep the user's settings. Called once per model,
        when it is quantized (never when a quantized checkpoint is reloaded: its config already lists the entries).
        Returns the entries added (empty when the rule does not apply).
        """
        if self.mixed_precision is not MixedPrecision.AUTO:
            return {}
        names = [n for n in layer_names if not any(matches_module(n, [p]) for p in self.module_overrides)]
        fmt = resolve_format(self.format, self.bits)
        if fmt in BUDGET_FORMATS:
            added = budget_overrides(
                {n: tuple(shapes[n]) for n in names if n in (shapes or {})}, fmt, dict(overhead or {})
            )
        elif fmt in blocks.LAYOUTS:
            added = block_overrides(names, fmt)
        else:
            added = data_free_overrides(names, self.bits, self.group_size)
        self.module_overrides.update(added)
        return added

    def prepend_overrides(self, entries: dict[str, dict[str, Any]]) -> None:
        """Put `entries` before the existing `module_overrides` (the first matching pattern wins, so they decide the
        layers they name); used by `fold_column_scales`, whose entries state a layer's complete format."""
        self.module_overrides = {**entries, **{p: s for p, s in self.module_overrides.items() if p not in entries}}

    def layer_settings(self, name: str) -> LayerSettings:
        """What the config asks for the Linear layer `name` (full dotted name): the `module_overrides` entry naming it
        exactly, else the first entry whose pattern selects it (a saved config.json sorts its keys, so the recorded
        per-layer entries are exact names), completed by the config's own values (at the config's bit width) or that
        width's defaults (`default_group_size`, `default_symmetric`, format "auto"); the config's values when no pattern
        selects it. An entry's `format` without `bits` takes the format's width. The format is resolved for the bit
        width (`resolve_format`); the group size is the asked one: a layer resolves it for its width
        (`rtn.effective_group_size`)."""
        exact = self.module_overrides.get(name)  # a saved config's keys come back sorted: exact names go first
        ordered = [(name, exact)] if exact is not None else []
        for pattern, settings in ordered + list(self.module_overrides.items()):
            if matches_module(name, [pattern]):
                fmt = settings.get("format")
                bits = settings.get("bits", default_bits(fmt) if fmt not in (None, QuantFormat.AUTO) else self.bits)
                same = bits == self.bits
                fmt = fmt if fmt is not None else (self.format if same else self._format_at(bits, settings))
                group_size = settings.get("group_size", self.group_size if same else default_group_size(bits))
                symmetric = settings.get("symmetric", self.symmetric if same else default_symmetric(bits))
                method = Method(settings.get("method", self.method))
                return LayerSettings(bits, group_size, symmetric, method, resolve_format(fmt, bits))
        return LayerSettings(
            self.bits, self.group_size, self.symmetric, Method(self.method), resolve_format(self.format, self.bits)
        )

    def _format_at(self, bits: int, settings: Mapping[str, Any]) -> str:
        """The format of a `module_overrides` entry that names another bit width and no format: the integer format
        stays "int" where it stores that width (an int8 config's {"bits": 4} entry is int4, as before iq4_xs became
        the 4-bit default), else "auto" at that width (`default_format`, "int" when the entry gives a field of
        `INT_ONLY_FIELDS`)."""
        if self.format == QuantFormat.INT and bits in SUPPORTED_BITS:
            return QuantFormat.INT
        return default_format(bits, asks_uniform(settings))

    def validate(self) -> None:
        """Re-check the fields (after a user changed attributes in place); raises like the constructor."""
        validate_fields({name: getattr(self, name) for name in FIELD_NAMES})

    def to_dict(self) -> dict[str, Any]:
        """Every field with its resolved value, as plain JSON values in `FIELDS` order;
        `HfQuantConfig.from_dict(c.to_dict()) == c`."""
        return {name: _plain(getattr(self, name)) for name in FIELD_NAMES}

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def __iter__(self):
        yield from copy.deepcopy(self.to_dict()).items()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HfQuantConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))


def _fields_doc() -> str:
    """The Args section of `HfQuantConfig`'s docstring, from `FIELDS`."""
    lines = ["", "    Args (the rows of `FIELDS`, in its order):"]
    for field in FIELDS:
        facts = []
        if field.choices is not None:
            facts.append("one of " + ", ".join(repr(v) for v in _values_of(field.choices)))
        if not callable(field.default):
            facts.append(f"default {_plain(field.default)!r}")
        suffix = f" ({'; '.join(facts)})" if facts else ""
        lines.append(f"        {field.name}{suffix}: {field.help}.")
    return "\n".join(lines) + "\n"


def _values_of(choices: Any) -> tuple:
    return _values(choices) if isinstance(choices, enum.EnumMeta) else tuple(choices)


HfQuantConfig.__doc__ = (HfQuantConfig.__doc__ or "") + _fields_doc()
