"""Tests of hfquant.ops.kernels: which kernel `select_kernel` picks on CPU, and each kernel against the dequantize reference.

Products run as a layer's plan says (`hfquant.ops.plan.plan_kernel` with `HFQUANT_KERNEL_CHOICE=native`: one
bfloat16 row takes hfquant's GEMV wherever it works here), the reference as `kernels.plain_plan(Kernel.DEQUANT, ...)`.

Tolerances (all relative to max |reference| of the output):
  - bfloat16 activations: 2%. The aten kernels and the reference both round the output to bfloat16 (2**-9 relative)
    and the int4 kernels also hold scale and (8 - z) * scale in bfloat16 (2**-9 each), so a few 2**-9 of the
    largest output plus accumulation-order noise (observed about 0.5%) stays well below 2%; a wrong nibble order,
    row layout, zero point or scale gives errors of the order of 100%.
  - float16: 0.5% (10 mantissa bits instead of 7). float32: 1e-5 (only the summation order differs).
Alignment tests run the kernel in a child process: an aten kernel that reads out of bounds crashes the process
(SIGSEGV) instead of raising, and must not take the test session down with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import hfquant
from hfquant.core import packing, rtn
from hfquant.core.format import StoredFormat
from hfquant.ops import kernels, plan
from hfquant.ops.kernels import Kernel, LayerTensors

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}

# (expected kernel on CPU, bits, symmetric, group_size, out_features N, in_features K)
CASES = [
    ("int8pack_mm", 8, True, 256, 48, 256),  # int8 symmetric per-channel
    ("int8pack_mm", 8, True, 64, 40, 64),
    ("int4pack_mm_cpu", 4, False, 32, 176, 256),  # two full 64-row blocks and a 48-row tail
    ("int4pack_mm_cpu", 4, True, 64, 48, 256),
    ("int4pack_mm_cpu", 4, False, 128, 16, 256),
    ("int4pack_mm_cpu", 4, False, 256, 64, 512),
    ("dequant", 8, False, 128, 24, 128),  # int8 asymmetric: the int8 kernel has no zero point
    ("dequant", 8, True, 32, 24, 128),  # int8 grouped: the int8 kernel has one scale per row
    ("dequant", 4, False, 576, 16, 576),  # int4 per-channel K=576: group outside 32..256
    ("dequant", 4, False, 512, 16, 1024),  # group 512 outside 32..256
    ("dequant", 4, False, 32, 8, 64),  # N=8: not a multiple of 16
]
CASE_IDS = [f"{kernel}-int{bits}-{'sym' if sym else 'asym'}-g{g}-N{n}-K{k}" for kernel, bits, sym, g, n, k in CASES]
PREFILL_ROWS = max(kernels.GEMM_MIN_ROWS.values())
BATCH_SHAPES = [(1,), (4,), (17,), (2, 3), (PREFILL_ROWS,), (3, PREFILL_ROWS // 3 + 1)]  # the last two: chunked GEMM


def _layer(bits: int, symmetric: bool, group: int, n: int, k: int, seed: int = 0):
    weight = torch.randn((n, k), generator=torch.Generator().manual_seed(seed))
    qt = rtn.quantize_weight(weight, bits, group, symmetric)
    stored = packing.pack_int4(qt.q) if bits == 4 else qt.q
    return qt, stored


@pytest.fixture(autouse=True)
def gemv_where_it_works(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # no timing; read when a plan is made


def _plans(kernel: str, fmt: StoredFormat, n: int, k: int, dtype: torch.dtype):
    """(the layer's plan, the dequantize reference's plan)."""
    layer_plan = plan.plan_kernel(fmt, k, n, "cpu", dtype)
    assert layer_plan.kernel == kernel
    return layer_plan, kernels.plain_plan(Kernel.DEQUANT, fmt, k, n, "cpu")


def _runtime(kernel: str, qt, stored: torch.Tensor, k: int, dtype: torch.dtype):
    source = qt.q if kernel in kernels.INT4_KERNELS else stored
    weight = kernels.prepare_weight(kernel, source, k)
    scale_zero = (
        kernels.scale_zero_for_int4(qt.scale, qt.zero_point, dtype) if kernel in kernels.INT4_KERNELS else None
    )
    return weight, scale_zero


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_select_kernel_on_cpu(case):
    expected, bits, symmetric, group, n, k = case
    got = kernels.select_kernel(StoredFormat(bits, group, symmetric), in_features=k, out_features=n, device="cpu")
    assert got == expected and isinstance(got, Kernel)


def test_select_kernel_falls_back_to_dequant_without_a_working_kernel(monkeypatch):
    monkeypatch.setattr(kernels, "kernel_works", lambda kernel, device: kernel == "dequant")
    for _, bits, symmetric, group, n, k in CASES:
        assert (
            kernels.select_kernel(StoredFormat(bits, group, symmetric), in_features=k, out_features=n, device="cpu")
            == Kernel.DEQUANT
        )


def test_select_kernel_on_an_unknown_device_is_dequant():
    assert (
        kernels.select_kernel(StoredFormat(8, 64, True), in_features=64, out_features=64, device="meta") == "dequant"
    )
    assert kernels.kernel_works(Kernel.DEQUANT, "meta")


def test_kernel_names_read_as_plain_strings():
    """Logs, module reprs and the tests compare and print kernels by their names."""
    assert [kernel.value for kernel in Kernel] == ["int8pack_mm", "int4pack_mm_cpu", "int4pack_mm_cuda", "dequant"]
    assert Kernel("int4pack_mm_cpu") is Kernel.INT4PACK_MM_CPU and Kernel.INT4PACK_MM_CPU == "int4pack_mm_cpu"
    assert str(Kernel.DEQUANT) == f"{Kernel.DEQUANT}" == "dequant" and repr(Kernel.DEQUANT) == "'dequant'"
    assert repr({Kernel.INT8PACK_MM: 2}) == "{'int8pack_mm': 2}"
    assert set(kernels.GEMM_MIN_ROWS) == {"int8pack_mm", "int4pack_mm_cpu"}


def test_scale_zero_for_int4_folds_the_zero_point():
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.25]], dtype=torch.bfloat16)  # (N=2, G=2)
    zero_point = torch.tensor([[8, 0], [15, 3]], dtype=torch.uint8)
    folded = kernels.scale_zero_for_int4(scale, zero_point, torch.float32)
    assert folded.shape == (2, 2, 2) and folded.dtype == torch.float32 and folded.is_contiguous()
    # (G, N, 2): [g, n] = [scale[n, g], (8 - z[n, g]) * scale[n, g]]
    assert folded[..., 0].tolist() == [[0.5, 1.0], [2.0, 0.25]]
    assert folded[..., 1].tolist() == [[0.0, -7.0], [16.0, 1.25]]
    symmetric = kernels.scale_zero_for_int4(scale, None, torch.bfloat16)
    assert symmetric.dtype == torch.bfloat16
    assert torch.equal(symmetric[..., 1], torch.zeros(2, 2, dtype=torch.bfloat16))


def test_prepare_weight_then_restore_codes_is_exact_for_the_cpu_int4_kernel():
    qt, _ = _layer(4, False, 32, 176, 128)
    runtime = kernels.prepare_weight("int4pack_mm_cpu", qt.q, 128)
    assert torch.equal(kernels.restore_codes("int4pack_mm_cpu", runtime, 176, 128), qt.q)
    with pytest.raises(ValueError, match="nothing to restore"):
        kernels.restore_codes("dequant", runtime, 176, 128)


def test_prepare_weight_copies_a_misaligned_stored_weight():
    _, stored = _layer(8, True, 64, 8, 64)
    buffer = torch.empty(stored.numel() + 1, dtype=stored.dtype)
    buffer[1:] = stored.reshape(-1)
    misaligned = buffer[1:].view(8, 64)
    assert misaligned.data_ptr() % 64
    for kernel in ("int8pack_mm", "dequant"):
        prepared = kernels.prepare_weight(kernel, misaligned, 64)
        assert prepared.data_ptr() % 64 == 0 and prepared.is_contiguous()
        assert prepared.data_ptr() != misaligned.data_ptr()
        assert torch.equal(prepared, stored)
    column_view = torch.zeros(8, 128, dtype=stored.dtype)[:, :64]
    assert kernels.prepare_weight("dequant", column_view, 64).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_quantized_matmul_matches_the_dequantize_reference(case, dtype):
    kernel, bits, symmetric, group, n, k = case
    qt, stored = _layer(bits, symmetric, group, n, k, seed=n + k)
    weight, scale_zero = _runtime(kernel, qt, stored, k, dtype)
    w_hat = rtn.dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric).double()
    layer_plan, reference_plan = _plans(kernel, StoredFormat(bits, group, symmetric), n, k, dtype)
    tensors = LayerTensors(weight, qt.scale, qt.zero_point, scale_zero)
    for index, batch in enumerate(BATCH_SHAPES):
        x = torch.randn((*batch, k), generator=torch.Generator().manual_seed(index)).to(dtype)
        y = kernels.quantized_matmul(layer_plan, tensors, x)
        reference = kernels.quantized_matmul(reference_plan, LayerTensors(stored, qt.scale, qt.zero_point), x)
        exact = x.double() @ w_hat.T  # float64 product with the dequantized weight
        assert y.dtype == dtype and y.shape == (*batch, n)
        assert reference.dtype == dtype and reference.shape == (*batch, n)
        limit = TOLERANCE[dtype] * exact.abs().max().item()
        assert (y.double() - reference.double()).abs().max().item() <= limit, (batch, kernel)
        assert (reference.double() - exact).abs().max().item() <= limit, (batch, "dequant")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "kernel, bits, symmetric, group, n, k",
    [
        ("int8pack_mm", 8, True, 128, 200, 128),
        ("int4pack_mm_cpu", 4, False, 32, 192, 128),
        ("int4pack_mm_cpu", 4, True, 64, 320, 256),
    ],
)
def test_many_rows_run_chunk_by_chunk_and_match_the_reference(
    monkeypatch, dtype, kernel, bits, symmetric, group, n, k
):
    """Prefill-sized inputs take the dequantize-a-chunk + float GEMM path; with a tiny chunk budget every 64 output
    channels are one chunk, so a wrong column offset or block order shows. Also: no big activation makes float16
    overflow (x @ q.T with |q| up to 127 would)."""
    monkeypatch.setattr(kernels, "_GEMM_CHUNK_BYTES", 1)
    qt, stored = _layer(bits, symmetric, group, n, k, seed=n)
    weight, scale_zero = _runtime(kernel, qt, stored, k, dtype)
    layer_plan, reference_plan = _plans(kernel, StoredFormat(bits, group, symmetric), n, k, dtype)
    calls = []
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", lambda *a: calls.append(a))
    for scale in (1.0, 300.0):
        x = (
            torch.randn((kernels.GEMM_MIN_ROWS[kernel] + 5, k), generator=torch.Generator().manual_seed(1)) * scale
        ).to(dtype)
        y = kernels.quantized_matmul(layer_plan, LayerTensors(weight, qt.scale, qt.zero_point, scale_zero), x)
        reference = kernels.quantized_matmul(reference_plan, LayerTensors(stored, qt.scale, qt.zero_point), x)
        assert torch.isfinite(y).all()
        limit = TOLERANCE[dtype] * reference.double().abs().max().item()
        assert (y.double() - reference.double()).abs().max().item() <= limit
    assert calls == []  # the aten kernels were not called


# ---------------------------------------------------------------------------------------------------------------
# Run in child processes (see module docstring): inputs that are non-contiguous or start at an odd address, and
# int8 per-channel layers whose in_features is not a multiple of 16.

_CHILD = r"""
import json, sys, types
spec = json.loads(sys.argv[1])
# Load hfquant.ops.kernels without hfquant/__init__ (which imports transformers): 1.5 s per child instead of 4 s.
package = types.ModuleType("hfquant")
package.__path__ = spec["path"]
sys.modules["hfquant"] = package
import os
os.environ["HFQUANT_KERNEL_CHOICE"] = "native"  # one bfloat16 row: hfquant's GEMV wherever it works, no timing
import torch
from hfquant.ops import kernels, plan
from hfquant.core import packing
from hfquant.core import rtn
from hfquant.core.format import StoredFormat


