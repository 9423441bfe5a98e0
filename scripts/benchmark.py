#!/usr/bin/env python
"""Benchmark hfquant against bf16 and the peer libraries; see benchmarks/benchmark.py.

The benchmark lives in benchmarks/ at the repository root, outside the installed package, so this script puts the
repository root on sys.path first (it then also finds hfquant there when it is not installed).

Examples:
    python scripts/benchmark.py                                  # both workloads, all methods (long: ~1 h on 2 cores)
    python scripts/benchmark.py --workload 1b --methods bf16,hfquant-int8,torchao-int8 --compile
    python scripts/benchmark.py --model /path/to/checkpoint --quick --methods bf16,hfquant-int4
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
