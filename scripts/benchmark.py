#!/usr/bin/env python
"""Benchmark hfquant against bf16 and the peer libraries; see hfquant/benchmark.py (same as `hfquant bench`).

Examples:
    python scripts/benchmark.py                                  # both workloads, all methods (long: ~1 h on 2 cores)
    python scripts/benchmark.py --workload 1b --methods bf16,hfquant-int8,torchao-int8 --compile
    python scripts/benchmark.py --model /path/to/checkpoint --quick --methods bf16,hfquant-int4
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("hfquant") is None:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hfquant.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
