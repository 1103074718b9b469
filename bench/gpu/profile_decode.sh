#!/usr/bin/env bash
# Per-kernel timings of one decode step (bench/RESULTS.md's "where the time goes"): runs
# `tessera bench` on a synthetic shape under Nsight Compute with graph nodes profiled one by
# one, and prints each kernel's mean duration and count over the profiled decode steps.
# Usage (device machine, after run.sh has unpacked the binaries):
#   bash bench/gpu/profile_decode.sh [shape] [batch] [tp]
# ncu serialises the kernels, so the sum is an upper bound on the graph's step time (no
# programmatic-launch overlap, no launch gaps); the shares are what it is for.
set -euo pipefail
SHAPE=${1:-llama-3-8b-v49k}
BATCH=${2:-1}
BIN=${BIN:-/tmp/tessera-gpu-bin}
OUTDIR=${OUT:-/tmp}
# Decode kernels only: skip prefill and the first steps, profile ~3 steps' worth.
ncu --graph-profiling node --cache-control none --clock-control none \
    --metrics gpu__time_duration.sum --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-700}" \
    --csv --log-file "$OUTDIR/ncu.log" \
    "$BIN/tessera" bench --device cuda --synthetic "$SHAPE" --prompts 512 --batches "$BATCH" \
    --gen-tokens 64 --repetitions 1 > "$OUTDIR/ncu.csv" 2>"$OUTDIR/ncu.err" || true
python3 - "$OUTDIR/ncu.log" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    print(open(sys.argv[1]).read()[-2000:]); sys.exit(0)
h = rows[0]
ki, vi = h.index("Kernel Name"), h.index("Metric Value")
t = collections.defaultdict(list)
for r in rows[1:]:
    try:
        t[r[ki].split("(")[0]].append(float(r[vi].replace(",", "")))
    except ValueError:
        pass
unit = [r for r in rows[1:2]][0][h.index("Metric Unit")] if rows[1:] else "?"
total = sum(sum(v) for v in t.values())
print(f"| kernel | calls | mean ({unit}) | share |")
print("|---|---:|---:|---:|")
for k, v in sorted(t.items(), key=lambda kv: -sum(kv[1])):
    print(f"| {k} | {len(v)} | {sum(v)/len(v):.1f} | {100*sum(v)/total:.1f}% |")
PY
