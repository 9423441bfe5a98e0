"""Fixtures shared by the tests; the plain helpers they build on are in helpers.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import tiny_model

LONGEST_FIRST = (
    "tests/real_model/test_real_model.py",
    "tests/reliability/test_interruption.py",
    "tests/commands/test_cli.py",
    "tests/interop/test_export_compressed_tensors.py",
    "tests/interop/test_export_gguf.py",
    "tests/real_model/test_gguf_import.py",
    "tests/project/test_bare_install.py",
    "tests/real_model/test_real_model_lora.py",
    "tests/interop/test_import_compressed_tensors.py",
    "tests/reliability/test_untrusted_text.py",
    "tests/commands/test_gguf_commands.py",
    "tests/reliability/test_signals_and_names.py",
    "tests/project/test_paired.py",
    "tests/project/test_benchmark.py",
    "tests/commands/test_convert.py",
    "tests/commands/test_hub.py",
)
"""The modules that run longest (seconds of setup and calls on one xdist worker, the nineteenth and twentieth sessions'
fresh-clone runs on the 2-core Zen 3: 50-380 s each; the twenty-first session's CPU cuts, measured per module, scaled
them: test_real_model.py ~280 -> ~205 s, test_interruption.py ~170 -> ~85 s, test_real_model_lora.py ~86 -> ~45 s,
which moves behind the ~50 s modules), longest first. `--dist loadfile` sends a worker a whole module at a time, in
the order of this list and then in collection order (see `pytest_collection_modifyitems`): started last, one of them
would leave the other worker idle for up to its length at the end of the run."""


def _xdist_distributes_by_module(config) -> bool:
    return getattr(config.option, "dist", "no") in ("loadfile", "loadscope", "loadgroup")


def pytest_configure(config):
    """A test run started as a background job by a non-interactive shell inherits SIGINT ignored (POSIX), and Python
    then keeps it ignored; the Ctrl-C tests need Python's own handler, in this process and in the processes they
    start (which inherit an ignored signal, never a handler)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the README's `-n 2` runs one worker per core: a worker's torch ops on two OpenMP threads would wait for (and
        # spin against) the other worker's; tests of the threaded kernels set their thread counts themselves
        torch.set_num_threads(1)
    if _xdist_distributes_by_module(config) and "--loadscope-reorder" not in config.invocation_params.args:
        # pytest-xdist otherwise sends the modules with the most tests first (`--loadscope-reorder`, its default), which
        # put the few-test real-model modules of 40-50 s last; the collection order below starts the longest first
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker, the modules of `LONGEST_FIRST` first, in its order (a module's own tests keep their
    order: module fixtures are set up once): the controller hands out work in the order its workers collected. A run in
    one process keeps pytest's order. (A worker's `config.option.dist` is always "no".)"""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest.fixture(
    params=[
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
    ]
)
def device(request) -> str:
    """Device a test puts its layers and inputs on: "cpu", and "cuda" where a GPU exists (skipped elsewhere)."""
    return request.param


@pytest.fixture(scope="session")
def float_checkpoint(tmp_path_factory):
    """Factory: `float_checkpoint(arch, dtype=torch.float32, **config_overrides)` -> directory of a saved random model.

    Built once per argument set with `helpers.tiny_model` (seed 0) and `save_pretrained`.
    """
    cache = {}

    def make(arch: str, dtype: torch.dtype = torch.float32, **overrides):
        key = (arch, dtype, tuple(sorted(overrides.items())))
        if key not in cache:
            model = tiny_model(arch, dtype=dtype, **overrides)
            path = tmp_path_factory.mktemp(f"{arch}_{str(dtype).removeprefix('torch.')}")
            model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make
