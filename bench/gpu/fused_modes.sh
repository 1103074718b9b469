#!/usr/bin/env bash
# Builds bench/gpu/fused_modes.cu against kernels/cuda/gemv.cu and against copies of it with
# one part of the fused modes removed (wrong results, timing only), runs each, prints the
# tables. On the device machine: `bash bench/gpu/fused_modes.sh [VARIANTS]` (default: all):
#   base       - gemv.cu as it is
#   res_noread - RESIDUAL's epilogue writes bf16(sum) without the residual's values
#   pfN, pfNs  - each CTA prefetches its next N tiles of w into L2 before the wait (below)
# (The no_scale and no_norm variants, which removed parts of the NORM modes' prologue, edit
# a prologue that 4d87e15 replaced; they are in git before it.)
# Extra variants: EXTRA="name=/path/to/gemv.cu ..." times other copies the same way.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/variants.sh
source bench/gpu/variants.sh
VARIANTS=${1:-"base res_noread"}  # also pfN / pfNs (below)
D=${FM_DIR:-/tmp/fused_modes}
mkdir -p "$D"
make_variant() { # name -> $D/name/gemv.cu
    variant_copy "$1" kernels/cuda/gemv.cu "$D/$1/gemv.cu" <<'PY'
if v == "res_noread":
    sub("= f32_to_bf16(bf16_to_f32(res_pre[r]) + sum);", "= f32_to_bf16(sum);")
elif v.startswith("pf"):
    # pfN: before the wait for the previous kernel, each CTA also prefetches its next N
    # tiles of w into L2 (cp.async.bulk.prefetch, beyond the ring's first copies), so HBM
    # keeps streaming while the kernel waits (attention's window, kernel boundaries).
    # pfNs: only for weights of at most 64 MB (qkv, o). Timing experiment (2026-12-04):
    # slower in every chain (fused + attention 115.8 us per layer; pf1 129.2, pf2 133.6,
    # pf1s 118.9), so not in gemv.cu.
    n, small = int(v[2:].rstrip("s")), v.endswith("s")
    cond = "(u64)rows * cols * 2 <= (64ull << 20)" if small else "true"
    sub("    if (early_w) PDL_WAIT();", f"""    if (early_w && {cond} && threadIdx.x < 2 * {n}) {{
        const int k = threadIdx.x >> 1, part = threadIdx.x & 1;
        const int tile = (int)blockIdx.x + (k + 1) * (int)gridDim.x;
        if (tile < tiles) {{
            int r0, n_rows;
            if (MODE == GEMV_NORM_SWIGLU) {{
                r0 = (part ? half : 0) + tile * 8;
                n_rows = min(8, half - tile * 8);
            }} else {{
                r0 = tile * GEMV_ROWS + part * 8;
                n_rows = min(8, rows - r0);
            }}
            if (n_rows > 0)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\\n" ::"l"(w + (u64)r0 * cols),
                             "r"((u32)(n_rows * cols * 2)) : "memory");
        }}
    }}
    if (early_w) PDL_WAIT();""")
elif v != "base":
    sys.exit(f"unknown variant {v}")
PY
}
variants_build_run fused_modes GEMV_SRC gemv.cu
