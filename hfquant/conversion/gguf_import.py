"""GGUF files run as they are: `from_gguf` (the model, llama.cpp's blocks kept) and `convert_gguf` (file to folder).

    model = hfquant.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)
    hfquant.convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-q4_1")  # an hfquant checkpoint folder

Every Linear layer stored in a block type hfquant has a layout for (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL,
IQ4_XS) keeps the file's bytes on a `QuantLinear` of that format (`hfquant.integration.gguf_model`); the config and
tokenizer are transformers' reading of the file (`AutoConfig` / `AutoTokenizer` with `gguf_file=`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoTokenizer

from hfquant.checkpoint import publish as folders
from hfquant.checkpoint.checksums import write_checksums
from hfquant.checkpoint.gguf_source import resolve_gguf
from hfquant.core.dtypes import torch_dtype

__all__ = ["GgufImportResult", "convert_gguf", "from_gguf"]

logger = logging.getLogger(__name__)


def _dtype(kwargs: dict) -> torch.dtype:
    """The dtype asked in `kwargs` (`dtype` or transformers' older `torch_dtype`, a dtype or its name; "auto" and
    None: bfloat16, the dtype hfquant's block kernels compute in), removed from `kwargs`."""
    asked = kwargs.pop("dtype", None)
    legacy = kwargs.pop("torch_dtype", None)
    asked = asked if asked is not None else legacy
    if asked is None or asked == "auto":
        return torch.bfloat16
    return asked if isinstance(asked, torch.dtype) else torch_dtype(str(asked))


def from_gguf(path_or_repo: str | os.PathLike, gguf_file: str | None = None, **from_pretrained_kwargs):
    """The transformers causal LM of a GGUF file with its Linear layers kept in the file's block types.

    Args:
        path_or_repo: a GGUF file, a folder holding `gguf_file`, or a Hub repo id holding `gguf_file`.
        gguf_file: the file's name inside the folder or repo (not needed for a file path).
        **from_pretrained_kwargs: transformers' `from_pretrained` arguments; `dtype` (default bfloat16) is the dtype
            of the embeddings, norms, float layers (F16/BF16/F32 tensors) and activations.
    Returns:
        The model: Llama, Mistral or Qwen2 (`hfquant.integration.gguf_model.GGUF_IMPORT_MODEL_TYPES`); each block
        Linear is a `QuantLinear` whose `weight` is the GGUF tensor's bytes, (N, K / block_size * type_size) uint8
        (rows of a Llama q/k projection in transformers' order). `save_pretrained` writes an hfquant checkpoint.
    Raises:
        ValueError: another architecture, a Linear weight in a GGUF type hfquant has no layout for (named), a file
            gguf-py cannot read, or an argument from_gguf sets itself (quantization_config, state_dict, config).
        FileNotFoundError / OSError: the file cannot be found or downloaded.
        ImportError: the gguf package (an optional dependency) is missing, with its pip command.
    """
    from hfquant.integration.gguf_model import load_gguf_model  # imports gguf, an optional dependency

    kwargs = dict(from_pretrained_kwargs)
    dtype = _dtype(kwargs)
    return load_gguf_model(resolve_gguf(path_or_repo, gguf_file), dtype, **kwargs)


def _drop_invented_tokens(path: Path, rows: int, tokenizer) -> None:
    """Remove from the saved `tokenizer.json` at `path` the added tokens past the embedding's `rows` that none of the
    tokenizer's named special tokens (bos, eos, unk, pad) is: transformers' GGUF tokenizer gives a file without a BOS
    or UNK token its class's default (`<|endoftext|>`) as one more token, which the file and the model do not have
    (and which would make the folder's GGUF export refuse a tokenizer longer than the embedding)."""
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    named = {getattr(tokenizer, f"{kind}_token", None) for kind in ("bos", "eos", "unk", "pad")} - {None}
    added = data.get("added_tokens") or []
    kept = [token for token in added if token.get("id", 0) < rows or token.get("content") in named]
    if len(kept) == len(added):
        return
    dropped = [token.get("content") for token in added if token not in kept]
    logger.info(
        "GGUF import: dropping %s, added by transformers' tokenizer past the %d tokens of the file", dropped, rows
    )
    data["added_tokens"] = kept
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")
    config = path.with_name("tokenizer_config.json")
    if config.is_file():
        values = json.loads(config.read_text(encoding="utf-8"))
        decoder = values.get("added_tokens_decoder")
        if isinstance(decoder, dict):
            values["added_tokens_decoder"] = {
                key: value
                for key, value in decoder.items()
                if int(key) < rows or (isinstance(value, dict) and value.get("content") in named)
            }
            config.write_text(json.dumps(values, ensure_ascii=False, indent=2), encoding="utf-8")


class GgufImportResult(NamedTuple):
    """What `convert_gguf` wrote: the folder, layers per stored format ("q4_k", "float"), seconds."""

    dst: Path
    formats: dict[str, int]
    seconds: float


def convert_gguf(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    gguf_file: str | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
) -> GgufImportResult:
    """Write the GGUF file `src` as the hfquant checkpoint folder `dst` (what `from_gguf(...).save_pretrained(dst)`
    and the tokenizer's `save_pretrained` write), published atomically.

    Raises:
        ValueError: as `from_gguf`; `dst` is the file itself or inside a folder of it.
        FileExistsError: `dst` exists and `overwrite` is False.
        OSError: a file could not be written; `dst` is left as it was.
    """
    start = time.perf_counter()
    path = resolve_gguf(src, gguf_file)
    dst = Path(dst).expanduser()
    folders.check_apart_from_source(dst, path, "DST")
    folders.check_destination(dst, overwrite)
    model = from_gguf(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with folders.temporary_folder(dst) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _drop_invented_tokens(tmp / "tokenizer.json", model.config.vocab_size, tokenizer)
        write_checksums(tmp)
        folders.give_umask_modes(tmp)
        folders.publish_folder(tmp, dst, overwrite)
    formats: dict[str, int] = {}
    for module in model.modules():
        fmt = getattr(module, "format", None)
        if fmt is not None and getattr(fmt, "block", None) is not None:
            formats[fmt.block] = formats.get(fmt.block, 0) + 1
    seconds = time.perf_counter() - start
    logger.info("converted %s -> %s: %s in %.1f s", path, dst, formats, seconds)
    return GgufImportResult(dst, formats, seconds)
