"""Block formats (GGUF's types) on the eager decode path of int4: a one-row call runs the block GEMV bound once
(`QuantLinear._row`), and q/k/v or gate/up of one block type run one GEMV over their concatenated rows (`hfquant.nn
.fused`; types of any block size, one C call over their own weights), in eager calls and compiled graphs alike, each
output equal to the layer's own GEMV bit for bit; saving still writes each layer's own bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfquant.core import blocks
from hfquant.core.format import StoredFormat
from hfquant.nn import fused
from hfquant.nn.linear import QuantLinear
from hfquant.ops import block_layout, native
from hfquant.ops.gemv import RowKernel
from tests.helpers import graph_ops, record_row_kernels

pytestmark = pytest.mark.skipif(
    not native.block_gemv_supported(blocks.layout("q4_k").ggml_type),
    reason="the block GEMV needs a C compiler and AVX2 or AVX512-VNNI",
)

K = 512
SIZES = (("q_proj", 256), ("k_proj", 64), ("v_proj", 96))


class Attention(nn.Module):
    """q/k/v of one block type (o_proj too, not a sibling), called as transformers' classes call them."""

    def __init__(self, name: str, v_name: str | None = None, bias: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        for attr, n in (*SIZES, ("o_proj", K)):
            fmt = StoredFormat.of_block(v_name if attr == "v_proj" and v_name else name)
            weight = torch.randn((n, K), generator=generator).to(torch.bfloat16)
            b = torch.randn((n,), generator=generator).to(torch.bfloat16) if bias else None
            setattr(self, attr, QuantLinear.from_float(weight, b, fmt))

    def members(self) -> tuple[QuantLinear, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def prepare(self) -> None:
        for layer in (*self.members(), self.o_proj):
            layer.prepare_kernel(torch.bfloat16)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _block(monkeypatch, name: str, v_name: str | None = None, bias: bool = False, link: bool = True) -> Attention:
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # read when the layers are planned: no timing in tests
    block = Attention(name, v_name, bias)
    if link:
        assert fused.link_decode_groups(block, QuantLinear) == 1
    block.prepare()
    return block


def _row(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn((*shape, K), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "iq4_xs", "hq3_0", "hq3_nl", "hq3_r"])
def test_a_block_layer_binds_its_gemv_and_gives_the_planned_paths_bytes(monkeypatch, name):
    used = record_row_kernels(monkeypatch)
    block = _block(monkeypatch, name, link=False)
    layer = block.o_proj
    assert layer.plan.row is RowKernel.BLOCK_GEMV and layer._row is not None
    x = _row(1, 1, 1)
    with torch.inference_mode():
        got = layer(x)
        planned = layer._planned_forward(x)  # LayerTensors, quantized_matmul, row_product
    assert got.shape == planned.shape == (1, 1, K)
    assert torch.equal(got, planned)
    assert used == [RowKernel.BLOCK_GEMV, RowKernel.BLOCK_GEMV]  # the bound call, then row_product's


def test_a_block_layer_with_a_column_scale_takes_the_planned_path(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    weight = torch.randn((64, K), generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    layer = QuantLinear.from_float(weight, None, StoredFormat.of_block("q4_k", method="sinq"))
    layer.prepare_kernel(torch.bfloat16)
    assert layer._buffers.get("weight_col_scale") is not None
    assert layer.plan.row is RowKernel.BLOCK_GEMV and layer._row is None  # x * c first: not a bare GEMV call


@pytest.mark.parametrize("shape", [(1, 1), (1,), ()], ids=["batch-seq", "row", "flat"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", ["q4_k", "q5_0", "iq4_nl"])
def test_fused_block_outputs_equal_each_layers_own_gemv_bit_for_bit(monkeypatch, name, bias, shape):
    block = _block(monkeypatch, name, bias=bias)
    group = block.q_proj._fused
    assert group is not None and block.o_proj._fused is None and group.scale_zero is None
    row_bytes = K // blocks.layout(name).block_size * blocks.layout(name).type_size
    assert group.weight.shape == (sum(n for _, n in SIZES), row_bytes)
    x = _row(3, *shape)
    with torch.inference_mode():
        got = block(x)
        group.dissolve()
        own = block(x)  # each member's own bound GEMV
        assert group.build()
    if not bias:  # one GEMV: the three outputs are views of one tensor
        assert len({y.untyped_storage().data_ptr() for y in got}) == 1
    for g, e, layer in zip(got, own, block.members(), strict=True):
        assert g.shape == e.shape == (*shape, layer.out_features)
        assert torch.equal(g, e)
        ggml_type = block_layout.kernel_type(name, layer.plan.block_rows)  # the R8 layout's code where it runs
        direct = native.block_gemv(x.reshape(1, K), layer.weight, K, ggml_type)  # ctypes, no module around it
        if bias:
            direct = direct + layer.bias
        assert torch.equal(g.reshape(1, -1), direct)


def _group_against_own(block, group) -> tuple:
    """The block's outputs through `group` (one row), checked equal to each layer's own GEMV (the group dissolved,
    then built again); returns the group's outputs."""
    x = _row(4, 1, 1)
    with torch.inference_mode():
        got = block(x)
        group.dissolve()
        own = block(x)
        assert group.build()
    for g, e, layer in zip(got, own, block.members(), strict=True):
        assert g.shape == e.shape == (1, 1, layer.out_features)
        assert torch.equal(g, e)
    return got


@pytest.mark.parametrize("bias", [False, True])
def test_members_of_block_types_of_one_block_size_share_one_call(monkeypatch, bias):
    """Q4_K_M's files: q and k in Q4_K, v in Q6_K (both 256-weight super-blocks). The three run one C call over their
    own weights (x quantized once), each output the bytes of its layer's own GEMV."""
    block = _block(monkeypatch, "q4_k", v_name="q6_k", bias=bias)
    group = block.q_proj._fused
    assert group is not None and block.k_proj._fused is group and block.v_proj._fused is group
    assert group.weight is None and group._types == (12, 12, 14)
    parts = group._parts  # the layers' weights, copied into consecutive byte ranges of one tensor (huge pages)
    assert all(layer.weight is part for layer, part in zip(block.members(), parts, strict=True))
    assert len({part.untyped_storage().data_ptr() for part in parts}) == 1
    assert all(a.data_ptr() + a.nbytes == b.data_ptr() for a, b in zip(parts[:-1], parts[1:], strict=True))
    got = _group_against_own(block, group)
    if not bias:
        assert len({y.untyped_storage().data_ptr() for y in got}) == 1  # one call: views of one output


@pytest.mark.parametrize("names", [("q4_k", "q8_0"), ("iq4_nl", "q5_k")], ids=["q4_k+q8_0", "iq4_nl+q5_k"])
def test_members_of_different_block_sizes_share_one_call(monkeypatch, names):
    """Q4_K (256-weight super-blocks) and Q8_0 (blocks of 32), or an IQ4_NL file's IQ4_NL q/k and Q5_K v: the C call
    quantizes the activation row once per block size; each output is the bytes of its layer's own GEMV."""
    block = _block(monkeypatch, names[0], v_name=names[1])
    group = block.q_proj._fused
    assert group is not None and block.k_proj._fused is group and block.v_proj._fused is group
    types = tuple(block_layout.kernel_type(m.plan.block, m.plan.block_rows) for m in block.members())
    assert group.weight is None and group._types == types
    got = _group_against_own(block, group)
    assert len({y.untyped_storage().data_ptr() for y in got}) == 1  # one call: views of one output


def test_fused_block_members_save_and_reload_their_own_bytes(monkeypatch, tmp_path):
    from safetensors.torch import load_file, save_file

    plain = _block(monkeypatch, "q4_k", link=False)
    block = _block(monkeypatch, "q4_k")
    group = block.q_proj._fused
    start = group.weight.data_ptr()
    row_bytes = group.weight.shape[1]
    assert [layer.weight.data_ptr() - start for layer in block.members()] == [0, 256 * row_bytes, 320 * row_bytes]
    saved, reference = block.state_dict(), plain.state_dict()
    assert saved.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(saved[key], tensor), key
        assert saved[key].untyped_storage().data_ptr() != group.weight.untyped_storage().data_ptr(), key
    save_file(saved, tmp_path / "block.safetensors")  # refuses tensors sharing memory
    reloaded = _block(monkeypatch, "q4_k")
    reloaded.load_state_dict(load_file(tmp_path / "block.safetensors"))
    assert reloaded.q_proj._fused is None  # loading leaves the group until prepared again
    reloaded.prepare()
    assert reloaded.q_proj._fused is not None
    x = _row(5, 1, 1)
    for a, b in zip(reloaded(x), block(x), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("v_name", [None, "q6_k"], ids=["q4_k", "q4_k+q6_k"])
def test_a_compiled_graph_calls_a_block_group_once_with_each_layers_bytes(monkeypatch, v_name, bias):
    block = _block(monkeypatch, "q4_k", v_name=v_name, bias=bias)
    group = block.q_proj._fused
    assert group.in_graphs
    x = _row(6, 1, 1)
    with torch.no_grad():
        expected = block(x)  # eager, fused
        group.dissolve()
        own = block(x)  # each layer's own GEMV
        assert group.build()
    outputs, ops = graph_ops(block, x)
    assert ops == ["hfquant_cpu.block_gemv_group"]
    assert group._traced is None  # the trace left nothing behind: the graph returns the three outputs only
    for got, fused_eager, alone in zip(outputs, expected, own, strict=True):
        assert torch.equal(got, fused_eager) and torch.equal(got, alone)

    group.dissolve()  # members not fused: one operator call per layer, the same bytes
    outputs, ops = graph_ops(block, x)
    assert ops == ["hfquant_cpu.block_gemv"] * 3
    for got, alone in zip(outputs, own, strict=True):
        assert torch.equal(got, alone)


def test_a_compiled_graph_whose_members_take_other_inputs_runs_their_own_calls(monkeypatch):
    """k and v called with another tensor than q's: q's call computes the group, k and v their own rows."""

    class Crossed(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, other):
            return self.inner.q_proj(x), self.inner.k_proj(other), self.inner.v_proj(other)

    block = _block(monkeypatch, "q4_k")
    x, other = _row(8, 1, 1), _row(9, 1, 1)
    with torch.no_grad():
        expected = Crossed(block)(x, other)
    torch._dynamo.reset()
    compiled = torch.compile(Crossed(block), fullgraph=True)
    with torch.no_grad():
        for got, e in zip(compiled(x, other), expected, strict=True):
            assert torch.equal(got, e)
    torch._dynamo.reset()


def test_fused_block_groups_leave_gradients_and_several_rows_to_the_per_layer_path(monkeypatch):
    block = _block(monkeypatch, "q4_k")
    x = _row(6, 1, 1)
    torch._dynamo.reset()
    needs_grad = x.clone().requires_grad_(True)
    q = block.q_proj(needs_grad)
    assert q.grad_fn is not None and block.q_proj._fused._cache is None  # the group computed nothing
    several = torch.cat([x.reshape(1, K), _row(7, 1)])  # two rows: each layer's dequantized product
    for layer in block.members():
        reference = several.float() @ layer.dequantize().T
        got = layer(several)
        torch.testing.assert_close(got.float(), reference, rtol=0, atol=0.01 * reference.abs().max().item())
    assert block.q_proj._fused._cache is None
