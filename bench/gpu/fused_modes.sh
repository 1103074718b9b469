#!/usr/bin/env bash
# Builds bench/gpu/fused_modes.cu against kernels/cuda/gemv.cu and against copies of it with
# one part of the fused modes removed (wrong results, timing only), runs each, prints the
# tables. On the device machine: `bash bench/gpu/fused_modes.sh [VARIANTS]` (default: all):
#   base       - gemv.cu as it is
#   no_scale   - the NORM modes' prologue sums the squares but never scales x: what the
#                scaling (the second half, after the barrier) costs
#   no_norm    - no prologue at all (x never read, no barrier): what the whole prologue costs
#   res_noread - RESIDUAL's epilogue writes bf16(sum) without the residual's values
# Extra variants: EXTRA="name=/path/to/gemv.cu ..." times other copies the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/variants.sh
source bench/gpu/variants.sh
VARIANTS=${1:-"base no_scale no_norm res_noread"}
D=${FM_DIR:-/tmp/fused_modes}
mkdir -p "$D"
make_variant() { # name -> path of its gemv.cu
    local v=$1 src=kernels/cuda/gemv.cu
    mkdir -p "$D/$v"
    V=$v python3 - "$src" "$D/$v/gemv.cu" <<'PY'
import os, sys
s = open(sys.argv[1]).read()
v = os.environ["V"]
def sub(old, new):
    global s
    assert s.count(old) == 1, f"{v}: {old!r} found {s.count(old)} times"
    s = s.replace(old, new)
if v == "no_scale":
    sub("        gemv_norm_scale(xn, gamma, m, cols, eps, ws, c0, c_step, per_tile);\n", "")
elif v == "no_norm":
    sub("        gemv_norm_sums(xn, x, m, cols, ws);\n        __syncthreads();\n", "")
    sub("        gemv_norm_scale(xn, gamma, m, cols, eps, ws, c0, c_step, per_tile);\n", "")
elif v == "res_noread":
    sub("= f32_to_bf16(bf16_to_f32(res_pre[r]) + sum);", "= f32_to_bf16(sum);")
elif v != "base":
    sys.exit(f"unknown variant {v}")
open(sys.argv[2], "w").write(s)
PY
}
variants_build_run fused_modes GEMV_SRC gemv.cu
