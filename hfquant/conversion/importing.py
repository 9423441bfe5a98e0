"""`hfquant import`: a compressed-tensors `pack-quantized` checkpoint (llm-compressor's W4A16 / W8A16, or an hfquant
export) -> an hfquant checkpoint folder, bit for bit, so it runs on hfquant's kernels.

    import_checkpoint(src, dst)

The inverse of `hfquant export` (`hfquant.checkpoint.compressed_tensors_import`: `weight_packed` bytes become hfquant's codes,
8-bit symmetric ones with the sign bit flipped back; the zero point is unpacked along N; bfloat16 scales are copied).
Each layer's scheme comes from `config_groups` matched as compressed-tensors matches (exact name, "re:" regex, or a
class name of the module in the float skeleton built on the meta device). The hfquant config written has the most
common scheme as its own format, every other layer by exact name in `module_overrides` (method "rtn"), and every
Linear layer left in float in `modules_to_not_convert`, so a reload builds exactly the stored layers (checked by
`hfquant verify`, whose sums are written too). Refused with the reason: activation or kv-cache quantization,
actorder / `g_idx`, float or other-width weights, group sizes outside 32-1024, non-bfloat16 scales that bfloat16
cannot hold exactly, and a quantized lm_head. Streaming, atomic publishing and copied files as in `hfquant export`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from pathlib import Path

from torch import nn

from hfquant.checkpoint import compressed_tensors_import as ct
from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.checksums import write_checksums
from hfquant.checkpoint.compressed_tensors import ExportLayer
from hfquant.checkpoint.copying import NOT_EXPORTED, copy_small_files
from hfquant.checkpoint.files import (
    CONFIG_NAME,
    read_headers,
    read_json,
    require_inside,
    tensor_files,
    write_index,
    write_json,
)
from hfquant.checkpoint.model_type import mark
from hfquant.checkpoint.sharding import shard_plan, write_shards
from hfquant.config import FIELD_NAMES, HfQuantConfig
from hfquant.conversion.export import ExportResult, check_dst
from hfquant.integration.skeleton import build_skeleton
from hfquant.nn.replace import output_embedding

__all__ = ["import_checkpoint", "hfquant_config_for"]

logger = logging.getLogger(__name__)


def hfquant_config_for(layers: list[ExportLayer], float_linears: list[str]) -> HfQuantConfig:
    """The `HfQuantConfig` under which hfquant rebuilds exactly `layers`: the most common (bits, group size,
    symmetric) as the config's, the others as exact-name `module_overrides`, `float_linears` in
    `modules_to_not_convert`; method "rtn" (no column scale); lm_head "keep" (the export's lm_head is float)."""
    schemes = Counter(layer.scheme for layer in layers)
    base = schemes.most_common(1)[0][0]
    overrides = {
        layer.name: {
            "bits": layer.scheme.bits,
            "group_size": layer.scheme.group_size,
            "symmetric": layer.scheme.symmetric,
            "method": "rtn",
        }
        for layer in layers
        if layer.scheme != base
    }
    kwargs = dict(
        bits=base.bits,
        group_size=base.group_size,
        symmetric=base.symmetric,
        method="rtn",
        module_overrides=overrides,
        modules_to_not_convert=sorted(float_linears),
        lm_head="keep",  # a compressed-tensors lm_head is float (a quantized one is refused): not the 4-bit default's int8
    )
    if "mixed_precision" in FIELD_NAMES:  # no data-free allocation on top: the layers' formats are given
        kwargs["mixed_precision"] = "none"
    return HfQuantConfig(**kwargs)


def _import_plan(folder: Path, headers: dict, groups, ignore) -> tuple[list[ExportLayer], list[str]]:
    """(the pack-quantized layers to import, matched to `groups` as compressed-tensors matches them, and the Linear
    layers left in float), from the float skeleton of `folder` built on the meta device.

    Raises:
        ValueError: no layer is quantized, the output embedding is, or a quantized layer is not an nn.Linear.
    """
    model, _, _ = build_skeleton(folder, "auto", None)
    modules = dict(model.named_modules())
    output = output_embedding(model)

    def classes(name: str) -> list[str]:
        module = modules.get(name)
        return [] if module is None else [cls.__name__ for cls in type(module).__mro__]

    layers = ct.plan_import(headers, groups, ignore, classes)
    for layer in layers:
        module = modules.get(layer.name)
        if module is not None and module is output:
            raise ValueError(
                f"{layer.name} (the output embedding) is quantized; hfquant's lm_head int4 / int8 use "
                "their own group sizes, so it cannot be imported bit for bit: export it with the lm_head "
                "in ignore"
            )
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"{layer.name} is quantized but is not an nn.Linear of {type(model).__name__} "
                f"({type(module).__name__ if module is not None else 'no such module'}); hfquant imports "
                "Linear layers"
            )
    if not layers:
        raise ValueError(f"{folder} holds no weight_packed tensor; nothing to import")
    quantized = {layer.name for layer in layers}
    float_linears = [
        n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in quantized and m is not output
    ]
    return layers, float_linears


