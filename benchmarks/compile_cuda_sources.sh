#!/usr/bin/env bash
# Compile the CUDA kernels (csrc/cuda_kernels.cu, no torch headers) with nvcc -c,
# so they cannot rot on machines without a GPU. Usage:
#   benchmarks/compile_cuda_sources.sh [nvcc arch, default sm_80]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
arch=${1:-sm_80}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"$nvcc" -c -O3 -std=c++17 -arch="$arch" -Xcompiler -Wall "$root/csrc/cuda_kernels.cu" -o "$out/cuda_kernels.o"
echo "compiled csrc/cuda_kernels.cu for $arch with $nvcc"
