"""The fast IQ4_NL / IQ4_XS search (hfquant.ops.native.iq4_quantize, csrc/iq4_search_cpu.c): GGUF's bytes (gguf-py's
dequantize reads them as hfquant's does), the AVX-512, AVX2 (a child with `HFQUANT_ISA=avx2`) and portable C bodies
give the same bytes, its error stays within a stated bound of the exhaustive search's on random and real-model rows, its
breakpoint sweep ("exact") finds what a dense scan finds, its "thorough" candidates are block_quantize's default and
`iq4_search` (HfQuantConfig's field, down to quantize-on-load) selects the others."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import results_by_isa, start_by_isa

from hfquant.config import HfQuantConfig
from hfquant.core import blocks
from hfquant.core.blocks import iq4
from hfquant.ops import native

pytestmark = pytest.mark.skipif(native.built_library() is None, reason="native library unavailable here")

NAMES = ["iq4_nl", "iq4_xs"]
GGML_TYPES = {"iq4_nl": 20, "iq4_xs": 23}


KINDS = ["normal", "heavy-tailed", "ties", "tiny", "scaled ties", "subnormal", "all subnormal"]


def _rows(kind: str, rows: int = 37, k: int = 512) -> torch.Tensor:
    """`rows` rows (not a multiple of 16 blocks: a partial lane group) of normal or heavy-tailed weights, one block all
    of one sign, one zero row. "ties": grid values and midpoints between them over 64, each block's first weight
    -127 / 64, so IQ4_NL's first scale is 1 / 64 and x / d lands on midpoints (ties to the larger value) and values;
    "tiny": normal weights of standard deviation 3e-5, so the float16 scales are subnormal; "scaled ties": `_ties`;
    "subnormal": rows of zeros but for one subnormal weight (1e-42 to 1e-39, which bfloat16 holds too): the block's
    scale inverse overflows and a zero weight times it is NaN (this crashed the portable body); "all subnormal": every
    weight subnormal (1e-42 to 1e-39 of either sign), so the float16 super-block and block scales are zero, which the
    bodies reached as +0.0 or -0.0 before every zero d was written as +0.0."""
    generator = torch.Generator().manual_seed(41)
    weight = torch.randn(rows, k, generator=generator) * 0.02
    if kind == "heavy-tailed":
        weight = weight * torch.exp(1.5 * torch.randn(rows, k, generator=generator))
    if kind == "tiny":
        weight = weight * 1.5e-3
    if kind == "all subnormal":
        return (torch.rand(rows, k, generator=generator) * 2 - 1) * torch.logspace(-42, -39, rows)[:, None]
    if kind == "subnormal":
        weight = torch.zeros(rows, k)
        weight[torch.arange(rows), torch.randint(k, (rows,), generator=generator)] = torch.logspace(-42, -39, rows)
        return weight
    if kind == "scaled ties":
        return _ties(rows, k, generator)
    if kind == "ties":
        grid = torch.tensor(iq4.KVALUES, dtype=torch.float32)
        points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
        weight = points[torch.randint(len(points), (rows, k), generator=generator)] / 64
        weight[:, ::32] = -127 / 64
    weight[0, :32] = weight[0, :32].abs() + 0.1
    weight[1] = 0.0
    return weight


def _ties(rows: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """Grid values and midpoints, of either sign (zeros and -0.0 among them), times a power of two per row (2^-12 to
    2^4), each block's first weight -127 or 113 times that power: the searches' scales at factor 1 of either grid end
    put x / d exactly on midpoints (ties to the larger value), and the other candidates near them, at every
    magnitude of the keys the AVX2 body compares (csrc/iq4_search_body.h, `iq4_values2_avx2`)."""
    grid = torch.tensor(iq4.KVALUES, dtype=torch.float32)
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([0.0, -0.0])])
    weight = points[torch.randint(len(points), (rows, k), generator=generator)]
    weight = weight * torch.where(torch.rand(rows, k, generator=generator) < 0.5, -1.0, 1.0)
    ends = torch.tensor([-127.0, 113.0])[torch.randint(2, (rows, k // 32), generator=generator)]
    weight[:, ::32] = ends
    return weight * torch.exp2(torch.randint(-12, 5, (rows, 1), generator=generator).float())


def test_avx2_body_gives_the_portable_bytes_on_many_rows_of_ties():
    """The AVX2 body's nearest values in 16-bit keys of the floats' bits (csrc/iq4_search_body.h) against the portable
    body's float compares, on 512 rows of `_ties` and of normal weights at several scales: the same bytes (this
    process's AVX2 body here; a CPU with AVX-512 runs it in `test_every_body_gives_the_same_bytes`' child)."""
    if native.iq4_search_body() != "avx2":
        pytest.skip("this process runs another body; the AVX2 child covers `_rows('scaled ties')`")
    generator = torch.Generator().manual_seed(45)
    normal = torch.randn(256, 1024, generator=generator) * torch.exp2(
        torch.randint(-20, 10, (256, 1), generator=generator).float()
    )
    weights = {"ties": _ties(256, 1024, generator), "normal": normal}
    for name in NAMES:
        for kind, weight in weights.items():
            for search in native.IQ4_SEARCHES:
                settings = native.IQ4_SEARCHES[search]
                for importance in (None, torch.rand(1024, generator=generator)):
                    vector = native.iq4_quantize(name, weight, importance, settings)
                    portable = native.iq4_quantize(name, weight, importance, settings, portable=True)
                    assert torch.equal(vector, portable), f"{name} {kind} {search} importance={importance is not None}"


def _relative_error(name: str, data: torch.Tensor, weight: torch.Tensor) -> float:
    return float(((blocks.dequantize(name, data) - weight) ** 2).sum() / (weight**2).sum())


@pytest.mark.parametrize("name", NAMES)
def test_bytes_decode_with_gguf_py(name):
    gguf = pytest.importorskip("gguf")
    weight = _rows("heavy-tailed")
    data = native.iq4_quantize(name, weight)
    assert data.shape == (weight.shape[0], blocks.layout(name).row_bytes(weight.shape[1]))
    reference = gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(GGML_TYPES[name]))
    ours = blocks.dequantize(name, data)
    assert np.array_equal(reference.astype(np.float32), ours.numpy())
    assert _relative_error(name, data, weight) < 0.01  # 4-bit codes: about 0.5% of the energy on these rows


IMPORTANCE_SHAPES = [None, "per column", "per element"]


def _importance(weight: torch.Tensor, shape: str | None) -> torch.Tensor | None:
    generator = torch.Generator().manual_seed(43)
    if shape is None:
        return None
    return torch.rand(weight.shape[1] if shape == "per column" else weight.shape, generator=generator) ** 2


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("importance_shape", IMPORTANCE_SHAPES)
@pytest.mark.parametrize("search", list(native.IQ4_SEARCHES))
def test_vector_and_portable_bodies_agree(name, kind, importance_shape, search):
    weight = _rows(kind)
    importance = _importance(weight, importance_shape)
    settings = native.IQ4_SEARCHES[search]
    vector = native.iq4_quantize(name, weight, importance, settings)
    portable = native.iq4_quantize(name, weight, importance, settings, portable=True)
    assert torch.equal(vector, portable)


@pytest.mark.parametrize("k", [4096, 8192])
def test_a_per_column_importance_of_a_wide_weight_gives_the_per_element_bytes(k):
    """IQ4_XS rows 4096 or 8192 wide: the (K,) importance repeats every 16 or 32 super-blocks, so a group of 16 lanes
    reads 16 consecutive rows of it at phase 0 or 16 (csrc/iq4_search_cpu.c transposes those by the body's tiles, and
    keeps them while the phase repeats); the same values as a (rows, K) importance (read per block, a partial group
    at the end) and the portable body must give the same bytes."""
    weight = _rows("heavy-tailed", rows=21, k=k)
    column = torch.rand(k, generator=torch.Generator().manual_seed(44)) ** 2
    search = native.IQ4_SEARCHES["fast"]
    per_column = native.iq4_quantize("iq4_xs", weight, column, search)
    assert torch.equal(per_column, native.iq4_quantize("iq4_xs", weight, column.expand(21, k).contiguous(), search))
    assert torch.equal(per_column, native.iq4_quantize("iq4_xs", weight, column, search, portable=True))
    assert not torch.equal(per_column, native.iq4_quantize("iq4_xs", weight, None, search))  # the importance counts


def _every_case() -> dict:
    """{case: bytes} of every type, kind of rows, importance and search, by the body this process runs."""
    return {
        f"{name} {kind} {shape} {search}": native.iq4_quantize(
            name, _rows(kind), _importance(_rows(kind), shape), native.IQ4_SEARCHES[search]
        )
        for name in NAMES
        for kind in KINDS
        for shape in IMPORTANCE_SHAPES
        for search in native.IQ4_SEARCHES
    }


_CHILD = """
    import sys, torch
    import test_iq4_search
    from hfquant.ops import native
    torch.save({"body": native.iq4_search_body(), "bytes": test_iq4_search._every_case()}, sys.argv[1])
