"""The quantizer's hooks called directly: the `LoadPlan` its pre-load hook builds for a tiny model (skipped modules,
layer formats, ties, dtype adapters), the `LoadReport` its weight op fills during a load (quantized keys), and the
error path (a failure the op records, raised by name once loading is over)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import auto_class, tiny_config, tiny_model
from transformers import AutoModelForCausalLM
from transformers.quantizers.base import HfQuantizer

import hfquant.integration.quantizer as quantizer_module
from hfquant import HfQuantConfig, QuantLinear
from hfquant.core import huge_pages
from hfquant.core.format import Method, StoredFormat
from hfquant.integration.load_plan import LoadPlan
from hfquant.integration.load_report import LoadReport
from hfquant.integration.quantize_weights import GroupRows
from hfquant.integration.quantizer import HfQuantQuantizer
from hfquant.nn import fused
from hfquant.nn.embedding import QuantEmbedding
from hfquant.ops import gemv, native

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def _meta_model(arch: str):
    with torch.device("meta"):
        return auto_class(arch).from_config(tiny_config(arch))


def _prepared(arch: str, config: HfQuantConfig, pre_quantized: bool = False):
    """(quantizer, meta-device model) after the pre-load hook, called as `from_pretrained` calls it."""
    quantizer = HfQuantQuantizer(config, pre_quantized=pre_quantized)
    model = _meta_model(arch)
    quantizer.preprocess_model(model=model, dtype=torch.float32, device_map={"": "cpu"}, checkpoint_files=None)
    return quantizer, model


def _own_fields(quantizer: HfQuantQuantizer) -> set[str]:
    """The instance fields the quantizer sets beyond those of transformers' `HfQuantizer.__init__`."""

    class Base(HfQuantizer):  # transformers' base class with its abstract capabilities filled in
        is_serializable = is_trainable = False

    base = Base(quantizer.quantization_config, pre_quantized=quantizer.pre_quantized)
    return set(vars(quantizer)) - set(vars(base))


# -- the plan ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", [{}, {"lm_head": "keep"}], ids=["default-lm_head", "keep"])
def test_the_plan_of_a_tiny_llama_names_the_skipped_modules_and_each_layer_format(head):
    config = HfQuantConfig(
        bits=4, group_size=32, mixed_precision="none", modules_to_not_convert=["layers.1.mlp"], **head
    )
    quantizer, model = _prepared("llama", config)
    plan = quantizer.plan
    assert "lm_head" in plan.skip and "layers.1.mlp" in plan.skip  # transformers' default and the user's
    formats = {layer.name: layer.format for layer in plan.layers}
    int4_g32 = StoredFormat(4, 32, False, Method.SINQ)  # the 4-bit default method
    for i in range(2):
        for name in ATTENTION:
            assert formats[f"model.layers.{i}.self_attn.{name}"] == int4_g32
    assert formats["model.layers.0.mlp.down_proj"] == int4_g32
    assert formats["model.layers.1.mlp.down_proj"] is None
    # the 4-bit default's lm_head: int8 per channel (64 inputs), RTN; "keep": float
    assert formats["lm_head"] == (None if head else StoredFormat(8, 64, True, Method.RTN))
    reasons = {layer.name: layer.reason for layer in plan.layers}
    assert reasons["model.layers.1.mlp.gate_proj"] == "modules_to_not_convert"
    assert plan.ties == [] and plan.embeddings == {} and plan.adapters == {}
    assert plan.compute_dtype == torch.float32
    # the model is what the plan says
    quantized = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    assert quantized == {name for name, fmt in formats.items() if fmt is not None}