def at_offset(x, offset):
    buffer = torch.empty(x.numel() + offset, dtype=x.dtype)
    buffer[offset:] = x.reshape(-1)
    return buffer[offset:].view(x.shape)


results = []
for (expected_kernel, bits, symmetric, group, n, k), dtype_name, batches in spec["jobs"]:
    dtype = getattr(torch, dtype_name)
    kernel = kernels.select_kernel(StoredFormat(bits, group, symmetric), in_features=k, out_features=n, device="cpu")
    job = f"{kernel} int{bits} g{group} N{n} K{k} {dtype_name}"
    assert expected_kernel is None or kernel == expected_kernel, job
    weight = torch.randn((n, k), generator=torch.Generator().manual_seed(0))
    qt = rtn.quantize_weight(weight, bits, group, symmetric)
    stored = packing.pack_int4(qt.q) if bits == 4 else qt.q
    runtime = kernels.prepare_weight(kernel, qt.q if kernel in kernels.INT4_KERNELS else stored, k)
    sz = kernels.scale_zero_for_int4(qt.scale, qt.zero_point, dtype) if kernel in kernels.INT4_KERNELS else None
    layer_plan = plan.plan_kernel(StoredFormat(bits, group, symmetric), k, n, "cpu", dtype)
    tensors = kernels.LayerTensors(runtime, qt.scale, qt.zero_point, sz)
    w_hat = rtn.dequantize_weight(qt.q, qt.scale, qt.zero_point, bits, symmetric).double()

    def run(x):
        return kernels.quantized_matmul(layer_plan, tensors, x)

    inputs, outputs = [], []
    for batch in batches:  # contiguous, aligned inputs first
        x = torch.randn((*batch, k), generator=torch.Generator().manual_seed(sum(batch))).to(dtype)
        print("running", job, batch, "contiguous", flush=True)  # the last line printed names the input of a crash
        y = run(x)
        exact = x.double() @ w_hat.T
        relative_error = float((y.double() - exact).abs().max() / exact.abs().max())
        results.append([job, batch, "contiguous", True, relative_error])
        inputs.append(x)
        outputs.append(y)
    for batch, x, expected in zip(batches, inputs, outputs):
        wide = torch.zeros((*batch, k + 8), dtype=dtype)
        wide[..., 8:] = x
        doubled = torch.zeros((2 * batch[0], *batch[1:], k), dtype=dtype)
        doubled[::2] = x
        variants = {
            "offset_1": at_offset(x, 1),
            "offset_3": at_offset(x, 3),
            "offset_8": at_offset(x, 8),
            "offset_24": at_offset(x, 24),
            "transposed": x.transpose(0, -1).contiguous().transpose(0, -1),
            "column_slice": wide[..., 8:],
            "every_other_row": doubled[::2],
        }
        for name, variant in variants.items():
            print("running", job, batch, name, flush=True)
            got = run(variant)
            diff = float((got.float() - expected.float()).abs().max())
            results.append([job, batch, name, bool(torch.equal(got, expected)), diff / float(expected.abs().max())])
