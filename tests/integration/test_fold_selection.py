"""`fold_column_scales` keeps a fold group only where it lowers the weights' reconstruction error
(`hfquant.integration.folding._fold_lowers_error`), measured in the original weight space.

Weights that already lie on a format's grid (a model dequantized from a GGUF file of that type) round-trip exactly
unfolded; a fold moves them off the grid, so it must be refused there, and the load must then give the grid back.
Weights with outlier input columns are what the fold is for: there it must be kept."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_model
from transformers import AutoModelForCausalLM

from hfquant import HfQuantConfig
from hfquant.core import blocks
from hfquant.core.blocks import legacy
from hfquant.core.format import Method, StoredFormat
from hfquant.integration import folding as integration_folding
from hfquant.integration.folding import find_blocks, plan_folds
from hfquant.nn.linear import QuantLinear
from hfquant.nn.replace import plan_layers
from hfquant.ops import balance

Q4_1 = StoredFormat.of_block("q4_1")
INT4 = StoredFormat(4, 32, False)


def _on_q4_1_grid(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (N, K) moved onto llama.cpp's Q4_1 grid: its reference quantization, dequantized."""
    return blocks.dequantize("q4_1", legacy.reference_q4_1(weight))


def _with_outlier_columns(weight: torch.Tensor) -> torch.Tensor:
    out = weight.clone()
    out[:, ::16] *= 12
    return out


def _sinq_scale(weight: torch.Tensor, group: int = 32) -> torch.Tensor:
    return balance.column_scale([weight], group)


def test_weights_on_the_grid_refuse_the_fold_and_round_trip_exactly():
    torch.manual_seed(0)
    weight = _on_q4_1_grid(torch.randn(96, 128))
    scale = _sinq_scale(_with_outlier_columns(torch.randn(96, 128)))  # far from 1: the fold moves every column
    assert scale.log().abs().max() > 0.5
    unfolded = integration_folding._reconstruction_error(weight, Q4_1, integration_folding.Transform(), "minmax", None)
    folded = integration_folding._reconstruction_error(
        weight, Q4_1, integration_folding.Transform(col_scale=scale), "minmax", None
    )
    energy = float(weight.double().square().sum())
    assert unfolded <= 1e-10 * energy  # the block search recovers the grid (min/max is one of its candidates)
    assert folded > 1e-5 * energy
    assert not integration_folding._fold_lowers_error([(weight, Q4_1, None)], scale, "minmax")


@pytest.mark.parametrize("fmt", [Q4_1, INT4], ids=["q4_1", "int4"])
def test_outlier_columns_keep_the_fold(fmt):
    torch.manual_seed(0)
    weight = _with_outlier_columns(torch.randn(96, 128))
    scale = _sinq_scale(weight)
    folded = integration_folding._reconstruction_error(
        weight, fmt, integration_folding.Transform(col_scale=scale), "minmax", None
    )
    unfolded = integration_folding._reconstruction_error(weight, fmt, integration_folding.Transform(), "minmax", None)
    assert folded < 0.9 * unfolded
    assert integration_folding._fold_lowers_error([(weight, fmt, None)], scale, "minmax")


def test_the_input_scale_weighs_the_columns():
    """A column the norm makes large counts more: the same two errors compare the other way round with it."""
    torch.manual_seed(0)
    weight = _with_outlier_columns(torch.randn(64, 128))
    scale = _sinq_scale(weight)
    fold, plain = integration_folding.Transform(col_scale=scale), integration_folding.Transform()
    alike = torch.ones(128)
    e = {
        (name, which): integration_folding._reconstruction_error(weight, INT4, t, "minmax", s)
        for name, s in (("alike", alike), ("none", None))
        for which, t in (("fold", fold), ("plain", plain))
    }
    assert e[("alike", "fold")] == pytest.approx(e[("none", "fold")], rel=1e-9)
    doubled = integration_folding._reconstruction_error(weight, INT4, plain, "minmax", 2 * alike)
    assert doubled == pytest.approx(4 * e[("none", "plain")], rel=1e-9)


def _whole_sum_rule(consumers, col_scale, input_scale=None) -> bool:
    """`_fold_lowers_error`'s rule on the whole sampled sums, without its first look at a few rows."""
    error = integration_folding._reconstruction_error
    sampled = [(*integration_folding._sampled_rows(w, rows), fmt) for w, fmt, rows in consumers]
    weights = None if input_scale is None else input_scale.double().square()
    energy = 0.0
    for w, _, _ in sampled:
        per_column = w.float().square().sum(0, dtype=torch.float64)
        energy += float((per_column * weights).sum() if weights is not None else per_column.sum())
    plain = sum(error(w, fmt, integration_folding.Transform(r, None), "minmax", input_scale) for w, r, fmt in sampled)
    if plain > integration_folding.EXACT_ENOUGH * energy:
        return True
    folded = sum(
        error(w, fmt, integration_folding.Transform(r, col_scale), "minmax", input_scale) for w, r, fmt in sampled
    )
    return folded < plain


