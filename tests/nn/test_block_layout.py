"""A block-format layer whose one-row kernel is the block GEMV holds its weight with rows interleaved by 8 where the
R8 GEMV runs (`hfquant.ops.block_layout`, IQ4_NL, IQ4_XS and Q3_K on the AVX2 body), or IQ4_XS by 16 where the R16 GEMV
runs (AVX512-VNNI): every path that reads the bytes as stored (save, dequantize, prefill, backward, a tied embedding's
lookup, a fused group) gives what the stored layout gives, and saving writes the stored bytes exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfquant.core import blocks
from hfquant.core.format import StoredFormat
from hfquant.nn import fused
from hfquant.nn.embedding import QuantEmbedding
from hfquant.nn.linear import QuantLinear
from hfquant.ops import block_layout, native

pytestmark = pytest.mark.skipif(
    not (native.block_gemv_supported(20) and native.block_rows8_supported(20)),
    reason="the R8 GEMVs need the AVX2 body (an x86-64 CPU with AVX2 + FMA + F16C)",
)

N = 72
runs_r16 = pytest.mark.skipif(
    not native.block_rows16_supported(23), reason="the R16 GEMV needs the AVX512-VNNI body of the block GEMVs"
)
CASES = [
    ("iq4_nl", 576, "8", N),
    ("iq4_xs", 512, "8", N),
    ("q3_k", 512, "8", N),
    pytest.param("iq4_xs", 512, "16", 80, marks=runs_r16),
]
"""(type, K, HFQUANT_BLOCK_ROWS, N): each interleaved layout of each type that has one."""


def _weight(k: int, n: int = N, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, k), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _layer(monkeypatch, name: str, k: int, rows: str, n: int = N) -> QuantLinear:
    """A prepared layer of `name`, its layout forced by HFQUANT_BLOCK_ROWS=`rows` ("1" stored, "8" / "16"
    interleaved)."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # no timing in tests
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", rows)
    layer = QuantLinear.from_float(_weight(k, n), None, StoredFormat.of_block(name))
    layer.prepare_kernel(torch.bfloat16)
    assert layer.plan.block_rows == int(rows)
    return layer


