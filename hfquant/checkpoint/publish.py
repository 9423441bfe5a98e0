"""Writing a folder so that readers see it whole or not at all: a hidden temporary folder beside the destination,
published by one atomic rename, with Ctrl-C and SIGTERM held back over the few steps that must not be cut in two.

    with temporary_folder(dst) as tmp:       # .DST.tmp-XXXXXXXX beside DST, deleted when the block ends
        ...write everything into tmp...
        publish_folder(tmp, dst, overwrite)  # DST is now the new folder; with overwrite, tmp holds the old one

On Linux the publishing rename is `renameat2(2)`: `RENAME_NOREPLACE` into an absent DST (a DST that appeared
meanwhile, say from a second convert, is never replaced: `FileExistsError`), `RENAME_EXCHANGE` over an existing
one (DST is the old complete version or the new complete version at every instant, even under SIGKILL). Where the
call or the file system lacks them, the fallback is an existence check and `os.rename`, and for an overwrite two
renames (DST moved aside, the new folder renamed in, the old one restored on any error or Ctrl-C); a SIGKILL
between those two renames leaves DST absent with its previous version intact in `.DST.old-*`.

Two rules hold for every writer (convert, export in both formats, import, the staged `save_pretrained`):
`check_apart_from_source` refuses a destination that is its source, lies inside it or contains it (links and `..`
resolved), before any work, since publishing over a folder that contains the source deletes the source; and
`give_umask_modes` gives what is published the modes the process's umask asks for (0666 & ~umask for files, 0777 &
~umask for folders), as a plain `open`/`mkdir` would, where safetensors and `tempfile` make them owner-only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "check_apart_from_source",
    "check_destination",
    "deferred_interrupts",
    "exchange",
    "give_umask_modes",
    "hidden_sibling",
    "process_umask",
    "publish_cache_folder",
    "publish_folder",
    "remove_folder",
    "rename_noreplace",
    "temporary_folder",
]

logger = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}
"""errno values of renameat2 when the kernel or the file system does not offer a flag: use the fallback."""


INTERRUPTS = (signal.SIGINT, signal.SIGTERM)
"""The signals that mean "stop, cleaning up": Ctrl-C, and what `kill`, `timeout`, `docker stop` and systemd send."""


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) and SIGTERM until the block ends, then deliver the first one received: its previous
    handler runs (SIGINT's default raises `KeyboardInterrupt` at the end of the block, never inside it; the `hfquant`
    command's SIGTERM handler does the same; SIGTERM's default ends the process, as it would have without the block).

    Python runs signal handlers in the main thread only, so this works there; in another thread the block runs
    unprotected (`signal.signal` cannot be called there). SIGKILL cannot be held back by anything.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[tuple[int, object]] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: received.append((signum, frame))) for signum in INTERRUPTS
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signum, frame = received[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL and signum != signal.SIGINT:
                signal.raise_signal(signum)
            elif handler != signal.SIG_IGN:
                raise KeyboardInterrupt


@contextlib.contextmanager
def temporary_folder(dst: Path) -> Iterator[Path]:
    """Create an empty hidden folder `.{dst.name}.tmp-XXXXXXXX` beside `dst` (mode 0755), yield it, and delete it
    (or whatever `publish_folder` swapped into its place) when the block ends, however it ends.

    The folder is registered for deletion in the same Ctrl-C-proof step that creates it, and deleted with Ctrl-C held
    back, so no interrupt can leave it behind; only SIGKILL can (a rerun ignores such leftovers; they are hidden
    and named after `dst`).

    Raises:
        OSError: the parent folder is missing or not writable.
    """
    path = None
    try:
        with deferred_interrupts():
            path = _create_unique(dst)
        yield path
    finally:
        with deferred_interrupts():  # a second Ctrl-C must not cut the cleanup short
            remove_folder(path)


NAME_MAX = 255
"""The longest file name, in bytes, that Linux file systems (ext4, xfs, btrfs, tmpfs) take."""


def hidden_sibling(path: Path, tag: str) -> Path:
    """A new hidden name beside `path`: `.{path.name}.{tag}-XXXXXXXX` (8 random hex digits), for a temporary file or
    folder that becomes, or stands for, `path`. A name too long for that to fit in NAME_MAX bytes keeps as much of its
    start as fits, then `~` and 8 hex digits of its sha256 (two long names sharing their start get different
    temporary names): every destination name that is legal gives a legal temporary name.

    Example: a 250-character `dst` gives `.` + its first 232 characters + `~1a2b3c4d.tmp-5e6f7a8b` (255 bytes).
    """
    suffix = f".{tag}-{secrets.token_hex(4)}"
    name = path.name
    room = NAME_MAX - 1 - len(suffix.encode())
    if len(os.fsencode(name)) > room:
        mark = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:8]
        while len(os.fsencode(name + mark)) > room:
            name = name[:-1]
        name += mark
    return path.parent / f".{name}{suffix}"


def _create_unique(dst: Path) -> Path:
    """mkdir a new `.{dst.name}.tmp-XXXXXXXX` (`hidden_sibling`) beside `dst` and return it."""
    while True:
        path = hidden_sibling(dst, "tmp")
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:
            continue
        path.chmod(0o755)  # mkdir's mode is reduced by the umask; the published folder should look ordinary
        return path


def remove_folder(path: Path | None) -> None:
    """Delete `path` (a folder, or a symlink that replaced a folder) if it exists; errors are ignored."""
    if path is None:
        return
    if path.is_symlink():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """`renameat2(src, dst, flags)`; False when unavailable or the file system lacks the flag, else True.

    Raises:
        OSError: any other failure (`FileExistsError` for `RENAME_NOREPLACE` onto an existing path).
    """
    function = getattr(_libc(), "renameat2", None)
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to load by that name (not a POSIX system)
        return None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Rename the folder `src` to the absent `dst`, atomically refusing to replace anything at `dst`.

    Raises:
        FileExistsError: `dst` exists (also when it appeared after any check the caller made).
    """
    try:
        if _renameat2(src, dst, _RENAME_NOREPLACE):
            return
        if dst.exists() or dst.is_symlink():
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)  # fallback; an empty DST made just now would be replaced, a non-empty one is refused
    except OSError as error:
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(
                f"{dst} exists: it appeared while this run was writing (another convert into the same DST finished "
                "first?); nothing was replaced. Rerun with --overwrite (overwrite=True) to replace it"
            ) from None
        raise