print("RESULT " + json.dumps(results), flush=True)
"""

ALL_BATCHES = [[1], [4], [17], [2, 3]]
# child name -> jobs (case, activation dtype, batch shapes); a case whose kernel is None takes select_kernel's pick.
ISOLATED = {
    "int8pack_mm-bfloat16": [(CASES[0], "bfloat16", ALL_BATCHES)],
    # int8 per-channel layers are valid for any in_features (no packing, one group per row)
    "int8-per-channel-K-not-multiple-of-16": [
        ((None, 8, True, k, 32, k), dtype, [[1], [2], [17]])
        for k, dtype in ((56, "bfloat16"), (72, "bfloat16"), (36, "bfloat16"), (33, "bfloat16"), (33, "float32"))
    ],
    "other-kernels": [
        (CASES[0], "float32", ALL_BATCHES),
        (CASES[2], "bfloat16", ALL_BATCHES),
        (CASES[3], "float32", ALL_BATCHES),
        (CASES[6], "bfloat16", ALL_BATCHES),
        (CASES[8], "bfloat16", [[1], [17]]),
    ],
}


@pytest.fixture(scope="module")
def children():
    """Start every child at once (their start-ups overlap), collect each one when its test asks."""
    processes = {}
    for name, jobs in ISOLATED.items():
        spec = json.dumps({"path": list(hfquant.__path__), "jobs": jobs})
        processes[name] = subprocess.Popen(
            [sys.executable, "-c", _CHILD, spec], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    yield processes
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("name", ISOLATED)
def test_in_child_process_no_crash_correct_and_layout_independent(children, name):
    """Exits cleanly; contiguous inputs match the float64 product (TOLERANCE); other layouts give the same result.

    "Same" is bit for bit for the aten kernels (they copy or read the input as it is); the "dequant" kernel calls
    F.linear, whose BLAS may sum in another order for an input at another alignment: there, within TOLERANCE.
    """
    out, err = children[name].communicate(timeout=120)
    assert children[name].returncode == 0, f"child exited with {children[name].returncode}:\n{out[-800:]}{err[-2000:]}"
    results = json.loads(out.rsplit("RESULT ", 1)[1])
    assert len(results) == 8 * sum(len(batches) for _, _, batches in ISOLATED[name])
    for job, batch, variant, equal, difference in results:
        if variant == "contiguous":
            assert difference <= TOLERANCE[getattr(torch, job.rsplit(" ", 1)[1])], (job, batch, difference)
        elif job.startswith("dequant"):
            assert difference <= TOLERANCE[getattr(torch, job.rsplit(" ", 1)[1])], (job, batch, variant, difference)
        else:
            assert equal, (job, batch, variant, difference)
