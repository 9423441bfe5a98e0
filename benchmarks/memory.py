"""Memory measurement helpers: process RSS, peak RSS, tensor footprint, file sizes.

The RSS helpers read ``/proc/self/status`` and therefore only work on Linux; on
other platforms they return ``None`` (``reset_peak_rss`` returns ``False``) and log
a debug message, so callers can print "n/a" instead of crashing.  ``tensor_bytes``
and ``dir_size_bytes`` are portable.

Units: ``*_mib`` functions return mebibytes (2**20 bytes) as ``float``;
``*_bytes`` functions return bytes as ``int``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

__all__ = ["rss_mib", "peak_rss_mib", "reset_peak_rss", "tensor_bytes", "dir_size_bytes", "import_model_code", "MIB"]

MIB = 1024 * 1024
_PROC_STATUS = "/proc/self/status"
_PROC_CLEAR_REFS = "/proc/self/clear_refs"


def _read_status_kib(field: str) -> int | None:
    """Return ``field`` (e.g. ``"VmRSS"``) of /proc/self/status in KiB, or None if unavailable."""
    try:
        with open(_PROC_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    # Format: "VmRSS:\t  434240 kB"
                    return int(line.split()[1])
    except OSError as exc:
        logger.debug("Cannot read %s (%s); RSS is only measurable on Linux", _PROC_STATUS, exc)
        return None
    logger.debug("%s has no %s field", _PROC_STATUS, field)
    return None


def rss_mib() -> float | None:
    """Current resident set size of this process in MiB (``VmRSS``).

    Returns:
        RSS in MiB as a float, or ``None`` where ``/proc/self/status`` does not
        exist (non-Linux) or lacks the field.  Never raises.
    """
    kib = _read_status_kib("VmRSS")
    return None if kib is None else kib / 1024.0


def peak_rss_mib() -> float | None:
    """Peak resident set size of this process in MiB (``VmHWM``, the "high water mark").

    The peak covers the whole process lifetime, or the time since the last
    successful :func:`reset_peak_rss`.

    Returns:
        Peak RSS in MiB as a float, or ``None`` on non-Linux systems.  Never raises.
    """
    kib = _read_status_kib("VmHWM")
    return None if kib is None else kib / 1024.0


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``) to its current RSS.

    Writes ``"5"`` to ``/proc/self/clear_refs`` (Linux >= 4.0).  This can be
    refused: non-Linux systems, a read-only ``/proc`` (some containers and
    sandboxes), or security modules.  In that case nothing changes and the
    function returns ``False``; the following :func:`peak_rss_mib` then still
    includes everything since process start, so measure in a fresh process (as
    ``scripts/run_example.py`` does) if you need a clean peak.

    Returns:
        ``True`` when the reset was accepted, ``False`` otherwise.  Never raises.
    """
    try:
        with open(_PROC_CLEAR_REFS, "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError as exc:
        logger.debug("Cannot reset peak RSS via %s: %s", _PROC_CLEAR_REFS, exc)
        return False


def _leaf_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """Yield the plain tensors holding the data of ``t``.

    Wrapper tensor subclasses (those implementing ``__tensor_flatten__``, e.g.
    torchao-style quantized tensors) own no storage themselves; their inner
    tensors are yielded instead, recursively.
    """
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        try:
            attrs, _ = t.__tensor_flatten__()
        except Exception:  # pragma: no cover - defensive, exotic subclasses
            attrs = None
        if attrs is not None:
            for name in attrs:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    yield from _leaf_tensors(inner)
            return
    yield t


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """Return [start, end) byte offsets of ``t`` inside its storage."""
    elem = t.element_size()
    start = t.storage_offset() * elem
    if t.numel() == 0:
        return start, start
    if t.is_contiguous():
        extent = t.numel()
    else:
        # Memory range touched by a strided view (an upper bound for views with gaps).
        extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=False))
    return start, start + extent * elem


def tensor_bytes(model: torch.nn.Module | Iterable[torch.Tensor]) -> int:
    """Bytes held by the parameters and buffers of ``model``, each byte counted once.

    Tensors sharing memory (tied embeddings, the same tensor registered twice,
    views into a common storage) are counted once: for every storage the union
    of the byte ranges actually used by the tensors is taken, so unused parts
    of a larger storage are not counted either.  Wrapper tensor subclasses are
    measured through their inner tensors.  Tensors on the ``meta`` device count
    their nominal size once per distinct tensor object.

    Args:
        model: a ``torch.nn.Module`` (parameters and buffers, persistent or not,
            all devices) or any iterable of tensors.

    Returns:
        Number of bytes as an ``int`` (divide by :data:`MIB` for MiB).

    Raises:
        TypeError: ``model`` is neither a module nor an iterable of tensors.
    """
    if isinstance(model, torch.nn.Module):
        tensors: Iterable = (
            t
            for _, t in list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False))
        )
    else:
        tensors = model

    spans: dict[tuple, list[tuple[int, int]]] = {}
    total_meta = 0
    seen_meta: set[int] = set()
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor_bytes expects a module or tensors, got {type(t).__name__}")
        for leaf in _leaf_tensors(t):
            if leaf.device.type == "meta":
                if id(leaf) not in seen_meta:
                    seen_meta.add(id(leaf))
                    total_meta += leaf.numel() * leaf.element_size()
                continue
            storage = leaf.untyped_storage()
            key = (str(leaf.device), storage.data_ptr())
            spans.setdefault(key, []).append(_byte_span(leaf))

    total = total_meta
    for intervals in spans.values():
        intervals.sort()
        cur_start, cur_end = None, None
        for start, end in intervals:
            if cur_end is None or start > cur_end:
                if cur_end is not None:
                    total += cur_end - cur_start
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        if cur_end is not None:
            total += cur_end - cur_start
    return total


def dir_size_bytes(path: str | os.PathLike, pattern: str = "*.safetensors") -> int:
    """Total size in bytes of the files matching ``pattern`` directly inside ``path``.

    Only the weight files are counted by default (``*.safetensors``); config,
    tokenizer and index files are not.  Sub-folders are not searched (use a
    pattern such as ``"**/*.safetensors"`` for that).  Symlinks are followed.

    Args:
        path: a directory (e.g. a ``save_pretrained`` output folder).
        pattern: glob pattern relative to ``path``.

    Returns:
        Size in bytes as an ``int`` (0 when nothing matches).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        NotADirectoryError: ``path`` is not a directory.
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"No such directory: {folder}")
    if not folder.is_dir():
        raise NotADirectoryError(f"Not a directory: {folder}")
    return sum(f.stat().st_size for f in folder.glob(pattern) if f.is_file())


def import_model_code(path: str | os.PathLike) -> None:
    """Import the Python module of the causal-LM class that ``from_pretrained(path)`` will build, so that a load's
    RSS and time measured after this call count the weights, not module imports: transformers' modeling modules
    import scipy where it is installed (about 70 MiB of RSS and 0.3-0.9 s on this project's machines).

    Raises:
        KeyError: the checkpoint's model type has no causal-LM class.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]
