"""benchmarks/paired.py: the rounds, their ratios and targets with stand-in workers that speak the protocol, and the
hfquant worker itself on a tiny checkpoint. No timing is asserted: the stand-ins print fixed rates."""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter

import pytest
import torch
from helpers import MERGES_VOCAB, TOKENIZER_VOCAB, tiny_model, tiny_tokenizer

from benchmarks import benchmark, llama_cpp, paired


def _stand_in(rates: list[float], fail_at: int | None = None, error_at_start: bool = False) -> list[str]:
    """A worker that answers the i-th request with rates[i] (cycling), and exits instead of answering request
    `fail_at`."""
    code = f"""
import sys
from collections import Counter
rates, fail_at = {rates!r}, {fail_at!r}
print("loading...", flush=True)
if {error_at_start!r}:
    print("ERROR ValueError: no such model", flush=True)
    sys.exit(1)
print("READY", flush=True)
for i, _ in enumerate(sys.stdin):
    if i == fail_at:
        sys.exit(3)
    print("TOK_S", rates[i % len(rates)], flush=True)
"""
    return [sys.executable, "-c", code]


def test_rounds_rotate_the_order_and_pair_per_round(tmp_path):
    probes = []

    def probe():
        probes.append(len(probes))
        return 40.0 + len(probes)

    engines = {"mine": (_stand_in([30.0, 36.0, 24.0]), None), "theirs": (_stand_in([25.0, 24.0, 30.0]), None)}
    result = paired.run_rounds(engines, rounds=3, timeout=60, log_dir=tmp_path, probe=probe)
    assert result["error"] is None and result["engines"] == ["mine", "theirs"]
    assert [r["order"] for r in result["rounds"]] == [["mine", "theirs"], ["theirs", "mine"], ["mine", "theirs"]]
    assert [r["read_gbs"] for r in result["rounds"]] == [41.0, 42.0, 43.0]
    pair = paired.pair_ratios(result, "mine", "theirs")
    assert pair["ratios"] == pytest.approx([1.2, 1.5, 0.8])
    assert (pair["median"], pair["min"], pair["max"]) == pytest.approx((1.2, 0.8, 1.5))
    assert (pair["mine_tok_s"], pair["theirs_tok_s"]) == (30.0, 25.0)
    assert paired.pair_ratios(result, "mine", "absent") is None
    assert (tmp_path / "paired-mine.log").exists()


def test_a_worker_that_dies_keeps_the_rounds_before(tmp_path):
    engines = {"mine": (_stand_in([30.0], fail_at=2), None), "theirs": (_stand_in([20.0]), None)}
    result = paired.run_rounds(engines, rounds=5, timeout=60, log_dir=tmp_path)
    assert len(result["rounds"]) == 2
    assert "mine: worker exited with status 3" in result["error"]
    assert paired.pair_ratios(result, "mine", "theirs")["median"] == pytest.approx(1.5)


def test_a_worker_that_dies_gets_its_engines_hint(tmp_path):
    engines = {"mine": (_stand_in([30.0], fail_at=1), None), "theirs": (_stand_in([20.0]), None)}
    hints = {"mine": lambda status: f"; hint for {status}"}
    result = paired.run_rounds(engines, rounds=3, timeout=60, log_dir=tmp_path, hints=hints)
    assert result["error"].endswith("; hint for 3")


def test_a_pause_comes_before_every_measurement(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(paired.time, "sleep", slept.append)
    engines = {"mine": (_stand_in([30.0]), None), "theirs": (_stand_in([20.0]), None)}
    result = paired.run_rounds(engines, rounds=3, timeout=60, log_dir=tmp_path, pause=2.5)
    assert len(result["rounds"]) == 3 and slept == [2.5] * 6
    slept.clear()
    paired.run_rounds(engines, rounds=2, timeout=60, log_dir=tmp_path)
    assert slept == []


def test_the_llama_cpp_crash_hint_names_amx_only_for_a_segfault_on_an_amx_cpu(monkeypatch):
    monkeypatch.setattr(llama_cpp, "isa_flags", lambda: ["avx2", "avx512f", "amx_int8"])
    assert "without AMX" in llama_cpp.crash_hint(-signal.SIGSEGV)
    assert llama_cpp.crash_hint(1) == "" and llama_cpp.crash_hint(-signal.SIGKILL) == ""
    monkeypatch.setattr(llama_cpp, "isa_flags", lambda: ["avx2", "avx512f"])
    assert llama_cpp.crash_hint(-signal.SIGSEGV) == ""


def test_a_worker_error_and_a_silent_worker_are_reported(tmp_path):
    result = paired.run_rounds({"bad": (_stand_in([1.0], error_at_start=True), None)}, 1, 60, tmp_path)
    assert result["rounds"] == [] and result["error"].startswith("bad: ValueError: no such model")
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]
    result = paired.run_rounds({"silent": (silent, None)}, 1, 0.5, tmp_path)
    assert "silent: no answer within 0.5 s" in result["error"]
    with pytest.raises(ValueError, match="rounds=0"):
        paired.run_rounds({"x": (silent, None)}, 0, 1, tmp_path)


