"""`clipping="mse"`: an MSE-searched clipping range per group (`hfquant.core.rtn.search_scale_zero_point`)."""

from __future__ import annotations

import pytest
import torch
from helpers import auto_class, input_ids, model_output

from hfquant import HfQuantConfig
from hfquant.core import rtn
from hfquant.nn.linear import QuantLinear


def _heavy_tailed(rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Gaussian values divided by the square root of uniform ones: a few large values per group, as in LLM weights."""
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(rows, cols, generator=generator)
        / torch.rand(rows, cols, generator=generator).clamp_min(0.05).sqrt()
    )


@pytest.mark.parametrize("bits, symmetric", [(4, False), (4, True), (8, True), (8, False)])
def test_mse_error_is_never_above_minmax_and_lower_on_heavy_tails(bits, symmetric):
    weight = _heavy_tailed()
    errors = {}
    for clipping in rtn.CLIPPING:
        q = rtn.quantize_weight(weight, bits, 32, symmetric, clipping)
        w_hat = rtn.dequantize_weight(q.q, q.scale, q.zero_point, bits, symmetric)
        errors[clipping] = (w_hat - weight).square().reshape(64, -1, 32).sum(-1)  # per (row, group)
    assert (errors["mse"] <= errors["minmax"] * (1 + 1e-6)).all()  # ratio 1.0 is min/max itself
    if bits == 4:  # at 8 bits a step is 1/255 of the range: clipping 2% of it already costs more than it saves
        assert errors["mse"].sum() < 0.95 * errors["minmax"].sum()  # heavy tails: clipping pays


def test_mse_codes_use_the_stored_format():
    weight = _heavy_tailed()
    plain, searched = (rtn.quantize_weight(weight, 4, 32, False, c) for c in rtn.CLIPPING)
    for a, b in zip(plain, searched, strict=False):
        assert a.dtype == b.dtype and a.shape == b.shape
    assert int(searched.q.max()) <= 15 and int(searched.zero_point.max()) <= 15


def test_unknown_clipping_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"clipping='p99' is not supported; allowed values are \['minmax', 'mse'\]"):
        rtn.quantize_weight(torch.randn(4, 32), 4, 32, False, "p99")
    with pytest.raises(ValueError, match="clipping='p99'"):
        HfQuantConfig(bits=4, clipping="p99")


def test_mse_checkpoint_records_clipping_and_reloads_bit_exactly(float_checkpoint, tmp_path):
    src = float_checkpoint("llama", torch.bfloat16)
    configs = {c: HfQuantConfig(bits=4, group_size=32, method="rtn", clipping=c) for c in rtn.CLIPPING}
    models = {
        c: auto_class("llama").from_pretrained(src, quantization_config=q, device_map="cpu")
        for c, q in configs.items()
    }
    layer = "model.layers.0.mlp.down_proj"
    scales = {c: m.get_submodule(layer).weight_scale for c, m in models.items()}
    assert not torch.equal(scales["mse"], scales["minmax"])  # the search chose other ranges
    model = models["mse"]
    model.save_pretrained(tmp_path)
    again = auto_class("llama").from_pretrained(tmp_path, device_map="cpu")
    assert again.config.quantization_config.clipping == "mse"
    ids = input_ids()
    assert torch.equal(model_output(again, ids), model_output(model, ids))
    assert isinstance(again.get_submodule(layer), QuantLinear)
    assert torch.equal(again.get_submodule(layer).weight_scale, scales["mse"])
