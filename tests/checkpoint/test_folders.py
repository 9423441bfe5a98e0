"""`hfquant.checkpoint.publish`: the temporary folder, the atomic publishing renames, and Ctrl-C held back over them."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hfquant.checkpoint import publish as folders


def _folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "file.txt").write_text(text)
    return path


def _contents(path: Path) -> str:
    return (path / "file.txt").read_text()


def test_publish_into_an_absent_dst(tmp_path):
    dst = tmp_path / "dst"
    with folders.temporary_folder(dst) as tmp:
        assert (
            tmp.parent == tmp_path and tmp.name.startswith(".dst.tmp-") and oct(tmp.stat().st_mode & 0o777) == "0o755"
        )
        (tmp / "file.txt").write_text("new")
        folders.publish_folder(tmp, dst, overwrite=False)
    assert _contents(dst) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_publish_over_an_existing_dst_swaps_and_deletes_the_old_version(tmp_path):
    dst = _folder(tmp_path / "dst", "old")
    with folders.temporary_folder(dst) as tmp:
        (tmp / "file.txt").write_text("new")
        folders.publish_folder(tmp, dst, overwrite=True)
        assert _contents(tmp) == "old"  # the swap: the old version waits in tmp until the block ends
    assert _contents(dst) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_an_existing_dst_is_refused_without_overwrite(tmp_path):
    dst = _folder(tmp_path / "dst", "old")
    with pytest.raises(FileExistsError, match="dst exists; pass --overwrite"):
        with folders.temporary_folder(dst) as tmp:
            folders.publish_folder(tmp, dst, overwrite=False)
    assert _contents(dst) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


@pytest.mark.parametrize("empty", [True, False])
def test_rename_noreplace_never_replaces_a_dst_that_appeared(tmp_path, empty):
    """The race the existence check cannot see: DST appears after it (an empty folder would be replaced by a plain
    rename(2))."""
    src = _folder(tmp_path / "src", "new")
    dst = tmp_path / "dst"
    dst.mkdir()
    if not empty:
        (dst / "file.txt").write_text("theirs")
    with pytest.raises(FileExistsError, match="appeared while this run was writing"):
        folders.rename_noreplace(src, dst)
    assert _contents(src) == "new" and sorted(p.name for p in dst.iterdir()) == ([] if empty else ["file.txt"])


def test_exchange_swaps_two_folders(tmp_path):
    a, b = _folder(tmp_path / "a", "A"), _folder(tmp_path / "b", "B")
    folders.exchange(a, b)
    assert (_contents(a), _contents(b)) == ("B", "A")


def test_the_fallback_without_renameat2_behaves_the_same(tmp_path, monkeypatch):
    """Where renameat2 or its flags are missing (another OS, a file system without them): check-and-rename, and an
    exchange by two renames."""
    monkeypatch.setattr(folders, "_renameat2", lambda src, dst, flags: False)
    a, b = _folder(tmp_path / "a", "A"), _folder(tmp_path / "b", "B")
    folders.exchange(a, b)
    assert (_contents(a), _contents(b)) == ("B", "A")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
    with pytest.raises(FileExistsError, match="appeared while this run was writing"):
        folders.rename_noreplace(a, b)
    folders.rename_noreplace(a, tmp_path / "c")
    assert _contents(tmp_path / "c") == "B"


def test_fallback_exchange_puts_dst_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(folders, "_renameat2", lambda src, dst, flags: False)
    dst = _folder(tmp_path / "dst", "old")
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError):
        folders.exchange(missing, dst)
    assert _contents(dst) == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["dst"]


def test_ctrl_c_is_held_back_until_the_block_ends():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with folders.deferred_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # the handler runs at one of these bytecodes; it must not raise here
                steps.append(None)
            steps.append("end")
    assert steps[-1] == "end"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_the_temporary_folder_is_removed_does_not_stop_the_removal(tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    real = folders.remove_folder

    def interrupted_remove(path):
        os.kill(os.getpid(), signal.SIGINT)
        real(path)

    monkeypatch.setattr(folders, "remove_folder", interrupted_remove)
    with pytest.raises(KeyboardInterrupt):
        with folders.temporary_folder(dst) as tmp:
            (tmp / "file.txt").write_text("unfinished")
    assert list(tmp_path.iterdir()) == []


def _complete(folder: Path) -> bool:
    return (folder / "done").is_file()


def test_cache_publishing_keeps_a_complete_entry_another_build_published_first(tmp_path):
    final = _folder(tmp_path / "entry", "theirs")
    (final / "done").touch()
    with folders.temporary_folder(final) as tmp:
        (tmp / "file.txt").write_text("ours")
        (tmp / "done").touch()
        folders.publish_cache_folder(tmp, final, _complete)
    assert _contents(final) == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


@pytest.mark.parametrize("leftover", [False, True])
def test_cache_publishing_replaces_an_incomplete_leftover_or_fills_an_absent_entry(tmp_path, leftover):
    final = tmp_path / "entry"
    if leftover:
        _folder(final, "half written")  # no "done" marker
    with folders.temporary_folder(final) as tmp:
        (tmp / "file.txt").write_text("ours")
        (tmp / "done").touch()
        folders.publish_cache_folder(tmp, final, _complete)
    assert _contents(final) == "ours" and _complete(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
