"""The one-row int4 and int8 kernels are chosen by timing on this CPU (hfquant.ops.choice), cached per CPU and shape."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from helpers import record_row_kernels

from hfquant import QuantLinear
from hfquant.core.format import StoredFormat
from hfquant.ops import choice, gemv, native, plan
from hfquant.ops.gemv import RowKernel
from hfquant.ops.kernels import Kernel

NEEDS_NATIVE = pytest.mark.skipif(not gemv.native_int4_works(), reason="hfquant's native int4 GEMV does not work here")
NEEDS_NATIVE_INT8 = pytest.mark.skipif(
    not gemv.native_int8_works(), reason="hfquant's native int8 GEMV does not work here"
)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No decision taken yet in this process, an empty cache folder, the default mode; the decisions taken here (on
    made-up timings) are forgotten afterwards."""
    monkeypatch.setenv("HFQUANT_CACHE", str(tmp_path))
    monkeypatch.delenv("HFQUANT_KERNEL_CHOICE", raising=False)
    choice._measured.cache_clear()
    yield tmp_path
    choice._measured.cache_clear()


def _timings(native_s: float, aten_s: float, calls: list):
    def measure(n, k, group_size=None):
        calls.append((n, k, group_size))
        return {"native": native_s, "aten": aten_s}

    return measure


@NEEDS_NATIVE
def test_measurement_times_both_kernels_on_the_shape(fresh):
    seconds = choice.measure_int4_row(128, 256, 64)
    assert set(seconds) == {"native", "aten", choice.ON_CPU}, seconds
    assert all(0 < s < 0.1 for name, s in seconds.items() if name != choice.ON_CPU), seconds
    assert 0 < seconds[choice.ON_CPU] <= 1