def _rows(k: int, m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn((1, m, k), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize(("name", "k", "rows", "n"), CASES)
def test_the_interleaved_weight_saves_and_dequantizes_as_stored(monkeypatch, name, k, rows, n):
    stored = _layer(monkeypatch, name, k, "1", n)
    layer = _layer(monkeypatch, name, k, rows, n)
    assert not torch.equal(layer.weight, stored.weight)  # the kernel's layout is another byte order
    assert torch.equal(layer.state_dict()["weight"], stored.weight)
    assert torch.equal(layer.stored_weight(), stored.weight)
    assert torch.equal(layer.dequantize(), stored.dequantize())


@pytest.mark.parametrize(("name", "k", "rows", "n"), CASES)
def test_one_row_agrees_with_the_row_kernel_and_many_rows_are_the_same_floats(monkeypatch, name, k, rows, n):
    stored = _layer(monkeypatch, name, k, "1", n)
    layer = _layer(monkeypatch, name, k, rows, n)
    with torch.inference_mode():
        one = _rows(k, 1)
        got, want = layer(one).float(), stored(one).float()
        # the same integer dots, summed in float32 in another order, then one bfloat16 rounding each
        assert torch.allclose(got, want, rtol=2**-7, atol=1e-3 * want.abs().max().item())
        many = _rows(k, 80)  # past gemv_max_rows: the prefill's chunked dequantization, the same weights
        assert torch.equal(layer(many), stored(many))


@pytest.mark.parametrize(("name", "k", "rows", "n"), CASES)
def test_the_backward_reads_the_stored_weights(monkeypatch, name, k, rows, n):
    grads = []
    for setting in ("1", rows):
        layer = _layer(monkeypatch, name, k, setting, n)
        x = _rows(k, 3).requires_grad_(True)
        layer(x).float().square().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize(("name", "k", "rows", "n"), CASES)
def test_the_torch_readers_of_the_interleaved_bytes_give_the_stored_rows(monkeypatch, name, k, rows, n):
    stored = _layer(monkeypatch, name, k, "1", n).weight
    weight = _layer(monkeypatch, name, k, rows, n).weight
    assert torch.equal(block_layout.storage_rows(weight, k, name, int(rows), 3, 45), stored[3:45])
    assert torch.equal(block_layout.storage_rows(weight, k, name, int(rows), 0, n), stored)
    index = torch.tensor([0, 17, 71, 5, 17])
    assert torch.equal(block_layout.gather_rows(weight, k, name, int(rows), index), stored[index])


def test_loading_a_state_dict_into_an_interleaved_layer_writes_the_stored_layout(monkeypatch):
    layer = _layer(monkeypatch, "iq4_nl", 576, "8")
    other = QuantLinear.from_float(_weight(576, seed=5), None, StoredFormat.of_block("iq4_nl"))
    layer.load_state_dict(other.state_dict())
    assert layer.plan.block_rows == 1 and torch.equal(layer.weight, other.weight)
    layer.prepare_kernel(torch.bfloat16)
    assert layer.plan.block_rows == 8 and torch.equal(layer.state_dict()["weight"], other.weight)


def test_a_tied_embedding_looks_up_rows_in_the_heads_interleaved_weight(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", "8")  # R8 where the VNNI row kernels would keep the stored rows too
    table = torch.randn(N, 576, generator=torch.Generator().manual_seed(4))
    module = QuantEmbedding.from_float(table, StoredFormat.of_block("iq4_nl"))
    head = QuantLinear(576, N, StoredFormat.of_block("iq4_nl"), bias=False, dtype=torch.bfloat16, device="meta")
    head.weight = module.weight.clone()
    head.prepare_kernel(torch.bfloat16)
    assert head.plan.block_rows == 8
    ids = torch.tensor([[3, 71, 8]])
    before, one = module(ids), module(torch.tensor([[9]]))  # several rows (torch), one bfloat16 row (C)
    assert module.share_with(head) == "kernel-layout" and module.weight is head.weight
    assert torch.equal(module(ids), before) and torch.equal(module(torch.tensor([[9]])), one)
    assert torch.equal(module.state_dict()["weight"], head.stored_weight())


class _QKV(nn.Module):
    def __init__(self):
        super().__init__()
        for i, (attr, n) in enumerate((("q_proj", 64), ("k_proj", 16), ("v_proj", 24))):
            setattr(self, attr, QuantLinear.from_float(_weight(576, n, seed=i), None, StoredFormat.of_block("iq4_nl")))

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def test_a_fused_group_of_interleaved_members_gives_each_members_own_bytes(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", "8")
    block = _QKV()
    assert fused.link_decode_groups(block, QuantLinear) == 1
    for layer in (block.q_proj, block.k_proj, block.v_proj):
        layer.prepare_kernel(torch.bfloat16)
    group = block.q_proj._decode_group
    assert group.build() and group._types == (blocks.layout("iq4_nl").ggml_type | native.BLOCK_ROWS8,)
    x = _rows(576, 1)
    with torch.inference_mode():
        together = block(x)
        alone = [
            layer._row(x, layer.weight, None).view(1, 1, -1) for layer in (block.q_proj, block.k_proj, block.v_proj)
        ]
    for a, b in zip(together, alone, strict=True):
        assert torch.equal(a, b)


def test_a_bad_layout_setting_is_named(monkeypatch):
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", "4")
    with pytest.raises(ValueError, match="HFQUANT_BLOCK_ROWS='4'"):
        block_layout.rows_for("iq4_nl", 64)


@pytest.mark.parametrize(("setting", "vnni", "rows"), [("", False, 8), ("", True, 1), ("8", True, 8), ("1", False, 1)])
def test_the_vnni_row_kernels_keep_the_stored_layout_unless_r8_is_asked(monkeypatch, setting, vnni, rows):
    # where the AVX512-VNNI row kernels run, a plan keeps IQ4_NL's stored rows; HFQUANT_BLOCK_ROWS=8 interleaves anyway
    # (the R8 GEMVs run there on their AVX2 bodies, as for a model interleaved on an AVX2 CPU and pickled)
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", setting)
    monkeypatch.setattr(block_layout, "_row_kernels_preferred", lambda: vnni)
    assert block_layout.rows_for("iq4_nl", 64) == rows
    assert block_layout.rows_for("iq4_nl", 60) == 1


@runs_r16
@pytest.mark.parametrize(
    ("setting", "vnni", "rows"), [("", True, 16), ("", False, 8), ("16", False, 16), ("1", True, 1)]
)
def test_iq4_xs_takes_r16_where_the_vnni_body_runs(monkeypatch, setting, vnni, rows):
    # IQ4_XS: R16 by default where the AVX512-VNNI body runs, whole groups of 16 rows only (else the stored rows)
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", setting)
    monkeypatch.setattr(block_layout, "_row_kernels_preferred", lambda: vnni)
    assert block_layout.rows_for("iq4_xs", 64) == rows
    assert block_layout.rows_for("iq4_xs", 72) == (8 if rows == 8 else 1)
    assert block_layout.rows_for("q3_k", 64) == (1 if vnni or setting in ("1", "16") else 8)  # no R16 layout


def test_an_r8_gemv_that_disagrees_with_the_row_kernel_keeps_the_stored_layout(monkeypatch, caplog):
    real = native.block_gemv

    def wrong(x, weight, k, ggml_type):
        y = real(x, weight, k, ggml_type)
        return y * 2 if ggml_type & native.BLOCK_ROWS8 else y

    monkeypatch.setattr(native, "block_gemv", wrong)
    monkeypatch.setenv("HFQUANT_BLOCK_ROWS", "8")  # asked for, R8 is still checked first
    block_layout._rows_work.cache_clear()
    try:
        assert block_layout.rows_for("iq4_nl", 64) == 1
        assert "disagrees" in caplog.text
    finally:
        block_layout._rows_work.cache_clear()
