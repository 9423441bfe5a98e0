"""Measurement tooling for hfquant, run from a source checkout and never installed: the benchmark against bf16 and
the peer quantization libraries (:mod:`benchmarks.benchmark`, driven by ``python scripts/benchmark.py``), the
random-weight 1.2B Llama checkpoint it measures speed and memory on (:mod:`benchmarks.random_model`), and the
process-RSS / tensor-footprint helpers that the benchmark, ``scripts/run_example.py`` and the tests use
(:mod:`benchmarks.memory`).  It is not part of the ``hfquant`` package (the wheel does not carry it); import it with
the repository root on ``sys.path`` (the scripts insert it, pytest's ``pythonpath`` setting adds it).
"""
