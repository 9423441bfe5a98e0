"""The other bodies of hfquant's dispatching C kernels, picked at load time by `HFQUANT_ISA` (csrc/isa_cpu.c), so this
AVX512-VNNI machine runs the code AVX2 CPUs run. A child process per setting computes on the inputs this process wrote
and its outputs are compared with this process's (every instruction set):
- every block type's GEMV and a fused group (blocks_cpu.c): VNNI body against AVX2 body (`HFQUANT_ISA=avx2`), bit
  for bit (the same integers, then float32 operations giving the same bfloat16 outputs), but IQ4_XS and IQ4_NL
  within a bfloat16 step (their AVX2 rows sum in another float order); on a CPU with AVX512-VBMI,
  BITALG and GFNI, the VNNI body with HQ3_R's GFNI step against the same body with its shift step
  (`HFQUANT_ISA=avx512vnni`, as Cascade Lake), bit for bit;
- the W4A8 int4 GEMV (int4_intdot_cpu.c): its AVX-512 body on the 64-row layout against its AVX2 body on the 32-row
  layout of the same weight (the AVX2 child), bit for bit (same integers, same float32 order per output);
- the bfloat16-activation int4 GEMVs: int4_cpu.c's (AVX512-BF16, exact bfloat16 inputs) against the AVX2 one
  (int16 activations) within their stated bounds;
- the int8 GEMV (int8_cpu.c): W8A16 body (VNNI) against the float body (`HFQUANT_ISA=avx512`), within the bound the
  source states (int16 rounding of each activation, then two bfloat16 roundings); against its AVX2 body
  (`HFQUANT_ISA=avx2`), bit for bit, on one-row and 4-row shapes (test_int8_gemv.py checks either against a float32
  model of the VNNI body's steps where only one exists);
- the one-query-row attention (attention_cpu.c): its AVX-512 body against its AVX2 body (`HFQUANT_ISA=avx2`) and its
  portable body (`HFQUANT_ISA=generic`), bit for bit (the same float32 operations in the same order).
- the SwiGLU product (decode_rows_cpu.c): its AVX-512 body (16 lanes) against its AVX2 and portable bodies (8 lanes),
  bit for bit (the same float32 operations lane by lane);
- the IQ4_NL / IQ4_XS search (iq4_search_cpu.c): its AVX-512 body against its AVX2 body (`HFQUANT_ISA=avx2`) and its
  portable body (`HFQUANT_ISA=generic`), the same bytes (test_iq4_search.py compares them on many more rows).
- the bfloat16 GEMV (bf16_cpu.c): its AVX512-BF16 body against its AVX2 body (`HFQUANT_ISA=avx2`), within float32
  summation error and one bfloat16 rounding each (other summation orders); the bfloat16 x float32 GEMV of the BOS
  forward: its AVX-512 body against its AVX2 and C bodies, bit for bit (the same fused multiply-adds in one order).
The children also show that the settings hold: with avx2 the AVX-512 kernels refuse, with generic every kernel refuses,
and an unknown value is named."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from helpers import results_by_isa, start_by_isa
from test_block_gemv import _random_blocks as random_blocks  # every code and scale bit pattern, finite float16s

from hfquant.core import blocks, packing, rtn
from hfquant.ops import native, torch_ops

pytestmark = pytest.mark.skipif(
    not {"avx512", "avx512_bf16", "avx512_vnni"} <= set(native.isa()),
    reason="compares the AVX-512 bodies with the others: needs AVX512-VNNI and AVX512-BF16",
)

N, K, GROUP = 64, 512, 64
INT8_LONG = (10, 8256)
"""An int8 weight whose rows go 4 at a time (K > 8192), two left over."""
K_TAIL = 576
"""An HQ3_R weight of 9 blocks per row: two groups of four and one block alone (the GEMV's last-group path)."""
GROUPS = {256: ["q2_k", "q4_k", "q6_k"], 32: ["q4_0", "q8_0", "iq4_nl"]}
"""The fused GEMVs compared: weights of one activation block size reading one x."""
ATTENTION = {
    "9x3x64": (9, 3, 64, 45),
    "8x2x72": (8, 2, 72, 19),
    "16x4x128": (16, 4, 128, 600),
    "2x1x24": (2, 1, 24, 7),
}
"""The attention shapes compared: heads, kv heads, head size, cached tokens (whole and partial groups of 8, two softmax blocks)."""


def _inputs() -> dict:
    """Everything both processes compute on (saved by this one, loaded by the child)."""
    generator = torch.Generator().manual_seed(11)
    x = (torch.randn(K, generator=generator) * torch.rand(K, generator=generator) * 4).to(torch.bfloat16)
    q = rtn.quantize_weight(torch.randn((N, K), generator=generator), 4, GROUP, False)
    codes8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    x_tail = (torch.randn(K_TAIL, generator=generator) * 3).to(torch.bfloat16)
    return {
        "x": x,
        "x_tail": x_tail,
        "hq3_r_tail": random_blocks("hq3_r", N, K_TAIL, 99),
        "blocks": {name: random_blocks(name, N, K, seed) for seed, name in enumerate(blocks.LAYOUTS)},
        "int4": {block_n: packing.CpuInt4Layout(block_n, True).pack(q.q) for block_n in (64, 32)},
        "int4_codes": q.q,
        "scale_zero": packing.scale_zero_for_int4(q.scale, q.zero_point, torch.bfloat16),
        "int8": codes8,
        "iq4_weight": torch.randn(N, K, generator=generator) * torch.exp(torch.randn(N, K, generator=generator)),
        "int8_scale": (torch.rand(N, generator=generator) * 0.01 + 1e-3).to(torch.bfloat16),
        "int8_long": (
            (torch.randn(INT8_LONG[1], generator=generator) * 3).to(torch.bfloat16),
            torch.randint(-128, 128, INT8_LONG, dtype=torch.int8, generator=generator),
            (torch.rand(INT8_LONG[0], generator=generator) * 0.01 + 1e-3).to(torch.bfloat16),
        ),
        "attention": {
            name: [
                (torch.randn(1, *shape, generator=generator) * scale).to(torch.bfloat16)
                for shape, scale in (((heads, 1, dim), 3), ((kv_heads, tokens, dim), 1), ((kv_heads, tokens, dim), 1))
            ]
            for name, (heads, kv_heads, dim, tokens) in ATTENTION.items()
        },
        "bf16_w": (torch.randn((N, K), generator=generator) * 0.1).to(torch.bfloat16),
        "bf16_bias": torch.randn(N, generator=generator).to(torch.bfloat16),
        "f32_x": torch.randn(K + 7, generator=generator),  # the bf16 x float32 GEMV's tail
        "f32_w": torch.randn((N, K + 7), generator=generator).to(torch.bfloat16),
        "swiglu": [  # 1000 values: every body's loop and its tail; gates over [-120, 120]
            (torch.randn(1000, generator=generator) * 10.0 ** torch.randint(-2, 3, (1000,), generator=generator))
            .clamp(-120, 120)
            .to(torch.bfloat16)
            for _ in range(2)
        ],
    }


def _outputs(data: dict) -> dict:
    """The GEMVs this process's instruction sets run, by name (the kernels that refuse are left out)."""
    x = data["x"]
    out = {}
    for name, weight in data["blocks"].items():
        if native.block_gemv_supported(blocks.layout(name).ggml_type):
            out[name] = native.block_gemv(x, weight, K, blocks.layout(name).ggml_type)
    if native.block_gemv_supported(blocks.layout("hq3_r").ggml_type):
        out["hq3_r_tail"] = native.block_gemv(
            data["x_tail"], data["hq3_r_tail"], K_TAIL, blocks.layout("hq3_r").ggml_type
        )
    for block, names in GROUPS.items():
        if native.block_gemv_supported(blocks.layout(names[0]).ggml_type):
            weights, types = (
                [data["blocks"][name] for name in names],
                [blocks.layout(name).ggml_type for name in names],
            )
            out[f"group{block}"] = native.block_gemv_group(x, weights, K, types)
    for block_n, weight in data["int4"].items():
        if native.int4_a8_supported(block_n):
            out[f"w4a8_{block_n}"] = native.int4_gemv_a8(x, weight, data["scale_zero"], GROUP, block_n)
    if "avx2" in native.isa():
        out["int4_avx2"] = native.int4_gemv_avx2(x, data["int4"][32], data["scale_zero"], GROUP)
    if native.int4_cpu_library() is not None:
        out["int4_bf16"] = native.int4_gemv(x, data["int4"][64], data["scale_zero"], GROUP)
    if native.int8_gemv_supported():
        out["int8"] = native.int8_gemv(x, data["int8"], data["int8_scale"])
        out["int8_long"] = native.int8_gemv(*data["int8_long"])
    try:
        out["bf16_gemv"] = native.bf16_gemv(x, data["bf16_w"], data["bf16_bias"])
    except RuntimeError:  # neither AVX512-BF16 nor AVX2 allowed: the kernel refuses
        pass
    out["bf16_f32"] = native.bf16_f32_gemv(data["f32_w"], data["f32_x"])
    out["iq4_body"] = native.iq4_search_body()
    for name in ("iq4_nl", "iq4_xs"):
        for search in ("thorough", "exact"):
            out[f"{name}_{search}"] = native.iq4_quantize(name, data["iq4_weight"], None, native.IQ4_SEARCHES[search])
    if torch_ops.loaded():
        for name, (q, k, v) in data["attention"].items():
            out[f"attention{name}"] = torch.ops.hfquant_cpu.attention_row(q, k, v, q.shape[-1] ** -0.5)
        out["swiglu"] = torch.ops.hfquant_cpu.silu_mul_row(*data["swiglu"])
    return out


_CHILD = """
    import sys, torch
    import test_isa
    from hfquant.ops import native, torch_ops
    data = torch.load(sys.argv[1])
    torch.save({"isa": native.isa(), "outputs": test_isa._outputs(data)}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """(inputs, this process's outputs, {setting: the child's result}) for HFQUANT_ISA avx2, avx512, avx512vnni and
    generic: the children run while this process computes."""
    folder = tmp_path_factory.mktemp("isa")
    data = _inputs()
    torch.save(data, folder / "inputs.pt")
    settings = ("avx2", "avx512", "avx512vnni", "generic")
    children = start_by_isa(_CHILD, settings, folder, str(folder / "inputs.pt"))
    outputs = _outputs(data)
    results = results_by_isa(children, folder, timeout=300)
    return data, outputs, results


def test_the_settings_lower_the_instruction_sets(compared):
    _, here, children = compared
    assert children["avx2"]["isa"] == ("avx2",)
    assert children["avx512"]["isa"] == ("avx2", "avx512", "avx512_bf16")
    assert children["avx512vnni"]["isa"] == ("avx2", "avx512", "avx512_bf16", "avx512_vnni")
    assert children["generic"]["isa"] == ()
    # avx2: as on a CPU without AVX-512, no int4_cpu_library kernel and no 64-row W4A8 GEMV
    assert "w4a8_64" in here and "w4a8_64" not in children["avx2"]["outputs"]
    assert "int8" not in children["generic"]["outputs"]
    assert "bf16_gemv" in children["avx2"]["outputs"] and "bf16_gemv" not in children["generic"]["outputs"]


BLOCK_OUTPUTS = [*blocks.LAYOUTS, "hq3_r_tail", *(f"group{block}" for block in GROUPS)]
IQ4_ROWS = {"iq4_xs": "iq4_xs", "iq4_nl": "iq4_nl", "group32": "iq4_nl"}
"""The outputs (or a group's part) whose AVX2 body sums in another float order than the VNNI body (blocks_body.h:
IQ4_XS's AVX2 row one int32 sum and one float product per super-block, IQ4_NL's one per block; the VNNI body one
float product per block or nibble half): the same integers, other float32 roundings, so they agree within a bfloat16
step, not bit for bit."""


def _iq4_columns(name: str) -> slice:
    """The output columns of IQ4_ROWS[name] in output `name` (a group: its weights' N rows in GROUPS' order)."""
    if not name.startswith("group"):
        return slice(None)
    at = GROUPS[int(name[len("group") :])].index(IQ4_ROWS[name])
    return slice(at * N, (at + 1) * N)


@pytest.mark.parametrize("name", BLOCK_OUTPUTS)
def test_every_block_gemv_gives_the_same_bits_in_its_avx2_body(compared, name):
    """Bit for bit, but IQ4_ROWS' columns: those within one bfloat16 step (2**-7 relative) of each other plus float32
    rounding of the products and sums in either body, (K / 32 + 16) * 2**-23 of sum |w| |x| (test_block_gemv's
    bound against the float64 product, once per body)."""
    data, here, children = compared
    want = here[name].reshape(-1)
    iq4 = torch.zeros(want.numel(), dtype=torch.bool)
    if name in IQ4_ROWS:
        iq4[_iq4_columns(name)] = True
        weight = blocks.dequantize(IQ4_ROWS[name], data["blocks"][IQ4_ROWS[name]]).double()
        magnitude = weight.abs() @ data["x"].double().abs()
    for setting in ("avx2", "avx512"):  # both lack VNNI: the AVX2 body
        got = children[setting]["outputs"][name].reshape(-1)
        assert torch.equal(got[~iq4], want[~iq4]), f"{name} {setting}: {(got.float() - want.float()).abs().max()}"
        if name in IQ4_ROWS:
            a, b = got[iq4].double(), want[iq4].double()
            bound = 2**-7 * torch.maximum(a.abs(), b.abs()) + 2 * (K / 32 + 16) * 2**-23 * magnitude
            assert ((a - b).abs() <= bound).all(), f"{name} {setting}: {((a - b).abs() - bound).max()}"


@pytest.mark.skipif(
    "avx512_vbmi_gfni" not in native.isa(), reason="compares HQ3_R's GFNI step with its shift step: needs VBMI, GFNI"
)
@pytest.mark.parametrize("name", BLOCK_OUTPUTS)
def test_every_block_gemv_gives_the_same_bits_without_gfni(compared, name):
    """HQ3_R's VNNI step here: four blocks at a time, codes by VBMI / GFNI / BITALG, each int32 lane one sub-block's
    dot (hq3r_body.h); without them one block at a time by shifts and masks, each lane 4 weights' dot, so the float32
    sums differ in order and the bfloat16 outputs must still agree (the other types: the same code either way)."""
    _, here, children = compared
    got = children["avx512vnni"]["outputs"][name]
    assert torch.equal(got, here[name]), f"{name}: {(got.float() - here[name].float()).abs().max()}"


def test_the_w4a8_gemv_gives_the_same_bits_in_its_avx2_body(compared):
    _, here, children = compared
    assert torch.equal(children["avx2"]["outputs"]["w4a8_32"], here["w4a8_64"])


@pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")
@pytest.mark.parametrize("name", ATTENTION)
def test_the_attention_gives_the_same_bits_in_its_avx2_and_portable_bodies(compared, name):
    _, here, children = compared
    for setting in ("avx2", "avx512", "generic"):  # avx512 runs the AVX-512 body too
        got = children[setting]["outputs"][f"attention{name}"]
        assert torch.equal(got, here[f"attention{name}"]), f"{name} {setting}"


@pytest.mark.skipif(not torch_ops.loaded(), reason="hfquant's operators unavailable (no C/C++ compiler)")
def test_the_swiglu_product_gives_the_same_bits_in_its_avx2_and_portable_bodies(compared):
    _, here, children = compared
    for setting in ("avx2", "avx512", "generic"):
        assert torch.equal(children[setting]["outputs"]["swiglu"], here["swiglu"]), setting


def _within(a: torch.Tensor, b: torch.Tensor, bound: torch.Tensor) -> None:
    """|a - b| <= bound + the two bfloat16 roundings (each at most 2^-8 of its value) + float32 sums (1e-5 of the
    largest output), output by output; and a != b (two computations, not one kernel called twice)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    limit = bound + 2**-8 * (a.abs() + b.abs()) + 1e-5 * a.abs().max()
    assert ((a - b).abs() <= limit).all(), ((a - b).abs() - limit).max()
    assert not torch.equal(a, b)


