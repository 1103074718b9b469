#!/usr/bin/env python3
"""What a decode step runs after its LM head, from a kernel_trace.c trace taken with
KTRACE_MEMCPY=1 (kernels and copies): for the median step, each kernel and copy from the end
of the step's last cuBLASLt kernel (the LM head) to the next step's first kernel, with its
start (µs after the LM head ended), duration and, for copies, bytes. Steps are the runs from
one `unpack4_u32` (a decode graph's first node) to the next; steps with another number of
events than the most common are left out.

Usage: step_tail.py TRACE.csv
"""
import collections
import csv
import statistics
import sys


def main(path):
    rows = []
    with open(path) as f:
        for r in csv.reader(line for line in f if not line.startswith("#")):
            if r[0] == "start_ns":
                continue
            rows.append((int(r[0]), int(r[1]), ",".join(r[8:]).split("(")[0][:40], r[3]))
    rows.sort()
    starts = [i for i, r in enumerate(rows) if r[2] == "unpack4_u32"]
    tails = []
    for a, b in zip(starts, starts[1:]):
        seg = rows[a:b]
        heads = [i for i, r in enumerate(seg) if r[2].startswith("nvjet")]
        if not heads:
            continue
        end = seg[heads[-1]][1]
        tail = [(name, (s - end) / 1e3, (e - s) / 1e3, n if name.startswith("memcpy") else "")
                for s, e, name, n in seg[heads[-1] + 1:]]
        tail.append(("next step's first kernel", (rows[b][0] - end) / 1e3, 0.0, ""))
        tails.append(tail)
    if not tails:
        sys.exit("no decode steps with an LM head in the trace")
    n = collections.Counter(len(t) for t in tails).most_common(1)[0][0]
    tails = [t for t in tails if len(t) == n]
    print(f"{len(tails)} steps; after the LM head ends (µs): event, start, duration, bytes")
    for i in range(n):
        print("  %-28s %8.2f %7.2f  %s" % (tails[0][i][0], statistics.median(t[i][1] for t in tails),
                                           statistics.median(t[i][2] for t in tails), tails[0][i][3]))


if __name__ == "__main__":
    main(sys.argv[1])
