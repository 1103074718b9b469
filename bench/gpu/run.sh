#!/usr/bin/env bash
# Every GPU test and benchmark of Tessera in one call on a GPU machine.
#
#   bench/gpu/run.sh prepare        # here (no GPU needed): build into .gpu/ (xz-compressed)
#   bench/gpu/run.sh [STAGES]       # on the GPU machine; STAGES (default: all) of
#                                   #   kernels  - kernel tests vs CPU references, then micro-benchmarks
#                                   #   model    - CUDA backend end to end (SmolLM2 vs llama.cpp / CPU,
#                                   #              batching, bad input; random Qwen3 vs PyTorch)
#                                   #   serve    - `tessera serve --device cuda` end to end (bench/gpu/serve_check.py)
#                                   #              and loadgen at 1/16/64 sessions
#                                   #   bench    - `tessera bench --device cuda` on synthetic 8B shapes
#                                   #   trace    - (not in the default list) kernel timeline of decode steps
#                                   #              (bench/gpu/kernel_trace.c, kernel_timeline.py) at
#                                   #              TRACE_BATCHES (default 1 64) sequences
#                                   #   tp       - (not in the default list; needs 2 GPUs: nvidia-h200-x2)
#                                   #              tensor parallel: kernels/tests/cuda_allreduce.rs (one-shot
#                                   #              all-reduce tests, then its latency vs NCCL by size),
#                                   #              worker/tests/cuda_tp.rs (random Qwen3 at tp=2, synthetic
#                                   #              llama-3.1-8b at tp=2 and pp=2, SmolLM2 at pp=2, each vs
#                                   #              1 GPU), worker/tests/cuda_service_stuck.rs (stuck-step
#                                   #              watch), then `tessera bench --device cuda --tp 2` and
#                                   #              `--pp 2` on synthetic shapes (TP_SHAPES, default
#                                   #              llama-3.1-8b): batch-1 decode vs tp=1 in the same run,
#                                   #              aggregate at 64 and 256 sequences; `tessera serve --pp 2`
#
# The device machine has no Rust: `prepare` builds the kernel tests (tessera-kernels/tests/cuda_*.rs),
# the worker's tests/cuda_model.rs and cuda_tp.rs and the `tessera` binary with the `cuda` feature (cudarc loads
# libcuda/libnvrtc/libcublasLt at run time, so no toolkit is needed here), strips and xz-compresses
# them into .gpu/ (listed in .git/info/exclude; carried with the device tool's `carry: [".gpu"]`).
# The default model (98 MB) is over one call's carry limit: `prepare` also splits it into
# .gpumodel/part-a and .gpumodelb/part-b: two earlier calls on the same warm machine carry them
# (`carry: [".gpumodel"]`, `cp .gpumodel/part-a /tmp/`; `carry: [".gpumodelb"]`,
# `cp .gpumodelb/part-b /tmp/`), since .gpu and the tree already take most of one call's 64 MiB;
# the `model` stage joins the parts. Logs go to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/../.."
KERNEL_TESTS=${KERNEL_TESTS:-"cuda_ops cuda_attention cuda_decode_early cuda_qkv cuda_init cuda_marks cuda_sampling cuda_gemv cuda_gemv_fused cuda_nccl cuda_token_mask"}
CPU_TESTS="matmul attention_f16"
MODEL=${TESSERA_MODEL_PATH:-$HOME/.cache/tessera/models/SmolLM2-135M-Instruct.Q4_1.gguf}

test_exe() { # crate test-name features -> path of the built test binary
    cargo test --release -p "$1" --features "$3" --test "$2" --no-run --message-format=json 2>/dev/null \
        | T="$2" python3 -c 'import json,os,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == os.environ["T"]:
        print(m["executable"])'
}

