#!/usr/bin/env bash
# The AOT budgets under Triton 3.6.0, the Triton of a stock CUDA image (torch 2.11), beside the pinned 3.7.1 that
# tests/test_triton_aot.py checks: every Triton kernel compiles for sm_90 with no spill, >= 25% estimated
# occupancy and <= 60 CPU s a compile (benchmarks/triton_aot.py --check). A venv of its own that sees the
# system's torch (the CPU wheel: nothing from CUDA is installed) with triton 3.6.0 alone installed in it,
# shadowing the system's. On the 2-core machine: ~25 s to build the venv, ~17 CPU s of compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_OLD=3.6.0
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m venv --system-site-packages "$tmp/triton-${TRITON_OLD}"
"$tmp/triton-${TRITON_OLD}/bin/pip" install -q --no-deps "triton==${TRITON_OLD}"
PYTHONPATH="$PWD" TRITON_INTERPRET=0 "$tmp/triton-${TRITON_OLD}/bin/python" benchmarks/triton_aot.py --target sm_90 \
    --jobs 2 --check
