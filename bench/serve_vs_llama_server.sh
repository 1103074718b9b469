#!/usr/bin/env bash
# Serving throughput and latency of `tessera serve` next to llama.cpp's llama-server on
# the same model, same machine, same load: bench/loadgen.py with 1 and 16 concurrent
# streaming sessions (prompt ~128 tokens, 128 generated tokens, ignore_eos).
#
#   bench/serve_vs_llama_server.sh LLAMA_SERVER [MODEL]
#
# Run on a quiet machine. DURATION (s, default 30), CONCURRENCY ("1 16"), THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_SERVER=${1:?path of llama-server}
cargo build --release --quiet --bin tessera
MODEL=${2:-$(target/release/tessera fetch-model)}
DURATION=${DURATION:-30}
CONCURRENCY=${CONCURRENCY:-"1 16"}
THREADS=${THREADS:-2}
PORT_T=18400
PORT_L=18401

wait_ready() { for _ in $(seq 1 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; echo "not ready: $1" >&2; return 1; }

echo "## $(date -u +%Y-%m-%d) $(git rev-parse --short HEAD) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $THREADS threads, ${DURATION}s per point"
echo
HEADER=--header
target/release/tessera serve --model "$MODEL" --port $PORT_T --threads "$THREADS" \
    --coordinator-args="--max-num-seqs 32 --max-num-batched-tokens 512" >/tmp/tessera-bench.log 2>&1 &
TPID=$!
trap 'kill $TPID 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_T/ready"
for c in $CONCURRENCY; do
    python3 bench/loadgen.py --url "http://127.0.0.1:$PORT_T" --concurrency "$c" --duration "$DURATION" \
        --prompt-tokens 128 --max-tokens 128 --ignore-eos --label "tessera c=$c" $HEADER
    HEADER=
done
kill $TPID; wait $TPID 2>/dev/null || true

"$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port $PORT_L -t "$THREADS" -np 16 -c $((16 * 512)) \
    >/tmp/llama-server-bench.log 2>&1 &
LPID=$!
trap 'kill $LPID 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$PORT_L/health"
for c in $CONCURRENCY; do
    python3 bench/loadgen.py --url "http://127.0.0.1:$PORT_L" --concurrency "$c" --duration "$DURATION" \
        --prompt-tokens 128 --max-tokens 128 --ignore-eos --label "llama-server c=$c"
done
kill $LPID; wait $LPID 2>/dev/null || true
