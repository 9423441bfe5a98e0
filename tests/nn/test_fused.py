"""Fused decode groups (`hfquant.nn.fused`): q/k/v and gate/up of one int4 format run one GEMV per decode row, their
outputs equal to each layer's own GEMV bit for bit; the stored tensors, the per-layer paths and torch.compile are
unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hfquant.core.format import StoredFormat
from hfquant.nn import fused
from hfquant.nn.linear import QuantLinear
from hfquant.ops import gemv, kernels, native, torch_ops
from hfquant.ops.kernels import Kernel
from tests.helpers import graph_ops

pytestmark = pytest.mark.skipif(not gemv.native_int4_works(), reason="hfquant's int4 GEMV does not run here")

K = 256
FORMAT = StoredFormat(4, 64, False)


class Attention(nn.Module):
    """The projections of a grouped-query attention block, called as transformers' classes call them."""

    def __init__(self, bias: bool = False):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        for name, n in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64), ("o_proj", K)):
            weight = torch.randn((n, K if name != "o_proj" else 128), generator=generator).to(torch.bfloat16)
            b = torch.randn((n,), generator=generator).to(torch.bfloat16) if bias else None
            setattr(self, name, QuantLinear.from_float(weight, b, FORMAT))

    def prepare(self) -> None:
        for layer in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            layer.prepare_kernel(torch.bfloat16)

    def forward(self, x):
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


def _block(monkeypatch, bias: bool = False) -> Attention:
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")  # read when the layers are planned
    block = Attention(bias)
    assert fused.link_decode_groups(block, QuantLinear) == 1
    block.prepare()
    return block


