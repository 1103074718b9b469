#!/usr/bin/env python3
"""Summarises a kernel trace of bench/gpu/kernel_trace.c per decode step.

A decode step is one replay of a CUDA graph: the kernels from one `unpack4_u32` (the graph's
first node) to the next. For the median step it prints the step's span, the time no kernel
ran (idle), and per kernel name the count, the mean duration and the mean time it ran alone
(no other kernel overlapping, i.e. what it adds to the step); then one middle layer's kernels
in start order with each one's start, duration and the gap since the previous kernel ended
(negative: it started before that one ended, programmatic launch).

A step may also be delimited by non-graph work alone (`--step-kernel -`): every run of graph
nodes between eager kernels, as bench/gpu/fused_modes.cu replays its layer chains (FM_ONLY),
so the chain and the model's step print the same tables.

A trace of several batch sizes (the bench runs batch 1 after its other sizes) holds several
graphs' steps: `--min-span-us N` keeps only the steps of at least N µs (e.g. 5000 for the
64-sequence steps of an 8B model).

Usage: kernel_timeline.py TRACE.csv [--step-kernel NAME|-] [--min-span-us N]
"""
import csv
import statistics
import sys
from collections import defaultdict


def short(name):
    return name.split("(")[0][:40]


def load(path):
    rows = []
    with open(path) as f:
        for r in csv.reader(line for line in f if not line.startswith("#")):
            if r[0] == "start_ns":
                continue
            rows.append((int(r[0]), int(r[1]), int(r[2]), short(",".join(r[8:]))))
    rows.sort()
    return rows


def steps(rows, first="unpack4_u32"):
    """Graph replays: runs of graph-node kernels, each starting at `first` ("-": at the first
    graph node after eager work)."""
    out, cur = [], None
    for r in rows:
        if r[2] == 0:  # not a graph node: eager work (prefill, warm-up)
            if cur:
                out.append(cur)
            cur = None
            continue
        if (r[3].startswith(first) if first != "-" else cur is None):
            if cur:
                out.append(cur)
            cur = []
        if cur is not None:
            cur.append(r)
    if cur:
        out.append(cur)
    return [s for s in out if len(s) > 10]


def alone_time(ks):
    """Per kernel index: the time it ran with no other kernel of the step running."""
    events = sorted([(s, 1, i) for i, (s, e, _, _) in enumerate(ks)] + [(e, -1, i) for i, (s, e, _, _) in enumerate(ks)])
    alone = [0] * len(ks)
    running = set()
    last = None
    idle = 0
    for t, kind, i in events:
        if last is not None:
            if len(running) == 1:
                alone[next(iter(running))] += t - last
            elif not running:
                idle += t - last
        if kind == 1:
            running.add(i)
        else:
            running.discard(i)
        last = t
    return alone, idle


def main():
    rows = load(sys.argv[1])
    args = sys.argv[2:]
    first = args[args.index("--step-kernel") + 1] if "--step-kernel" in args else "unpack4_u32"
    st = steps(rows, first)
    if "--min-span-us" in args:
        floor = float(args[args.index("--min-span-us") + 1]) * 1e3
        st = [s for s in st if s[-1][1] - s[0][0] >= floor]
    if not st:
        print("no graph steps in the trace")
        return
    spans = [s[-1][1] - s[0][0] for s in st]
    med = sorted(range(len(st)), key=lambda i: spans[i])[len(st) // 2]
    s = st[med]
    alone, idle = alone_time(s)
    print(f"{len(st)} graph steps, {len(s)} kernels each; median step span {spans[med] / 1e3:.1f} us "
          f"(min {min(spans) / 1e3:.1f}), no kernel running {idle / 1e3:.1f} us")
    agg = defaultdict(lambda: [0, 0, 0])
    for (b, e, _, n), a in zip(s, alone):
        agg[n][0] += 1
        agg[n][1] += e - b
        agg[n][2] += a
    print(f"{'kernel':40} {'count':>5} {'mean us':>8} {'alone us':>9} {'alone total':>11}")
    for n, (c, d, a) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        print(f"{n:40} {c:5d} {d / c / 1e3:8.2f} {a / c / 1e3:9.2f} {a / 1e3:11.1f}")
    # One middle layer: the kernels between two consecutive starts of the layer's first
    # kernel (the first, in step order, that runs once per layer: as often as attention).
    counts = defaultdict(int)
    for *_, n in s:
        counts[n] += 1
    att = [c for n, c in counts.items() if n.startswith("paged_decode")]
    layers = att[0] if att else max(counts.values())
    first = next(n for *_, n in s if counts[n] == layers)
    idx = [i for i, r in enumerate(s) if r[3] == first]
    mid = len(idx) // 2
    lo, hi = idx[mid], idx[mid + 1] if mid + 1 < len(idx) else len(s)
    t0 = s[lo][0]
    print(f"\nlayer {mid} of {len(idx)} (from '{first}'), us:")
    print(f"{'kernel':40} {'start':>7} {'dur':>7} {'gap':>7} {'alone':>7}")
    prev_end = s[lo - 1][1] if lo > 0 else t0
    for i in range(lo, hi):
        b, e, _, n = s[i]
        print(f"{n:40} {(b - t0) / 1e3:7.2f} {(e - b) / 1e3:7.2f} {(b - prev_end) / 1e3:7.2f} {alone[i] / 1e3:7.2f}")
        prev_end = max(prev_end, e)
    print(f"layer span {(s[hi][0] - t0) / 1e3 if hi < len(s) else (prev_end - t0) / 1e3:.2f} us")


if __name__ == "__main__":
    main()
