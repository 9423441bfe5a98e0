"""`FoldStream`: the folds of `fold_column_scales` computed block by block beside the streaming load
(`hfquant.integration.folding`). It must give `plan_folds`'s folds exactly, fold the blocks after the first on its
worker thread only as the load reads them (`FOLD_AHEAD` blocks ahead), answer membership without folding, and keep the map it
reads ahead through out of the load's page-out (`streaming.spare_mapping`)."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from helpers import tiny_model
from safetensors.torch import load_file

from hfquant import HfQuantConfig
from hfquant.checkpoint import streaming
from hfquant.integration import folding
from hfquant.integration.folding import FoldStream, find_blocks, plan_folds
from hfquant.nn.replace import plan_layers


def _spread(model) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 + 0.1)
            elif name.endswith(("q_proj.weight", "down_proj.weight")):
                param[:, :: param.shape[1] // 4] *= 12


@pytest.fixture()
def checkpoint(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    _spread(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    plans = plan_layers(model, HfQuantConfig(bits=4, group_size=32), ["lm_head"])
    return model, plans, files


@pytest.fixture()
def folded_on(monkeypatch):
    """Block index -> name of the thread that folded it."""
    threads: dict[int, str] = {}
    fold = folding._Planner.fold

    def recording(self, block, *args):
        threads[self.blocks.index(block)] = threading.current_thread().name
        return fold(self, block, *args)

    monkeypatch.setattr(folding._Planner, "fold", recording)
    return threads


def _equal(a: dict, b: dict) -> bool:
    def same(x, y):
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return a.keys() == b.keys() and all(
        same(a[k].row_scale, b[k].row_scale) and same(a[k].col_scale, b[k].col_scale) for k in a
    )


def test_the_stream_gives_plan_folds_folds_exactly(checkpoint, folded_on):
    model, plans, files = checkpoint
    state = {}
    for path in files:
        state.update(load_file(path))
    expected = plan_folds(model, plans, state.__getitem__, progress=False)
    assert any(t.col_scale is not None for t in expected.values())
    stream = FoldStream(model, plans, files)
    stream.fold_first()
    try:
        got = {name: stream.get(name) for name in expected}
        assert _equal(got, expected)
        assert _equal(pickle.loads(pickle.dumps(stream)), expected)  # a plain dict for `hfquant convert`'s workers
    finally:
        stream.close()
    assert folded_on[0] == threading.current_thread().name  # the first block in the pre-load hook
    assert all(folded_on[i] != threading.current_thread().name for i in range(1, 4))  # the others on the worker


def test_membership_answers_without_folding_and_the_worker_reads_fold_ahead_blocks_ahead(
    checkpoint, folded_on, monkeypatch
):
    monkeypatch.setattr(folding, "FOLD_AHEAD", 2)
    model, plans, files = checkpoint
    blocks = find_blocks(model)
    stream = FoldStream(model, plans, files)
    try:
        assert all(name in stream for block in blocks for name in block)  # every group is quantized here
        assert "lm_head" not in stream and stream
        assert not folded_on  # nothing folded until the pre-load hook asks for the first block
        stream.fold_first()
        assert set(folded_on) == {0}
        stream.get(blocks[0].q)
        stream._futures[2].result()  # queued by the read of block 0 (blocks 1 and 2), folded in order
        assert set(folded_on) == {0, 1, 2} and 3 not in stream._futures
        stream.get(blocks[1].q)
        stream._futures[3].result()
        assert set(folded_on) == {0, 1, 2, 3}
        assert all(folded_on[i].startswith("hfquant-folds") for i in (1, 2, 3))
        assert stream.get("lm_head") is None
    finally:
        stream.close()


def test_a_block_read_elsewhere_is_folded_in_the_callers_thread_under_float32(checkpoint, folded_on):
    model, plans, files = checkpoint
    blocks = find_blocks(model)
    stream = FoldStream(model, plans, files)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as in the pre-load hook: no worker may fold under it
    try:
        stream.get(blocks[3].q)
    finally:
        torch.set_default_dtype(default)
        stream.close()
    assert folded_on[3] == threading.current_thread().name and 1 not in folded_on


def test_the_callers_thread_folds_at_one_torch_thread_and_restores_the_count(checkpoint, monkeypatch):
    """Block 0 (folded in the pre-load hook) runs torch's operations at one intra-op thread, and the caller's count is
    back after; the worker leaves torch's count alone (it is the process's)."""
    model, plans, files = checkpoint
    seen: dict[int, int] = {}
    fold = folding._Planner.fold

    def recording(self, block, *args):
        seen[self.blocks.index(block)] = torch.get_num_threads()
        return fold(self, block, *args)

    monkeypatch.setattr(folding._Planner, "fold", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stream = FoldStream(model, plans, files)
        stream.fold_first()
        assert seen == {0: 1} and torch.get_num_threads() == 2
        stream.get(find_blocks(model)[1].q)
        stream.close()
        assert seen[1] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_spared_map_is_left_to_its_owner(monkeypatch):
    advised = []
    monkeypatch.setattr(
        streaming, "mapped_checkpoint_ranges", lambda: [(0x1000, 0x9000, "a"), (0x10000, 0x20000, "b")]
    )
    monkeypatch.setattr(
        streaming, "_madvise", lambda: lambda start, length, advice: advised.append((start, advice)) or 0
    )
    assert streaming.spare_mapping(0x1800) == (0x1000, 0x9000)
    try:
        streaming.release_checkpoint_pages()
        assert advised == [(0x10000, streaming._MADV_PAGEOUT)]
        advised.clear()
        streaming.release_checkpoint_pages(keep_cached=True)  # the owner's own release unmaps both
        assert [start for start, _ in advised] == [0x1000, 0x10000]
    finally:
        streaming.spare_mapping(0x1800, spared=False)
    advised.clear()
    streaming.release_checkpoint_pages()
    assert [start for start, _ in advised] == [0x1000, 0x10000]
