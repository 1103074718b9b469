#!/usr/bin/env python3
"""Where a served step's time goes, from the coordinator's Prometheus histograms: the
mean wall time of an engine step (`tessera:step_duration_seconds`), its coordinator part
(`step_cpu`), the worker's forward pass and sampling (`step_worker`), the rest (between
the processes: gRPC, waiting), and the mean tokens and sequences per step.

  python3 bench/step_breakdown.py URL/metrics --save before.json   # snapshot
  ... run a load ...
  python3 bench/step_breakdown.py URL/metrics --since before.json --label "c=16"

With --since, only the steps between the snapshot and now count. Prints one markdown row.
"""
import argparse
import json
import re
import sys
import urllib.request

HISTS = {
    "step": "tessera:step_duration_seconds",
    "coord": "tessera:step_cpu_seconds",
    "worker": "tessera:step_worker_seconds",
    "tokens": "tessera:iteration_tokens_total",
    "seqs": "tessera:batch_size",
}


def scrape(url):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for key, name in HISTS.items():
        s = c = 0.0
        for m in re.finditer(rf"^{re.escape(name)}_(sum|count)(?:{{[^}}]*}})? (\S+)$", text, re.M):
            if m.group(1) == "sum":
                s += float(m.group(2))
            else:
                c += float(m.group(2))
        out[key] = [s, c]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--save")
    ap.add_argument("--since")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    now = scrape(a.url)
    if a.save:
        json.dump(now, open(a.save, "w"))
        return
    if a.since:
        before = json.load(open(a.since))
        now = {k: [v[0] - before[k][0], v[1] - before[k][1]] for k, v in now.items()}
    mean = {k: (v[0] / v[1] if v[1] else float("nan")) for k, v in now.items()}
    steps = now["step"][1]
    other = mean["step"] - mean["coord"] - mean["worker"]
    print(f"| {a.label} | {steps:.0f} | {mean['step'] * 1e3:.2f} | {mean['coord'] * 1e3:.2f} | "
          f"{mean['worker'] * 1e3:.2f} | {other * 1e3:.2f} | {mean['tokens']:.1f} | {mean['seqs']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