def _row(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn((*shape, K), generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _unfused(block: Attention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each projection by its own GEMV (the group dissolved), then the group built again."""
    group = block.q_proj._decode_group
    group.dissolve()
    try:
        return block(x)
    finally:
        assert group.build()


@pytest.mark.parametrize("shape", [(1, 1), (1,), ()], ids=["batch-seq", "row", "flat"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inference_mode", [False, True])
def test_fused_outputs_equal_each_layers_own_gemv_bit_for_bit(monkeypatch, shape, bias, inference_mode):
    block = _block(monkeypatch, bias)
    group = block.q_proj._fused
    assert group is not None and block.o_proj._fused is None
    with torch.inference_mode(inference_mode):
        x = _row(1, *shape)
        got = block(x)
    # one GEMV: the three outputs are views of one tensor
    assert len({y.untyped_storage().data_ptr() for y in got}) == (1 if not bias else 3)
    expected = _unfused(block, x)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape == (*shape, g.shape[-1])
        assert torch.equal(g, e)
    # and against the planned per-layer path (several rows, each its own aten product)
    many = torch.cat([x.reshape(1, K), _row(2, 1)])
    for layer, g in zip((block.q_proj, block.k_proj, block.v_proj), got, strict=True):
        torch.testing.assert_close(layer(many)[:1].float(), g.reshape(1, -1).float(), rtol=0.02, atol=0.02)


def test_the_members_weights_are_rows_of_the_groups_tensor_and_the_state_dict_is_unchanged(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    plain = Attention()
    plain.prepare()
    block = _block(monkeypatch)
    group = block.q_proj._fused
    start = group.weight.data_ptr()
    offsets = [layer.weight.data_ptr() - start for layer in (block.q_proj, block.k_proj, block.v_proj)]
    assert offsets == [0, 128 * K // 2, 192 * K // 2]  # views: no second copy of the codes
    saved, reference = block.state_dict(), plain.state_dict()
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(saved[name], tensor), name
        assert saved[name].untyped_storage().data_ptr() != group.weight.untyped_storage().data_ptr()
    reloaded = Attention()
    reloaded.load_state_dict(saved)
    fused.link_decode_groups(reloaded, QuantLinear)
    reloaded.prepare()
    assert reloaded.q_proj._fused is not None
    x = _row(3, 1, 1)
    for a, b in zip(reloaded(x), block(x), strict=True):
        assert torch.equal(a, b)


def test_loading_into_a_fused_layer_leaves_the_group(monkeypatch):
    block = _block(monkeypatch)
    x = _row(4, 1, 1)
    expected = block(x)
    block.k_proj.load_state_dict(block.k_proj.state_dict())
    assert block.q_proj._fused is None and block.k_proj._fused is None
    q, k, v = block(x)  # k unprepared: the dequantized product; q and v their own GEMVs
    assert q.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    assert torch.equal(q, expected[0]) and torch.equal(v, expected[2])
    block.k_proj.prepare_kernel(torch.bfloat16)  # every member prepared again: the group forms again
    assert block.q_proj._fused is not None
    for a, b in zip(block(x), expected, strict=True):
        assert torch.equal(a, b)


def test_siblings_called_with_other_inputs_get_their_own_product_and_the_group_stops_fusing(monkeypatch):
    block = _block(monkeypatch)
    x, other = _row(5, 1, 1), _row(6, 1, 1)
    expected_k = _unfused(block, other)[1]
    for _ in range(fused.MAX_MISSES + 2):
        block.q_proj(x)
        assert torch.equal(block.k_proj(other), expected_k)
    assert block.q_proj._fused is None  # cross-attention-like use: fusing would compute rows no one takes


def test_an_input_changed_in_place_between_siblings_is_computed_again(monkeypatch):
    block = _block(monkeypatch)
    x = _row(7, 1, 1)
    block.q_proj(x)
    x.mul_(2)
    assert torch.equal(block.k_proj(x), _unfused(block, x)[1])


def test_a_swapped_weight_is_read_not_the_groups_copy(monkeypatch):
    """What an offloading hook does between calls: another tensor in the member's `_buffers`."""
    block = _block(monkeypatch)
    x = _row(8, 1, 1)
    expected = block(x)
    block.k_proj._buffers["weight"] = block.k_proj.weight.clone()
    for a, b in zip(block(x), expected, strict=True):
        assert torch.equal(a, b)
    assert block.q_proj._fused is None


def test_gradients_and_compiled_graphs_take_the_per_layer_path(monkeypatch):
    block = _block(monkeypatch)
    x = _row(9, 1, 1)
    expected = _unfused(block, x)
    needs_grad = x.clone().requires_grad_(True)
    q = block.q_proj(needs_grad)
    assert q.grad_fn is not None and block.q_proj._fused._cache is None
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        for a, b in zip(compiled(x), expected, strict=True):
            assert torch.equal(a, b)
    torch._dynamo.reset()


def test_members_of_different_formats_are_not_grouped():
    generator = torch.Generator().manual_seed(0)
    parent = nn.Module()
    parent.gate_proj = QuantLinear.from_float(torch.randn((128, K), generator=generator), None, FORMAT)
    parent.up_proj = QuantLinear.from_float(torch.randn((128, K), generator=generator), None, StoredFormat(8, K, True))
    assert fused.link_decode_groups(parent, QuantLinear) == 0


def test_a_pickled_layer_binds_its_own_gemv(monkeypatch, tmp_path):
    block = _block(monkeypatch)
    x = _row(10, 1, 1)
    expected = block(x)
    torch.save(block, tmp_path / "block.pt")
    copy = torch.load(tmp_path / "block.pt", weights_only=False)
    assert copy.q_proj._row is not None and copy.q_proj._fused is None
    for a, b in zip(copy(x), expected, strict=True):
        assert torch.equal(a, b)


def _prepared_together(monkeypatch, dtype: torch.dtype = torch.bfloat16) -> tuple[Attention, list]:
    """A block whose group's members are prepared by `DecodeGroup.prepare` (as a load prepares them), and the `out`
    each `native.int4_repack` call into the kernel layout was given."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    block = Attention()
    fused.link_decode_groups(block, QuantLinear)
    outs = []
    repack = native.int4_repack

    def recorded(weight, to_cpu_layout, out=None):
        if to_cpu_layout:  # into the kernel layout (not a stored layout given back)
            outs.append(out)
        return repack(weight, to_cpu_layout, out)

    monkeypatch.setattr(native, "int4_repack", recorded)
    assert block.q_proj._decode_group.prepare(dtype) == [Kernel.INT4PACK_MM_CPU] * 3
    block.o_proj.prepare_kernel(dtype)
    return block, outs


def _members(block: Attention) -> tuple[QuantLinear, ...]:
    return block.q_proj, block.k_proj, block.v_proj


def test_members_prepared_together_are_repacked_straight_into_the_groups_tensor(monkeypatch):
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    plain = Attention()  # no group: each layer its own GEMV
    plain.prepare()
    block, outs = _prepared_together(monkeypatch)
    group = block.q_proj._fused
    assert group is not None and group.weight.shape == (256, K // 2)
    # each member's repack wrote its rows of the group's tensor: nothing concatenated afterwards
    assert [out.data_ptr() == layer.weight.data_ptr() for out, layer in zip(outs, _members(block), strict=False)] == [
        True
    ] * 3
    assert outs[3] is None  # o_proj: a tensor of its own
    start, storage = group.weight.data_ptr(), group.weight.untyped_storage().data_ptr()
    assert [layer.weight.data_ptr() - start for layer in _members(block)] == [0, 128 * K // 2, 192 * K // 2]
    assert all(layer.weight.untyped_storage().data_ptr() == storage for layer in _members(block))
    saved, reference = block.state_dict(), plain.state_dict()
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(saved[name], tensor), name
    x = _row(11, 1, 1)
    got = block(x)
    assert len({y.untyped_storage().data_ptr() for y in got}) == 1  # one GEMV
    for g, e in zip(got, plain(x), strict=True):
        assert torch.equal(g, e)
    weight = group.weight
    for g, e in zip(got, _unfused(block, x), strict=True):  # dissolved, then built again
        assert torch.equal(g, e)
    assert block.q_proj._fused.weight is weight  # the members' rows still in one tensor: nothing copied
    block.q_proj.decode_activations = "float"  # the same plan (a load sets it on every layer): the group stays
    assert block.q_proj._fused is group and group.weight is weight


def test_members_that_will_not_share_a_gemv_are_prepared_each_into_its_own_tensor(monkeypatch):
    """float32 activations: (scale, zero) pairs in float32, no bound GEMV, so no group tensor to repack into."""
    block, outs = _prepared_together(monkeypatch, torch.float32)
    assert outs == [None] * 4 and block.q_proj._fused is None
    pointers = {layer.weight.untyped_storage().data_ptr() for layer in _members(block)}
    assert len(pointers) == 3
    x = _row(12, 1, 1).float()
    plain = Attention()
    plain.prepare()
    for layer, reference in zip(_members(block), _members(plain), strict=True):
        reference.prepare_kernel(torch.float32)
        assert torch.equal(layer(x), reference(x))


def test_a_built_group_prepared_again_repacks_into_a_new_tensor_with_the_same_outputs(monkeypatch):
    block, outs = _prepared_together(monkeypatch)
    x = _row(13, 1, 1)
    expected = block(x)
    old = block.q_proj._fused.weight
    block.k_proj.load_state_dict(block.k_proj.state_dict())  # k unprepared, q and v still views of `old`
    assert block.q_proj._decode_group.prepare(torch.bfloat16) == [Kernel.INT4PACK_MM_CPU] * 3
    group = block.q_proj._fused
    assert group is not None and group.weight.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
    assert [
        out.data_ptr() == layer.weight.data_ptr() for out, layer in zip(outs[4:], _members(block), strict=True)
    ] == [True] * 3
    for a, b in zip(block(x), expected, strict=True):
        assert torch.equal(a, b)


def test_prepare_packed_int4_writes_into_out_on_either_path():
    generator = torch.Generator().manual_seed(14)
    for n in (64, 48):  # the native pass (N % 64 == 0), and unpacked codes then a copy
        packed = torch.randint(0, 256, (n, K // 2), dtype=torch.uint8, generator=generator)
        expected = kernels.prepare_packed_int4(Kernel.INT4PACK_MM_CPU, packed, K)
        rows = torch.zeros((n + 16, K // 2), dtype=torch.uint8)
        got = kernels.prepare_packed_int4(Kernel.INT4PACK_MM_CPU, packed, K, out=rows[16:])
        assert got.data_ptr() == rows[16:].data_ptr() and torch.equal(got, expected)
        assert not rows[:16].any()  # nothing written outside `out`
        with pytest.raises(RuntimeError, match="out must be a contiguous"):
            kernels.prepare_packed_int4(Kernel.INT4PACK_MM_CPU, packed, K, out=rows[:n, :-1])
    with pytest.raises(ValueError, match="out= is for"):
        kernels.prepare_packed_int4(Kernel.DEQUANT, packed, K, out=rows[:n])


@pytest.mark.skipif(not torch_ops.loaded(), reason="the dispatcher operators do not build here")
@pytest.mark.parametrize("bias", [False, True])
def test_a_compiled_graph_calls_an_int4_group_once_with_each_layers_bytes(monkeypatch, bias):
    block = _block(monkeypatch, bias)
    group = block.q_proj._fused
    assert group.in_graphs and block.q_proj.plan.compiled_row is block.q_proj.plan.row
    x = _row(6, 1, 1)
    with torch.no_grad():
        expected = block(x)  # eager, fused
        own = _unfused(block, x)  # each layer's own GEMV
    outputs, ops = graph_ops(block, x)
    assert ops == [f"hfquant_cpu.{block.q_proj.plan.row.value}"]
    assert group._traced is None  # the trace left nothing behind: the graph returns the three outputs only
    for got, fused_eager, alone in zip(outputs, expected, own, strict=True):
        assert torch.equal(got, fused_eager) and torch.equal(got, alone)

    group.dissolve()  # members not fused: one operator call per layer, the same bytes
    outputs, ops = graph_ops(block, x)
    assert len(ops) == 3
    for got, alone in zip(outputs, own, strict=True):
        assert torch.equal(got, alone)
