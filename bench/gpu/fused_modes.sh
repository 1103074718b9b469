#!/usr/bin/env bash
# Builds bench/gpu/fused_modes.cu against kernels/cuda/gemv.cu and against copies of it with
# one part of the fused modes removed (wrong results, timing only), runs each, prints the
# tables. On the device machine: `bash bench/gpu/fused_modes.sh [VARIANTS]` (default: all):
#   base       - gemv.cu as it is
#   res_noread - RESIDUAL's epilogue writes bf16(sum) without the residual's values
# (The no_scale and no_norm variants, which removed parts of the NORM modes' prologue, edit
# a prologue that 4d87e15 replaced; they are in git before it.)
# Extra variants: EXTRA="name=/path/to/gemv.cu ..." times other copies the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/variants.sh
source bench/gpu/variants.sh
VARIANTS=${1:-"base res_noread"}
D=${FM_DIR:-/tmp/fused_modes}
mkdir -p "$D"
make_variant() { # name -> $D/name/gemv.cu
    variant_copy "$1" kernels/cuda/gemv.cu "$D/$1/gemv.cu" <<'PY'
if v == "res_noread":
    sub("= f32_to_bf16(bf16_to_f32(res_pre[r]) + sum);", "= f32_to_bf16(sum);")
elif v != "base":
    sys.exit(f"unknown variant {v}")
PY
}
variants_build_run fused_modes GEMV_SRC gemv.cu