def test_planning_does_not_change_the_model():
    """`_plan` only decides: the swaps are `apply_plan`'s."""
    quantizer = HfQuantQuantizer(HfQuantConfig(bits=8, embedding_dtype="int8"), pre_quantized=False)
    model = _meta_model("llama_tied")
    before = {name: type(module) for name, module in model.named_modules()}
    plan = quantizer._plan(model, torch.float32, [], None)
    assert isinstance(plan, LoadPlan) and plan.ties and any(layer.format for layer in plan.layers)
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_a_lm_head_tied_to_a_quantized_embedding_is_planned_as_a_tie():
    quantizer, model = _prepared("llama_tied", HfQuantConfig(bits=8, embedding_dtype="int8"))
    plan = quantizer.plan
    assert plan.ties == [("lm_head", "model.embed_tokens")]
    assert list(plan.embeddings) == ["model.embed_tokens"] and plan.embeddings["model.embed_tokens"].bits == 8
    assert "lm_head" not in {layer.name for layer in plan.layers}  # swapped by the tie, not as a layer
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.model.embed_tokens, QuantEmbedding)
    assert "lm_head.weight" not in model.all_tied_weights_keys  # the tie is hfquant's now


def test_an_untied_quantized_lm_head_is_planned_as_a_layer():
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8, lm_head="int4"))
    head = next(layer for layer in quantizer.plan.layers if layer.name == "lm_head")
    assert head.format is not None and head.format.bits == 4
    assert quantizer.plan.ties == []
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.bits == 4


def test_float_embeddings_in_another_dtype_are_cast_and_get_adapters():
    quantizer, model = _prepared("llama_tied", HfQuantConfig(bits=8, embedding_dtype="bfloat16"))
    plan = quantizer.plan
    assert plan.casts == {"model.embed_tokens": torch.bfloat16}
    assert plan.adapters == {"model.embed_tokens": (torch.bfloat16, False), "lm_head": (torch.bfloat16, True)}
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert quantizer.quantization_config.compute_dtype == "float32"  # recorded so that a reload restores it


def test_conflicting_formats_for_one_tied_tensor_are_refused_while_planning():
    with pytest.raises(ValueError, match="lm_head='int4' and embedding_dtype='int8' conflict"):
        _prepared("llama_tied", HfQuantConfig(bits=8, lm_head="int4", embedding_dtype="int8"))


@pytest.mark.parametrize(
    ("arch", "config", "one_off"),
    [("llama", "lm_head", "lm_head"), ("llama_tied", "embedding_dtype", "model.embed_tokens")],
)
def test_the_spares_first_maps_are_the_stored_weights_of_a_size_of_their_own(arch, config, one_off):
    """`_one_off_stored_bytes`: the untied lm_head's or the tied embedding's int8 weight, whose size no other module's
    stored weight has (the decoder layers repeat theirs)."""
    quantizer, model = _prepared(arch, HfQuantConfig(bits=8, **{config: "int8"}))
    module = model.get_submodule(one_off)
    stored = (module.weight, module.weight_scale)
    assert quantizer_module._one_off_stored_bytes(model, quantizer.plan) == tuple(t.nbytes for t in stored)


def test_the_allocations_counted_for_the_spares_are_those_the_load_makes(tmp_path, monkeypatch):
    """`stored_allocations`, from which `_one_off_stored_bytes` picks the spares' first maps, gives the sizes that a
    quantize-on-load asks `huge_pages.empty` for: on a one-layer Llama the weights of q/k and gate/up as one tensor
    per group (`GroupRows`; their members' own sizes are never asked), every other layer's stored tensors."""
    tiny_model("llama", num_hidden_layers=1).save_pretrained(tmp_path)
    counted, asked, loading = [], [], [True]
    real_empty, real_counted = huge_pages.empty, quantizer_module.stored_allocations

    def empty(shape, dtype, device=None):
        if loading[0] and torch.device(device or "cpu").type == "cpu":  # not the meta skeleton's
            asked.append(math.prod(shape) * dtype.itemsize)
        return real_empty(shape, dtype, device)

    def stored_allocations(modules):
        counted.extend(real_counted(modules))
        return counted

    after = HfQuantQuantizer._process_model_after_weight_loading

    def after_loading(self, *args, **kwargs):
        loading[0] = False  # the kernels' own copies are not the load's stored tensors
        return after(self, *args, **kwargs)

    monkeypatch.setattr(huge_pages, "empty", empty)
    monkeypatch.setattr(quantizer_module, "stored_allocations", stored_allocations)
    monkeypatch.setattr(HfQuantQuantizer, "_process_model_after_weight_loading", after_loading)
    config = HfQuantConfig(bits=4, format="int", group_size=32, fold_column_scales=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map="cpu")
    members = model.model.layers[0].self_attn.q_proj._decode_group.members
    weights = [math.prod(m.format.tensor_specs((m.out_features,), m.in_features)["weight"][1]) for m in members]
    assert len(members) > 1 and sum(weights) in counted  # int4: a byte per two codes, one tensor for the group
    assert sorted(counted) == sorted(asked)


