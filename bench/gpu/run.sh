#!/usr/bin/env bash
# CUDA kernel tests and micro-benchmarks of tessera-kernels, in one call on a GPU machine.
#
#   bench/gpu/run.sh prepare   # here (no GPU needed): build the test binary into .gpu/
#   bench/gpu/run.sh           # on the GPU machine: run tests, then benchmarks, print a table
#
# The device machine has no Rust: `prepare` builds `tests/cuda_ops.rs` with the `cuda`
# feature (cudarc loads libcuda/libnvrtc/libcublasLt at run time, so no toolkit is needed
# here), strips it and copies it to .gpu/cuda_ops. .gpu/ is listed in .git/info/exclude and
# travels with the device tool's `carry: [".gpu"]`. Logs go to $OUT (or /tmp) as tests.log
# and bench.log.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [[ "${1:-}" == prepare ]]; then
    set -e
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    exe=$(cargo test --release -p tessera-kernels --features cuda --test cuda_ops --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_ops":
        print(m["executable"])')
    mkdir -p .gpu
    cp "$exe" .gpu/cuda_ops
    strip .gpu/cuda_ops
    ls -l .gpu/cuda_ops
    exit 0
fi

BIN=${BIN:-.gpu/cuda_ops}
LOG=${OUT:-/tmp}
# A fresh kernel cache: the first Device compiles with NVRTC, later ones hit the cache.
export TESSERA_CACHE_DIR=$(mktemp -d)

echo "== device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used \
    --format=csv 2>&1 | tee "$LOG/device.txt"

echo "== tests (TESSERA_GPU_TESTS=1)"
TESSERA_GPU_TESTS=1 "$BIN" --test-threads=1 --nocapture --skip bench_ 2>&1 | tee "$LOG/tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmarks (TESSERA_GPU_BENCH=1)"
TESSERA_GPU_BENCH=1 "$BIN" --test-threads=1 --nocapture bench_ 2>&1 | tee "$LOG/bench.log"
bench_rc=${PIPESTATUS[0]}

echo "== peer: PyTorch bf16 GEMM at the same shapes"
python3 bench/gpu/torch_gemm.py 2>&1 | tee "$LOG/torch.log"

echo
echo "== summary"
grep -E '^test result:|FAILED|panicked' "$LOG/tests.log" "$LOG/bench.log" | sed 's/^/  /'
grep -oE 'module .* compiled in .*|device NVIDIA.*' "$LOG/tests.log" | sed 's/^/  /'
echo "  tests exit $tests_rc, benchmarks exit $bench_rc"
echo
echo "| op | shape | time | rate | bandwidth |"
echo "|---|---|---|---|---|"
grep -oE 'BENCH \|.*' "$LOG/bench.log" | sed 's/^BENCH //; s/$/ |/'
grep -oE 'TORCH \|.*' "$LOG/torch.log" | sed 's/^TORCH | gemm/| torch gemm/; s/$/ |/'
exit $(( tests_rc != 0 || bench_rc != 0 ))
