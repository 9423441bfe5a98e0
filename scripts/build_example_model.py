#!/usr/bin/env python
"""Build (or reuse) the example SmolLM2-135M-Instruct bf16 safetensors checkpoint and print its path.

Usage: python scripts/build_example_model.py [--cache-dir DIR] [--max-shard-size 100MB]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# the repository root: benchmarks/ (where the builder lives: it is not part of the wheel), and hfquant when it is not
# installed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="root cache folder (default: $HFQUANT_CACHE or ~/.cache/hfquant); the model goes in "
        "<cache-dir>/smollm2-135m-instruct-bf16",
    )
    parser.add_argument("--max-shard-size", default="100MB", help="shard size for save_pretrained (default: 100MB)")
    args = parser.parse_args(argv)

    from benchmarks.example_model import build_example_model

    try:
        path = build_example_model(args.cache_dir, max_shard_size=args.max_shard_size)
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