def test_folds_given_to_the_constructor_are_the_plan_s():
    folds = {"model.layers.0.mlp.up_proj": object()}
    quantizer = HfQuantQuantizer(HfQuantConfig(bits=8), folds=folds, pre_quantized=False)
    assert quantizer.plan.folds == folds
    assert quantizer.param_needs_quantization(None, "model.layers.0.mlp.up_proj.bias")


# -- the report ----------------------------------------------------------------------------------------------------


def test_the_report_after_a_load_holds_every_quantized_key(float_checkpoint, monkeypatch):
    started = []
    start = huge_pages.Spares.start
    monkeypatch.setattr(
        huge_pages.Spares, "start", lambda budget, first=(): started.append(start(budget, first)) or started[-1]
    )
    model = auto_class("llama").from_pretrained(
        float_checkpoint("llama"), quantization_config=HfQuantConfig(bits=8), device_map="cpu"
    )
    quantizer = model.hf_quantizer
    layers = {name for name, module in model.named_modules() if isinstance(module, QuantLinear)}
    assert len(layers) == 14
    assert quantizer.report.quantized_keys == {f"{name}.weight" for name in layers}
    assert quantizer.report.failed == {} and quantizer.report.out_of_memory == []
    if huge_pages._AVAILABLE:  # the spare weight maps made beside the load are freed with it, and let go
        assert len(started) == 1 and started[0]._closed and started[0]._held == 0
        assert huge_pages._spares is None and quantizer.report.spares is None
    assert {layer.name for layer in quantizer.plan.layers if layer.format is not None} == layers
    assert len(_own_fields(quantizer)) <= 4, _own_fields(quantizer)
    # attention_requested: whether from_pretrained named an attn_implementation (then the one-row attention stays off)
    assert _own_fields(quantizer) == {"plan", "report", "attention_requested"}


def test_the_pre_load_hook_starts_the_spares_before_it_folds_the_first_block(float_checkpoint, monkeypatch):
    """The spares' first maps are made while the first block is folded (`FoldStream.fold_first`, on the hook's
    thread), and both before the weights stream in."""
    events = []
    start, fold_first = huge_pages.Spares.start, quantizer_module.FoldStream.fold_first
    convert = quantizer_module.HfQuantQuantize.convert
    monkeypatch.setattr(
        huge_pages.Spares, "start", lambda *args, **kwargs: events.append("spares") or start(*args, **kwargs)
    )
    monkeypatch.setattr(
        quantizer_module.FoldStream, "fold_first", lambda self: events.append("fold") or fold_first(self)
    )
    monkeypatch.setattr(
        quantizer_module.HfQuantQuantize,
        "convert",
        lambda self, *a, **k: events.append("convert") or convert(self, *a, **k),
    )
    auto_class("llama").from_pretrained(
        float_checkpoint("llama"),
        quantization_config=HfQuantConfig(bits=4, group_size=32, fold_column_scales=True),
        device_map="cpu",
    )
    assert events[:3] == ["spares", "fold", "convert"], events[:5]


def test_the_weight_op_records_each_quantized_tensor_and_passes_the_others():
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8))
    op = quantizer.get_quantize_ops()
    key = "model.layers.0.self_attn.q_proj.weight"
    stored = op.convert({key: torch.randn(64, 64), "model.norm.weight": torch.ones(64)}, model=model)
    assert set(stored) == {key, key + "_scale", "model.norm.weight"}  # symmetric int8: no zero point
    assert stored[key].dtype == torch.int8 and torch.equal(stored["model.norm.weight"], torch.ones(64))
    assert quantizer.report.quantized_keys == {key}