if [[ "${1:-}" == prepare ]]; then
    set -e
    for d in .gpu .gpumodel .gpumodelb; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
    rm -rf .gpu .gpumodel .gpumodelb && mkdir -p .gpu .gpumodel .gpumodelb
    for t in $KERNEL_TESTS; do cp "$(test_exe tessera-kernels "$t" cuda)" ".gpu/$t"; done
    cp "$(test_exe tessera-worker cuda_model cuda)" .gpu/cuda_model
    cp "$(test_exe tessera-worker cuda_tp cuda)" .gpu/cuda_tp
    cp "$(test_exe tessera-worker cuda_service_stuck cuda)" .gpu/cuda_service_stuck  # tp stage
    cp "$(test_exe tessera-kernels cuda_allreduce cuda)" .gpu/cuda_allreduce  # tp stage: needs 2 GPUs
    # CPU kernels whose AVX-512 VNNI paths this machine (AVX2 only, like CI's) cannot run:
    # the device's host CPU runs them in the kernels stage.
    for t in $CPU_TESTS; do cp "$(test_exe tessera-kernels "$t" "")" ".gpu/$t"; done
    cargo build --release --features cuda
    cp target/release/tessera .gpu/tessera
    strip .gpu/*
    xz -T0 -6 .gpu/*
    if [[ -f "$MODEL" ]]; then
        half=$(( $(stat -c %s "$MODEL") / 2 ))
        head -c "$half" "$MODEL" > .gpumodel/part-a
        tail -c +"$(( half + 1 ))" "$MODEL" > .gpumodelb/part-b
        sha256sum "$MODEL" | cut -d' ' -f1 > .gpu/model.sha256
    fi
    du -sh .gpu .gpumodel .gpumodelb; ls -l .gpu
    exit 0
fi

STAGES=${*:-kernels model serve bench}
LOG=${OUT:-/tmp}
BIN=/tmp/tessera-gpu-bin
mkdir -p "$BIN"
for f in .gpu/*.xz; do xz -dc "$f" > "$BIN/$(basename "$f" .xz)"; chmod +x "$BIN/$(basename "$f" .xz)"; done
# A fresh kernel cache: the first Device compiles with NVRTC, later ones hit the cache.
export TESSERA_CACHE_DIR=$(mktemp -d)
rc_all=0
run() { # label logfile command...
    local label=$1 log=$2; shift 2
    echo "== $label" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    (( rc != 0 )) && { echo "!! $label exited $rc" | tee -a "$log"; rc_all=1; }
    return 0
}

# part-a and part-b arrive in earlier calls (carry .gpumodel / .gpumodelb; those calls copy
# them to /tmp).
[[ -f .gpumodel/part-a ]] && cp .gpumodel/part-a /tmp/part-a
[[ -f .gpumodelb/part-b ]] && cp .gpumodelb/part-b /tmp/part-b
if [[ -f /tmp/part-a && -f /tmp/part-b ]]; then
    cat /tmp/part-a /tmp/part-b > /tmp/smollm2.gguf
    echo "$(cat .gpu/model.sha256)  /tmp/smollm2.gguf" | sha256sum -c -
    export TESSERA_MODEL_PATH=/tmp/smollm2.gguf
fi

echo "== device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used \
    --format=csv 2>&1 | tee "$LOG/device.txt"

if [[ " $STAGES " == *" kernels "* ]]; then
    : > "$LOG/kernels.log"
    for t in $KERNEL_TESTS; do
        run "kernel tests $t" "$LOG/kernels.log" env TESSERA_GPU_TESTS=1 "$BIN/$t" --test-threads=1 --nocapture --skip bench_
    done
    [[ -n "${SKIP_KERNEL_BENCH:-}" ]] || for t in $KERNEL_TESTS; do
        run "kernel benchmarks $t" "$LOG/kernels.log" env TESSERA_GPU_BENCH=1 "$BIN/$t" --test-threads=1 --nocapture bench_
    done
    run "peer: PyTorch bf16 GEMM" "$LOG/kernels.log" python3 bench/gpu/torch_gemm.py
    # The CPU kernels on the host's ISA (the VNNI kernels must equal the AVX2 ones bit for bit).
    run "host CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(grep -o 'avx512_vnni\|avx512vl' /proc/cpuinfo | sort -u | xargs)" \
        "$LOG/kernels.log" true
    for t in $CPU_TESTS; do
        run "CPU kernel tests $t" "$LOG/kernels.log" "$BIN/$t" --nocapture
    done
fi

if [[ " $STAGES " == *" model "* ]]; then
    : > "$LOG/model.log"
    run "PyTorch reference: random Qwen3" "$LOG/model.log" python3 bench/gpu/torch_qwen3_ref.py /tmp/qwen3-ref
    run "model tests" "$LOG/model.log" env TESSERA_GPU_TESTS=1 TESSERA_TORCH_REF=/tmp/qwen3-ref \
        "$BIN/cuda_model" --test-threads=1 --nocapture
fi

if [[ " $STAGES " == *" serve "* ]]; then
    : > "$LOG/serve.log"
    if [[ -f /tmp/smollm2.gguf ]]; then
        run "tessera serve --device cuda (SmolLM2)" "$LOG/serve.log" python3 bench/gpu/serve_check.py "$BIN/tessera" /tmp/smollm2.gguf
        for c in 1 16 64; do
            run "loadgen c=$c" "$LOG/serve.log" sh -c "$BIN/tessera serve --device cuda --model /tmp/smollm2.gguf --port 8124 >/tmp/serve-load.log 2>&1 & p=\$!; \
                for i in \$(seq 120); do curl -sf localhost:8124/ready >/dev/null && break; sleep 0.5; done; \
                python3 bench/loadgen.py --url http://127.0.0.1:8124 --concurrency $c --duration 15 --prompt-tokens 128 \
                    --max-tokens 128 --ignore-eos --label 'tessera cuda c=$c' --header; kill \$p; wait \$p"
        done
    else
        echo "!! no /tmp/smollm2.gguf: carry .gpumodel and .gpumodelb in earlier calls" | tee -a "$LOG/serve.log"
    fi
fi

if [[ " $STAGES " == *" bench "* ]]; then
    : > "$LOG/bench.log"
    for shape in ${BENCH_SHAPES:-llama-3-8b-v49k llama-3.1-8b}; do
        run "tessera bench --device cuda --synthetic $shape" "$LOG/bench.log" \
            "$BIN/tessera" bench --device cuda --synthetic "$shape" ${BENCH_ARGS:-}
    done
fi

if [[ " $STAGES " == *" trace "* ]]; then
    # Kernel timeline of decode steps (CUDA graph nodes included) through CUPTI
    # (bench/gpu/kernel_trace.c), one process per batch size; the traces stay in $LOG.
    : > "$LOG/trace.log"
    cupti=${CUPTI_DIR:-/usr/local/cuda-13.0/targets/x86_64-linux}
    rm -f /tmp/libktrace.so
    if run "build the CUPTI kernel tracer" "$LOG/trace.log" gcc -O2 -shared -fPIC -I"$cupti/include" \
        -o /tmp/libktrace.so bench/gpu/kernel_trace.c -L"$cupti/lib" -lcupti && [[ -f /tmp/libktrace.so ]]; then
        for b in ${TRACE_BATCHES:-1 64}; do
            run "kernel timeline, ${TRACE_SHAPE:-llama-3-8b-v49k}, $b sequences" "$LOG/trace.log" sh -c \
                "LD_LIBRARY_PATH=$cupti/lib CUDA_INJECTION64_PATH=/tmp/libktrace.so KTRACE_OUT=$LOG/trace$b.csv \
                 $BIN/tessera bench --device cuda --synthetic ${TRACE_SHAPE:-llama-3-8b-v49k} --prompts 512 \
                 --batches $b --gen-tokens 32 | grep -E '^\\| decode' && python3 bench/gpu/kernel_timeline.py $LOG/trace$b.csv"
        done
    fi
fi

if [[ " $STAGES " == *" tp "* ]]; then
    : > "$LOG/tp.log"
    [[ -f /tmp/qwen3-ref/logits.f32 ]] || run "PyTorch reference: random Qwen3" "$LOG/tp.log" \
        python3 bench/gpu/torch_qwen3_ref.py /tmp/qwen3-ref
    # One-shot all-reduce over NVLink peer memory: ranks as processes (CUDA IPC) and as threads.
    # Two GPUs are this stage's premise: with TESSERA_NEED_TWO_GPUS=1 a test that finds fewer
    # fails instead of skipping.
    export TESSERA_NEED_TWO_GPUS=1
    run "NCCL tests" "$LOG/tp.log" env TESSERA_GPU_TESTS=1 "$BIN/cuda_nccl" --test-threads=1 --skip bench_
    run "one-shot all-reduce tests" "$LOG/tp.log" env TESSERA_GPU_TESTS=1 \
        "$BIN/cuda_allreduce" --test-threads=1 --nocapture --skip bench_
    run "one-shot all-reduce vs NCCL benchmark" "$LOG/tp.log" env TESSERA_GPU_BENCH=1 \
        "$BIN/cuda_allreduce" --test-threads=1 --nocapture bench_
    run "tensor-parallel tests" "$LOG/tp.log" env TESSERA_GPU_TESTS=1 TESSERA_TORCH_REF=/tmp/qwen3-ref \
        "$BIN/cuda_tp" --test-threads=1 --nocapture
    run "stuck-step watch (tp=2 worker services)" "$LOG/tp.log" env TESSERA_GPU_TESTS=1 \
        TESSERA_TORCH_REF=/tmp/qwen3-ref "$BIN/cuda_service_stuck" --nocapture
    for shape in ${TP_SHAPES:-llama-3.1-8b}; do
        for split in "--tp 2" "--pp 2"; do
            run "tessera bench --device cuda $split --synthetic $shape" "$LOG/tp.log" \
                "$BIN/tessera" bench --device cuda $split --synthetic "$shape" --batches 1,64,256 ${BENCH_ARGS:-}
        done
    done
    # The serving path over two pipeline stages (SmolLM2 cannot be split over 2 tensor ranks).
    if [[ -f /tmp/smollm2.gguf ]]; then
        run "tessera serve --device cuda --pp 2 (SmolLM2)" "$LOG/tp.log" \
            python3 bench/gpu/serve_check.py "$BIN/tessera" /tmp/smollm2.gguf --pp 2
    fi
fi

echo
echo "== summary ($STAGES)"
cat "$LOG"/kernels.log "$LOG"/model.log "$LOG"/serve.log "$LOG"/tp.log 2>/dev/null \
    | grep -E '^== |^test result:|FAILED|FAIL |panicked|^!! |RESULT|TORCH|^\| tessera|skipped [a-z0-9_]+: |bit-equal|^== host CPU' | sed 's/^/  /'
[[ -f "$LOG/kernels.log" ]] && { echo "| op | shape | time | rate | bandwidth |"; echo "|---|---|---|---|---|";
    grep -oE 'BENCH \|.*' "$LOG/kernels.log" | sed 's/^BENCH //; s/$/ |/'; }
[[ -f "$LOG/bench.log" ]] && grep -E '^(#|\|)' "$LOG/bench.log"
[[ -f "$LOG/tp.log" ]] && grep -E '^(#|\|)' "$LOG/tp.log"
exit $rc_all
