"""Tests of benchmarks.memory."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import TOKENIZER_VOCAB, tiny_model

from benchmarks.memory import MIB, dir_size_bytes, peak_rss_mib, reset_peak_rss, rss_mib, tensor_bytes

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


# ---------------------------------------------------------------- RSS


@linux_only
def test_rss_and_peak_are_positive_and_ordered():
    rss, peak = rss_mib(), peak_rss_mib()
    assert isinstance(rss, float) and isinstance(peak, float)
    assert 1 < rss <= peak


def _touch_100_mib() -> tuple[bool, float, float, float, float]:
    was_reset = reset_peak_rss()
    peak_before, rss_before = peak_rss_mib(), rss_mib()
    x = torch.ones(100 * MIB, dtype=torch.uint8)  # ones(): every page is written
    rss_during = rss_mib()
    del x
    return was_reset, peak_before, rss_before, rss_during, peak_rss_mib()


@linux_only
def test_peak_rss_grows_after_touching_100_mib():
    # The kernel may reclaim other pages of this process meanwhile (file pages of checkpoints mapped by earlier
    # tests; this VM runs DAMON reclaim), which lowers VmRSS by a few MiB to tens of MiB: up to three attempts.
    for _attempt in range(3):
        was_reset, peak_before, rss_before, rss_during, peak_after = _touch_100_mib()
        if rss_during - rss_before > 90:
            break
    assert rss_during - rss_before > 90, (rss_before, rss_during)
    # The high-water mark keeps the spike after the memory is freed (VmHWM trails VmRSS by the kernel's lazily
    # synced per-thread counters, a fraction of a MiB: compare with the 90 MiB step, not with rss_during itself).
    assert peak_after >= rss_before + 90
    assert peak_after >= peak_before
    if was_reset:
        assert peak_after - peak_before > 80


@linux_only
def test_reset_peak_rss_lowers_the_high_water_mark():
    x = torch.ones(100 * MIB, dtype=torch.uint8)
    del x
    peak_with_spike = peak_rss_mib()
    if not reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not writable here")
    assert peak_rss_mib() <= peak_with_spike + 1  # RSS may grow by a few pages between the two reads (seen: 12 KiB)
    # Right after a reset the peak is (about) the current RSS. The kernel's RSS counters are batched per thread, and
    # memory freed between the two reads widens the gap, so in a large test process one reading can be off: the
    # closest of three resets counts (without a working reset every gap would stay at the spike's height).
    gaps = []
    for _ in range(3):
        reset_peak_rss()
        gaps.append(peak_rss_mib() - rss_mib())
    assert min(gaps) < 20, gaps


def test_rss_helpers_return_none_without_proc(monkeypatch):
    import benchmarks.memory as mem

    monkeypatch.setattr(mem, "_PROC_STATUS", "/nonexistent/status")
    monkeypatch.setattr(mem, "_PROC_CLEAR_REFS", "/nonexistent/clear_refs")
    assert mem.rss_mib() is None
    assert mem.peak_rss_mib() is None
    assert mem.reset_peak_rss() is False


# ---------------------------------------------------------------- tensor_bytes


def test_tensor_bytes_counts_tied_embeddings_once():
    tied = tiny_model("llama_tied", **TOKENIZER_VOCAB)
    untied = tiny_model("llama", **TOKENIZER_VOCAB)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    emb = tied.model.embed_tokens.weight.nbytes
    unique = sum(p.nbytes for p in tied.parameters()) + sum(b.nbytes for b in tied.buffers())
    assert tensor_bytes(tied) == unique
    assert tensor_bytes(untied) == tensor_bytes(tied) + emb
    # Naively summing every registered tensor would double count.
    naive = sum(t.nbytes for _, t in tied.named_parameters(remove_duplicate=False))
    assert naive > sum(p.nbytes for p in tied.parameters())


def test_tensor_bytes_dtype_and_buffers():
    m = tiny_model("llama_tied", dtype=torch.float32, **TOKENIZER_VOCAB)
    half = tiny_model("llama_tied", dtype=torch.bfloat16, **TOKENIZER_VOCAB)
    params32 = sum(p.numel() for p in m.parameters()) * 4
    buffers = sum(b.nbytes for b in m.buffers())
    assert tensor_bytes(m) == params32 + buffers
    assert tensor_bytes(half) == params32 // 2 + sum(b.nbytes for b in half.buffers())


def test_tensor_bytes_views_of_one_storage():
    base = torch.zeros(10, 8)  # 320 bytes
    mod = torch.nn.Module()
    mod.a = torch.nn.Parameter(base[:5], requires_grad=False)  # rows 0-4
    mod.b = torch.nn.Parameter(base[5:], requires_grad=False)  # rows 5-9, disjoint
    mod.register_buffer("c", base[3:7])  # overlaps both
    mod.register_buffer("d", base[:5])  # same range as a, different tensor object
    assert tensor_bytes(mod) == 320
    mod2 = torch.nn.Module()
    mod2.register_buffer("x", base[:2])
    mod2.register_buffer("y", base[8:])
    # Unused middle of the storage is not counted.
    assert tensor_bytes(mod2) == 4 * 8 * 4


def test_tensor_bytes_transposed_view_and_iterable():
    w = torch.zeros(16, 4, dtype=torch.int8)
    assert tensor_bytes([w, w.t(), w]) == 64
    assert tensor_bytes([torch.zeros(3), torch.zeros(3)]) == 24
    with pytest.raises(TypeError):
        tensor_bytes([1, 2])


def test_tensor_bytes_meta_device():
    with torch.device("meta"):
        lin = torch.nn.Linear(8, 4)
    assert tensor_bytes(lin) == (8 * 4 + 4) * 4


# ---------------------------------------------------------------- dir_size_bytes


def test_dir_size_bytes_counts_only_safetensors(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 234)
    (tmp_path / "config.json").write_text("{}" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.safetensors").write_bytes(b"x" * 50)
    assert dir_size_bytes(tmp_path) == 1234
    assert dir_size_bytes(tmp_path, "**/*.safetensors") == 1284
    assert dir_size_bytes(tmp_path / "sub") == 50


def test_dir_size_bytes_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        dir_size_bytes(tmp_path / "missing")
    f = tmp_path / "f.safetensors"
    f.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        dir_size_bytes(f)
    assert dir_size_bytes(tmp_path) == 0


def test_import_model_code_imports_the_class_module_before_a_load(tmp_path):
    """The modeling module a load would import is imported by the call, in a fresh process (so that it was not
    already there): the RSS and time of a load measured afterwards leave module imports out."""
    import subprocess
    from pathlib import Path

    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    code = (
        "import sys\n"
        "from benchmarks.memory import import_model_code\n"
        "name = 'transformers.models.gpt2.modeling_gpt2'\n"
        "before = name in sys.modules\n"
        f"import_model_code({str(tmp_path)!r})\n"
        "print(before, name in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["False", "True"]
