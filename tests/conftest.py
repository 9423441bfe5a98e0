"""Fixtures shared by the tests; the plain helpers they build on are in helpers.py."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import tiny_model


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
