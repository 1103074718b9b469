"""Tensor and pipeline parallel serving on CPU workers joined by the TCP collective: a
replica sharded over TP=3, PP=2 and TP=3 x PP=2 worker processes (`tessera serve --tp N
--pp M`) answers exactly as one worker does, greedy token for token, alone and under 16
concurrent sessions, and samples (seeded, grammar-constrained) as one worker does.
(Every rank computes whole output features, see worker/src/parallel.rs, so the logits are
bit-identical, not merely close.)"""
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from support import MODEL_NAME, admin_addresses, greedy_text, parse_metrics, scrape, worker_pids

PROMPTS = [f"Write one sentence about {s}." for s in
           ["the ocean", "a red bicycle", "quantum computers", "volcanoes", "jazz music", "honey bees",
            "chess openings", "paper airplanes"]] + [
           f"Here is a short fact about {s}:" for s in
           ["the moon landing", "a lost key", "the Roman empire", "deep sea fish", "a rainy Tuesday",
            "the first computer", "a mountain village", "my grandmother's garden"]]
MAX_TOKENS = 16


def _run(client, prompt):
    return greedy_text(client, prompt, MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(cluster):
    client = cluster.client()
    return [_run(client, p) for p in PROMPTS]


@pytest.mark.parametrize("which", ["tp3_cluster", "pp2_cluster", "tp3_pp2_cluster"])
def test_sharded_replica_equals_one_worker_alone_and_under_16_sessions(request, which, reference):
    sharded = request.getfixturevalue(which)
    client = sharded.client()
    alone = [_run(client, p) for p in PROMPTS[:4]]
    assert alone == reference[:4], f"{which}: solo answers differ from one worker's"
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _run(client, p), PROMPTS))
    differ = [(p, r, t) for p, r, t in zip(PROMPTS, reference, together) if r != t]
    assert not differ, f"{which}: {len(differ)} of 16 differ from one worker under load, e.g. {differ[:2]}"


def _sampled(client, i):
    """A seeded, sampled answer; every other one constrained to a JSON object."""
    extra = {"response_format": {"type": "json_object"}} if i % 2 else {}
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[i], max_tokens=24, temperature=0.9, seed=i,
                                  extra_body=extra)
    return r.choices[0].text


def test_tensor_ranks_sample_alike_with_lookahead(tp3_cluster, cluster):
    """Each tensor rank runs its own sampled token in a lookahead decode (the coordinator
    fails the replica if the ranks' tokens ever differ), so seeded sampling and grammar-
    constrained sequences must come out of TP=3 as they do from one worker."""
    want = [_sampled(cluster.client(), i) for i in range(8)]
    client = tp3_cluster.client()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _sampled(client, i), range(8)))
    differ = [(i, w, g) for i, (w, g) in enumerate(zip(want, got)) if w != g]
    assert not differ, f"{len(differ)} of 8 differ from one worker, e.g. {differ[:2]}"
    # The replica did run lookahead decodes (it is not merely the old serial loop).
    coordinator = admin_addresses(tp3_cluster)["coordinator"][-1]
    m = parse_metrics(scrape(f"http://{coordinator}/metrics"))
    assert sum(v for k, v in m.items() if k.startswith("tessera:lookahead_decodes_total")) > 0, m


def _stream_then_signal(cluster, sig, rank):
    """Streams a long completion and sends `sig` to worker `rank` after 5 events. Returns
    the events and the seconds from the signal to the end of the stream."""
    body = {"model": MODEL_NAME, "prompt": "Count slowly:", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    pids = worker_pids(cluster)
    assert len(pids) == 3, f"expected 3 workers in the group, found {pids}"
    events, t0 = [], None
    with requests.post(cluster.url("/v1/completions"), json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[6:])
                if len(events) == 5:
                    os.kill(pids[rank], sig)
                    t0 = time.monotonic()
    return events, time.monotonic() - t0, pids[rank]


def _ends_with_error(events) -> bool:
    """An OpenAI-shaped error event, then `[DONE]`: how a stream that fails mid-way ends."""
    return len(events) >= 2 and events[-1] == b"[DONE]" and "error" in json.loads(events[-2])


def test_a_dead_rank_fails_its_replicas_requests_promptly(doomed_tp3_cluster):
    """Killing one tensor-parallel worker mid-stream ends the stream with an OpenAI-shaped
    error event within seconds (the dead rank's gRPC stream breaks and its peers' collective
    calls fail), and later requests are refused rather than left hanging."""
    c = doomed_tp3_cluster
    events, elapsed, _ = _stream_then_signal(c, signal.SIGKILL, 1)
    assert elapsed < 35, f"the stream took {elapsed:.1f} s to end after the rank died"
    assert _ends_with_error(events), f"the stream ended without an error event and [DONE]: {events[-3:]}"
    # Nothing hangs afterwards: the coordinator marks the replica unhealthy and refuses new
    # work until `tessera serve` has started the worker again and the coordinator has
    # re-formed the replica (test_chaos.py checks that); a new request gets an error status
    # or, once re-formed, an answer, fast.
    t1 = time.monotonic()
    r = requests.post(c.url("/v1/completions"), json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4},
                      timeout=60)
    assert r.status_code in (200, 503), (r.status_code, r.text[:200])
    assert time.monotonic() - t1 < 10


def test_a_hung_rank_fails_its_replica_at_the_step_deadline(hung_tp3_cluster):
    """A rank that stops responding without dying (SIGSTOP) fails the replica's stream with
    an error event at the coordinator's step deadline (5 s here), not never."""
    try:
        events, elapsed, pid = _stream_then_signal(hung_tp3_cluster, signal.SIGSTOP, 2)
    finally:
        for p in worker_pids(hung_tp3_cluster):
            os.kill(p, signal.SIGCONT)
    assert elapsed < 20, f"the stream took {elapsed:.1f} s to end after the rank hung"
    assert _ends_with_error(events), f"no error event and [DONE] at the end: {events[-3:]}"