def test_the_bf16_activation_int4_gemvs_agree_within_their_bounds(compared):
    """int4_cpu.c sums the exact bfloat16 products in float32; the AVX2 GEMV rounds each input to int16 per block of
    32 first (at most max|x_block| / 65534): the bound is sum_k |w[n, k]| * max|x_block(k)| / 65534."""
    data, here, children = compared
    scale, zero = data["scale_zero"][..., 0].double().t(), data["scale_zero"][..., 1].double().t()  # (N, G)
    w = (data["int4_codes"].double() - 8).reshape(N, -1, GROUP) * scale[..., None] + zero[..., None]
    x_block = data["x"].double().abs().reshape(-1, 32).amax(dim=1).repeat_interleave(32)
    bound = (w.reshape(N, K).abs() * x_block).sum(dim=1) / 65534
    _within(here["int4_bf16"], children["avx2"]["outputs"]["int4_avx2"], bound)


def test_the_int8_gemv_bodies_agree_within_the_activation_rounding(compared):
    """W8A16 (VNNI) rounds each input to int16 per block of 64 (at most max|x_block| / 65534), the float body does
    not: the bound is scale[n] * sum_k |q[n, k]| * max|x_block(k)| / 65534."""
    data, here, children = compared
    x_block = data["x"].double().abs().reshape(-1, 64).amax(dim=1).repeat_interleave(64)
    bound = data["int8_scale"].double() * (data["int8"].double().abs() * x_block).sum(dim=1) / 65534
    _within(here["int8"], children["avx512"]["outputs"]["int8"], bound)


