"""etcd mode end to end: a real etcd (Debian's etcd-server) on loopback, one `tessera worker`,
two `tessera coordinator`s and a `tessera gateway`, all with `--etcd-endpoints`. The worker
registers itself, the first coordinator wins the election, forms its replica from etcd and
publishes its address; the gateway finds it there and serves a completion. Then the leader
is killed with SIGKILL: the standby must take over (its lease wait is the TTL) and the
gateway must follow it, serving the same greedy completion. A worker stopped with SIGSTOP
(hung: its step stream stays open) loses its lease: the coordinator must fail its replica
within the TTL and a few seconds, not at the 300 s step deadline, and re-form it once the
worker resumes and registers again. A worker that registers after the start forms a new
replica (scale-out).

Skipped when no etcd binary exists, unless TESSERA_REQUIRE_ETCD is set (CI sets it).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from support import MODEL_NAME, Stream, free_port, model_path, tessera_bin

TTL_S = 2


def etcd_bin() -> str | None:
    return os.environ.get("TESSERA_ETCD_BIN") or shutil.which("etcd") or (
        "/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)


class Procs:
    """The processes a test started, each in its own process group, with their logs."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        self.procs[name] = p
        return p

    def tail(self, name: str, lines: int = 30) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{self.tail(n)}" for n in self.procs)

    def stop_all(self) -> list[str]:
        """SIGTERM to every process, etcd last (the others deregister and resign through it);
        returns the names of those that had to be killed."""
        left = []
        order = [n for n in self.procs if n != "etcd"] + ["etcd"] * ("etcd" in self.procs)
        for batch in (order[:-1], order[-1:]):
            for name in batch:
                if self.procs[name].poll() is None:
                    os.killpg(self.procs[name].pid, signal.SIGTERM)
            for name in batch:
                p = self.procs[name]
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    left.append(name)
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
        return left


def wait_for(what: str, check, timeout: float, procs: Procs) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout} s\n{procs.tails()}")


