"""compressed-tensors `pack-quantized` layers (llm-compressor's W4A16 / W8A16, or hfquant's exports) as hfquant's stored
tensors, bit for bit: the inverse of the mapping in `hfquant.checkpoint.compressed_tensors` (its table, read right to
left). `weight_packed` bytes become hfquant's codes (8-bit symmetric ones with the sign bit flipped back), the zero
point is unpacked along N, bfloat16 scales are copied, `weight_shape` is checked and dropped.

What hfquant cannot hold exactly is refused with the reason (`ValueError`): activation or kv-cache quantization, other
formats, float or other-width weights, actorder (`weight_g_idx`), dynamic or block scales, group sizes outside
32-1024 or not dividing the input width, scales that bfloat16 cannot hold exactly or that are not finite and > 0.
"""

from __future__ import annotations

import functools
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping

import torch

from hfquant.checkpoint.compressed_tensors import FORMAT, QUANT_METHOD, ExportLayer, OutputTensor, Scheme
from hfquant.checkpoint.files import TensorHeader
from hfquant.core import rtn
from hfquant.core.format import StoredFormat
from hfquant.core.packing import unpack_int4

__all__ = [
    "PRESETS",
    "IMPORT_GROUP_SIZES",
    "read_quantization_config",
    "matches_target",
    "target_regex",
    "plan_import",
    "plan_import_outputs",
    "unpack_words",
    "unpack_zero_point",
    "import_tensor",
]

PRESETS = {"W4A16": Scheme(4, 128, True), "W4A16_ASYM": Scheme(4, 128, False), "W8A16": Scheme(8, 128, True)}
"""compressed-tensors preset names (a config group given as `{"W4A16": ["Linear"]}`) hfquant reads."""
IMPORT_GROUP_SIZES = tuple(2**p for p in range(5, 11))
_LAYER_TENSORS = {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}


def _weights_scheme(group: str, entry: dict) -> Scheme:
    """The Scheme of one `config_groups` entry, or a ValueError saying why hfquant cannot hold it."""
    where = f"config_groups[{group!r}]"
    for field in ("input_activations", "output_activations"):
        if entry.get(field) is not None:
            raise ValueError(
                f"{where} quantizes {field} (e.g. W4A8, W8A8); hfquant stores weight-only schemes "
                "(W4A16, W8A16) and computes with float activations"
            )
    if entry.get("format") not in (None, FORMAT):
        raise ValueError(f"{where} has format {entry.get('format')!r}; hfquant imports {FORMAT!r} only")
    args = entry.get("weights")
    if not isinstance(args, dict):
        raise ValueError(f"{where} has no weights arguments; hfquant imports weight-quantized groups only")
    if args.get("actorder") not in (None, False):
        raise ValueError(
            f"{where} uses actorder={args['actorder']!r}: activation ordering permutes the input columns "
            "of each group (g_idx), while hfquant's groups are consecutive columns; export from "
            "llm-compressor without actorder"
        )
    bits, kind, strategy = args.get("num_bits"), args.get("type", "int"), args.get("strategy")
    if kind != "int" or bits not in (4, 8):
        raise ValueError(f"{where} stores {kind} {bits}-bit weights; hfquant imports int 4 and int 8 only")
    if args.get("dynamic") not in (None, False) or args.get("block_structure") is not None:
        raise ValueError(f"{where} uses dynamic or block quantization; hfquant imports static group / channel scales")
    group_size = args.get("group_size")
    if strategy == "channel" or (strategy is None and group_size == -1):
        return Scheme(bits, None, bool(args.get("symmetric", True)))
    if strategy not in ("group", None) or group_size not in IMPORT_GROUP_SIZES:
        raise ValueError(
            f"{where} has strategy {strategy!r}, group_size {group_size!r}; hfquant imports strategy "
            f"'channel' or 'group' with a group size in {list(IMPORT_GROUP_SIZES)}"
        )
    return Scheme(bits, group_size, bool(args.get("symmetric", True)))


