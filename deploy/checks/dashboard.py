"""Checks the Grafana dashboard (deploy/observability/grafana/tessera-dashboard.json):
its layout (unique panel ids, every panel inside the 24-column grid and overlapping no
other, a Prometheus query with a refId in every panel) and every query's PromQL, by
writing the queries as recording rules and running `promtool check rules` on them
(Grafana's $__rate_interval and friends become 5m first).

Usage: python dashboard.py DASHBOARD.json PROMTOOL   (exit 1 with the problems on failure)
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def queries(dashboard):
    for panel in dashboard["panels"]:
        for sub in [panel, *panel.get("panels", [])]:
            for t in sub.get("targets", []):
                yield sub, t


def check_layout(dashboard, problems):
    ids, boxes = set(), []
    for p in dashboard["panels"]:
        if p["id"] in ids:
            problems.append(f"panel id {p['id']} is used twice")
        ids.add(p["id"])
        g = p["gridPos"]
        if g["x"] < 0 or g["x"] + g["w"] > 24:
            problems.append(f"panel {p['title']!r} leaves the 24-column grid")
        for other, og in boxes:
            if g["x"] < og["x"] + og["w"] and og["x"] < g["x"] + g["w"] and g["y"] < og["y"] + og["h"] and og["y"] < g["y"] + g["h"]:
                problems.append(f"panels {p['title']!r} and {other!r} overlap")
        boxes.append((p["title"], g))
        if p["type"] != "row":
            if not p.get("targets"):
                problems.append(f"panel {p['title']!r} has no query")
            for t in p.get("targets", []):
                if not t.get("expr") or not t.get("refId"):
                    problems.append(f"panel {p['title']!r}: a target without expr or refId")


def check_promql(dashboard, promtool, problems):
    rules = []
    for i, (panel, target) in enumerate(queries(dashboard)):
        expr = target["expr"]
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        rules.append({"record": f"dashboard:panel_{panel['id']}:{target['refId']}", "expr": expr})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dashboard-queries.yml"
        path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
        out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        if out.returncode != 0:
            problems.append("PromQL errors:\n" + out.stdout + out.stderr)
    return len(rules)


def main(path, promtool):
    dashboard = json.loads(Path(path).read_text())
    problems = []
    check_layout(dashboard, problems)
    n = check_promql(dashboard, promtool, problems)
    for p in problems:
        print(f"{path}: {p}")
    if not problems:
        print(f"{path}: {len(dashboard['panels'])} panels, {n} queries: layout and PromQL valid")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
