#!/usr/bin/env bash
# Served tensor parallelism with and without decode lookahead (issue 5), on a machine with
# 2 GPUs (nvidia-h200-x2), after the default model's halves were carried to /tmp/part-a and
# /tmp/part-b (bench/gpu/run.sh's recipe) and with .gpu/tessera.xz and .gpullama carried:
#   OUT=$OUT bash bench/gpu/serve_tp.sh
# Builds the random bf16 llama-3-8b GGUF (make_gguf.py, as llama_cpp.sh serve8b; SmolLM2's 9
# heads do not split over 2 ranks), then `tessera serve --tp 2` on it with TESSERA_LOOKAHEAD=0
# and =1 (loadgen at 1 and 16 sessions, 128 + 128 tokens), sampled runs (temperature 0.9 and
# 1.0) with lookahead to check that the ranks keep agreeing, and `tessera bench --tp 2` for
# the engine's own step.
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=/tmp/tessera-gpu-bin
LOG=${OUT:-/tmp}/serve_tp.log
: > "$LOG"
mkdir -p "$BIN"
xz -dc .gpu/tessera.xz > "$BIN/tessera" && chmod +x "$BIN/tessera"
[[ -f /tmp/smollm2.gguf ]] || cat /tmp/part-a /tmp/part-b > /tmp/smollm2.gguf
export TESSERA_CACHE_DIR=${TESSERA_CACHE_DIR:-$(mktemp -d)}
SRC=/tmp/llsrc
[[ -d $SRC/llama.cpp/gguf-py ]] || { mkdir -p "$SRC" && xz -dc .gpullama/llama.tar.xz | tar xf - -C "$SRC" llama.cpp/gguf-py; }
G=/tmp/l8b.gguf
[[ -f $G ]] || PYTHONPATH="$SRC/llama.cpp/gguf-py" python3 bench/gpu/make_gguf.py /tmp/smollm2.gguf $G 2>&1 | tail -1
echo "== $(basename $G) tp=2: lookahead off / on" | tee -a "$LOG"
SERVE_ARGS="--tp 2" CONC="1 16" DURATION=${DURATION:-15} bash bench/gpu/serve_ab.sh $G \
    "off=TESSERA_LOOKAHEAD=0" "on=TESSERA_LOOKAHEAD=1" 2>&1 | tee -a "$LOG"
echo "== sampled, lookahead on, 8B tp=2" | tee -a "$LOG"
"$BIN/tessera" serve --device cuda --tp 2 --model $G --port 8128 >/tmp/serve-tp-sampled.log 2>&1 &
p=$!
for _ in $(seq 240); do curl -sf localhost:8128/ready >/dev/null && break; sleep 0.5; done
python3 bench/loadgen.py --url http://127.0.0.1:8128 --concurrency 16 --duration 10 --prompt-tokens 128 \
    --max-tokens 128 --temperature 0.9 --ignore-eos --label "sampled c=16" --header 2>&1 | tee -a "$LOG"
python3 bench/loadgen.py --url http://127.0.0.1:8128 --concurrency 4 --duration 6 --prompt-tokens 64 \
    --max-tokens 64 --temperature 1.0 --label "sampled c=4, EOS allowed" 2>&1 | tee -a "$LOG"
kill $p; wait $p 2>/dev/null
echo "rank disagreements in the log: $(grep -ci disagree /tmp/serve-tp-sampled.log)" | tee -a "$LOG"
echo "== tessera bench --tp 2 (engine)" | tee -a "$LOG"
"$BIN/tessera" bench --device cuda --model $G --tp 2 --prompts 128 --decode-prompt 128 --batches 1,16 \
    --gen-tokens 128 2>&1 | grep -E '^(#|\|)' | tee -a "$LOG"