def complete(base: str) -> str | None:
    try:
        r = requests.post(base + "/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    except requests.RequestException:
        return None
    return r.json()["choices"][0]["text"] if r.status_code == 200 else None


@pytest.fixture()
def etcd_cluster(tmp_path):
    etcd = etcd_bin()
    if etcd is None:
        if os.environ.get("TESSERA_REQUIRE_ETCD", "") not in ("", "0"):
            pytest.fail("TESSERA_REQUIRE_ETCD is set but no etcd binary was found")
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    procs = Procs(tmp_path)
    client, peer = free_port(), free_port()
    endpoint, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    procs.start("etcd", [etcd, "--name", "e2e", "--data-dir", str(tmp_path / "etcd"),
                         "--listen-client-urls", endpoint, "--advertise-client-urls", endpoint,
                         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                         "--initial-cluster", f"e2e={peer_url}", "--logger", "zap", "--log-level", "warn"])

    def etcd_healthy():
        try:
            return requests.get(endpoint + "/health", timeout=1).json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    try:
        wait_for("etcd health", etcd_healthy, 20, procs)
        yield procs, endpoint
    finally:
        left = procs.stop_all()
        assert not left, f"ignored SIGTERM: {left}\n{procs.tails()}"


def test_failover_through_etcd(etcd_cluster):
    procs, endpoint = etcd_cluster
    binary, model = str(tessera_bin()), model_path()
    common = ["--etcd-endpoints", endpoint, "--cluster-name", "e2e", "--lease-ttl-s", str(TTL_S)]
    procs.start("worker", [binary, "worker", "--listen", f"127.0.0.1:{free_port()}", "--threads", "1", *common])
    coord = ["--model", model, "--kv-memory-mib", "64", "--connect-timeout-s", "60"]
    a_port, b_port, http_port = free_port(), free_port(), free_port()
    a = procs.start("coordinator_a", [binary, "coordinator", "--listen", f"127.0.0.1:{a_port}", *coord, *common])
    procs.start("gateway", [binary, "gateway", "--listen", f"127.0.0.1:{http_port}", "--model", model, *common])
    base = f"http://127.0.0.1:{http_port}"

    first: list[str] = []
    wait_for("a completion through the first leader", lambda: first.append(complete(base)) or first[-1], 90, procs)
    assert f"127.0.0.1:{a_port}" in procs.tail("coordinator_a", 200)

    procs.start("coordinator_b", [binary, "coordinator", "--listen", f"127.0.0.1:{b_port}", *coord, *common])
    time.sleep(TTL_S + 1)
    assert "leading cluster" not in procs.tail("coordinator_b", 200), "two leaders at once"

    os.killpg(a.pid, signal.SIGKILL)
    a.wait(timeout=10)
    killed = time.monotonic()
    # The standby's campaign returns once the dead leader's lease expires.
    wait_for("the standby leading", lambda: "leading cluster" in procs.tail("coordinator_b", 200), TTL_S + 3, procs)
    wait_for("the standby publishing", lambda: "published" in procs.tail("coordinator_b", 200), 60, procs)
    took = time.monotonic() - killed
    second: list[str] = []
    wait_for("a completion through the new leader", lambda: second.append(complete(base)) or second[-1], 60, procs)
    assert second[-1] == first[-1], "greedy output changed across the failover"
    assert f"published 127.0.0.1:{b_port}" in procs.tail("coordinator_b", 200), f"took {took:.1f} s"


def start_one_replica(procs: Procs, endpoint: str, cluster: str):
    """A worker, a coordinator and a gateway in etcd cluster `cluster`, serving; returns the
    worker's process, the flags they share, the gateway's base URL and a first greedy text."""
    binary, model = str(tessera_bin()), model_path()
    common = ["--etcd-endpoints", endpoint, "--cluster-name", cluster, "--lease-ttl-s", str(TTL_S)]
    worker = procs.start("worker", [binary, "worker", "--listen", f"127.0.0.1:{free_port()}", "--threads", "1",
                                    *common])
    procs.start("coordinator", [binary, "coordinator", "--listen", f"127.0.0.1:{free_port()}", "--model", model,
                                "--kv-memory-mib", "64", "--connect-timeout-s", "60", *common])
    http_port = free_port()
    procs.start("gateway", [binary, "gateway", "--listen", f"127.0.0.1:{http_port}", "--model", model, *common])
    base = f"http://127.0.0.1:{http_port}"
    first: list[str] = []
    wait_for("a first completion", lambda: first.append(complete(base)) or first[-1], 90, procs)
    return worker, common, base, first[-1]


class Base:
    """What support.Stream needs of a cluster: URLs and headers."""

    def __init__(self, base: str):
        self.base = base

    def url(self, path: str) -> str:
        return self.base + path

    def headers(self) -> dict:
        return {}


def test_a_hung_worker_is_evicted_when_its_lease_expires(etcd_cluster):
    procs, endpoint = etcd_cluster
    worker, _, base, first = start_one_replica(procs, endpoint, "hung")

    stream = Stream(Base(base), {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 600,
                                 "temperature": 0, "ignore_eos": True}, timeout=120)
    wait_for("the stream's first tokens", lambda: stream.tokens_seen >= 3 or stream.ended, 30, procs)
    assert stream.ended is None, f"the stream ended early: {stream.ended}"
    os.killpg(worker.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert stream.join(TTL_S + 8), f"stream still open {TTL_S + 8} s after the worker hung\n{procs.tails()}"
        took = stream.ended_at - stopped
        assert stream.ended == "error", f"{stream.ended} after {took:.1f} s"
        # The client sees a generic server error; the coordinator's log says why.
        assert "no longer registered" in procs.tail("coordinator", 200), procs.tail("coordinator", 200)
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
    # Resumed, the worker registers again and the replica is re-formed on it.
    again: list[str] = []
    wait_for("a completion after the worker resumed", lambda: again.append(complete(base)) or again[-1], 60, procs)
    assert again[-1] == first


def test_a_worker_registered_later_forms_a_new_replica(etcd_cluster):
    procs, endpoint = etcd_cluster
    first_worker, common, base, first = start_one_replica(procs, endpoint, "grow")
    second_addr = f"127.0.0.1:{free_port()}"
    procs.start("worker_2", [str(tessera_bin()), "worker", "--listen", second_addr, "--threads", "1", *common])
    wait_for("the second replica", lambda: f"replica 1 added on {second_addr}" in procs.tail("coordinator", 200),
             60, procs)
    # Its step deadline is logged as the first replica's is: CPU workers, 300 s.
    added = procs.tail("coordinator", 200).split(f"replica 1 added on {second_addr}", 1)[1].split("\n", 1)[0]
    assert "(step deadline 300 s)" in added, added
    # The first replica's worker dies for good: the new replica serves on its own.
    os.killpg(first_worker.pid, signal.SIGKILL)
    first_worker.wait(timeout=10)
    again: list[str] = []
    wait_for("a completion on the added replica", lambda: again.append(complete(base)) or again[-1], 30, procs)
    assert again[-1] == first
