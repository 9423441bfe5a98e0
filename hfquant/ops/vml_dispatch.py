"""One call of each MKL VML function ATen uses, on one thread, before a loaded model runs.

ATen computes float32 and float64 `cos`, `sin`, `exp`, `log`, `sqrt`, `tanh` and a few others on contiguous CPU
tensors with MKL's VML (`aten/src/ATen/cpu/vml.h`), each intra-op thread on its chunk. oneMKL 2024.2 (the one
PyTorch 2.13's wheels bundle) picks each function's kernel on its first call in a process; when that first call runs
on several threads at once, one thread can run a low-accuracy kernel for its chunk (PyTorch issue #188792; a fix
with the same 1-element warm-up is PyTorch pull request #188791, open). A rotary embedding's `cos` over 48 positions
(3072 values) is such a first call: on an Intel Xeon (family 6 model 167, two threads, 2026-11-29) 9 of 16 fresh
processes computed it differently from the next call, so a model's first forward, and the logits of a model
reloaded in another process, differed at random (10 of 3072 bfloat16 cos values one step apart; logits up to 1.25
apart on SmolLM2-135M).

`resolve_vml_dispatch()` calls each of those functions once on a 1-element tensor of each dtype (one thread: ATen
splits work from 2048 values), so their kernels are chosen before any model runs. hfquant's quantizer calls it in
every `from_pretrained` that loads or quantizes a model, and `hfquant.evaluation` before it measures any model (a
bf16 baseline loaded without hfquant); it costs well under a millisecond after the first time.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["VML_FUNCTIONS", "resolve_vml_dispatch"]

VML_FUNCTIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
"""The torch functions ATen routes to MKL VML for float32 and float64 (`IMPLEMENT_VML_MKL` in ATen's vml.h)."""


@functools.cache
def resolve_vml_dispatch() -> None:
    """Call every `VML_FUNCTIONS` once on a 1-element float32 and float64 CPU tensor (0.5, inside every domain), so
    that MKL picks each function's kernel on one thread. Once per process; nothing to do where torch has no MKL."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")  # a CPU tensor under any default device
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
