"""Fixtures: real `tessera serve` clusters on free loopback ports.

`cluster` (whole session) runs with default flags; clusters with special flags get their
own instance for the module that needs them. Each waits for /ready (120 s at most) before
its tests run and, at teardown, is stopped with SIGTERM to its process group; a process
of the group that outlives that is killed and fails the run (it would be a leak in
`tessera serve`'s shutdown).

Environment: TESSERA_BIN (default target/release/tessera), TESSERA_MODEL_PATH (default:
what `tessera fetch-model` prints).
"""
import pytest

from support import Cluster

API_KEY = "e2e-key-7f3a"


def _cluster(request, tmp_path_factory, name, **flags):
    c = Cluster(name, tmp_path_factory.mktemp(name), **flags)
    yield c
    leftovers = c.stop()
    assert not leftovers, f"{name}: {leftovers}\n{c.log_tail()}"


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    """Default flags; shared by every module."""
    yield from _cluster(request, tmp_path_factory, "default")


@pytest.fixture(scope="module")
def guarded_cluster(request, tmp_path_factory):
    """An API key, a 4 KiB body limit and a 128-token context."""
    yield from _cluster(
        request,
        tmp_path_factory,
        "guarded",
        gateway_args=f"--api-key {API_KEY} --max-body-bytes 4096 --max-model-len 128",
    )


@pytest.fixture(scope="module")
def small_queue_cluster(request, tmp_path_factory):
    """Two running and two waiting sequences at most: the rest is refused."""
    yield from _cluster(request, tmp_path_factory, "small_queue", coordinator_args="--max-waiting 2 --max-num-seqs 2")


@pytest.fixture(scope="module")
def metrics_cluster(request, tmp_path_factory):
    """One running and one waiting sequence at most, so a workload's outcomes are known."""
    yield from _cluster(request, tmp_path_factory, "metrics", coordinator_args="--max-waiting 1 --max-num-seqs 1")


@pytest.fixture(scope="module")
def tp3_pp2_cluster(request, tmp_path_factory):
    """One replica sharded over 6 worker processes: tensor parallel 3 x pipeline 2."""
    yield from _cluster(request, tmp_path_factory, "tp3_pp2", serve_args=("--tp", "3", "--pp", "2"))


@pytest.fixture(scope="module")
def tp3_cluster(request, tmp_path_factory):
    """One replica over 3 tensor-parallel worker processes."""
    yield from _cluster(request, tmp_path_factory, "tp3", serve_args=("--tp", "3"))


@pytest.fixture(scope="module")
def pp2_cluster(request, tmp_path_factory):
    """One replica over 2 pipeline stages."""
    yield from _cluster(request, tmp_path_factory, "pp2", serve_args=("--pp", "2"))


@pytest.fixture(scope="module")
def doomed_tp3_cluster(request, tmp_path_factory):
    """A TP=3 replica whose worker the test kills (its own instance)."""
    yield from _cluster(request, tmp_path_factory, "doomed_tp3", serve_args=("--tp", "3"))


@pytest.fixture(scope="module")
def hung_tp3_cluster(request, tmp_path_factory):
    """A TP=3 replica with a 5 s step deadline, whose worker the test freezes."""
    yield from _cluster(request, tmp_path_factory, "hung_tp3", serve_args=("--tp", "3"),
                        coordinator_args="--step-timeout-s 5")


@pytest.fixture(scope="session")
def client(cluster):
    return cluster.client()
