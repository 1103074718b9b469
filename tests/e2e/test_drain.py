"""Graceful drain: SIGTERM to `tessera serve` during 16 streams, with a drain timeout
longer than they need. Readiness goes false and new requests get 503 with `Retry-After`
at once, every stream completes normally, then every process of the cluster exits and
none is left behind."""
import os
import signal
import time

import pytest
import requests

from support import MODEL_NAME, Cluster, Stream, assert_openai_error, wait_until, worker_pids

STREAMS = 16
MAX_TOKENS = 48


@pytest.fixture
def draining_cluster(tmp_path_factory):
    c = Cluster("drain", tmp_path_factory.mktemp("drain"), serve_args=("--workers", "2", "--drain-timeout-s", "120"))
    yield c
    leftovers = c.stop()
    assert not leftovers, f"{leftovers}\n{c.log_tail()}"


def test_sigterm_finishes_streams_refuses_new_work_and_leaves_nothing(draining_cluster):
    c = draining_cluster
    workers = worker_pids(c)
    assert len(workers) == 2
    body = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    streams = [Stream(c, {**body, "prompt": f"Story number {i}: once upon a time"}) for i in range(STREAMS)]
    wait_until(lambda: all(s.tokens_seen >= 2 for s in streams), 120, "every stream to be under way")
    os.kill(c.proc.pid, signal.SIGTERM)
    # New work is refused at once, while the streams are still running.
    # (A request that raced the signal may still be served; wrapped in a list because a
    # 503 `Response` is falsy.)
    [r] = wait_until(lambda: (lambda r: [r] if r.status_code == 503 else None)(
        c.post("/v1/completions", {**body, "prompt": "Too late", "max_tokens": 4}, timeout=10)), 5,
        "new requests to be refused")
    assert_openai_error(r, 503)
    assert int(r.headers["Retry-After"]) >= 1
    ready = requests.get(c.url("/ready"), timeout=5)
    assert ready.status_code == 503
    assert sum(1 for s in streams if s.ended is None) > 0, "the streams ended before the refusal was checked"
    # Every stream completes normally.
    assert all(s.join(timeout=120) for s in streams), "a stream hung during the drain"
    ended = [(s.ended, s.finish_reason, s.error) for s in streams]
    assert all(e == ("done", "length", None) for e in ended), ended
    # Then everything exits: serve, gateway, coordinator, workers.
    c.proc.wait(timeout=60)
    assert c.proc.returncode == 0, c.log_tail()
    wait_until(lambda: not c.group_alive(), 10, "every process of the cluster to exit")
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
