#!/usr/bin/env bash
# The release check: builds the sdist and, from it, the wheel (`python -m build`, no build isolation: torch is not a
# build requirement, and the local setuptools builds offline), installs the wheel into a fresh venv outside the
# tree (--system-site-packages: torch and the other dependencies come from the running Python; the check proves
# smf_kernels and smf themselves come from the venv), builds the CPU extension from the installed package's
# smf_kernels/csrc/ into an empty cache, and runs .ci/wheel_smoke.py (ext vs torch, version, license, data files).
# Measured on 2 cores shared with other jobs: 3 min 24 s (61 CPU-s) at load 4-10, 3 min 2 s (56 CPU-s) at load 10-11,
# most of it the extension's build (28 s on 2 idle cores: benchmarks/RESULTS.md); the sdist and wheel: 11 s.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH  # the installed package, not a checkout, must be imported

echo "wheel check: building the sdist and the wheel into $work/dist"
python -m build --no-isolation --outdir "$work/dist" "$repo" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
ls "$work/dist"
echo "wheel check: built in ${SECONDS} s"

echo "wheel check: installing the wheel into a fresh venv"
python -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install -q --no-deps --no-index "$work/dist"/smf_kernels-*.whl

echo "wheel check: building the CPU extension from the installed package (ninja; ~30 s on 2 idle cores)"
cd "$work"  # outside the checkout: nothing of the tree is on sys.path
export SMF_KERNELS_EXT_DIR="$work/ext-cache" HF_HUB_OFFLINE=1
"$work/venv/bin/python" -m smf_kernels.build_ext
"$work/venv/bin/smf" --help > /dev/null
"$work/venv/bin/python" "$repo/.ci/wheel_smoke.py"
echo "wheel check: passed in ${SECONDS} s"