def import_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, *, max_shard_size: int | str = "2GB", overwrite: bool = False
) -> ExportResult:
    """Write the compressed-tensors `pack-quantized` checkpoint folder `src` as an hfquant checkpoint folder `dst`.

    Every pack-quantized Linear layer `P` becomes hfquant's `P.weight` ((N, K/2) uint8 at 4 bits, (N, K) int8 / uint8
    at 8 bits), `P.weight_scale` (N, K/g) bfloat16 and, when asymmetric, `P.weight_zero_point` (N, K/g) uint8, with
    the same integers and scales (docs/interop.md); other tensors are copied.

    Raises:
        ValueError: `src` is not a compressed-tensors pack-quantized checkpoint, or holds something hfquant cannot
            store exactly (the message names the layer or config group and the reason), or config.json, the index or
            a shard is a link leaving `src`.
        FileExistsError: `dst` exists and `overwrite` is False.
        FileNotFoundError: `src` has no config.json or no safetensors.
        OSError: a file could not be written; `dst` is left as it was.
    """
    start = time.perf_counter()
    folder, dst = Path(src).expanduser(), Path(dst).expanduser()
    if not (folder / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"SRC {folder} has no config.json; pass a compressed-tensors checkpoint folder")
    check_dst(dst, folder, overwrite)
    shard_plan([], max_shard_size)
    require_inside(folder, folder / CONFIG_NAME)
    config = read_json(folder / CONFIG_NAME)
    if not isinstance(config, dict) or "quantization_config" not in config:
        raise ValueError(
            f"{folder / CONFIG_NAME} has no quantization_config; SRC must be a compressed-tensors checkpoint"
        )
    groups, ignore = ct.read_quantization_config(config["quantization_config"])
    files = tensor_files(folder)
    headers = {}
    for path in dict.fromkeys(files.values()):
        headers.update(read_headers(path))

    layers, float_linears = _import_plan(folder, headers, groups, ignore)
    hfconfig = hfquant_config_for(layers, float_linears)
    outputs = ct.plan_import_outputs(headers, layers)
    split = shard_plan(outputs, max_shard_size)

    dst.parent.mkdir(parents=True, exist_ok=True)
    with folders.temporary_folder(dst) as tmp:
        write_shards(outputs, split, files, tmp, ct.import_tensor)
        if split.is_sharded:
            write_index(tmp, split.tensor_to_filename, dict(split.metadata))
        config = mark(dict(config, quantization_config=hfconfig.to_dict()))
        write_json(tmp / CONFIG_NAME, config)
        copy_small_files(folder, tmp, skipped=NOT_EXPORTED)
        write_checksums(tmp)
        folders.give_umask_modes(tmp)
        folders.publish_folder(tmp, dst, overwrite)
    result = ExportResult(
        dst,
        list(split.filename_to_tensors),
        len(layers),
        0,
        len({layer.scheme for layer in layers}),
        time.perf_counter() - start,
    )
    logger.info(
        "imported %s -> %s: %d layers in %d format(s) in %.1f s",
        src,
        dst,
        len(layers),
        result.config_groups,
        result.seconds,
    )
    return result
