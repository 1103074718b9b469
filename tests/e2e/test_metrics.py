"""Metrics: after a known workload the counters of every role add up.

The cluster runs one sequence and queues one more at most (`metrics_cluster`), so the
workload's outcomes are certain: successes (streamed and not, one cut by `max_tokens`),
rejections before generation (an invalid request, an unknown model, a full queue: 429), and
one client that goes away mid-stream. Then, on the gateway,
requests = successes + failures + cancellations + rejections, TTFT is observed once per
request that produced a token, and the token counters equal the responses' usage; the
coordinator and the worker answer on their admin endpoints with step counts, one queue time
per admitted request and prefix-cache hits for a repeated prompt. The ranks of a
tensor-parallel replica each report the time their steps spent in collectives.

`EXPECTED_METRICS` lists, per role, the metric names operators' dashboards use; a deploy
test can import it.
"""
import collections
import time

import requests

from support import MODEL_NAME, admin_addresses, assert_openai_error, metric_families, parse_metrics, scrape, sse_events

EXPECTED_METRICS = {
    "gateway": [
        "tessera:requests_total",
        "tessera:requests_in_progress",
        "tessera:request_success_total",
        "tessera:request_failure_total",
        "tessera:request_cancelled_total",
        "tessera:request_rejected_total",
        "tessera:time_to_first_token_seconds",
        "tessera:inter_token_latency_seconds",
        "tessera:e2e_request_latency_seconds",
        "tessera:prompt_tokens_total",
        "tessera:generation_tokens_total",
        "tessera:request_prompt_tokens",
        "tessera:request_generation_tokens",
        # From the coordinator's Status RPC, summed over its replicas.
        "tessera:num_requests_running",
        "tessera:num_requests_waiting",
        "tessera:kv_cache_usage_perc",
    ],
    "coordinator": [
        "tessera:num_requests_running",
        "tessera:num_requests_waiting",
        "tessera:kv_cache_usage_perc",
        "tessera:prefix_cache_queries_total",
        "tessera:prefix_cache_hits_total",
        "tessera:num_preemptions_total",
        "tessera:request_queue_time_seconds",
        "tessera:iteration_tokens_total",
        "tessera:batch_size",
        "tessera:step_duration_seconds",
        "tessera:step_cpu_seconds",
        "tessera:step_worker_seconds",
        "tessera:lookahead_decodes_total",
    ],
    "worker": [
        "tessera:worker_step_duration_seconds",
        "tessera:worker_tokens_total",
        "tessera:worker_collective_seconds",
    ],
}

# Names ending in `_total` that are not counters: vLLM's histogram of tokens per step, and
# the gateway's gauge of KV blocks (a name older clients read).
TOTAL_BUT_NOT_COUNTER = {"tessera:iteration_tokens_total", "tessera:kv_cache_blocks_total"}

# Long enough to fill several 16-token KV blocks, so its second run hits the prefix cache.
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill, "
               "and the farmer counts his sheep in the green valley below the old stone bridge. ") * 3