def test_kernels_are_timed_on_one_thread_interleaved_and_the_thread_count_is_restored():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    order = []

    def kernel(name):
        return lambda w: order.append((name, torch.get_num_threads()))

    try:
        seconds = choice._time_kernels({"native": kernel("native"), "aten": kernel("aten")}, [torch.zeros(1)] * 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert set(seconds) == {"native", "aten", choice.ON_CPU}
    assert {threads for _, threads in order} == {1}
    timed = [name for name, _ in order[4:]]  # after one warm-up pass of two copies per kernel
    assert timed == ["native", "native", "aten", "aten"] * choice._PASSES


@pytest.mark.parametrize("native_s, aten_s, expected", [(1e-5, 2e-5, True), (2e-5, 1e-5, False), (1e-5, 1e-5, False)])
def test_the_faster_kernel_is_kept_and_a_tie_goes_to_aten(fresh, monkeypatch, native_s, aten_s, expected):
    calls = []
    monkeypatch.setattr(choice, "measure_int4_row", _timings(native_s, aten_s, calls))
    assert choice.int4_row_uses_native(2048, 2048, 128) is expected
    assert choice.int4_row_uses_native(2048, 2048, 128) is expected
    assert calls == [(2048, 2048, 128)]  # measured once per process
    entry = json.loads(choice.cache_file().read_text())[choice.cpu_signature()]["int4 2048x2048 g128"]
    assert entry == {"kernel": "native" if expected else "aten", "native_us": native_s * 1e6, "aten_us": aten_s * 1e6}


def test_a_timing_on_a_busy_machine_decides_for_every_process_until_it_expires(fresh, monkeypatch):
    """A timing whose thread ran under `_MIN_ON_CPU` of its wall time (other processes took the core) is recorded as
    provisional: the next processes use it (the same kernels, the same outputs) until `_PROVISIONAL_SECONDS` have
    passed; then the next process measures again, and a quiet timing is recorded for good."""
    calls = []

    def busy(n, k, group_size=None):
        calls.append((n, k, group_size))
        return {"native": 2e-5, "aten": 1e-5, choice.ON_CPU: choice._MIN_ON_CPU / 2}

    now = [1_000_000.0]
    monkeypatch.setattr(choice.time, "time", lambda: now[0])
    monkeypatch.setattr(choice, "measure_int4_row", busy)
    assert choice.int4_row_uses_native(512, 2048, 64) is False and len(calls) == 1
    record = json.loads(choice.cache_file().read_text())[choice.cpu_signature()]["int4 512x2048 g64"]
    assert record["kernel"] == "aten" and record["provisional_until"] == now[0] + choice._PROVISIONAL_SECONDS
    monkeypatch.setattr(choice, "measure_int4_row", _timings(1e-5, 2e-5, calls))
    now[0] += choice._PROVISIONAL_SECONDS - 1
    choice._measured.cache_clear()  # as in a new process, on a quiet machine, within the provisional time
    assert choice.int4_row_uses_native(512, 2048, 64) is False and len(calls) == 1
    now[0] += 2
    choice._measured.cache_clear()  # a new process after it
    assert choice.int4_row_uses_native(512, 2048, 64) is True and len(calls) == 2
    record = json.loads(choice.cache_file().read_text())[choice.cpu_signature()]["int4 512x2048 g64"]
    assert record["kernel"] == "native" and "provisional_until" not in record


def test_a_record_another_process_made_while_this_one_timed_holds(fresh, monkeypatch):
    """Two processes timing one shape at once (a job's workers on a fresh cache): the one that records second uses the
    first one's choice, so that both decode alike."""
    calls = []

    def timed_beside_another(n, k, group_size=None):
        calls.append((n, k, group_size))
        choice._store(choice.cpu_signature(), "int8 512x2048", {"kernel": "aten", "native_us": 9.0, "aten_us": 8.0})
        return {"native": 1e-5, "aten": 2e-5}

    monkeypatch.setattr(choice, "measure_int8_row", timed_beside_another)
    assert choice.int8_row_uses_native(512, 2048) is False and len(calls) == 1
    assert choice.row_timings(512, 2048, None) == pytest.approx((9e-6, 8e-6))
    record = json.loads(choice.cache_file().read_text())[choice.cpu_signature()]["int8 512x2048"]
    assert record == {"kernel": "aten", "native_us": 9.0, "aten_us": 8.0}


@pytest.mark.parametrize("until", ["soon", [1]])
def test_a_malformed_provisional_time_is_measured_again(fresh, monkeypatch, until):
    signature = choice.cpu_signature()
    choice._store(signature, "int8 512x2048", {"kernel": "aten", "native_us": 2.0, "aten_us": 1.0})
    data = json.loads(choice.cache_file().read_text())
    data[signature]["int8 512x2048"]["provisional_until"] = until
    choice.cache_file().write_text(json.dumps(data))
    calls = []
    monkeypatch.setattr(choice, "measure_int8_row", lambda n, k: calls.append(1) or {"native": 1e-5, "aten": 2e-5})
    assert choice.int8_row_uses_native(512, 2048) is True and calls == [1]


def test_the_timing_thread_share_of_the_wall_time_is_measured(monkeypatch):
    """`_time_kernels`' `ON_CPU` is the thread's CPU time over the wall time of the timed passes: it falls when the
    kernels wait without running (a core taken by other processes) and is 1 when they compute. The clocks are fakes
    that the kernels advance, so the machine's load cannot move the result."""
    clock = {"wall": 100.0, "cpu": 7.0}
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(choice.time, "thread_time", lambda: clock["cpu"])

    def waiting(w):  # 1 ms of wall time, a quarter of it on the CPU
        clock["wall"] += 1e-3
        clock["cpu"] += 0.25e-3

    def computing(w):
        clock["wall"] += 1e-3
        clock["cpu"] += 1e-3

    idle = choice._time_kernels({"native": waiting, "aten": waiting}, [torch.zeros(1)] * 2)
    busy = choice._time_kernels({"native": computing, "aten": computing}, [torch.zeros(1)] * 4)
    assert idle[choice.ON_CPU] == pytest.approx(0.25) and busy[choice.ON_CPU] == pytest.approx(1.0), (idle, busy)
    assert idle["native"] == pytest.approx(1e-3) and busy["aten"] == pytest.approx(1e-3)


def test_a_new_process_reads_the_decision_from_the_cache_file(fresh, monkeypatch):
    monkeypatch.setattr(choice, "measure_int4_row", _timings(2e-5, 1e-5, []))
    assert choice.int4_row_uses_native(512, 2048, 64) is False
    choice._measured.cache_clear()  # as in a new process

    def never(*args):
        raise AssertionError("measured again although the cache file holds the decision")

    monkeypatch.setattr(choice, "measure_int4_row", never)
    assert choice.int4_row_uses_native(512, 2048, 64) is False
    # another CPU (or torch) has its own entry: measured there
    monkeypatch.setattr(choice, "cpu_signature", lambda: "Other CPU | family 6 model 143 | avx2 | torch 2.13.0")
    choice._measured.cache_clear()
    calls = []
    monkeypatch.setattr(choice, "measure_int4_row", _timings(1e-5, 2e-5, calls))
    assert choice.int4_row_uses_native(512, 2048, 64) is True and calls == [(512, 2048, 64)]
    assert len(json.loads(choice.cache_file().read_text())) == 2


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"%s": {"int4 2048x2048 g128": {"kernel": "gpu"}}}'])
def test_a_malformed_cache_file_is_ignored_and_rewritten(fresh, monkeypatch, content):
    choice.cache_file().write_text(content.replace("%s", choice.cpu_signature()))
    calls = []
    monkeypatch.setattr(choice, "measure_int4_row", _timings(1e-5, 2e-5, calls))
    assert choice.int4_row_uses_native(2048, 2048, 128) is True and len(calls) == 1
    assert (
        json.loads(choice.cache_file().read_text())[choice.cpu_signature()]["int4 2048x2048 g128"]["kernel"]
        == "native"
    )


