#!/usr/bin/env bash
# Compiles the standalone GPU benchmark programs (bench/gpu/*.cu) for the H200 (sm_90a) with
# NVIDIA's nvcc, without running them. Several include the kernel sources themselves
# (fused_modes.cu: gemv.cu and attention.cu; sweep_gemv.cu: gemv.cu), so a kernel change that
# breaks a benchmark is found here, not in a device call. No GPU needed: scripts/setup unpacks
# NVIDIA's nvcc wheels (13.0, the device's) into target/nvcc. The programs that include
# cublasLt.h are left out (cuBLAS's headers come in a ~500 MB wheel); they build on the device.
# Prints one line per program and the compiler's messages; exits 1 if any failed.
#
# Usage: bench/gpu/check_sources.sh   (NVCC=path overrides the compiler)
set -euo pipefail
cd "$(dirname "$0")/../.."
cu13="$PWD/target/nvcc/nvidia/cu13"
nvcc=${NVCC:-$cu13/bin/nvcc}
[ -x "$nvcc" ] || command -v "$nvcc" >/dev/null ||
    { echo "check_sources: $nvcc not found (bash scripts/setup fetches it)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0
for src in bench/gpu/*.cu; do
    name=$(basename "$src" .cu)
    if grep -qE '<cublasLt\.h>|"cublaslt_plan\.cuh"' "$src"; then
        echo "skip $name (needs cuBLAS headers)"
        continue
    fi
    # -c: the host side is compiled too (it is most of a benchmark), nothing is linked.
    if "$nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -c -o "$tmp/$name.o" "$src" >"$tmp/$name.log" 2>&1; then
        echo "ok   $name"
    else
        echo "FAIL $name"
        cat "$tmp/$name.log"
        failed=1
    fi
done
exit $failed
