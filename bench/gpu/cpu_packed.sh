#!/usr/bin/env bash
# The packed CPU matmul kernels (kernels/src/cpu/packed.rs) and the tiled attention
# (attention_tiled.rs) on the device host's AVX-512 VNNI cores, in one call (issue 3):
# their tests (bit-equality with the scalar packed kernel, batch invariance, the
# references), attention_bench, par_bench, `matmul_bench --packed` at 1 and 16 threads,
# `tessera bench` with the row-major against the packed kernels (cpu_ab.sh), then the
# served comparison with llama-server (llama_cpp.sh cpuserve, which builds llama.cpp for
# this CPU first) and llama-bench at 1 and 16 threads (cpubench). SKIP_AB=1 leaves out the
# matmul_bench and row-major/packed steps, SKIP_SERVE=1 everything after the batched bench.
# Carried: .gpu2/{tessera,matmul,matmul_bench,attention_tiled,attention_bench,par_bench}.xz (here:
# `bash bench/gpu/cpu_packed.sh prepare`) and .gpullama; /tmp/smollm2.gguf assembled from
# the halves of run.sh prepare.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=/tmp/tessera-gpu-bin
if [[ "${1:-}" == prepare ]]; then
    set -e
    cargo build --release
    cargo build --release -p tessera-kernels --example matmul_bench --example attention_bench --example par_bench
    t=$(cargo test --release -p tessera-kernels --test matmul --test attention_tiled --no-run --message-format=json 2>/dev/null |
        python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("profile", {}).get("test") and m.get("executable"): print(m["executable"])')
    rm -rf .gpu2 && mkdir -p .gpu2
    for f in target/release/tessera target/release/examples/{matmul,attention,par}_bench $t; do
        strip -o ".gpu2/$(basename "$f" | sed 's/-[0-9a-f]*$//')" "$f"
    done
    xz -T0 .gpu2/*
    grep -qx "/.gpu2/" .git/info/exclude || echo "/.gpu2/" >> .git/info/exclude
    du -sh .gpu2
    exit 0
fi
mkdir -p "$BIN"
for f in tessera matmul matmul_bench attention_tiled attention_bench par_bench; do
    xz -dc ".gpu2/$f.xz" > "$BIN/$f" && chmod +x "$BIN/$f"
done
echo "== $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs"
for t in matmul attention_tiled; do
    echo "== kernel tests ($t)"
    "$BIN/$t" --test-threads 4 2>&1 | grep -E '^test |test result|bit-equal|packed |skipped' | sed 's/^/  /'
done
echo "== attention_bench (tiled f32 softmax vs the f16 llama.cpp-rounding kernel)"
THREADS="1 16" "$BIN/attention_bench" | sed 's/^/  /'
echo "== par_bench (what one parallel op costs beyond its work)"
"$BIN/par_bench" | sed 's/^/  /'
if [[ ${SKIP_AB:-0} != 1 ]]; then
    echo "== matmul_bench --packed"
    THREADS="1 16" "$BIN/matmul_bench" --packed | sed 's/^/  /'
    echo "== tessera bench: row-major vs packed"
    ROUNDS=${ROUNDS:-2} THREAD_LIST=16 BIN=$BIN bash bench/gpu/cpu_ab.sh "rowmajor=TESSERA_CPU_PACKED=0" "packed=TESSERA_CPU_PACKED=1"
fi
echo "== tessera bench: 16 sequences decoding together, per-op profile"
CUDA_VISIBLE_DEVICES= TESSERA_CPU_OP_PROFILE=1 "$BIN/tessera" bench --model "${MODEL:-/tmp/smollm2.gguf}" --threads 16 \
    --prompt-tokens 128 --gen-tokens 64 --repetitions 2 --cpu-batch 16 2>&1 | grep -E '^\|' | sed 's/^/  /'
[[ ${SKIP_SERVE:-0} == 1 ]] && exit 0
OUT=${OUT:-/tmp} DURATION=${DURATION:-15} BIN=$BIN bash bench/gpu/llama_cpp.sh cpuserve
# An earlier build carried as .gpu2/tessera-old.xz: served the same way, right after.
if [[ -f .gpu2/tessera-old.xz ]]; then
    echo "== the same load on the earlier binary (.gpu2/tessera-old.xz)" | tee -a "${OUT:-/tmp}/cpu-serve.log"
    cp "$BIN/tessera" "$BIN/tessera-new" && xz -dc .gpu2/tessera-old.xz > "$BIN/tessera"
    OUT=${OUT:-/tmp} DURATION=${DURATION:-15} SKIP_LLAMA_SERVER=1 bash bench/gpu/llama_cpp.sh cpuserve
    mv "$BIN/tessera-new" "$BIN/tessera"
fi
THREAD_LIST="1 16" OUT=${OUT:-/tmp} BIN=$BIN bash bench/gpu/llama_cpp.sh cpubench