"""


@pytest.fixture(scope="module")
def bodies_by_isa(tmp_path_factory):
    """{HFQUANT_ISA setting: {"body": the child's body, "bytes": its `_every_case()`}} for "avx2" (the AVX2 body)
    and "generic" (the portable one), children of this process (csrc/isa_cpu.c reads the setting at load)."""
    folder = tmp_path_factory.mktemp("iq4_isa")
    return results_by_isa(start_by_isa(_CHILD, ("avx2", "generic"), folder), folder)


@pytest.mark.skipif("avx2" not in native.isa(), reason="runs the AVX2 body: needs AVX2, FMA and F16C")
@pytest.mark.parametrize("setting, body", [("avx2", "avx2"), ("generic", "portable")])
def test_every_body_gives_the_same_bytes(bodies_by_isa, setting, body):
    """The body `HFQUANT_ISA` picks (AVX2 as on a CPU without AVX-512; portable C with no vector instructions) gives
    this process's bytes (its AVX-512 body here where the CPU has it) on every case."""
    assert bodies_by_isa[setting]["body"] == body
    here = _every_case()
    got = bodies_by_isa[setting]["bytes"]
    assert got.keys() == here.keys()
    differ = [case for case in here if not torch.equal(got[case], here[case])]
    assert not differ, f"{setting}: {len(differ)} of {len(here)} cases differ, e.g. {differ[:4]}"


# The fast search against the exhaustive one (iq4_search="exhaustive", the torch codec's bytes): relative
# squared error at most this much higher. Measured: SmolLM2 / MiniLM layers +0.3-0.4% (fast), 0.00% (thorough);
# docs/performance.md, "The IQ4 search at load speed"; lean's IQ4_XS +0.25-0.27% over fast's (twenty-fourth session).
BOUND = {"fast": 1.04, "lean": 1.045, "thorough": 1.005, "exact": 1.005}


def _exhaustive(name, weight):
    return native.block_quantize(name, weight, iq4_search="exhaustive")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("search", ["fast", "lean", "thorough", "exact"])
def test_error_within_bound_of_the_exhaustive_search_on_random_rows(name, search):
    weight = _rows("normal", rows=64, k=1024)
    old = _relative_error(name, _exhaustive(name, weight), weight)
    new = _relative_error(name, native.iq4_quantize(name, weight, search=native.IQ4_SEARCHES[search]), weight)
    assert new <= BOUND[search] * old, f"{name} {search}: {new:.6f} against the exhaustive search's {old:.6f}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("search", ["fast", "lean", "thorough", "exact"])
@pytest.mark.slow  # builds the SmolLM2 fixture on first use
def test_error_within_bound_of_the_exhaustive_search_on_real_rows(name, search):
    from safetensors import safe_open

    from benchmarks.example_model import build_example_model

    folder = build_example_model()
    key = "model.layers.0.mlp.down_proj.weight"
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(str(folder / shard), "pt") as handle:
        weight = handle.get_tensor(key)[:96].float()  # (96, 1536): 256 and 32 both divide it
    old = _relative_error(name, _exhaustive(name, weight), weight)
    new = _relative_error(name, native.iq4_quantize(name, weight, search=native.IQ4_SEARCHES[search]), weight)
    assert new <= BOUND[search] * old, f"{name} {search}: {new:.6f} against the exhaustive search's {old:.6f}"


@pytest.mark.parametrize("kind", ["normal", "heavy-tailed"])
@pytest.mark.parametrize("rounds", [0, 1])
def test_breakpoint_sweep_matches_a_dense_scan(kind, rounds):
    """The sweep finds the best segment of constant codes over factors 0.8-1.2 exactly: a scan of 801 factors per
    grid end (steps of 0.0005) finds the same block scale in nearly every block (measured: all but 1 of 2048
    heavy-tailed blocks) and a lower error in none (IQ4_NL, whose error is the block stage's and the refits')."""
    weight = _rows(kind, rows=64, k=1024)
    sweep = native.iq4_quantize("iq4_nl", weight, search=native.Iq4Search(sweep=(0.8, 1.2), rounds=rounds))
    factors = np.linspace(0.8, 1.2, 801).tolist()
    scan = native.iq4_quantize("iq4_nl", weight, search=native.Iq4Search(native._both_ends(factors), rounds=rounds))
    errors = [((blocks.dequantize("iq4_nl", data) - weight) ** 2).reshape(-1, 32).sum(1) for data in (sweep, scan)]
    assert bool((errors[0] <= errors[1] * (1 + 1e-6)).all())
    same = (sweep.reshape(-1, 18) == scan.reshape(-1, 18)).all(1).float().mean()
    assert same >= 0.99, f"the sweep and the dense scan agree on {same:.3f} of the blocks"


def test_block_quantize_takes_the_thorough_search_unless_told():
    weight = _rows("normal", rows=8)
    thorough = native.iq4_quantize("iq4_xs", weight, search=native.IQ4_SEARCHES["thorough"])
    assert torch.equal(native.block_quantize("iq4_xs", weight), thorough)
    fast = native.iq4_quantize("iq4_xs", weight, search=native.IQ4_SEARCHES["fast"])
    assert torch.equal(native.block_quantize("iq4_xs", weight, iq4_search="fast"), fast)
    assert not torch.equal(fast, thorough)
    exhaustive = native.block_quantize("iq4_xs", weight, iq4_search=HfQuantConfig(iq4_search="exhaustive").iq4_search)
    assert torch.equal(exhaustive, blocks.quantize("iq4_xs", weight))
    with pytest.raises(ValueError, match="iq4_search='quick' is not allowed; use one of"):
        native.block_quantize("iq4_xs", weight, iq4_search="quick")
    with pytest.raises(ValueError, match="iq4_search='quick' is not allowed; use one of"):
        HfQuantConfig(format="iq4_xs", iq4_search="quick")


@pytest.mark.parametrize("search", ["fast", "lean", "exhaustive"])
def test_the_config_field_reaches_quantize_on_load(search):
    """`HfQuantConfig(iq4_search=...)` is saved in config.json and decides the bytes a load writes (through the
    transformers quantizer's `quantize_on_load`)."""
    from hfquant.core.format import StoredFormat
    from hfquant.integration.quantize_weights import quantize_on_load
    from hfquant.nn.linear import QuantLinear

    config = HfQuantConfig.from_dict(HfQuantConfig(format="iq4_xs", iq4_search=search).to_dict())
    assert config.iq4_search == search and config.to_dict()["iq4_search"] == search
    # rows on which every search gives other bytes than block_quantize's default ("thorough", whose choices equal the
    # exhaustive search's on 8 normal rows: only a zero scale's sign told them apart before it was made +0.0)
    weight = _rows("heavy-tailed", rows=16)
    layer = QuantLinear(512, 16, StoredFormat.of_block("iq4_xs"), False, torch.float32, "meta")
    stored, _ = quantize_on_load(layer, "l.weight", weight, None, "minmax", iq4_search=config.iq4_search)
    assert torch.equal(stored["l.weight"], native.block_quantize("iq4_xs", weight, iq4_search=search))
    assert not torch.equal(stored["l.weight"], native.block_quantize("iq4_xs", weight))


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="covers"):
        native.iq4_quantize("q4_0", torch.zeros(1, 256))
    with pytest.raises(ValueError, match="multiple of 256"):
        native.iq4_quantize("iq4_xs", torch.zeros(1, 288))
    with pytest.raises(ValueError, match="refused"):
        native.iq4_quantize("iq4_xs", torch.zeros(1, 256), search=native.Iq4Search(level_options=2))
    with pytest.raises(ValueError, match="refused"):  # more than two crossings per weight could fall in the range
        native.iq4_quantize("iq4_xs", torch.zeros(1, 256), search=native.Iq4Search(sweep=(0.8, 1.3)))
    for bad in (float("nan"), float("inf"), -float("inf")):
        weight = torch.zeros(2, 256)
        weight[1, 7] = bad
        with pytest.raises(ValueError, match="finite weights"):
            native.iq4_quantize("iq4_xs", weight)
        importance = torch.ones(256)
        importance[3] = bad
        with pytest.raises(ValueError, match="importance must be"):
            native.iq4_quantize("iq4_xs", torch.zeros(2, 256), importance)
    with pytest.raises(ValueError, match="importance must be"):
        native.iq4_quantize("iq4_xs", torch.zeros(2, 256), -torch.ones(256))


def test_out_threads_and_a_checked_weight_give_the_same_bytes():
    """`out=` (a layer's rows), `threads=` and `finite=True` (quantize-on-load checked the chunk) change where and how
    the search runs, never its bytes; a badly shaped `out` is refused naming the shape."""
    weight = torch.randn(70, 512, generator=torch.Generator().manual_seed(5)) * 0.02
    importance = torch.rand(512, generator=torch.Generator().manual_seed(6)) + 0.01
    for name in NAMES:
        expected = native.iq4_quantize(name, weight, importance)
        stored = torch.zeros(80, expected.shape[1], dtype=torch.uint8)
        got = native.block_quantize(name, weight, importance, "thorough", out=stored[5:75], threads=1, finite=True)
        assert got.data_ptr() == stored[5:75].data_ptr() and torch.equal(stored[5:75], expected)
        assert not stored[:5].any() and not stored[75:].any()
        assert torch.equal(native.iq4_quantize(name, weight, importance, threads=2), expected)
        with pytest.raises(ValueError, match=r"\(70, "):
            native.iq4_quantize(name, weight, out=stored[:69])


def test_lean_is_fast_with_one_level_per_block():
    """ "lean" keeps fast's block scales and super-block candidates and tries one 6-bit level per IQ4_XS block (the
    nearest to scale / d) instead of three: IQ4_NL's bytes are fast's, IQ4_XS's differ and err a little more (on
    SmolLM2's and MiniLM's layers 0.25-0.27%; on these heavy-tailed random rows 3.4%)."""
    fast, lean = native.IQ4_SEARCHES["fast"], native.IQ4_SEARCHES["lean"]
    assert lean == dataclasses.replace(fast, level_options=1)
    weight = _rows("heavy-tailed", rows=64, k=1024)
    assert torch.equal(
        native.iq4_quantize("iq4_nl", weight, search=lean), native.iq4_quantize("iq4_nl", weight, search=fast)
    )
    by_fast, by_lean = (native.iq4_quantize("iq4_xs", weight, search=s) for s in (fast, lean))
    assert not torch.equal(by_fast, by_lean)
    errors = [_relative_error("iq4_xs", data, weight) for data in (by_fast, by_lean)]
    assert errors[1] <= 1.05 * errors[0], errors