def test_the_bf16_gemv_bodies_agree_within_float32_sums(compared):
    """The AVX512-BF16 body (vdpbf16ps pairs, 2 x 16 lanes) and the AVX2 body (4 x 8 lanes) sum the same exact
    products in other orders: each within half a bfloat16 step (2^-8 relative) plus K * 2^-24 * sum |x w| of the
    exact sum, so the two at most one bfloat16 step apart (rarely: 64 outputs may all agree)."""
    data, here, children = compared
    exact = data["x"].double() @ data["bf16_w"].double().t() + data["bf16_bias"].double()
    magnitude = data["x"].double().abs() @ data["bf16_w"].double().abs().t() + data["bf16_bias"].double().abs()
    for y in (here["bf16_gemv"], children["avx2"]["outputs"]["bf16_gemv"]):
        assert ((y.double() - exact).abs() <= 2.0**-8 * exact.abs() + K * 2.0**-24 * magnitude).all()
    step = 2.0**-7 * here["bf16_gemv"].double().abs()
    assert ((children["avx2"]["outputs"]["bf16_gemv"].double() - here["bf16_gemv"].double()).abs() <= step).all()
    assert torch.equal(children["avx512"]["outputs"]["bf16_gemv"], here["bf16_gemv"])  # AVX512-BF16 still there