def test_targets_use_the_paired_median():
    group = {
        "engines": ["hfquant-int8", "llamacpp-q8_0"],
        "rounds": [{"read_gbs": 31.5}, {"read_gbs": 48.0}],
        "pairs": [
            {
                "mine": "hfquant-int8",
                "theirs": "llamacpp-q8_0",
                "rounds": 5,
                "median": 0.92,
                "min": 0.9,
                "max": 0.95,
                "mine_tok_s": 23.0,
                "theirs_tok_s": 25.0,
            },
            {
                "mine": "hfquant-int8 +compile",
                "theirs": "llamacpp-q8_0",
                "rounds": 5,
                "median": 1.25,
                "min": 1.1,
                "max": 1.3,
                "mine_tok_s": 31.25,
                "theirs_tok_s": 25.0,
            },
        ],
        "error": "llamacpp-q8_0: worker exited with status 1",
    }
    speed = {c["target"]: c for c in paired.paired_targets([group], speed=True)}
    assert not speed["hfquant-int8 decode >= 1.2x llamacpp-q8_0 (same weights, paired median of 5 rounds)"]["met"]
    assert speed["hfquant-int8 +compile decode >= 1.2x llamacpp-q8_0 (same weights, paired median of 5 rounds)"]["met"]
    small = paired.paired_targets([group], speed=False)
    assert [c["target"] for c in small] == [
        "hfquant-int8 +compile decode >= 0.8x llamacpp-q8_0 (same weights, paired median of 5 rounds)"
    ]
    table = paired.render([group])
    assert "| hfquant-int8 +compile | llamacpp-q8_0 | 5 | 31.25 | 25.00 | 1.25x (1.10-1.30) | 31.5-48.0 |" in table
    assert "stopped: llamacpp-q8_0: worker exited with status 1" in table


def test_without_llama_cpp_the_group_says_why(tmp_path):
    args = benchmark.build_parser().parse_args(
        [
            "--paired-rounds",
            "2",
            "--out",
            str(tmp_path),
            "--compile",
            "--llama-python",
            str(tmp_path / "no" / "python"),
        ]
    )
    groups = paired.for_workload(
        tmp_path, ["bf16", "llamacpp-q8_0"], args, benchmark.QUICK, benchmark.quantization_config, None
    )
    assert len(groups) == 1 and groups[0]["rounds"] == [] and "no llama-cpp-python" in groups[0]["error"]
    assert groups[0]["engines"] == ["hfquant-int8", "hfquant-int8 +compile", "llamacpp-q8_0"]


def test_hfquant_worker_serves_decodes(tmp_path):
    path = tmp_path / "tiny"
    tiny_model("llama", dtype=torch.bfloat16, **TOKENIZER_VOCAB).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = paired.hfquant_command("hfquant-int8", "eager", path, quick=True)
    result = paired.run_rounds({"hfquant-int8": (command, env)}, rounds=2, timeout=300, log_dir=tmp_path)
    assert result["error"] is None, (tmp_path / "paired-hfquant-int8.log").read_text()
    assert all(r["tok_s"]["hfquant-int8"] > 0 for r in result["rounds"]) and len(result["rounds"]) == 2


def test_benchmark_reports_paired_rounds_and_their_targets(tmp_path):
    """`scripts/benchmark.py --paired-rounds 2` end to end on a tiny checkpoint: the hfquant worker is the real one,
    llama.cpp is a stand-in executable (given as --llama-python) answering 50 tok/s, so the table and the targets
    can be checked without llama-cpp-python."""
    pytest.importorskip("gguf")
    import json

    path = tmp_path / "tiny"
    tiny_model("llama", dtype=torch.bfloat16, **MERGES_VOCAB).save_pretrained(path)
    tiny_tokenizer(merges=True).save_pretrained(path)  # the GGUF export needs a merge list
    fake = tmp_path / "fake-llama-python"
    stand_in = _stand_in([50.0])[2]
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{stand_in}'\n")
    fake.chmod(0o755)
    out = tmp_path / "bench"
    rc = benchmark.main(
        [
            "--model",
            str(path),
            "--quick",
            "--compile",
            "--methods",
            "llamacpp-q8_0",
            "--paired-rounds",
            "2",
            "--llama-python",
            str(fake),
            "--out",
            str(out),
            "--timeout",
            "300",
        ]
    )
    data = json.loads((out / "benchmark.json").read_text())["workloads"]["model"]
    (group,) = data["paired"]
    assert group["error"] is None and len(group["rounds"]) == 2, group
    assert group["engines"] == ["hfquant-int8", "hfquant-int8 +compile", "llamacpp-q8_0"]
    assert [p["mine"] for p in group["pairs"]] == ["hfquant-int8", "hfquant-int8 +compile"]
    for pair in group["pairs"]:
        assert pair["theirs_tok_s"] == 50.0 and pair["median"] == pytest.approx(pair["mine_tok_s"] / 50.0)
    # not the speed workload: only the compiled fast path has a target (0.8x), as for the rows
    target = [t for t in data["targets"] if "paired median of 2 rounds" in t["target"]]
    assert [t["target"] for t in target] == [
        "hfquant-int8 +compile decode >= 0.8x llamacpp-q8_0 (same weights, paired median of 2 rounds)"
    ]
    assert "Paired decode rounds (2 per group" in (out / "benchmark.md").read_text()
    assert rc in (0, 1)  # the llama.cpp row itself fails: the stand-in does not speak the row worker's protocol