class _Pages:
    """A `PageReleaser` that records what the weight op consumes."""

    def __init__(self):
        self.consumed = []

    def consume(self, address, nbytes):
        self.consumed.append((address, nbytes))
        return nbytes

    def read(self, nbytes, copied=True):
        return 0


def test_the_weight_op_consumes_the_checkpoint_views_of_the_weights_it_quantized():
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8))
    quantizer.report.pages = pages = _Pages()
    op = quantizer.get_quantize_ops()
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    layers = [model.get_submodule(name.rpartition(".")[0]) for name in (q, k)]
    rows, k_shape = ((layer.out_features, layer.in_features) for layer in layers)
    view = torch.randn(2, *rows)[1]  # a view, as transformers reads a tensor of the load's dtype from the map
    norm = torch.ones(2, 64)[0]
    op.convert({q: view, "model.norm.weight": norm, k: torch.randn(k_shape)}, model=model)
    assert pages.consumed == [(view.data_ptr(), view.nbytes)]  # not the norm (kept), not the copy (k_proj)


def test_a_source_that_a_stored_tensor_shares_is_not_consumed():
    pages = _Pages()
    source = torch.randn(4, 64, 64)[1]
    quantizer_module._consume_source(pages, source, [torch.zeros(3), source[2:]])
    quantizer_module._consume_source(pages, source.t(), [torch.zeros(3)])  # not contiguous: its span is not its bytes
    assert pages.consumed == []
    quantizer_module._consume_source(pages, source, [torch.zeros(3)])
    assert pages.consumed == [(source.data_ptr(), 64 * 64 * 4)]


