#!/usr/bin/env bash
# Compiles every kernel module of kernels/cuda/ for an AMD GPU arch (default gfx90a) with
# hipcc --genco, through kernels/hip/compat.h, exactly as the HIP loader assembles them
# (compat.h + common.cuh [+ sampling_shared.cuh for the sampling modules] + the .cu file; the
# list mirrors kernels/src/cuda/sources.rs and a Rust test checks the two agree).
# Needs Debian's hipcc and rocm-device-libs, no GPU. Prints one line per module and the compiler's
# messages; exits 1 if any module failed.
#
# Usage: kernels/hip/check_sources.sh [gfx-arch ...]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cuda="$here/../cuda"
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(gfx90a)
command -v hipcc >/dev/null || { echo "check_sources: hipcc not found (apt-get install hipcc rocm-device-libs)" >&2; exit 1; }

# module = file stem; the sampling modules also take sampling_shared.cuh.
modules=(norm activation embedding inputs rope attention qkv init sampling sampling_split gemv allreduce_oneshot token_mask)
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in "${archs[@]}"; do
    # The width the host launches with (kernels/src/hip/gfx.rs): gfx10 and later 32, else 64.
    case $arch in gfx1[0-9][0-9][0-9]*) wave=32 ;; *) wave=64 ;; esac
    for m in "${modules[@]}"; do
        src="$tmp/$m.hip"
        {
            cat "$here/compat.h"
            cat "$cuda/common.cuh"
            case $m in sampling | sampling_split) cat "$cuda/sampling_shared.cuh" ;; esac
            cat "$cuda/$m.cu"
        } >"$src"
        if ! out=$(hipcc --genco --offload-arch="$arch" -O3 -std=c++17 -DTESSERA_EXPECT_WARP_SIZE=$wave -o "$tmp/$m.co" "$src" 2>&1); then
            echo "$out" >&2
            echo "FAILED $arch $m" >&2
            failed=$((failed + 1))
            continue
        fi
        [ -n "$out" ] && echo "$out" >&2
        echo "ok $arch (wave $wave) $m ($(stat -c %s "$tmp/$m.co") bytes)"
    done
done
if [ "$failed" -gt 0 ]; then
    echo "check_sources: $failed module(s) failed to compile" >&2
    exit 1
fi
