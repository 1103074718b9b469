#!/usr/bin/env bash
# CUDA kernel tests and micro-benchmarks of tessera-kernels, in one call on a GPU machine.
#
#   bench/gpu/run.sh prepare   # here (no GPU needed): build the test binaries into .gpu/
#   bench/gpu/run.sh           # on the GPU machine: run tests, then benchmarks, print a table
#
# The device machine has no Rust: `prepare` builds `tests/cuda_ops.rs` and
# `tests/cuda_attention.rs` with the `cuda` feature (cudarc loads libcuda/libnvrtc/
# libcublasLt at run time, so no toolkit is needed here), strips them and copies them to
# .gpu/<test name>. .gpu/ is listed in .git/info/exclude and
# travels with the device tool's `carry: [".gpu"]`. Logs go to $OUT (or /tmp) as tests.log
# and bench.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
TESTS="cuda_ops cuda_attention"

if [[ "${1:-}" == prepare ]]; then
    set -e
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    mkdir -p .gpu
    for t in $TESTS; do
        exe=$(cargo test --release -p tessera-kernels --features cuda --test "$t" --no-run --message-format=json 2>/dev/null \
            | T="$t" python3 -c 'import json,os,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == os.environ["T"]:
        print(m["executable"])')
        cp "$exe" ".gpu/$t"
        strip ".gpu/$t"
        ls -l ".gpu/$t"
    done
    exit 0
fi

BINDIR=${BINDIR:-.gpu}
LOG=${OUT:-/tmp}
# A fresh kernel cache: the first Device compiles with NVRTC, later ones hit the cache.
export TESSERA_CACHE_DIR=$(mktemp -d)

echo "== device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,utilization.gpu,memory.used \
    --format=csv 2>&1 | tee "$LOG/device.txt"

tests_rc=0
bench_rc=0
: > "$LOG/tests.log"
: > "$LOG/bench.log"
for t in $TESTS; do
    echo "== tests $t (TESSERA_GPU_TESTS=1)" | tee -a "$LOG/tests.log"
    TESSERA_GPU_TESTS=1 "$BINDIR/$t" --test-threads=1 --nocapture --skip bench_ 2>&1 | tee -a "$LOG/tests.log"
    rc=${PIPESTATUS[0]}; (( rc != 0 )) && tests_rc=$rc
done
for t in $TESTS; do
    echo "== benchmarks $t (TESSERA_GPU_BENCH=1)" | tee -a "$LOG/bench.log"
    TESSERA_GPU_BENCH=1 "$BINDIR/$t" --test-threads=1 --nocapture bench_ 2>&1 | tee -a "$LOG/bench.log"
    rc=${PIPESTATUS[0]}; (( rc != 0 )) && bench_rc=$rc
done

echo "== peer: PyTorch bf16 GEMM at the same shapes"
python3 bench/gpu/torch_gemm.py 2>&1 | tee "$LOG/torch.log"

echo
echo "== summary"
grep -E '^== |^test result:|FAILED|panicked' "$LOG/tests.log" "$LOG/bench.log" | sed 's/^/  /'
grep -oE 'module .* compiled in .*|device NVIDIA.*' "$LOG/tests.log" | sed 's/^/  /'
echo "  tests exit $tests_rc, benchmarks exit $bench_rc"
echo
echo "| op | shape | time | rate | bandwidth |"
echo "|---|---|---|---|---|"
grep -oE 'BENCH \|.*' "$LOG/bench.log" | sed 's/^BENCH //; s/$/ |/'
grep -oE 'TORCH \|.*' "$LOG/torch.log" | sed 's/^TORCH | gemm/| torch gemm/; s/$/ |/'
exit $(( tests_rc != 0 || bench_rc != 0 ))