# -- preparing the kernels -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not gemv.native_int4_works(), reason="hfquant's int4 GEMV does not run here")
def test_quantize_on_load_repacks_the_weights_it_wrote_in_place(float_checkpoint, monkeypatch):
    """Quantizing on load, a decode group's codes are written into consecutive rows of one tensor (`GroupRows`) and
    every weight the load quantized is repacked where it is (no second tensor): the same state dict and logits as a
    load that gives each weight a tensor of its own and repacks into new ones."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    source = float_checkpoint("llama", torch.bfloat16, **shape)
    config = HfQuantConfig(bits=4, group_size=64, method="rtn", mixed_precision="none")
    calls = []
    repack = native.int4_repack

    def recorded(weight, to_cpu_layout, out=None):
        if to_cpu_layout:
            calls.append((weight.data_ptr(), None if out is None else out.data_ptr()))
        return repack(weight, to_cpu_layout, out)

    monkeypatch.setattr(native, "int4_repack", recorded)
    model = auto_class("llama").from_pretrained(source, quantization_config=config)
    assert len(calls) == 14 and all(weight == out for weight, out in calls)  # 7 layers a block, each in place
    for layer in model.model.layers:
        for members in (
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            (layer.mlp.gate_proj, layer.mlp.up_proj),
        ):
            group = members[0]._fused
            assert group is not None and group.weight.data_ptr() == members[0].weight.data_ptr()
    assert model.hf_quantizer.report.rows is not None and not model.hf_quantizer.report.rows._tensors
    calls.clear()
    monkeypatch.setattr(GroupRows, "weight_out", lambda rows, module, device: None)
    monkeypatch.setattr(HfQuantQuantizer, "_own_weights", lambda quantizer: set())
    apart = auto_class("llama").from_pretrained(source, quantization_config=config)
    assert len(calls) == 14 and all(weight != out for weight, out in calls)
    saved, reference = model.state_dict(), apart.state_dict()
    assert saved.keys() == reference.keys()
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.items())
    ids = torch.tensor([[1, 50, 90, 120]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, apart(ids).logits)


@pytest.mark.skipif(not gemv.native_int4_works(), reason="hfquant's int4 GEMV does not run here")
def test_a_reload_repacks_each_fused_groups_members_straight_into_its_tensor(float_checkpoint, tmp_path, monkeypatch):
    """#28: the q/k/v and gate/up members of a reloaded int4 model are repacked into their rows of the group's tensor
    (each code byte written once), with the logits and the state dict of members concatenated after their repack."""
    monkeypatch.setenv("HFQUANT_KERNEL_CHOICE", "native")
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
    source = float_checkpoint("llama", torch.bfloat16, **shape)
    config = HfQuantConfig(bits=4, group_size=64, method="rtn", mixed_precision="none")
    auto_class("llama").from_pretrained(source, quantization_config=config).save_pretrained(tmp_path / "int4")
    outs = []
    repack = native.int4_repack

    def recorded(weight, to_cpu_layout, out=None):
        if to_cpu_layout:
            outs.append(out)
        return repack(weight, to_cpu_layout, out)

    monkeypatch.setattr(native, "int4_repack", recorded)
    model = auto_class("llama").from_pretrained(tmp_path / "int4")
    repacked_into = {out.data_ptr() for out in outs if out is not None}
    for layer in model.model.layers:
        for members in (
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            (layer.mlp.gate_proj, layer.mlp.up_proj),
        ):
            group = members[0]._fused
            assert group is not None and group.members == list(members)
            assert all(member.weight.data_ptr() in repacked_into for member in members)
            assert group.weight.data_ptr() == members[0].weight.data_ptr()
    monkeypatch.setattr(fused.DecodeGroup, "_rows", lambda group, dtype, in_place=False: None)  # each its own, a cat
    concatenated = auto_class("llama").from_pretrained(tmp_path / "int4")
    assert concatenated.model.layers[0].self_attn.q_proj._fused is not None
    saved, reference = model.state_dict(), concatenated.state_dict()
    assert saved.keys() == reference.keys()
    assert all(torch.equal(saved[name], tensor) for name, tensor in reference.items())
    ids = torch.tensor([[1, 50, 90, 120]])
    with torch.no_grad():
        first, second = (
            model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True),
            concatenated.generate(
                ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True
            ),
        )
    for a, b in zip(first.logits, second.logits, strict=True):
        assert torch.equal(a, b)


# -- the error path ------------------------------------------------------------------------------------------------


def test_a_tensor_that_fails_is_recorded_then_raised_by_name_after_loading():
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8))
    key = "model.layers.0.mlp.down_proj.weight"
    weight = torch.randn(64, 128)
    weight[3, 5] = float("nan")
    assert quantizer.get_quantize_ops().convert({key: weight}, model=model) == {}
    assert list(quantizer.report.failed) == [key] and "NaN" in quantizer.report.failed[key]
    with pytest.raises(ValueError, match=rf"could not quantize {key}: .*NaN.*modules_to_not_convert=\['model"):
        quantizer._process_model_after_weight_loading(model)


def test_running_out_of_memory_is_recorded_then_raised_as_a_memory_error(monkeypatch):
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8))

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(quantizer_module, "quantize_on_load", no_memory)
    key = "model.layers.1.self_attn.v_proj.weight"
    quantizer.get_quantize_ops().convert({key: torch.randn(32, 64)}, model=model)
    assert quantizer.report.out_of_memory == [key]
    with pytest.raises(MemoryError, match=rf"out of memory while quantizing {key} \(1 tensor\(s\)\).*hfquant convert"):
        quantizer._process_model_after_weight_loading(model)


def test_a_layer_the_checkpoint_never_provided_is_refused_after_loading():
    quantizer, model = _prepared("llama", HfQuantConfig(bits=8))
    quantizer.get_quantize_ops().convert({"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64)}, model=model)
    with pytest.raises(ValueError, match=r"the checkpoint has no tensor for model\.layers\.0\.mlp\.down_proj\.weight"):
        quantizer._process_model_after_weight_loading(model)


def test_the_report_raises_out_of_memory_before_other_failures():
    report = LoadReport(failed={"a.weight": "holds NaN"}, out_of_memory=["b.weight"])
    with pytest.raises(MemoryError, match="b.weight"):
        report.raise_failures()
    report.out_of_memory.clear()
    with pytest.raises(ValueError, match=r"a\.weight: holds NaN \(1 tensor\(s\) failed: \['a\.weight'\]\)"):
        report.raise_failures()
    LoadReport(quantized_keys={"a.weight"}).raise_missing(["a.weight"])  # complete: nothing raised