def exchange(src: Path, dst: Path) -> None:
    """Swap the folders `src` and `dst` (both must exist): afterwards `dst` holds what `src` held and vice versa.

    Atomic with `renameat2(RENAME_EXCHANGE)`; elsewhere two renames through `.{dst.name}.old-XXXXXXXX`, with the old
    `dst` put back if the second fails or Ctrl-C arrives between them.

    Raises:
        FileNotFoundError: `dst` or `src` does not exist.
        OSError: a rename failed; `dst` is as it was.
    """
    if _renameat2(src, dst, _RENAME_EXCHANGE):
        return
    aside = hidden_sibling(dst, "old")
    with deferred_interrupts():
        os.rename(dst, aside)
        try:
            os.rename(src, dst)
        except BaseException:
            os.rename(aside, dst)
            raise
        os.rename(aside, src)


def check_destination(dst: Path, overwrite: bool) -> None:
    """Refuse, before any work, a destination folder that is a file, lies under a file, or exists without `overwrite`.

    Raises:
        FileExistsError, NotADirectoryError: naming `dst` and the fix.
    """
    if dst.is_file():
        raise FileExistsError(f"DST {dst} is a file, not a checkpoint folder; pass the path of a folder to write")
    parent = next((p for p in dst.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise NotADirectoryError(f"{parent} is a file, so DST {dst} cannot be created under it; pass a folder path")
    if (dst.exists() or dst.is_symlink()) and not overwrite:
        raise FileExistsError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it")


def _named(path: Path, real: Path) -> str:
    """`path` as the user gave it, with where it leads when links or `..` make that another path."""
    return str(path) if Path(os.path.abspath(path)) == real else f"{path} (= {real})"


def check_apart_from_source(
    dst: str | os.PathLike, src: str | os.PathLike, written: str = "the output", *, file: bool = False
) -> None:
    """Refuse a destination `dst` that is the source folder `src`, lies inside it, or contains it, with symlinks and
    `..` resolved in both paths: replacing a folder that contains the source deletes the source, and writing inside
    the source changes it. Call it before any work, with the local source folder.

    A `file` destination (one file, written beside and renamed over it) may be a new file inside `src` (transformers
    loads a GGUF from the checkpoint folder: `from_pretrained(folder, gguf_file=...)`), never an existing one (a
    shard, config.json, or a link into SRC).

    Raises:
        ValueError: one line naming both paths (and what links or `..` made of them) and the fix.
    """
    dst, src = Path(dst).expanduser(), Path(src).expanduser()
    real_dst, real_src = dst.resolve(), src.resolve()
    if real_dst == real_src:
        relation = "is"
    elif real_dst.is_relative_to(real_src):
        if file and not (os.path.lexists(dst) or os.path.lexists(real_dst)):
            return
        relation = "is an existing file in" if file else "is inside"
    elif real_src.is_relative_to(real_dst):
        relation = "contains"
    else:
        return
    raise ValueError(
        f"DST {_named(dst, real_dst)} {relation} SRC {_named(src, real_src)}; writing there would change or delete "
        f"SRC: write {written} {'under a new name or outside SRC' if file else 'to another folder, outside SRC'}"
    )


def process_umask() -> int:
    """The process's umask (e.g. 0o022), read without changing it where Linux reports it (`/proc/self/status`);
    elsewhere set to 0o077 for the instant it is read and restored (a file created meanwhile by another thread is
    private rather than open to all)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def give_umask_modes(folder: Path, *, root: bool = True) -> None:
    """Give every file under `folder` mode 0666 & ~umask and every folder 0777 & ~umask (`folder` itself too when
    `root`), as `open` and `mkdir` would: safetensors writes its files 0600 and `tempfile` makes private ones, which
    a checkpoint served from another account or a container cannot read. Links are left alone, never followed.
    Call it on what this process wrote, before carrying over files of an old version (hard links share the mode).

    Raises:
        OSError: a mode could not be set.
    """
    mask = process_umask()
    for parent, folder_names, file_names in os.walk(folder):
        for name in folder_names:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), 0o777 & ~mask)
        for name in file_names:
            if not os.path.islink(os.path.join(parent, name)):
                os.chmod(os.path.join(parent, name), 0o666 & ~mask)
    if root:
        os.chmod(folder, 0o777 & ~mask)


def publish_folder(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Make the finished folder `tmp` appear as `dst` in one step; Ctrl-C during the step is delivered after it.

    An absent `dst` is created by an atomic rename that never replaces a `dst` appearing meanwhile. An existing
    `dst` is replaced only with `overwrite`, by swapping: afterwards `tmp` holds the previous version, for the caller
    to delete (`temporary_folder` does).

    Raises:
        FileExistsError: `dst` exists and `overwrite` is False, or it appeared during the run (the message says so).
        OSError: the rename failed; `dst` is as it was.
    """
    with deferred_interrupts():
        exists = dst.exists() or dst.is_symlink()
        if exists and not overwrite:
            raise FileExistsError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it")
        if not exists:
            try:
                rename_noreplace(tmp, dst)
                return
            except FileExistsError:  # it appeared meanwhile: replace it only when asked to
                if not overwrite:
                    raise
        exchange(tmp, dst)


def publish_cache_folder(tmp: Path, final: Path, is_complete: Callable[[Path], bool]) -> None:
    """Publish a finished cache build `tmp` as `final`, where several processes may build the same entry at once.

    A complete `final` (by `is_complete`, for example a marker file written last) is kept and `tmp` is left for the
    caller to delete: another process finished first, and its readers keep their files. An incomplete leftover at
    `final` (an older or interrupted build) is swapped out atomically.

    Raises:
        FileExistsError: `final` appeared during the rename and is not complete (a build is publishing it now).
        OSError: the rename failed; `final` is as it was.
    """
    with deferred_interrupts():
        if is_complete(final):
            return
        if final.exists() or final.is_symlink():
            logger.warning("Replacing the incomplete folder %s (an interrupted or older build)", final)
        try:
            publish_folder(tmp, final, overwrite=final.exists() or final.is_symlink())
        except FileExistsError:
            if not is_complete(final):
                raise
