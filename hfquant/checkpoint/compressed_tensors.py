"""hfquant's stored layers as compressed-tensors `pack-quantized` tensors (the format llm-compressor writes and vLLM
and transformers' CompressedTensors integration read), one tensor at a time.

A quantized hfquant layer `P` (docs/format.md: N = out_features, K = in_features, g its group size, G = K / g) maps
to these compressed-tensors tensors, bit for bit:

| hfquant | compressed-tensors |
| --- | --- |
| `P.weight` 4 bits: (N, K/2) uint8, byte[n, j] = c[n, 2j] \\| c[n, 2j+1] << 4 | `P.weight_packed` (N, K/8) int32: the same bytes read as little-endian int32 (compressed-tensors stores q + 8 with q = c - 8 in [-8, 7], element i of a word in bits 4i..4i+3) |
| `P.weight` 8 bits symmetric: (N, K) int8 q | `P.weight_packed` (N, K/4) int32: bytes q + 128 (the sign bit flipped), four per word |
| `P.weight` 8 bits asymmetric: (N, K) uint8 q | `P.weight_packed` (N, K/4) int32: the same bytes (compressed-tensors' q - 128, stored + 128) |
| `P.weight_scale` (N, G) bfloat16 | `P.weight_scale` (N, G) bfloat16, unchanged |
| `P.weight_zero_point` (N, G) uint8 z | `P.weight_zero_point` (ceil(N / (32 / bits)), G) int32: z packed along N (its zero point z - 2^(bits-1), stored + 2^(bits-1), i.e. the byte or nibble z), column by column; for engine "transformers" (N, G) int32, those words in its first rows and zeros after |
| (the shape) | `P.weight_shape` (2,) int64 [N, K] |

Both dequantize to `(q - z) * scale` per group (compressed-tensors with signed q and z, hfquant with unsigned ones,
the difference cancels), so compressed-tensors' own `unpack_from_int32` and `dequantize` give hfquant's weights.
A row whose packed bytes are not a multiple of 4 is padded with zero bytes, as `pack_to_int32` pads.

Two engines read these files, and in their current versions they disagree on one tensor, the zero point of an
asymmetric layer (`ENGINES`):

- "vllm": the layout above, which compressed-tensors' own `compress` writes and vLLM (its `weight_zero_point`
  parameter is (N * bits / 32, G)) and llm-compressor read. vLLM fuses q/k/v and gate/up into one layer with one
  scheme, so a fused set whose members are stored in different formats (the 4-bit default's int8 late v_proj beside
  int4 q/k_proj) is written in float, all of the set (`vllm_float_layers`), with a warning naming the sets.
- "transformers": transformers 5 (5.24) with compressed-tensors 0.20 builds the model on the meta device and
  compresses it there, which leaves the zero point unpacked, (N, G) in the group's `zp_dtype`; a packed zero point
  is then a shape mismatch, and its decompression later unpacks whatever tensor it holds with `unpack_from_int32`,
  which reads only the first ceil(N * bits / 32) rows. So the zero point is written (N, G) int32 with the packed
  words in those rows and zeros below, and the group's `zp_dtype` is "torch.int32": it loads quantized (the
  packed codes kept until the first forward decompresses them) and decompresses to the same weights. vLLM refuses
  that shape.

Symmetric layers have no zero point: both engines read the same files.

Not expressible, so refused (`ValueError` naming the layer): a `weight_col_scale` (method "sinq" multiplies every
input column by its own scale, which compressed-tensors has no tensor for). Quantized embeddings and a quantized
lm_head are not `pack-quantized` targets (vLLM and transformers quantize Linear layers only): they are written
dequantized, `(q - z) * scale` computed in float32 and cast to the compute dtype, a few rows at a time.

`plan_layers` reads only headers; `export_tensor` builds one output tensor from the source tensors it names. The
inverse (compressed-tensors -> hfquant) is `hfquant.checkpoint.compressed_tensors_import`.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch

from hfquant.checkpoint.files import TensorHeader
from hfquant.core import rtn
from hfquant.core.format import StoredFormat
from hfquant.core.packing import unpack_int4

logger = logging.getLogger(__name__)

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"))
"""Layers that vLLM fuses into one (its `packed_modules_mapping`: qkv_proj, gate_up_proj) and then quantizes with the
scheme of the first one: their schemes must all be the same (vLLM's compressed-tensors `should_ignore_layer` /
`find_matched_target`, 0.32)."""

__all__ = [
    "ENGINES",
    "QUANT_METHOD",
    "FORMAT",
    "ExportLayer",
    "OutputTensor",
    "Scheme",
    "plan_layers",
    "plan_outputs",
    "quantization_config",
    "export_tensor",
    "pack_words",
    "pack_zero_point",
    "vllm_float_layers",
]

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
ENGINES = ("vllm", "transformers")
"""The readers an export is laid out for: they differ in the zero point of asymmetric layers (module docstring)."""
_DEQUANT_CHUNK_BYTES = 4 * 2**20
"""float32 bytes dequantized at a time for an embedding or lm_head written in float."""


class Scheme(NamedTuple):
    """One compressed-tensors `config_groups` entry: bits, group size (None: strategy "channel"), symmetric."""

    bits: int
    group_size: int | None
    symmetric: bool

    def weights(self, engine: str = "vllm") -> dict:
        """The `weights` QuantizationArgs of the group, as compressed-tensors' JSON schema spells them; for engine
        "transformers" an asymmetric group also names its zero point's dtype (`zp_dtype` "torch.int32")."""
        args = {
            "num_bits": self.bits,
            "type": "int",
            "symmetric": self.symmetric,
            "strategy": "channel" if self.group_size is None else "group",
            "group_size": self.group_size,
            "dynamic": False,
        }
        if engine == "transformers" and not self.symmetric:
            args["zp_dtype"] = "torch.int32"
        return args