def read_quantization_config(qconfig: dict) -> tuple[list[tuple[list[str], Scheme]], list[str]]:
    """([(targets, scheme) per config group], ignore) of a compressed-tensors `quantization_config`.

    Raises:
        ValueError: another quant_method or format, a kv-cache scheme, or a group `_weights_scheme` refuses: the
            message names the group and the reason (activation quantization, actorder / g_idx, float or other-width
            weights, a group size hfquant does not store).
    """
    if not isinstance(qconfig, dict) or qconfig.get("quant_method") != QUANT_METHOD:
        method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
        raise ValueError(f"quantization_config has quant_method {method!r}; hfquant import reads {QUANT_METHOD!r}")
    if qconfig.get("format") not in (FORMAT, "mixed-precision"):
        raise ValueError(
            f"quantization_config has format {qconfig.get('format')!r}; hfquant imports {FORMAT!r} "
            "(int weights packed in int32) only"
        )
    if qconfig.get("kv_cache_scheme") is not None:
        raise ValueError("quantization_config quantizes the kv cache (kv_cache_scheme); hfquant does not")
    if qconfig.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_status is {qconfig.get('quantization_status')!r}; import reads 'compressed'")
    groups = []
    for group, entry in (qconfig.get("config_groups") or {}).items():
        if isinstance(entry, list):
            if group.upper() not in PRESETS:
                raise ValueError(
                    f"config_groups[{group!r}] is the preset {group!r}; hfquant imports {sorted(PRESETS)}"
                )
            groups.append((list(entry), PRESETS[group.upper()]))
        elif isinstance(entry, dict):
            if entry.get("format") is None and qconfig.get("format") != FORMAT:
                raise ValueError(
                    f"config_groups[{group!r}] has no format in a mixed-precision config; hfquant "
                    f"imports {FORMAT!r} groups only"
                )
            groups.append((list(entry.get("targets") or []), _weights_scheme(group, entry)))
        else:
            raise ValueError(f"config_groups[{group!r}] is {type(entry).__name__}; expected a scheme or a preset")
    ignore = list(qconfig.get("ignore") or [])
    for target in [*(t for targets, _ in groups for t in targets), *ignore]:
        if isinstance(target, str) and target.startswith("re:"):
            target_regex(target)  # a pattern that could hang import is refused before any work
    return groups, ignore


MAX_PATTERN_CHARS = 256
MAX_NAME_CHARS = 256
MAX_OPEN_REPEATS = 3
"""Bounds on the "re:" patterns of a compressed-tensors config and the names they are matched against: with no nested
or alternating repeat and no backreference, a match costs at most about len(name) ** open repeats steps (16.7
million at these bounds, well under a second), where a pattern such as `(a+)+$` costs 2 ** len(name)."""

_REPEATS = {re._constants.MAX_REPEAT, re._constants.MIN_REPEAT, getattr(re._constants, "POSSESSIVE_REPEAT", None)}


def _backtracking_risks(items, inside: bool, found: list[str]) -> int:
    """The unbounded repeats of the parsed pattern `items` (`re._parser`), appending to `found` what can make a
    match take exponential time: a repeat inside a repeat, an alternation inside a repeat, a backreference."""
    constants = re._constants
    opened = 0
    for op, value in items:
        if op in (constants.GROUPREF, constants.GROUPREF_EXISTS):
            found.append("a backreference")
        elif op in _REPEATS:
            low, high, sub = value
            if inside and high > 1:
                found.append("a repeat inside a repeat")
            opened += high == constants.MAXREPEAT or high > 1000
            opened += _backtracking_risks(sub, inside or high > 1, found)
        elif op is constants.SUBPATTERN:
            opened += _backtracking_risks(value[-1], inside, found)
        elif op is constants.BRANCH:
            if inside:
                found.append("an alternation inside a repeat")
            opened += sum(_backtracking_risks(branch, inside, found) for branch in value[1])
        elif op in (constants.ASSERT, constants.ASSERT_NOT):
            opened += _backtracking_risks(value[1], inside, found)
        elif op is getattr(constants, "ATOMIC_GROUP", None):
            opened += _backtracking_risks(value, inside, found)
    return opened