@pytest.mark.parametrize("kind", ["fifo", "huge", "another user's"])
def test_a_cache_path_that_is_not_a_small_file_of_this_user_is_ignored_not_read(fresh, monkeypatch, kind):
    """A FIFO at the cache path would block every load on its read; a huge file would be read whole; another user's
    file could steer this user's choices. Each is ignored (and replaced when the new decision is recorded)."""
    path = choice.cache_file()
    entry = {choice.cpu_signature(): {"int4 2048x2048 g128": {"kernel": "aten", "native_us": 9, "aten_us": 1}}}
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_text(json.dumps(entry) + " " * (2**20 + 1))
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        path.write_text(json.dumps(entry))
        os.chown(path, 12345, -1)
    calls = []
    monkeypatch.setattr(choice, "measure_int4_row", _timings(1e-5, 2e-5, calls))
    answer = []
    worker = threading.Thread(target=lambda: answer.append(choice.int4_row_uses_native(2048, 2048, 128)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "reading the cache path blocked"
    assert answer == [True] and len(calls) == 1  # measured, not read from the planted entry
    assert (
        path.is_file()
        and json.loads(path.read_text())[choice.cpu_signature()]["int4 2048x2048 g128"]["kernel"] == "native"
    )


def test_the_environment_forces_a_kernel_without_timing_and_refuses_other_values(fresh, monkeypatch):
    def never(*args):
        raise AssertionError("measured although HFQUANT_KERNEL_CHOICE forces the kernel")

    monkeypatch.setattr(choice, "measure_int4_row", never)
    for value, expected in (("aten", False), ("native", True), ("ATEN ", False)):
        monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", value)
        assert choice.int4_row_uses_native(64, 64, 32) is expected
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "fastest")
    with pytest.raises(ValueError, match=r"HFQUANT_KERNEL_CHOICE='fastest' .*\['measure', 'native', 'aten'\]"):
        choice.int4_row_uses_native(64, 64, 32)


def test_a_failed_measurement_keeps_aten(fresh, monkeypatch):
    def broken(*args):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(choice, "measure_int4_row", broken)
    assert choice.int4_row_uses_native(128, 256, 64) is False
    assert not choice.cache_file().exists()  # nothing recorded: measured again in the next process


def _layer() -> QuantLinear:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn((128, 256), generator=generator)
    layer = QuantLinear.from_float(weight, None, StoredFormat(4, 64, False))
    layer.prepare_kernel(torch.bfloat16)
    return layer


@NEEDS_NATIVE
@pytest.mark.parametrize("native_faster", [True, False], ids=["gemv-faster", "aten-faster"])
def test_one_row_of_a_prepared_layer_runs_the_kernel_chosen_for_its_shape(fresh, monkeypatch, native_faster):
    monkeypatch.setattr(choice, "measure_int4_row", _timings(1e-5 if native_faster else 3e-5, 2e-5, []))
    used = record_row_kernels(monkeypatch)
    layer = _layer()
    assert layer.kernel == Kernel.INT4PACK_MM_CPU
    assert layer.plan.row == (RowKernel.INT4_GEMV if native_faster else RowKernel.ATEN)
    x = torch.randn((1, 256), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = layer(x)
    assert used == ([RowKernel.INT4_GEMV] if native_faster else [])
    # either kernel computes the same product: within bf16 rounding of the dequantized reference
    reference = x.float() @ layer.dequantize(torch.float32).t()
    assert torch.allclose(y.float(), reference, rtol=0.02, atol=0.02 * reference.abs().max().item())


@NEEDS_NATIVE_INT8
def test_int8_measurement_times_both_kernels_and_the_gemv_matches_float64(fresh):
    seconds = choice.measure_int8_row(96, 256)
    assert set(seconds) == {"native", "aten", choice.ON_CPU}, seconds
    assert 0 < seconds["native"] < 0.1 and 0 < seconds["aten"] < 0.1, seconds
    generator = torch.Generator().manual_seed(2)
    for n, k in ((96, 256), (100, 48), (2048, 2048), (10, 8192)):  # odd N; K % 16 == 0; long rows go 4 at a time
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
        scale = (torch.rand(n, generator=generator) * 0.01).to(torch.bfloat16)
        x = torch.randn((1, k), generator=generator).to(torch.bfloat16)
        y = native.int8_gemv(x, q, scale).double()
        reference = (x.double() @ q.double().t()) * scale.double()
        # rounded once to bfloat16: half a bfloat16 step of each output; plus float32 sums; plus, where K % 64 == 0
        # (W8A16 on a VNNI CPU), the int16 rounding of each activation: at most its 64-block's max|x| * 2**-16
        block_max = x.double().abs().reshape(-1, 64).amax(dim=1).repeat_interleave(64) if k % 64 == 0 else 0 * x[0]
        activation = (q.double().abs() @ block_max.double()) * scale.double() * 2**-16
        bound = reference.abs() * 2**-8 + 1e-6 * reference.abs().max() + 1.01 * activation
        assert ((y - reference).abs() <= bound).all(), (n, k)
    with pytest.raises(RuntimeError, match="K % 16"):
        native.int8_gemv(
            torch.zeros((1, 40), dtype=torch.bfloat16),
            torch.zeros((8, 40), dtype=torch.int8),
            torch.ones(8, dtype=torch.bfloat16),
        )


def test_int8_shapes_have_their_own_cache_entries(fresh, monkeypatch):
    calls = []
    monkeypatch.setattr(choice, "measure_int8_row", _timings(1e-5, 2e-5, calls))
    monkeypatch.setattr(choice, "measure_int4_row", _timings(2e-5, 1e-5, calls))
    assert choice.int8_row_uses_native(2048, 2048) is True
    assert choice.int4_row_uses_native(2048, 2048, 128) is False
    entries = json.loads(choice.cache_file().read_text())[choice.cpu_signature()]
    assert entries["int8 2048x2048"]["kernel"] == "native" and entries["int4 2048x2048 g128"]["kernel"] == "aten"


@NEEDS_NATIVE_INT8
@pytest.mark.parametrize("native_faster", [True, False], ids=["gemv-faster", "aten-faster"])
def test_one_row_of_a_prepared_int8_layer_runs_the_kernel_chosen_for_its_shape(fresh, monkeypatch, native_faster):
    monkeypatch.setattr(choice, "measure_int8_row", _timings(1e-5 if native_faster else 3e-5, 2e-5, []))
    weight = torch.randn((96, 256), generator=torch.Generator().manual_seed(0))
    layer = QuantLinear.from_float(weight, None, StoredFormat(8, 256, True))
    layer.prepare_kernel(torch.bfloat16)
    assert layer.kernel == Kernel.INT8PACK_MM
    assert layer.plan.row == (RowKernel.INT8_GEMV if native_faster else RowKernel.ATEN)
    used = []
    real = gemv.row_product
    monkeypatch.setattr(gemv, "row_product", lambda *args: used.append(1) or real(*args))
    x = torch.randn((1, 256), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = layer(x)
    assert bool(used) is native_faster
    assert not layer(x.repeat(3, 1)).isnan().any() and len(used) == int(native_faster)  # several rows: aten
    reference = x.float() @ layer.dequantize(torch.float32).t()
    assert torch.allclose(y.float(), reference, rtol=0.02, atol=0.02 * reference.abs().max().item())


@NEEDS_NATIVE
@pytest.mark.parametrize(
    "native_us, aten_us, compiled",
    [(10.0, 30.0, True), (12.5, 14.8, False)],
    ids=["gemv-wins-by-more-than-the-op-call", "gemv-wins-by-less"],
)
def test_compiled_graphs_keep_the_gemv_only_where_it_beats_the_custom_op_overhead(
    fresh, monkeypatch, native_us, aten_us, compiled
):
    """A compiled graph calls the GEMV as a Python custom op (about 9 us more per call here): a shape where the GEMV
    wins by less than that runs aten's kernel when compiled, the GEMV in eager (SmolLM2's 576 x 576 layers: 12.5 vs
    14.8 us made compiled decoding 0.88x aten's speed)."""
    monkeypatch.setattr(choice, "measure_int4_row", _timings(native_us * 1e-6, aten_us * 1e-6, []))
    monkeypatch.setattr(gemv, "custom_op_overhead_s", lambda: 9e-6)
    layer_plan = plan.plan_kernel(StoredFormat(4, 64, False), 576, 576, "cpu", torch.bfloat16)
    assert layer_plan.row is RowKernel.INT4_GEMV
    assert layer_plan.compiled_row is (RowKernel.INT4_GEMV if compiled else RowKernel.ATEN)
    assert choice.row_timings(576, 576, 64) == pytest.approx((native_us * 1e-6, aten_us * 1e-6))


def test_custom_op_overhead_is_measured_and_non_negative():
    overhead = gemv.custom_op_overhead_s()
    assert 0.0 <= overhead < 1e-3
