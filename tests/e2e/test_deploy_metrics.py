"""The operator's dashboard and alerts read metrics that exist.

Every `tessera:` metric that the Grafana dashboard (deploy/observability/grafana), the
Prometheus alert rules (deploy/observability/tessera-alerts.yml) and the gateway
autoscaler (deploy/k8s/base/autoscaling.yaml) query must be exported by a running cluster,
by the role whose job the query names (`job="tessera-gateway" | "tessera-coordinator" |
"tessera-worker"`, the jobs of prometheus.yml and the ServiceMonitors). A histogram counts
when it is queried through its `_bucket`, `_sum` or `_count` series. Label matchers must
match too: a label the metric does not carry, or a value it never takes (e.g. a failure
`reason`), would make a panel silently empty or an alert never fire.

The cluster is the shared `tessera serve` one; its coordinator and worker serve /metrics
on the admin endpoints they print at start (support.admin_addresses).
"""
import json
import re
from pathlib import Path

import yaml

from support import MODEL_NAME, REPO, admin_addresses, metric_families, scrape

OBSERVABILITY = REPO / "deploy" / "observability"
ROLES = ("gateway", "coordinator", "worker")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# A metric name, then optionally its selector: `tessera:foo_bucket{job="tessera-gateway", reason=~"a|b"}`.
REFERENCE = re.compile(r"(tessera:[A-Za-z0-9_:]+)(\{[^}]*\})?")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{([^}]*)\})?\s")
# Labels Prometheus adds at scrape time, not the process.
TARGET_LABELS = {"job", "instance"}


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard, the alert rules and the autoscaler."""
    out = []
    dashboard = json.loads((OBSERVABILITY / "grafana" / "tessera-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"dashboard panel {panel['title']!r}", target["expr"]))
    rules = yaml.safe_load((OBSERVABILITY / "tessera-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule.get('alert') or rule.get('record')}", rule["expr"]))
    for doc in yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / "autoscaling.yaml").read_text()):
        for trigger in doc["spec"]["triggers"]:
            out.append((f"autoscaler {doc['metadata']['name']}", trigger["metadata"]["query"]))
    return out


def samples(text: str) -> dict[str, list[dict[str, str]]]:
    """The label sets of every sample, by sample name."""
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = dict((k, v) for k, _, v in MATCHER.findall(m.group(2) or ""))
            out.setdefault(m.group(1), []).append(labels)
    return out


def family_of(name: str, families: dict[str, str]) -> str | None:
    if name in families:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base) == "histogram":
            return base
    return None


def matches(op: str, pattern: str, value: str) -> bool:
    full = re.fullmatch(pattern, value) is not None if op in ("=~", "!~") else value == pattern
    return full if op in ("=", "=~") else not full


def test_every_metric_the_dashboard_and_alerts_use_exists(cluster):
    # One request, so the histograms and counters have observations, not only declarations.
    r = cluster.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Deploy", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text

    addrs = admin_addresses(cluster)
    assert "coordinator" in addrs and "worker" in addrs, f"no admin endpoints announced: {addrs}"
    texts = {"gateway": scrape(cluster.url("/metrics")),
             "coordinator": scrape(f"http://{addrs['coordinator'][-1]}/metrics"),
             "worker": scrape(f"http://{addrs['worker'][-1]}/metrics")}
    families = {role: metric_families(texts[role]) for role in ROLES}
    series = {role: samples(texts[role]) for role in ROLES}

    problems, checked = [], set()
    for where, expr in queries():
        for name, selector in REFERENCE.findall(expr):
            matchers = MATCHER.findall(selector or "")
            jobs = [v for k, op, v in matchers if k == "job" and op == "="]
            for _, op, v in matchers:
                if _ == "job" and op == "=" and v.removeprefix("tessera-") not in ROLES:
                    problems.append(f"{where}: job {v!r} is not a Tessera role's job")
            roles = [j.removeprefix("tessera-") for j in jobs if j.removeprefix("tessera-") in ROLES] or list(ROLES)
            found = [role for role in roles if family_of(name, families[role])]
            if not found:
                problems.append(f"{where}: {name} is not exported by {' or '.join(roles)}")
                continue
            checked.add(name)
            for role in found:
                label_sets = series[role].get(name, [])
                for key, op, value in matchers:
                    if key in TARGET_LABELS:
                        continue
                    if not any(key in ls for ls in label_sets) and op in ("=", "=~"):
                        problems.append(f"{where}: {name} on the {role} has no label {key!r}")
                        continue
                    values = {ls.get(key, "") for ls in label_sets}
                    if op in ("=", "=~") and not any(matches(op, value, v) for v in values):
                        problems.append(f"{where}: {name}{{{key}{op}{value!r}}} matches none of {sorted(values)}")
                    if op == "=~":
                        for alternative in value.split("|"):
                            if re.fullmatch(r"[A-Za-z0-9_]+", alternative) and alternative not in values:
                                problems.append(f"{where}: {name} never has {key}={alternative!r}")
    assert not problems, "\n".join(problems)
    # The files really were read: the core series of each role are among those checked.
    for name in ("tessera:time_to_first_token_seconds_bucket", "tessera:num_requests_waiting",
                 "tessera:kv_cache_usage_perc", "tessera:prefix_cache_hits_total",
                 "tessera:worker_collective_seconds_sum", "tessera:worker_step_duration_seconds_bucket"):
        assert name in checked, f"{name} not used by the dashboard or the alerts"


def test_reference_parsing_catches_a_missing_metric_and_label_value():
    """The checks above fail on what they are meant to catch (no cluster needed)."""
    families = {"tessera:x_seconds": "histogram", "tessera:y_total": "counter"}
    assert family_of("tessera:x_seconds_bucket", families) == "tessera:x_seconds"
    assert family_of("tessera:y_total_bucket", families) is None
    assert family_of("tessera:z", families) is None
    refs = REFERENCE.findall('sum(rate(tessera:y_total{job="tessera-gateway", reason=~"a|b"}[5m])) / tessera:z')
    assert [r[0] for r in refs] == ["tessera:y_total", "tessera:z"]
    assert MATCHER.findall(refs[0][1]) == [("job", "=", "tessera-gateway"), ("reason", "=~", "a|b")]
    assert samples('tessera:y_total{reason="a"} 1\ntessera:y_total{reason="c"} 0\n# TYPE x counter\n') == \
        {"tessera:y_total": [{"reason": "a"}, {"reason": "c"}]}
    assert matches("=~", "a|b", "a") and not matches("=~", "a|b", "c") and matches("!=", "a", "b")