@pytest.mark.parametrize("case", ["random", "int8", "on_grid", "grid_but_one_row", "row_scaled"])
def test_the_first_rows_decide_as_the_whole_sum_would(case):
    """The early look at `_FIRST_ROWS` sampled rows gives the whole sum's decision: far from the grid (int4, and int8
    whose error is near the bound, so the whole sum decides), on it (refused), and on it but for one late row (only
    the whole sum sees it)."""
    torch.manual_seed(0)
    fmt = StoredFormat(8, 32, False) if case == "int8" else INT4
    weight = torch.randn(256, 128)
    if case in ("on_grid", "grid_but_one_row"):
        fmt = Q4_1
        weight = _on_q4_1_grid(weight)
    if case == "grid_but_one_row":
        weight[200] = torch.randn(128) * 3  # sampled (every 4th row), after the first rows
    rows = torch.rand(256) + 0.5 if case == "row_scaled" else None
    scale = _sinq_scale(_with_outlier_columns(torch.randn(96, 128)))
    norm = torch.rand(128) + 0.5
    consumers = [(weight, fmt, rows), (torch.randn(64, 128) if case == "random" else weight[:64], fmt, None)]
    for input_scale in (None, norm):
        want = _whole_sum_rule(consumers, scale, input_scale)
        assert integration_folding._fold_lowers_error(consumers, scale, "minmax", input_scale) == want
    if case == "on_grid":
        assert not want


def test_sampled_rows_are_evenly_spaced_and_paired_with_their_row_scale():
    weight = torch.arange(1000.0).repeat_interleave(32).reshape(1000, 32)
    rows = torch.arange(1000.0) + 1
    sample, sample_rows = integration_folding._sampled_rows(weight, rows)
    assert sample.shape == (integration_folding._ERROR_ROWS, 32)
    assert torch.equal(sample[:, 0] + 1, sample_rows)
    assert sample[0, 0] == 0 and sample[-1, 0] > 1000 - 1000 / integration_folding._ERROR_ROWS - 1
    small = torch.zeros(10, 32)
    assert integration_folding._sampled_rows(small, None)[0] is small


def _grid_model():
    """A tiny Llama (widths multiples of 32) whose quantized matrices all lie on a Q4_1 grid, norms spread out."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.copy_(torch.rand(param.shape, generator=generator) * 2 + 0.1)
            elif name.endswith("proj.weight"):
                param.copy_(_on_q4_1_grid(_with_outlier_columns(param.float())))
    return model


def test_plan_on_grid_weights_folds_nothing_and_stores_rtn():
    model = _grid_model()
    config = HfQuantConfig(format="q4_1")
    plans = plan_layers(model, config, ["lm_head"])
    state = model.state_dict()
    transforms = plan_folds(model, plans, state.__getitem__, progress=False)
    layers = {m for b in find_blocks(model) for m in b if m.endswith("proj")}
    assert set(transforms) == layers  # only the Linear layers, each with an empty Transform; no norm
    assert all(t.row_scale is None and t.col_scale is None for t in transforms.values())
    every = plan_folds(model, plans, state.__getitem__, progress=False, select=False)
    assert any(t.col_scale is not None for t in every.values())  # without the test the same model folds
    assert integration_folding.fold_overrides(config, plans, transforms).keys() == layers


def test_load_of_grid_weights_gives_the_grid_back(tmp_path):
    model = _grid_model()
    model.save_pretrained(tmp_path / "src")
    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path / "src", quantization_config=HfQuantConfig(format="q4_1"), device_map="cpu"
    )
    source = model.state_dict()
    layers = {n: m for n, m in quantized.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        assert layer.format.method is Method.RTN and "weight_col_scale" not in layer._buffers
        original = source[name + ".weight"]
        error = (layer.dequantize() - original).norm() / original.norm()
        assert error < 1e-6, (name, float(error))
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(quantized.state_dict()[norm], source[norm])  # nothing moved into the norms


def test_the_error_test_quantizes_iq4_layers_with_the_configs_search(monkeypatch):
    """The error test quantizes as the load will (`iq4_search`), not with the default search."""
    model = _grid_model()
    plans = plan_layers(model, HfQuantConfig(format="iq4_nl"), ["lm_head"])
    searches = []
    original = integration_folding.quantize_to_buffers

    def recording(*args, **kwargs):
        searches.append(kwargs.get("iq4_search"))
        return original(*args, **kwargs)

    monkeypatch.setattr(integration_folding, "quantize_to_buffers", recording)
    state = model.state_dict()
    plan_folds(model, plans, state.__getitem__, progress=False, iq4_search="fast")
    assert searches and set(searches) == {"fast"}
