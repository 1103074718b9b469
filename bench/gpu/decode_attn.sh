#!/usr/bin/env bash
# Builds bench/gpu/decode_attn.cu against kernels/cuda/attention.cu and against copies of it
# with one change each (timing only: some compute wrong results), runs each, prints the
# tables. On the device machine: `bash bench/gpu/decode_attn.sh [VARIANTS] [-- CASES]`:
#   base       - attention.cu as it is
#   copies     - the decode loop copies its tiles and computes nothing: the copies' ceiling
#   qk4        - Q K^T summed in two interleaved chains of mma (odd and even k steps), so a
#                tile's scores wait for 4 dependent mma instead of 8
#   wrange     - each warp takes a contiguous run of its split's tiles (warp w the w-th
#                quarter) instead of every 4th tile; copies_wrange: without the compute
#   l2pfN      - each warp also asks L2 for its K/V tile N tiles beyond the ring's newest
#                (cp.async.bulk.prefetch.L2, a row per lane), so more bytes are in flight
#                than the ring holds; copies_l2pfN: the same without the compute
# Default: base copies. CASES (batch:context ...) go to the program (default 64:600 256:600
# 64:4096 16:600). DA_STREAMK=1 in the environment adds the stream-K copy ceilings.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=bench/gpu/variants.sh
source bench/gpu/variants.sh
VARIANTS="base copies"
if [[ $# -gt 0 && "$1" != -- ]]; then VARIANTS=$1; shift; fi
[[ "${1:-}" == -- ]] && shift
D=${DA_DIR:-/tmp/decode_attn}
mkdir -p "$D"
make_variant() { # name -> $D/name/attention.cu
    variant_copy "$1" kernels/cuda/attention.cu "$D/$1/attention.cu" <<'PY'
if v.endswith("wrange"):
    # Each warp takes a contiguous run of the split's tiles instead of every DEC_WARPS-th.
    sub("    const u32 my_tiles = n_tiles > warp ? (n_tiles - warp - 1) / DEC_WARPS + 1 : 0;\n",
        "    const u32 w_first = n_tiles * warp / DEC_WARPS, my_tiles = n_tiles * (warp + 1) / DEC_WARPS - w_first;\n")
    sub("    auto tile_pos = [&](u32 j) { return start + (warp + j * DEC_WARPS) * DEC_TILE; };",
        "    auto tile_pos = [&](u32 j) { return start + (w_first + j) * DEC_TILE; };")
    v = "copies" if v == "copies_wrange" else "base"
pf = None
if v.startswith("copies_l2pf"):
    pf, v = int(v[len("copies_l2pf"):]), "copies"
elif v.startswith("l2pf"):
    pf, v = int(v[len("l2pf"):]), "base"
if pf:
    # Lanes 0-15 prefetch the K rows of tile t, lanes 16-31 its V rows.
    sub("    u32 next = row_slot(ST - 1);\n",
        "    auto l2pf = [&](u32 t) {\n"
        "        const u32 ps = row_slot(t);\n"
        "        if (ps < SLOT_PAST) {\n"
        "            const bf16* src = ((lane >> 4) ? v_cache : k_cache) + (u64)kvh * HD + (u64)ps * slot_stride;\n"
        "            asm volatile(\"cp.async.bulk.prefetch.L2.global [%0], %1;\" :: \"l\"(src), \"n\"(HD * 2) : \"memory\");\n"
        "        }\n"
        "    };\n"
        f"    for (u32 t = ST - 1; t < ST - 1 + {pf}; ++t) l2pf(t);\n"
        "    u32 next = row_slot(ST - 1);\n")
    sub("        next = row_slot(jn + 1);\n", f"        next = row_slot(jn + 1);\n        l2pf(jn + {pf});\n")
if v == "copies":
    sub("        dec_tile<HD>(kb, vb, qa, o, m, l, tile_pos(j), end, scale_log2, lane);\n", "")
if v == "qk4":
    sub("    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;\n#pragma unroll\n    for (int kk = 0; kk < NKS; ++kk) {",
        "    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;\n    float s2[2][4] = {};\n#pragma unroll\n    for (int kk = 0; kk < NKS; ++kk) {")
    sub("        mma_bf16(s[0], a, b[0], b[1]);\n        mma_bf16(s[1], a, b[2], b[3]);\n    }\n",
        "        mma_bf16((kk & 1) ? s2[0] : s[0], a, b[0], b[1]);\n        mma_bf16((kk & 1) ? s2[1] : s[1], a, b[2], b[3]);\n    }\n"
        "#pragma unroll\n    for (int n = 0; n < 2; ++n)\n#pragma unroll\n        for (int e = 0; e < 4; ++e) s[n][e] += s2[n][e];\n")
elif v not in ("base", "copies"):
    sys.exit(f"unknown variant {v}")
PY
}
variants_build_run decode_attn ATTN_SRC attention.cu "$@"
