"""hfquant's block searches in C (hfquant.ops.native.kquant_quantize and block_quantize, csrc/blocks_quant_cpu.c)
against the torch codecs they speed up (hfquant.core.blocks.quantize): the same bytes on random and heavy-tailed rows,
with and without an importance, and on edge rows (zeros, constant, huge, tiny, one spike); the importance moves the
error where it points; quantize-on-load takes the C path."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="native library unavailable here")


def _c_search(name, weight, importance=None):
    """`native.block_quantize` held to the torch codecs' bytes: IQ4_NL / IQ4_XS with iq4_search="exhaustive" (the C
    port of the torch codec's search; the default search is tests/ops/test_iq4_search.py's)."""
    return native.block_quantize(name, weight, importance, iq4_search="exhaustive")


TYPES = list(native.KQUANT_TYPES)
BLOCK32_TYPES = [name for name in native.BLOCK_QUANTIZE_TYPES if name not in native.KQUANT_TYPES]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("with_importance", [False, True])
def test_random_rows_match_the_torch_codec(name, with_importance):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 512, generator=generator) * 0.03
    weight[0, :256] += 0.5  # a super-block all of one sign: the offset path
    importance = torch.rand(512, generator=generator) ** 2 if with_importance else None
    want = blocks.quantize(name, weight, importance)
    got = native.kquant_quantize(name, weight, importance)
    assert got.dtype == torch.uint8 and torch.equal(got, want), f"{name}: C bytes differ from the torch codec"


EDGES = ["zeros", "constant", "negative constant", "huge", "tiny", "one spike"]


def _edge_rows(edge: str, seed: int) -> torch.Tensor:
    """Two 256-weight rows of one of the `EDGES` a search must survive."""
    generator = torch.Generator().manual_seed(seed)
    if edge == "huge":
        return torch.randn(2, 256, generator=generator) * 3e4
    if edge == "tiny":
        return torch.randn(2, 256, generator=generator) * 1e-6
    return {
        "zeros": torch.zeros(2, 256),
        "constant": torch.full((2, 256), 0.25),
        "negative constant": torch.full((2, 256), -1.5),
        "one spike": torch.zeros(2, 256).index_fill_(1, torch.tensor([17]), 2.0),
    }[edge]


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("edge", EDGES)
def test_edge_rows_give_the_same_bytes(name, edge):
    weight = _edge_rows(edge, seed=5)
    want = blocks.quantize(name, weight)
    got = native.kquant_quantize(name, weight)
    assert torch.equal(got, want), f"{name} {edge}: C bytes differ from the torch codec"


@pytest.mark.parametrize("name", TYPES)
def test_importance_moves_the_error(name):
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(4, 256, generator=generator)
    favoured = torch.ones(256)
    favoured[:64] = 1000.0
    plain = blocks.dequantize(name, native.kquant_quantize(name, weight, torch.ones(256)))
    weighted = blocks.dequantize(name, native.kquant_quantize(name, weight, favoured))
    error = lambda data: ((data - weight)[:, :64] ** 2).sum().item()  # noqa: E731
    assert error(weighted) < error(plain)
    per_row = native.kquant_quantize(name, weight, favoured.expand(4, 256))
    assert torch.equal(per_row, native.kquant_quantize(name, weight, favoured))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="covers"):
        native.kquant_quantize("q8_0", torch.zeros(1, 256))
    with pytest.raises(ValueError, match="multiple of 256"):
        native.kquant_quantize("q4_k", torch.zeros(1, 100))
    with pytest.raises(ValueError, match="finite"):
        native.kquant_quantize("q4_k", torch.full((1, 256), float("nan")))
    with pytest.raises(ValueError, match="importance"):
        native.kquant_quantize("q4_k", torch.zeros(1, 256), -torch.ones(256))


def test_quantize_on_load_takes_the_c_path_with_the_same_bytes(monkeypatch):
    from hfquant.nn import linear

    weight = torch.randn(6, 512, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    calls = []
    original = native.kquant_quantize
    monkeypatch.setattr(native, "kquant_quantize", lambda *a: calls.append(a[0]) or original(*a))
    stored = torch.empty(6, blocks.layout("q4_k").row_bytes(512), dtype=torch.uint8)
    linear._quantize_blocks(weight, "q4_k", stored, None, None)
    assert calls == ["q4_k"]
    assert torch.equal(stored, blocks.quantize("q4_k", weight.float()))


@pytest.mark.parametrize("name", TYPES)
def test_without_importance_c_and_torch_use_the_same_default(name):
    from hfquant.core.blocks import importance

    weight = torch.randn(4, 256, generator=torch.Generator().manual_seed(13))
    default = importance.default_importance(name, weight)
    assert torch.equal(blocks.quantize(name, weight), blocks.quantize(name, weight, default))
    assert torch.equal(native.kquant_quantize(name, weight), blocks.quantize(name, weight))
    if default is not None:  # a weighted default changes the bytes
        assert not torch.equal(blocks.quantize(name, weight), blocks.quantize(name, weight, torch.ones(256)))


# ---------------------------------------------------------------------------------------------------------------------
# the 32-weight types and IQ4_XS (native.block_quantize)


def _rows(kind: str, name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(17)
    rows = 8 if name == "iq4_xs" else 24  # the torch IQ4_XS search is slow
    weight = torch.randn(rows, 512, generator=generator) * 0.02
    if kind == "heavy-tailed":  # log-normal magnitudes: blocks with one or two outliers many times the rest
        weight = weight * torch.exp(1.5 * torch.randn(rows, 512, generator=generator))
    weight[0, :32] = weight[0, :32].abs() + 0.1  # a block all of one sign
    return weight


@pytest.mark.parametrize("name", BLOCK32_TYPES)
@pytest.mark.parametrize("kind", ["normal", "heavy-tailed"])
@pytest.mark.parametrize("importance_shape", [None, "per column", "per element"])
def test_block_search_matches_the_torch_codec(name, kind, importance_shape):
    weight = _rows(kind, name)
    generator = torch.Generator().manual_seed(19)
    importance = {
        None: None,
        "per column": torch.rand(512, generator=generator) ** 2,
        "per element": torch.rand(weight.shape, generator=generator) ** 2 + 0.01 * weight.abs(),
    }[importance_shape]
    want = blocks.quantize(name, weight, importance)
    got = _c_search(name, weight, importance)
    assert got.dtype == torch.uint8 and got.shape == want.shape
    differing = (got != want).any(1).nonzero().flatten().tolist()
    assert not differing, f"{name} {kind}: C bytes differ from the torch codec in rows {differing}"


@pytest.mark.parametrize("name", BLOCK32_TYPES)
@pytest.mark.parametrize("edge", EDGES)
def test_block_search_edge_rows_give_the_same_bytes(name, edge):
    weight = _edge_rows(edge, seed=23)
    assert torch.equal(_c_search(name, weight), blocks.quantize(name, weight)), f"{name} {edge}"


@pytest.mark.parametrize("name", BLOCK32_TYPES)
def test_block_search_importance_moves_the_error(name):
    weight = torch.randn(4, 256, generator=torch.Generator().manual_seed(29))
    favoured = torch.ones(256)
    favoured[::4] = 1000.0  # a quarter of every block: a block's own scale can favour them
    plain = blocks.dequantize(name, _c_search(name, weight, torch.ones(256)))
    weighted = blocks.dequantize(name, _c_search(name, weight, favoured))
    error = lambda data: ((data - weight)[:, ::4] ** 2).sum().item()  # noqa: E731
    assert error(weighted) < error(plain)


def test_block_quantize_refuses_bad_arguments():
    with pytest.raises(ValueError, match="covers"):
        native.block_quantize("q4_2", torch.zeros(1, 256))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.block_quantize("q4_0", torch.zeros(1, 100))
    with pytest.raises(ValueError, match="multiple of 256"):
        native.block_quantize("iq4_xs", torch.zeros(1, 288))
    with pytest.raises(ValueError, match="finite"):
        native.block_quantize("iq4_nl", torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match="importance"):
        native.block_quantize("q8_0", torch.zeros(1, 64), torch.ones(32))
    with pytest.raises(ValueError, match="importance"):
        native.block_quantize("q5_1", torch.zeros(1, 64), -torch.ones(64))


@pytest.mark.parametrize("name", ["iq4_nl", "q4_0", "hq3_0", "hq3_nl"])
def test_quantize_on_load_takes_the_block_search_in_c(monkeypatch, name):
    from hfquant.nn import linear

    weight = torch.randn(6, 512, generator=torch.Generator().manual_seed(31)).to(torch.bfloat16)
    calls = []
    original = native.block_quantize
    monkeypatch.setattr(native, "block_quantize", lambda *a, **k: calls.append(a[0]) or original(*a, **k))
    stored = torch.empty(6, blocks.layout(name).row_bytes(512), dtype=torch.uint8)
    linear._quantize_blocks(weight, name, stored, None, None, iq4_search="exhaustive")
    assert calls == [name]
    assert torch.equal(stored, blocks.quantize(name, weight.float()))


def test_quantize_on_load_falls_back_to_torch_without_the_library(monkeypatch):
    from hfquant.nn import linear

    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(37))
    monkeypatch.setattr(native, "built_library", lambda: None)
    monkeypatch.setattr(native, "block_quantize", lambda *a: pytest.fail("the C search ran without the library"))
    stored = torch.empty(4, blocks.layout("q5_0").row_bytes(64), dtype=torch.uint8)
    linear._quantize_blocks(weight, "q5_0", stored, None, None)
    assert torch.equal(stored, blocks.quantize("q5_0", weight))
