"""The data-free importance of the block formats' searches (hfquant.core.blocks.importance): each type's rule, what
`blocks.quantize` uses when given none, and the large weights x^2 keeps closer than an unweighted search."""

from __future__ import annotations

import pytest
import torch

from hfquant.core import blocks
from hfquant.core.blocks import importance


def _heavy_tailed(rows: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=generator) * torch.rand(rows, k, generator=generator).pow(4).mul(4).add(0.5)


@pytest.mark.parametrize("name", list(blocks.LAYOUTS))
def test_every_type_has_a_rule_computed_as_documented(name):
    weight = _heavy_tailed(3, 256, seed=1)
    got = importance.default_importance(name, weight)
    rule = importance.RULES[name]
    if rule == "uniform":
        assert got is None
        return
    if rule == "square":
        want = weight * weight
    else:
        b = weight.reshape(3, 8, 32)
        want = (b.pow(2).mean(-1, keepdim=True).sqrt() + b.abs()).reshape(3, 256)
        want = want * want if rule == "rms_abs_square" else want
    assert got.shape == weight.shape and torch.allclose(got, want)


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "hq3_0"])
def test_quantize_without_importance_uses_the_types_default(name):
    weight = _heavy_tailed(4, 256, seed=2)
    default = importance.default_importance(name, weight)
    assert torch.equal(blocks.quantize(name, weight), blocks.quantize(name, weight, default))
    assert not torch.equal(blocks.quantize(name, weight), blocks.quantize(name, weight, torch.ones(256)))


@pytest.mark.parametrize("name", ["iq4_nl", "q4_0", "q3_k"])
def test_the_square_rule_keeps_the_largest_weights_closer_than_an_unweighted_search(name):
    weight = _heavy_tailed(16, 512, seed=3)
    large = weight.abs() >= weight.abs().quantile(0.99)
    default = blocks.dequantize(name, blocks.quantize(name, weight, importance.rule_importance("square", weight)))
    uniform = blocks.dequantize(name, blocks.quantize(name, weight, torch.ones(512)))
    assert ((default - weight)[large] ** 2).sum() < ((uniform - weight)[large] ** 2).sum()


def test_unknown_names_rules_and_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown block format 'q9_k'"):
        importance.default_importance("q9_k", torch.ones(2, 32))
    with pytest.raises(ValueError, match="unknown importance rule 'cube'"):
        importance.rule_importance("cube", torch.ones(2, 32))
    with pytest.raises(ValueError, match="multiple of 32"):
        importance.rule_importance("square", torch.ones(2, 30))
    assert importance.rule_importance("uniform", torch.ones(2, 32)) is None


def test_stored_scale_rule_of_hq3_0_is_uniform_and_changes_the_search():
    weight = _heavy_tailed(4, 256, seed=4)
    got = importance.stored_scale_importance("hq3_0", weight)
    assert importance.STORED_SCALE_RULES["hq3_0"] == "uniform"
    assert got.shape == (256,) and torch.equal(got, torch.ones(256))
    assert not torch.equal(blocks.quantize("hq3_0", weight, got), blocks.quantize("hq3_0", weight))


@pytest.mark.parametrize("name", [n for n in blocks.LAYOUTS if n not in importance.STORED_SCALE_RULES])
def test_types_without_a_stored_scale_rule_keep_their_default(name):
    assert importance.stored_scale_importance(name, _heavy_tailed(2, 256, seed=5)) is None