def test_the_bf16_f32_gemv_gives_the_same_bits_in_its_avx2_and_c_bodies(compared):
    _, here, children = compared
    for setting in ("avx2", "avx512", "generic"):
        assert torch.equal(children[setting]["outputs"]["bf16_f32"], here["bf16_f32"]), setting


def test_the_int8_gemv_gives_the_same_bits_in_its_avx2_body(compared):
    """W8A16 on K % 64 == 0: vpmaddwd's int32 sums are vpdpwssd's, the float32 steps after them the same."""
    _, here, children = compared
    for name in ("int8", "int8_long"):
        got = children["avx2"]["outputs"][name]
        assert torch.equal(got, here[name]), f"{name}: {(got.float() - here[name].float()).abs().max()}"


_PROBE = """
    import ctypes, sys
    library = ctypes.CDLL(sys.argv[1])
    print(library.hfquant_isa(), library.hfquant_int4_cpu_supported(), library.hfquant_block_gemv_supported(12),
          library.hfquant_int4_a8_supported(32), library.hfquant_int8_gemv_supported())
"""


def test_generic_refuses_every_kernel_and_a_bad_value_is_named(monkeypatch):
    """The C library alone (no torch: a fast child): generic allows nothing, so every kernel refuses; an unknown
    value gives the refused bit, which hfquant.ops.native turns into an error naming it."""
    library = native.built_library()._name
    for setting, want in (("generic", [0, 0, 0, 0, 0]), ("avx3", [native._ISA_REFUSED, 0, 0, 0, 0])):
        command = [sys.executable, "-c", textwrap.dedent(_PROBE), library]
        result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HFQUANT_ISA": setting})
        assert [int(value) for value in result.stdout.split()] == want, (setting, result.stderr[-2000:])
    monkeypatch.setenv("HFQUANT_ISA", "avx3")
    refused = types.SimpleNamespace(hfquant_isa=lambda: native._ISA_REFUSED)
    with pytest.raises(ValueError, match="HFQUANT_ISA='avx3' is not understood; use one of"):
        native._check_isa(refused)


def test_the_iq4_search_gives_the_same_bytes_in_its_avx2_and_portable_bodies(compared):
    _, here, children = compared
    bodies = {setting: children[setting]["outputs"]["iq4_body"] for setting in children}
    assert here["iq4_body"] == "avx512"
    assert bodies == {"avx2": "avx2", "avx512": "avx512", "avx512vnni": "avx512", "generic": "portable"}
    for setting in ("avx2", "generic"):
        for key in ("iq4_nl_thorough", "iq4_nl_exact", "iq4_xs_thorough", "iq4_xs_exact"):
            assert torch.equal(children[setting]["outputs"][key], here[key]), f"{key} {setting}"