@functools.lru_cache(maxsize=256)
def target_regex(target: str) -> re.Pattern:
    """The compiled "re:<regex>" `target` of an untrusted compressed-tensors config, refused when matching it could
    hang: longer than MAX_PATTERN_CHARS, a backreference, a repeat or an alternation inside a repeat (`(a+)+`,
    `(a|ab)*`: catastrophic backtracking), more than MAX_OPEN_REPEATS unbounded repeats, or not a regex.

    Raises:
        ValueError: one line naming the pattern (repr: escaped) and what is allowed.
    """
    pattern = target.removeprefix("re:")
    shown = repr(target[:80] + ("..." if len(target) > 80 else ""))
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(
            f"compressed-tensors target {shown} is {len(pattern)} characters long; hfquant matches patterns of at "
            f"most {MAX_PATTERN_CHARS}: shorten it, or list the module names"
        )
    try:
        parsed = re._parser.parse(pattern)
    except re.error as error:
        raise ValueError(f"compressed-tensors target {shown} is not a regular expression ({error})") from None
    found: list[str] = []
    opened = _backtracking_risks(list(parsed), False, found)
    if opened > MAX_OPEN_REPEATS:
        found.append(f"{opened} unbounded repeats (at most {MAX_OPEN_REPEATS})")
    if found:
        raise ValueError(
            f"compressed-tensors target {shown} has {found[0]}, which can make matching take exponential time; "
            "hfquant refuses nested or alternating repeats and backreferences in an untrusted config: write the "
            "pattern without them (e.g. 're:.*mlp\\.(up|down)_proj$'), or list the module names"
        )
    return re.compile(pattern)


def matches_target(name: str, classes: Iterable[str], target: str) -> bool:
    """compressed-tensors' matching: "re:<regex>" matched from the start of the module name, else the exact name or
    the name of one of the module's classes (`classes`, e.g. its MRO: "Linear"). A regex is checked by
    `target_regex` and matched only against names of at most MAX_NAME_CHARS characters.

    Raises:
        ValueError: a pattern that could hang (`target_regex`), or a module name too long to match against one.
    """
    if target.startswith("re:"):
        if len(name) > MAX_NAME_CHARS:
            raise ValueError(
                f"module name {name[:80] + '...'!r} is {len(name)} characters long; hfquant matches compressed-tensors "
                f"patterns against names of at most {MAX_NAME_CHARS}"
            )
        return target_regex(target).match(name) is not None
    return target == name or target in classes


def plan_import(
    headers: Mapping[str, TensorHeader],
    groups: list[tuple[list[str], Scheme]],
    ignore: list[str],
    classes: Callable[[str], list[str]],
) -> list[ExportLayer]:
    """The pack-quantized layers of a compressed-tensors checkpoint (`P.weight_packed`) with their hfquant format.

    Raises:
        ValueError: a layer has tensors hfquant cannot hold (`weight_g_idx`, global or input scales), no config group
            targets it, or its shapes disagree with its scheme (naming the layer and the reason).
    """
    layers = []
    for key in headers:
        prefix, _, tensor = key.rpartition(".")
        if tensor == "weight_g_idx":
            raise ValueError(
                f"{prefix} has weight_g_idx (activation ordering): its group of each input column is "
                "permuted, hfquant's groups are consecutive columns; export without actorder"
            )
        if tensor != "weight_packed":
            continue
        extra = sorted(
            k.rpartition(".")[2]
            for k in headers
            if k.startswith(f"{prefix}.weight_")
            and k.rpartition(".")[0] == prefix
            and k.rpartition(".")[2] not in _LAYER_TENSORS
        )
        if extra:
            raise ValueError(f"{prefix} stores {extra}, which hfquant's weight-only format has no tensor for")
        names = classes(prefix)
        scheme = next((s for targets, s in groups if any(matches_target(prefix, names, t) for t in targets)), None)
        if scheme is None or any(matches_target(prefix, names, t) for t in ignore):
            raise ValueError(f"{prefix} has packed weights, but no config group targets it (or it is ignored)")
        packed, scale = headers[key], headers.get(f"{prefix}.weight_scale")
        zero = headers.get(f"{prefix}.weight_zero_point")
        if scale is None or f"{prefix}.weight_shape" not in headers or (zero is None) != scheme.symmetric:
            raise ValueError(
                f"{prefix}: weight_scale, weight_shape and (asymmetric only) weight_zero_point are "
                f"needed; found {sorted(k for k in headers if k.startswith(prefix + '.'))}"
            )
        n, groups_per_row = scale.shape
        k = packed.shape[1] * 32 // scheme.bits
        group_size = scheme.group_size or k
        if k % group_size or k // group_size != groups_per_row or packed.shape[0] != n:
            raise ValueError(
                f"{prefix}: weight_packed {packed.describe()} and weight_scale {scale.describe()} do not "
                f"fit {scheme}; hfquant imports layers whose input width is a multiple of the group size"
            )
        layers.append(ExportLayer(prefix, StoredFormat(scheme.bits, group_size, scheme.symmetric), n, k, False))
    return layers


