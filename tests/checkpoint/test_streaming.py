"""hfquant.checkpoint.streaming.PageReleaser: the pages of a streamed checkpoint are released once per share of it
read (not once per tensor: each release advises every mapped shard whole), and always at the end."""

from __future__ import annotations

import pytest

from hfquant.checkpoint import streaming
from hfquant.checkpoint.streaming import PageReleaser

MIB = 2**20


@pytest.fixture()
def calls(monkeypatch):
    made = {"release": 0, "trim": 0}

    def release():
        made["release"] += 1
        return 1

    def trim():
        made["trim"] += 1

    monkeypatch.setattr(streaming, "release_checkpoint_pages", release)
    monkeypatch.setattr(streaming, "trim_heap", trim)
    return made


@pytest.mark.parametrize(
    "total, every",
    [(0, 16 * MIB), (270 * 10**6, 16 * MIB), (2_350_000_000, 2_350_000_000 // 32), (16 * 10**9, 256 * MIB)],
)
def test_share_of_the_checkpoint_within_16_and_256_mib(total, every):
    assert PageReleaser.for_checkpoint(total).every_bytes == every


def test_releases_once_per_share_and_trims_the_heap_in_between(calls):
    releaser = PageReleaser(100)
    advised = [releaser.read(30) for _ in range(10)]  # 300 bytes: releases after the 4th, 8th tensor
    assert calls["release"] == 2 and advised == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert calls["trim"] == 8  # every other tensor still gives back its freed heap memory
    assert releaser.flush() == 1 and calls["release"] == 3 and releaser.pending == 0


def test_one_tensor_larger_than_the_share_is_released_at_once(calls):
    releaser = PageReleaser(100)
    releaser.read(1000)
    assert calls["release"] == 1 and releaser.pending == 0


def test_background_releases_run_beside_the_load_one_at_a_time(monkeypatch):
    import threading

    started, finish = [], threading.Event()

    def release():
        started.append(threading.current_thread().name)
        if len(started) == 1:
            assert finish.wait(10)  # the first release is still running when the next share is read
        return 1

    monkeypatch.setattr(streaming, "release_checkpoint_pages", release)
    monkeypatch.setattr(streaming, "trim_heap", lambda: None)
    releaser = PageReleaser(100, background=True)
    assert releaser.read(100) == 0  # submitted, not waited for
    assert releaser.pending == 0
    waiter = threading.Thread(target=releaser.read, args=(100,))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and len(started) == 1  # the second release waits for the first: one share in flight
    finish.set()
    waiter.join(10)
    assert releaser.flush() == 1
    assert len(started) == 3 and started[0] != threading.current_thread().name
    assert started[2] == threading.current_thread().name  # the last release, at the end of loading, is the caller's