def test_a_4bit_group_also_runs_llama_cpps_fastest_4bit_type(tmp_path):
    """Issue #32: the default's group (llamacpp-int4) runs Q4_0 too, and its hfquant engines are paired with both."""
    args = benchmark.build_parser().parse_args(
        ["--paired-rounds", "2", "--out", str(tmp_path), "--compile", "--llama-python", str(tmp_path / "no" / "py")]
    )
    groups = paired.for_workload(
        tmp_path, ["llamacpp-int4", "llamacpp-q4_0"], args, benchmark.QUICK, benchmark.quantization_config, None
    )
    assert [g["engines"] for g in groups] == [
        ["hfquant-int4", "hfquant-int4 +compile", "llamacpp-int4", "llamacpp-q4_0"],
        ["hfquant-int4-sym", "hfquant-int4-sym +compile", "llamacpp-q4_0"],
    ]


def _pair(mine: str, theirs: str, median: float) -> dict:
    return {"mine": mine, "theirs": theirs, "rounds": 3, "median": median, "min": median, "max": median}


def test_the_default_against_q4_0_has_issue_32s_limits():
    pairs = [
        _pair("hfquant-4bit", "llamacpp-4bit", 1.3),
        _pair("hfquant-4bit +compile", "llamacpp-4bit", 1.3),
        _pair("hfquant-4bit", "llamacpp-q4_0", 1.05),
        _pair("hfquant-4bit +compile", "llamacpp-q4_0", 1.1),
        _pair("hfquant-int4-rtn", "llamacpp-q4_0", 0.9),  # no limit: only the default has one against Q4_0
        _pair("hfquant-int4", "llamacpp-q4_0", 0.9),  # the int format's 4-bit defaults: no longer the default
    ]
    speed = {c["target"]: (c["limit"], c["met"]) for c in paired.paired_targets([{"pairs": pairs}], speed=True)}
    assert speed == {
        "hfquant-4bit decode >= 1.2x llamacpp-4bit (same weights, paired median of 3 rounds)": (1.2, True),
        "hfquant-4bit +compile decode >= 1.2x llamacpp-4bit (same weights, paired median of 3 rounds)": (1.2, True),
        "hfquant-4bit decode >= 1.0x llamacpp-q4_0 (llama.cpp's fastest 4-bit type, paired median of 3 rounds)": (
            1.0,
            True,
        ),
        "hfquant-4bit +compile decode >= 1.2x llamacpp-q4_0 (llama.cpp's fastest 4-bit type, paired median of 3 "
        "rounds)": (1.2, False),
    }
    small = {c["target"]: c["limit"] for c in paired.paired_targets([{"pairs": pairs[:2]}], speed=False)}
    assert small == {
        "hfquant-4bit decode >= 0.8x llamacpp-4bit (same weights, paired median of 3 rounds)": 0.8,
        "hfquant-4bit +compile decode >= 1.0x llamacpp-4bit (same weights, paired median of 3 rounds)": 1.0,
    }


@pytest.mark.parametrize("count", [2, 3, 4, 5])
def test_balanced_order_puts_every_engine_after_every_other_equally(count):
    rows = [paired.balanced_order(count, r) for r in range(2 * count)]
    assert all(sorted(row) == list(range(count)) for row in rows)
    assert sorted(row[0] for row in rows) == sorted(list(range(count)) * 2)
    follows = Counter((a, b) for row in rows for a, b in zip(row[:-1], row[1:], strict=True))
    assert set(follows) == {(a, b) for a in range(count) for b in range(count) if a != b}
    assert len(set(follows.values())) == 1