def plan_import_outputs(headers: Mapping[str, TensorHeader], layers: list[ExportLayer]) -> list[OutputTensor]:
    """Every tensor of the hfquant checkpoint: each layer's `StoredFormat` tensors, every other tensor copied."""
    owned = {f"{layer.name}.{t}": layer for layer in layers for t in _LAYER_TENSORS}
    outputs = []
    for key, header in headers.items():
        layer = owned.get(key)
        if layer is None:
            outputs.append(OutputTensor(key, header.dtype, header.shape, "copy", key))
        elif key == f"{layer.name}.weight_packed":
            for name, (dtype, shape) in layer.fmt.tensor_specs((layer.rows,), layer.in_features).items():
                outputs.append(OutputTensor(f"{layer.name}.{name}", dtype, shape, f"import_{name}", layer.name, layer))
    return outputs


def unpack_words(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Inverse of `pack_words`: (R, W) int32 -> the first `nbytes` bytes of each row, (R, nbytes) uint8."""
    if sys.byteorder != "little":
        raise RuntimeError("compressed-tensors import reads int32 as little-endian bytes; this machine is big-endian")
    rows = words.shape[0]
    return words.contiguous().reshape(-1).view(torch.uint8).reshape(rows, -1)[:, :nbytes].contiguous()


def unpack_zero_point(words: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of `pack_zero_point`: (ceil(N * bits / 32), G) int32 -> (N, G) uint8 zero points."""
    columns = unpack_words(words.t().contiguous(), math.ceil(rows * bits / 8))  # (G, bytes)
    if bits == 4:
        columns = unpack_int4(columns)
    return columns[:, :rows].t().contiguous()


def import_tensor(output: OutputTensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The hfquant tensor `output` (as `plan_import_outputs` planned it), reading compressed-tensors tensors with
    `read(name)`.

    Raises:
        ValueError: scales that bfloat16 cannot hold exactly or that are not finite and > 0, a weight_shape that
            disagrees with the packed shapes, or a source tensor of another dtype or shape than planned; each named.
    """
    layer = output.layer
    if output.role == "copy":
        return read(output.source).contiguous()
    name, fmt = layer.name, layer.fmt
    if output.role == "import_weight":
        shape = read(f"{name}.weight_shape")
        if shape.tolist() != [layer.rows, layer.in_features]:
            raise ValueError(
                f"{name}.weight_shape is {shape.tolist()}, the packed tensors hold "
                f"[{layer.rows}, {layer.in_features}]; only unpadded layers can be imported"
            )
        codes = unpack_words(read(f"{name}.weight_packed"), output.shape[1])
        tensor = (codes ^ 0x80).view(torch.int8) if fmt.bits == 8 and fmt.symmetric else codes
    elif output.role == "import_weight_scale":
        source = read(f"{name}.weight_scale")
        tensor = source.to(rtn.SCALE_DTYPE)
        if not torch.equal(tensor.to(source.dtype), source):
            raise ValueError(
                f"{name}.weight_scale is {source.dtype} with values bfloat16 cannot hold exactly; "
                "hfquant stores bfloat16 scales and imports only what it holds bit for bit"
            )
        if not bool((torch.isfinite(tensor) & (tensor > 0)).all()):
            raise ValueError(f"{name}.weight_scale holds scales that are not finite and > 0; hfquant refuses those")
    elif output.role == "import_weight_zero_point":
        tensor = unpack_zero_point(read(f"{name}.weight_zero_point"), fmt.bits, layer.rows)
    else:
        raise ValueError(f"unknown output role {output.role!r}")
    if tensor.dtype != output.dtype or tuple(tensor.shape) != output.shape:
        raise ValueError(
            f"{output.name}: made {tensor.dtype} {tuple(tensor.shape)}, planned {output.dtype} "
            f"{output.shape} from the headers"
        )
    return tensor.contiguous()