class ExportLayer(NamedTuple):
    """One quantized layer of the source: its module name in the files, stored format and shape."""

    name: str
    fmt: StoredFormat
    rows: int  # N
    in_features: int  # K
    dequantize: bool  # an embedding or the lm_head: written as a float `weight`

    @property
    def scheme(self) -> Scheme:
        """Its compressed-tensors group: per-channel (strategy "channel") when one group spans the row."""
        group = None if self.fmt.group_size == self.in_features else self.fmt.group_size
        return Scheme(self.fmt.bits, group, self.fmt.symmetric)

    def sources(self) -> list[str]:
        """The hfquant tensors of the layer (docs/format.md)."""
        return [f"{self.name}.{n}" for n in self.fmt.tensor_names()]


class OutputTensor(NamedTuple):
    """One tensor of the export: name, dtype, shape, and how it is made (`role`) from which layer (or copied)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    role: str  # "copy", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "dequantized"
    source: str  # the source tensor for "copy", else the layer name
    layer: ExportLayer | None = None


def plan_layers(
    headers: Mapping[str, TensorHeader],
    in_features: Callable[[str], int | None],
    fallback_bits: Callable[[str], int],
    dequantized: Iterable[str] = (),
) -> list[ExportLayer]:
    """The quantized layers of an hfquant checkpoint, from its safetensors headers.

    A layer `P` is a `P.weight` with a `P.weight_scale`. Its width: int8 codes are 8 bits; uint8 codes without a
    zero point are 4 bits (symmetric 8-bit codes are always int8); uint8 codes with a zero point are 8 bits when
    they hold `in_features(P)` columns, 4 bits when half as many, and `fallback_bits(P)` (the config's width for
    that layer) when the float shape is unknown (e.g. MoE experts fused in the model).

    Args:
        headers: file tensor name -> header, every tensor of the checkpoint.
        in_features: K of the float layer `P` (from the model skeleton), or None when unknown.
        fallback_bits: bit width of `P` from the checkpoint's config, used only when K is unknown.
        dequantized: layers to write as float weights (quantized embeddings, a quantized lm_head).
    Raises:
        ValueError: a layer has a `weight_col_scale` (method "sinq"; the message names every such layer and what to
            do), or stored shapes that no hfquant format gives (naming the layer).
    """
    dequantized = set(dequantized)
    sinq = [k.removesuffix(".weight_col_scale") for k in headers if k.endswith(".weight_col_scale")]
    if sinq:
        listed = ", ".join(sinq[:3]) + (f" and {len(sinq) - 3} more" if len(sinq) > 3 else "")
        raise ValueError(
            f"{listed} ({len(sinq)} layer(s)) store a weight_col_scale (method 'sinq': every input column has its own "
            "scale), which compressed-tensors pack-quantized cannot express; exporting would change the weights. "
            "Allowed: layers quantized with method 'rtn'. Quantize the float checkpoint again with method='rtn' "
            "(hfquant convert SRC DST --method rtn) and export that"
        )
    layers = []
    for key, header in headers.items():
        if not key.endswith(".weight") or f"{key}_scale" not in headers:
            continue
        name = key.removesuffix(".weight")
        scale = headers[f"{key}_scale"]
        symmetric = f"{key}_zero_point" not in headers
        if len(header.shape) != 2 or len(scale.shape) != 2 or scale.shape[0] != header.shape[0]:
            raise ValueError(
                f"{name}: weight {header.describe()} with weight_scale {scale.describe()} is not a 2-D hfquant layer "
                "(docs/format.md); only checkpoints written by hfquant can be exported"
            )
        cols = header.shape[1]
        k = in_features(name)
        if header.dtype == torch.int8:
            bits = 8
        elif header.dtype != torch.uint8:
            raise ValueError(f"{name}.weight is {header.describe()}; hfquant codes are int8 or uint8")
        elif symmetric:
            bits = 4
        elif k is not None:
            bits = 8 if cols == k else 4
        else:
            bits = fallback_bits(name)
        k = cols * (2 if bits == 4 else 1) if k is None else k
        groups = scale.shape[1]
        if cols * (2 if bits == 4 else 1) != k or k % groups:
            raise ValueError(
                f"{name}: stored weight {header.describe()} and weight_scale {scale.describe()} do not fit a "
                f"{bits}-bit layer with {k} input features; the checkpoint does not match its config (hfquant verify)"
            )
        fmt = StoredFormat(bits, k // groups, symmetric)
        layers.append(ExportLayer(name, fmt, header.shape[0], k, name in dequantized))
    return layers


def plan_outputs(
    headers: Mapping[str, TensorHeader],
    layers: list[ExportLayer],
    compute_dtype: torch.dtype,
    engine: str = "vllm",
) -> list[OutputTensor]:
    """Every tensor of the export, in the source's order: each layer's compressed-tensors tensors (or its
    dequantized `weight` in `compute_dtype`) where its `weight` was, every other tensor copied. `engine` (one of
    `ENGINES`) sets the zero point's rows: ceil(N * bits / 32) for "vllm", N for "transformers"."""
    _check_engine(engine)
    owned = {src: layer for layer in layers for src in layer.sources()}
    outputs = []
    for key, header in headers.items():
        layer = owned.get(key)
        if layer is None:
            outputs.append(OutputTensor(key, header.dtype, header.shape, "copy", key))
            continue
        if key != f"{layer.name}.weight":
            continue  # written with the layer
        n, k, fmt = layer.rows, layer.in_features, layer.fmt
        if layer.dequantize:
            outputs.append(OutputTensor(key, compute_dtype, (n, k), "dequantized", layer.name, layer))
            continue
        outputs.append(
            OutputTensor(
                f"{layer.name}.weight_packed",
                torch.int32,
                (n, math.ceil(k * fmt.bits / 32)),
                "weight_packed",
                layer.name,
                layer,
            )
        )
        outputs.append(
            OutputTensor(
                f"{layer.name}.weight_scale",
                rtn.SCALE_DTYPE,
                (n, k // fmt.group_size),
                "weight_scale",
                layer.name,
                layer,
            )
        )
        if not fmt.symmetric:
            outputs.append(
                OutputTensor(
                    f"{layer.name}.weight_zero_point",
                    torch.int32,
                    (math.ceil(n * fmt.bits / 32) if engine == "vllm" else n, k // fmt.group_size),
                    "weight_zero_point",
                    layer.name,
                    layer,
                )
            )
        outputs.append(
            OutputTensor(f"{layer.name}.weight_shape", torch.int64, (2,), "weight_shape", layer.name, layer)
        )
    return outputs


def _fused_sets(layers: list[ExportLayer], ignore: Iterable[str]) -> list[tuple[list[str], list[Scheme | None]]]:
    """(member names, their schemes: None for float) of every fused sibling set (`FUSED_SIBLINGS` under one parent
    module) whose members do not share one scheme, or of which some are written in float."""
    schemes = {layer.name: (None if layer.dequantize else layer.scheme) for layer in layers}
    schemes.update({name: None for name in ignore})
    found = []
    for parent in sorted({name.rpartition(".")[0] for name in schemes}):
        for siblings in FUSED_SIBLINGS:
            names = [f"{parent}.{s}" if parent else s for s in siblings]
            if all(n in schemes for n in names) and len({schemes[n] for n in names}) > 1:
                found.append((names, [schemes[n] for n in names]))
    return found


def _describe(scheme: Scheme | None) -> str:
    if scheme is None:
        return "float"
    group = "per-channel" if scheme.group_size is None else f"group {scheme.group_size}"
    return f"{scheme.bits}-bit {group} {'symmetric' if scheme.symmetric else 'asymmetric'}"


def fused_scheme_conflicts(layers: list[ExportLayer], ignore: Iterable[str]) -> list[str]:
    """Fused sibling sets (`FUSED_SIBLINGS` under one parent module) whose members do not share one scheme, or of
    which some are written in float (`ignore`, a dequantized layer): one line each, e.g.
    "model.layers.15.self_attn.{q_proj,k_proj,v_proj}: 4-bit group 64 asymmetric, 4-bit group 64 asymmetric,
    8-bit per-channel symmetric". vLLM refuses such a checkpoint (or fails to load it); compressed-tensors'
    own readers do not mind."""
    lines = []
    for names, schemes in _fused_sets(layers, ignore):
        parent = names[0].rpartition(".")[0]
        siblings = ",".join(n.rpartition(".")[2] for n in names)
        lines.append(f"{parent}.{{{siblings}}}: {', '.join(_describe(s) for s in schemes)}")
    return lines


def vllm_float_layers(layers: list[ExportLayer], ignore: Iterable[str]) -> list[str]:
    """The quantized layers to write in float for vLLM: every member of a fused set that `fused_scheme_conflicts`
    names (vLLM quantizes a fused layer with one scheme, so the set is served in float instead, as the same
    dequantized weights hfquant computes with). Logs one warning naming the sets and the alternative."""
    conflicts = fused_scheme_conflicts(layers, ignore)
    if not conflicts:
        return []
    quantized = {layer.name for layer in layers if not layer.dequantize}
    names = [n for members, _ in _fused_sets(layers, ignore) for n in members if n in quantized]
    logger.warning(
        "vLLM fuses q/k/v and gate/up into one layer each with one scheme; %d set(s) are stored in different formats "
        "(e.g. %s), so their %d quantized layers are written in float (dequantized, listed in 'ignore'). To keep them "
        "quantized, convert with one format for the set (hfquant convert ... --mixed-precision none), or export with "
        "engine='transformers' (--engine transformers), whose reader takes mixed sets",
        len(conflicts),
        conflicts[0],
        len(names),
    )
    return names


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} is not an engine the export is laid out for; allowed: {list(ENGINES)}")


def quantization_config(layers: list[ExportLayer], ignore: Iterable[str], engine: str = "vllm") -> dict:
    """`quantization_config` of config.json in compressed-tensors' schema (its `QuantizationConfig`).

    One `config_groups` entry per distinct (bits, group size, symmetric) of the layers written quantized, in order
    of first appearance, named group_0, group_1, ...; with one group its targets are ["Linear"] (every Linear not
    in `ignore`), with several each lists its layers by name. `ignore`: the Linear layers kept in float. For
    `engine` "transformers" asymmetric groups carry `zp_dtype` "torch.int32" (`Scheme.weights`).

    Raises:
        ValueError: an `engine` not in `ENGINES`.
    """
    _check_engine(engine)
    schemes: dict[Scheme, list[str]] = {}
    for layer in layers:
        if not layer.dequantize:
            schemes.setdefault(layer.scheme, []).append(layer.name)
    groups = {}
    for i, (scheme, names) in enumerate(schemes.items()):
        targets = ["Linear"] if len(schemes) == 1 else list(names)
        groups[f"group_{i}"] = {
            "targets": targets,
            "weights": scheme.weights(engine),
            "input_activations": None,
            "output_activations": None,
        }
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


# -- the tensors -------------------------------------------------------------------------------------------------


def pack_words(rows: torch.Tensor) -> torch.Tensor:
    """(R, B) uint8 bytes -> (R, ceil(B / 4)) int32, each word the little-endian int32 of four bytes (the last
    padded with zero bytes), as compressed-tensors' `pack_to_int32` lays out its words.

    Raises:
        RuntimeError: on a big-endian machine (the int32 view would reverse the bytes).
    """
    if sys.byteorder != "little":
        raise RuntimeError("compressed-tensors export reads bytes as little-endian int32; this machine is big-endian")
    pad = -rows.shape[1] % 4
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    # through 1-D: a contiguous (1, B) tensor may carry stride 1 in its first dimension, which view() refuses
    return rows.contiguous().reshape(-1).view(torch.int32).reshape(rows.shape[0], -1)


def pack_zero_point(zero_point: torch.Tensor, bits: int) -> torch.Tensor:
    """hfquant zero points (N, G) uint8 -> compressed-tensors' (ceil(N * bits / 32), G) int32, packed along N.

    Column g of the result holds z[:, g] as `pack_words` of its bytes (8 bits) or nibbles (4 bits: z[2m] in the low
    nibble of byte m). Example, 4 bits: a column z = [1, 2, ..., 8] is the word 0x87654321.
    """
    columns = zero_point.t().contiguous()  # (G, N)
    if bits == 4:
        if columns.shape[1] % 2:
            columns = torch.nn.functional.pad(columns, (0, 1))
        columns = columns[:, 0::2] | (columns[:, 1::2] << 4)
    return pack_words(columns).t().contiguous()


def _dequantized(layer: ExportLayer, read: Callable[[str], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The float weight (N, K) of `layer` in `dtype`, dequantized in row chunks of bounded float32 size."""
    fmt = layer.fmt
    codes = read(f"{layer.name}.weight")
    scale = read(f"{layer.name}.weight_scale")
    zero_point = None if fmt.symmetric else read(f"{layer.name}.weight_zero_point")
    out = torch.empty((layer.rows, layer.in_features), dtype=dtype)
    step = max(1, _DEQUANT_CHUNK_BYTES // (4 * layer.in_features))
    for start in range(0, layer.rows, step):
        rows = slice(start, start + step)
        chunk = unpack_int4(codes[rows]) if fmt.bits == 4 else codes[rows]
        out[rows] = rtn.dequantize_weight(
            chunk, scale[rows], None if zero_point is None else zero_point[rows], fmt.bits, fmt.symmetric, dtype
        )
    return out


def export_tensor(output: OutputTensor, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The tensor `output` (as `plan_outputs` planned it), reading its source tensors with `read(name)`.

    Raises:
        ValueError: a source tensor's dtype or shape differs from its header's plan (a changed file).
    """
    layer = output.layer
    if output.role == "copy":
        tensor = read(output.source)
    elif output.role == "dequantized":
        tensor = _dequantized(layer, read, output.dtype)
    elif output.role == "weight_shape":
        tensor = torch.tensor([layer.rows, layer.in_features], dtype=torch.int64)
    elif output.role == "weight_scale":
        tensor = read(f"{layer.name}.weight_scale")
    elif output.role == "weight_packed":
        codes = read(f"{layer.name}.weight")
        if codes.dtype == torch.int8:  # symmetric 8 bits: compressed-tensors stores q + 128
            codes = codes.view(torch.uint8) ^ 0x80
        tensor = pack_words(codes)
    elif output.role == "weight_zero_point":
        tensor = pack_zero_point(read(f"{layer.name}.weight_zero_point"), layer.fmt.bits)
        if output.shape[0] > tensor.shape[0]:  # engine "transformers": the words in the first rows of (N, G)
            tensor = torch.nn.functional.pad(tensor, (0, 0, 0, output.shape[0] - tensor.shape[0]))
    else:
        raise ValueError(f"unknown output role {output.role!r}")
    if tensor.dtype != output.dtype or tuple(tensor.shape) != output.shape:
        raise ValueError(
            f"{output.name}: made {tensor.dtype} {tuple(tensor.shape)}, planned {output.dtype} {output.shape} from the "
            "headers; the source changed while it was read"
        )
    return tensor.contiguous()
