"""hfquant's k-quant search in C (hfquant.ops.native.kquant_quantize, csrc/blocks_quant_cpu.c) against the torch codec
it speeds up (hfquant.core.blocks.quantize): the same bytes on random rows, with and without an importance, and on edge
rows (zeros, constant, huge, tiny, one spike); the importance moves the error where it points."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="native library unavailable here")

TYPES = list(native.KQUANT_TYPES)


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


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(
    "edge",
    ["zeros", "constant", "negative constant", "huge", "tiny", "one spike"],
)
def test_edge_rows_give_the_same_bytes(name, edge):
    generator = torch.Generator().manual_seed(5)
    rows = {
        "zeros": torch.zeros(2, 256),
        "constant": torch.full((2, 256), 0.25),
        "negative constant": torch.full((2, 256), -1.5),
        "huge": torch.randn(2, 256, generator=generator) * 3e4,
        "tiny": torch.randn(2, 256, generator=generator) * 1e-6,
        "one spike": torch.zeros(2, 256).index_fill_(1, torch.tensor([17]), 2.0),
    }
    weight = rows[edge]
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
