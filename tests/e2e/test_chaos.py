"""Chaos: `kill -9` of a worker during 32 concurrent streams.

- One replica: every stream ends with an OpenAI-shaped error event within 10 s of the
  kill and no connection hangs; `tessera serve` starts the worker again on its address,
  the coordinator re-forms the replica after a readiness check, and new requests succeed.
- Two replicas: the dead replica's streams are migrated to the other one (re-prefilled
  with the tokens generated so far), so every stream completes, and its greedy text equals
  an undisturbed run's, with no token missing or repeated.
"""
import os
import signal
import time

import pytest
import requests

from support import MODEL_NAME, Cluster, Stream, wait_until, worker_pids

STREAMS = 32
PROMPTS = [f"Here is a short fact about the number {i}:" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def one_replica(tmp_path_factory):
    c = Cluster("chaos_one", tmp_path_factory.mktemp("chaos_one"))
    yield c
    leftovers = c.stop()
    assert not leftovers, f"{leftovers}\n{c.log_tail()}"


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    c = Cluster("chaos_two", tmp_path_factory.mktemp("chaos_two"), serve_args=("--workers", "2"))
    yield c
    leftovers = c.stop()
    assert not leftovers, f"{leftovers}\n{c.log_tail()}"


def _body(prompt, max_tokens):
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _kill_when_streaming(cluster, streams, pid, min_tokens=2):
    """SIGKILLs `pid` once every stream has seen `min_tokens` events; returns the time."""
    wait_until(lambda: all(s.tokens_seen >= min_tokens or s.ended for s in streams), 120,
               "every stream to be under way")
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def _reformed(cluster, count):
    """The log says the coordinator re-formed a replica `count` times."""
    return cluster.log_tail(400).count("re-formed on") >= count


def test_one_replica_streams_fail_fast_and_the_cluster_reforms(one_replica):
    c = one_replica
    [pid] = worker_pids(c)
    streams = [Stream(c, _body(p, 400)) for p in PROMPTS]
    killed_at = _kill_when_streaming(c, streams, pid)
    hung = [i for i, s in enumerate(streams) if not s.join(timeout=max(0.1, killed_at + 10 - time.monotonic()))]
    assert not hung, f"{len(hung)} streams still open 10 s after the kill\n{c.log_tail()}"
    for s in streams:
        assert s.ended == "error", f"a stream ended with {s.ended!r}, not an error event"
        assert s.ended_at - killed_at < 10
        assert set(s.error) >= {"message", "type"}, s.error
    # The worker is started again and the replica re-formed: requests succeed again.
    wait_until(lambda: len(worker_pids(c)) == 1 and worker_pids(c) != [pid], 30, "the worker to be restarted")
    wait_until(lambda: _reformed(c, 1), 60, "the replica to re-form")
    # The new link's deadline is logged as the first formation's is: a CPU worker, 300 s.
    assert "step deadline 300 s" in c.log_tail(400).split("re-formed on", 1)[1].split("\n", 1)[0], c.log_tail()
    [r] = wait_until(lambda: (lambda r: [r] if r.status_code != 503 else None)(
        c.post("/v1/completions", _body("Hi", 4))), 10, "requests to be served again")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    wait_until(lambda: requests.get(c.url("/ready"), timeout=2).status_code == 200, 5, "/ready to say so")


def test_two_replicas_migrate_every_stream_with_identical_greedy_output(two_replicas):
    c = two_replicas
    max_tokens = 32
    # The undisturbed run, under the same concurrency.
    reference = [Stream(c, _body(p, max_tokens)) for p in PROMPTS]
    assert all(s.join(timeout=180) for s in reference)
    assert all(s.ended == "done" for s in reference), [s.ended for s in reference]
    pids = worker_pids(c)
    assert len(pids) == 2, pids
    streams = [Stream(c, _body(p, max_tokens)) for p in PROMPTS]
    _kill_when_streaming(c, streams, pids[0], min_tokens=4)
    assert all(s.join(timeout=120) for s in streams), "a stream hung after the kill"
    failed = [(i, s.ended, s.error) for i, s in enumerate(streams) if s.ended != "done"]
    assert not failed, f"{len(failed)} streams did not complete: {failed[:3]}\n{c.log_tail()}"
    differ = [(PROMPTS[i], r.text, s.text) for i, (r, s) in enumerate(zip(reference, streams)) if r.text != s.text]
    assert not differ, f"{len(differ)} of {STREAMS} differ from the undisturbed run, e.g. {differ[:2]}"
    assert all(s.finish_reason == "length" for s in streams)
    # The killed worker comes back and its replica re-forms; both serve again.
    wait_until(lambda: _reformed(c, 1), 60, "the failed replica to re-form")
    after = [Stream(c, _body(p, 8)) for p in PROMPTS[:8]]
    assert all(s.join(timeout=120) and s.ended == "done" for s in after), [s.ended for s in after]
    assert [s.text for s in after] == [r.text[:len(s.text)] for r, s in zip(reference[:8], after)]