def total(samples: dict, name: str) -> float:
    """The sum of a metric's samples over all its label sets."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def admin(cluster) -> dict[str, str]:
    """`/metrics` URLs of the coordinator and the (single) worker."""
    addrs = admin_addresses(cluster)
    assert "coordinator" in addrs and "worker" in addrs, addrs
    return {role: f"http://{addrs[role][-1]}" for role in ("coordinator", "worker")}


def stream_open(c, body: dict) -> requests.Response:
    r = requests.post(c.url("/v1/completions"), json={**body, "stream": True}, stream=True, timeout=120)
    return r


def test_admin_endpoints_answer(metrics_cluster):
    for role, base in admin(metrics_cluster).items():
        assert requests.get(base + "/health", timeout=5).status_code == 200, role
        assert requests.get(base + "/ready", timeout=5).status_code == 200, role
        assert requests.get(base + "/nope", timeout=5).status_code == 404, role


def test_every_dashboard_metric_exists(metrics_cluster):
    urls = {"gateway": metrics_cluster.url("/metrics"), **{r: b + "/metrics" for r, b in admin(metrics_cluster).items()}}
    for role, names in EXPECTED_METRICS.items():
        families = metric_families(scrape(urls[role]))
        missing = [n for n in names if n not in families]
        assert not missing, f"{role} lacks {missing}"
        for name, kind in families.items():
            assert name.startswith("tessera:"), name
            assert (kind == "counter") == name.endswith("_total") or name in TOTAL_BUT_NOT_COUNTER, name


def test_counters_add_up_after_a_known_workload(metrics_cluster):
    c = metrics_cluster
    urls = admin(c)
    before = {"gateway": c.metrics(), **{r: parse_metrics(scrape(b + "/metrics")) for r, b in urls.items()}}
    reasons, usage = collections.Counter(), {"prompt_tokens": 0, "completion_tokens": 0}

    def success(finish_reason, u):
        reasons[finish_reason] += 1
        for k in usage:
            usage[k] += u[k]

    # Successes: the long prompt twice (the second hits the prefix cache), a streamed chat
    # with usage, and a completion cut by max_tokens.
    for _ in range(2):
        r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        success(r.json()["choices"][0]["finish_reason"], r.json()["usage"])
    with requests.post(c.url("/v1/chat/completions"), stream=True, timeout=120,
                       json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}],
                             "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.text
        chunks = list(sse_events(r))
    success(next(ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]),
            chunks[-1]["usage"])
    r = c.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Count: one, two,", "max_tokens": 3,
                                   "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    success("length", r.json()["usage"])

    # Token counters equal the usage of those responses (nothing else ran meanwhile).
    mid = c.metrics()
    assert mid["tessera:generation_tokens_total"] - total(before["gateway"], "tessera:generation_tokens_total") == \
        usage["completion_tokens"]
    assert mid["tessera:prompt_tokens_total"] - total(before["gateway"], "tessera:prompt_tokens_total") == \
        usage["prompt_tokens"]

    # Rejections before generation: invalid, unknown model.
    assert_openai_error(c.post("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "temperature": -1}), 400)
    assert_openai_error(c.post("/v1/completions", {"model": "no-such-model", "prompt": "x"}), 404)
    # A full queue: one sequence running (it has sent a token), one waiting, the next is refused.
    long_body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                 "temperature": 0}
    running = stream_open(c, long_body)
    assert running.status_code == 200
    events = sse_events(running)
    next(events)  # its first token: it is running
    waiting = stream_open(c, {**long_body, "max_tokens": 4})
    assert waiting.status_code == 200  # admitted, queued behind the running one
    assert_openai_error(c.post("/v1/completions", {**long_body, "max_tokens": 4}), 429)
    # The running client goes away mid-stream; the waiting one then runs to its end.
    next(events)
    running.close()
    done = list(sse_events(waiting))
    waiting.close()
    assert done and done[-1]["choices"][0]["finish_reason"] == "length", done[-1:]
    reasons["length"] += 1
    successes = sum(reasons.values())

    # Once the gateway has let go of the cancelled request, nothing is in flight.
    deadline = time.monotonic() + 30
    while c.metrics()["tessera:requests_in_progress"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    after = c.metrics()
    d = {k: v - total(before["gateway"], k) for k, v in after.items() if not k.endswith("_in_progress")}
    requests_seen = d["tessera:requests_total"]
    ended = (total(d, "tessera:request_success_total") + total(d, "tessera:request_failure_total")
             + d["tessera:request_cancelled_total"] + total(d, "tessera:request_rejected_total"))
    print(f"requests {requests_seen}, ended {ended}: {sorted((k, v) for k, v in d.items() if '_total' in k and v)}")
    assert after["tessera:requests_in_progress"] == 0
    assert requests_seen == ended == successes + 1 + 3
    assert total(d, "tessera:request_success_total") == successes
    for reason in ("stop", "length", "abort"):
        assert d[f'tessera:request_success_total{{finished_reason="{reason}"}}'] == reasons[reason], reason
    assert total(d, "tessera:request_failure_total") == 0
    assert d["tessera:request_cancelled_total"] == 1
    assert d['tessera:request_rejected_total{reason="invalid_request"}'] == 1
    assert d['tessera:request_rejected_total{reason="not_found"}'] == 1
    assert d['tessera:request_rejected_total{reason="overloaded"}'] == 1
    # Every request that produced a token, once: the successes and the cancelled one.
    assert d["tessera:time_to_first_token_seconds_count"] == successes + 1
    assert d["tessera:e2e_request_latency_seconds_count"] == successes
    assert d["tessera:inter_token_latency_seconds_count"] > 0
    assert d["tessera:generation_tokens_total"] >= usage["completion_tokens"] + 4 + 2

    # The coordinator: one queue time per admitted request, steps, prefix-cache hits.
    coord = parse_metrics(scrape(urls["coordinator"] + "/metrics"))
    dc = {k: v - before["coordinator"].get(k, 0) for k, v in coord.items()}
    assert dc["tessera:request_queue_time_seconds_count"] == successes + 1
    assert dc["tessera:step_duration_seconds_count"] > 0
    assert dc["tessera:iteration_tokens_total_count"] > 0
    assert dc["tessera:iteration_tokens_total_sum"] >= usage["completion_tokens"]
    assert dc['tessera:prefix_cache_hits_total{replica="0"}'] >= 16
    assert dc['tessera:prefix_cache_queries_total{replica="0"}'] >= dc['tessera:prefix_cache_hits_total{replica="0"}']
    assert coord['tessera:num_requests_running{replica="0"}'] == 0
    assert coord['tessera:num_requests_waiting{replica="0"}'] == 0
    assert 0 <= coord['tessera:kv_cache_usage_perc{replica="0"}'] <= 1

    # The worker: the steps it ran, under their phases, and the tokens it ran.
    work = parse_metrics(scrape(urls["worker"] + "/metrics"))
    dw = {k: v - before["worker"].get(k, 0) for k, v in work.items()}
    assert dw['tessera:worker_step_duration_seconds_count{phase="prefill"}'] > 0
    assert dw['tessera:worker_step_duration_seconds_count{phase="decode"}'] > 0
    assert total(dw, "tessera:worker_step_duration_seconds_count") == dc["tessera:step_duration_seconds_count"]
    assert dw["tessera:worker_tokens_total"] == dc["tessera:iteration_tokens_total_sum"]


def test_sharded_workers_report_their_collective_time(tp3_cluster):
    """Each of the 3 tensor-parallel ranks times the collectives of every step it runs."""
    r = tp3_cluster.post("/v1/completions", {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 4,
                                             "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    workers = admin_addresses(tp3_cluster)["worker"]
    assert len(workers) == 3, workers
    for addr in workers:
        m = parse_metrics(scrape(f"http://{addr}/metrics"))
        steps = total(m, "tessera:worker_step_duration_seconds_count")
        assert steps >= 4, (addr, steps)  # a prefill and the decodes
        assert m['tessera:worker_collective_seconds_count{group="tp"}'] == steps, addr
        assert 0 < m['tessera:worker_collective_seconds_sum{group="tp"}'] < total(
            m, "tessera:worker_step_duration_seconds_sum"), addr
        assert m['tessera:worker_collective_seconds_count{group="pp"}'] == 0, addr
