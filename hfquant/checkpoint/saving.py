"""`save_pretrained` into a folder that already holds a checkpoint, without a moment where it holds none.

transformers' `save_pretrained` writes into the folder in place: `config.json` first, then the shards. A full disk,
a kill or an error half-way leaves a config that no longer matches the shards, so the previous good checkpoint no
longer loads; and a sharded save over a single-file checkpoint leaves the old `model.safetensors`, which
transformers then loads instead of the new index. `save_staged` runs the save into a hidden folder beside the
destination, carries over the destination's other files (a tokenizer, a README, sub-folders), drops its stale weight
files, and swaps the two folders in one atomic step (`hfquant.checkpoint.publish`):

    save_staged(functools.partial(type(model).save_pretrained, model), "out", max_shard_size="50MB")
    attach_staged_save(model)   # model.save_pretrained(...) now does the above (what hfquant does on load)

An empty or absent destination is written directly, as transformers does. A destination that is a symlink is
written through by transformers itself (hfquant does not replace a link it did not create). Either way what the save
wrote gets the modes the umask asks for (safetensors writes its files owner-only), and a model's `save_pretrained`
refuses the folder it was loaded from, one inside it or one containing it (`check_apart_from_source`).

Either way the saved `config.json` gets `model_type` "hfquant" (`hfquant.checkpoint.model_type.mark_config_file`)
before the folder is published, so that transformers without hfquant refuses the checkpoint by name.
`save_pretrained(..., push_to_hub=True)` therefore saves first and pushes afterwards with `model.push_to_hub` (transformers
would upload from inside its save, before the marking).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hfquant.checkpoint.files import stamp_checkpoint_ids
from hfquant.checkpoint.model_type import mark_config_file
from hfquant.checkpoint.publish import (
    check_apart_from_source,
    give_umask_modes,
    process_umask,
    publish_folder,
    temporary_folder,
)
from hfquant.core.binding import bind, is_bound

__all__ = ["WEIGHT_FILE", "attach_staged_save", "is_weight_file", "save_staged"]

logger = logging.getLogger(__name__)

WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model|tf_model|flax_model)(-\d{5}-of-\d{5})?\.(safetensors|bin|h5|msgpack)"
    r"(\.index\.json)?$"
)
"""Names of the weight files and indexes `save_pretrained` writes (single file, shards, index): the files of a
previous checkpoint that must not survive a new save."""


def is_weight_file(name: str) -> bool:
    """Whether `name` (a file name, no folder) is a weight file or weight index of a transformers checkpoint."""
    return WEIGHT_FILE.match(name) is not None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path) -> list[str]:
    """Give `new` (the finished save) every entry of `old` it did not write itself, except stale weight files; return
    their names. Files are hard-linked (no data copied) where the file system allows, symlinks copied as links."""
    written = {entry.name for entry in new.iterdir()}
    kept = []
    for entry in sorted(old.iterdir()):
        if entry.name in written or (is_weight_file(entry.name) and not entry.is_dir()):
            continue
        target = new / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))
        kept.append(entry.name)
    return kept


def save_staged(save: Callable[..., Any], save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """Call `save(folder, *args, **kwargs)` (a bound `save_pretrained`) so that an existing, non-empty
    `save_directory` holds its previous content or the complete new save at every instant.

    Args:
        save: the save function; its first argument is the folder to write.
        save_directory: where the checkpoint goes.
        *args, **kwargs: passed to `save` unchanged (with `push_to_hub=True` and no `repo_id`, the repo is named
            after `save_directory`, as transformers names it, not after the hidden folder).
    Returns:
        What `save` returns.
    Raises:
        Whatever `save` raises (the destination is then unchanged), and OSError when the hidden folder cannot be
        created beside the destination or the swap fails (unchanged too).
    """
    dst = Path(save_directory)
    # the shards' placeholder ids become the save's id once all are written, and config.json is marked; a save
    # that pushes to the Hub is left as pushed (changing files after the upload would make the local files differ
    # from the uploaded ones; `_staged_save_pretrained` never pushes from inside the save)
    stamp = (lambda folder: None) if kwargs.get("push_to_hub") else _finish
    if dst.is_symlink() or not dst.is_dir() or not any(dst.iterdir()):
        result = save(save_directory, *args, **kwargs)
        stamp(save_directory)
        _give_modes_after_direct_save(dst)
        return result
    if kwargs.get("push_to_hub"):
        kwargs.setdefault("repo_id", dst.resolve().name)
    with temporary_folder(dst) as staging:
        result = save(str(staging), *args, **kwargs)
        stamp(staging)
        give_umask_modes(staging)  # before the carry-over: its hard links share the old files' modes
        kept = _carry_over(dst, staging)
        publish_folder(staging, dst, overwrite=True)  # afterwards `staging` holds the old folder, deleted on exit
    logger.info("saved into %s by swapping folders; kept %d other entries: %s", dst, len(kept), kept)
    return result


def _give_modes_after_direct_save(dst: Path) -> None:
    """The umask's modes for what a save into an absent or empty folder wrote: everything in it; through a link
    (whose folder may hold other files), the weight files only (safetensors writes them owner-only)."""
    if not dst.is_symlink():
        give_umask_modes(dst, root=False)
        return
    mode = 0o666 & ~process_umask()
    for entry in dst.iterdir():
        if is_weight_file(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.chmod(mode)


def _finish(folder: str | os.PathLike) -> None:
    """What a finished save gets before it is published: checkpoint ids stamped, config.json marked."""
    stamp_checkpoint_ids(folder)
    if Path(folder, "config.json").is_file():
        mark_config_file(folder)


_HUB_ARGUMENTS = ("repo_id", "commit_message", "create_pr", "private", "token", "revision", "tags")


def _staged_save_pretrained(model, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    """`model.save_pretrained` of a model hfquant loaded: the class's own, through `save_staged`. With
    `push_to_hub=True` the folder is saved (and marked) first, then `model.push_to_hub` uploads a save of the model
    (hfquant's, with its card, once `hfquant.publishing.hub.attach_model_card` ran); the repo defaults to the folder's
    name, as transformers names it. A `save_directory` that is the folder the model was loaded from, inside it or
    containing it is refused (`check_apart_from_source`): the swap would delete the checkpoint being read.

    Raises:
        ValueError: `save_directory` is the model's source folder, inside it or contains it; nothing is written.
    """
    source = _source_folder(model)
    if source is not None:
        check_apart_from_source(save_directory, source, "the save")
    if not kwargs.pop("push_to_hub", False):
        return save_staged(functools.partial(type(model).save_pretrained, model), save_directory, *args, **kwargs)
    hub = {name: kwargs.pop(name) for name in _HUB_ARGUMENTS if name in kwargs}
    repo_id = hub.pop("repo_id", os.fspath(save_directory).rstrip(os.sep).split(os.sep)[-1])
    result = save_staged(functools.partial(type(model).save_pretrained, model), save_directory, *args, **kwargs)
    shards = {"max_shard_size": kwargs["max_shard_size"]} if "max_shard_size" in kwargs else {}
    model.push_to_hub(repo_id, **hub, **shards)
    return result


def _source_folder(model) -> Path | None:
    """The local folder `model` was loaded from (`name_or_path`), or None (a Hub id, a model built in memory)."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name or not Path(name).expanduser().is_dir():
        return None
    return Path(name).expanduser()


def attach_staged_save(model) -> None:
    """Make `model.save_pretrained` go through `save_staged`; this instance only, idempotent. Bound by
    `core.binding.bind` (not a closure), so that `copy.deepcopy(model)` saves the copy and `torch.save(model)` pickles."""
    if is_bound(getattr(model, "save_pretrained", None), _staged_save_pretrained):
        return
    model.save_pretrained = bind(_staged_save_pretrained, model)
