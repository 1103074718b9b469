"""Prefix-cache affinity across replicas (`tessera serve --workers 2`): a request whose prompt
shares a prefix with an earlier one goes to the replica that served it (and finds the prefix
in that replica's KV cache) while that replica is at most `--affinity-margin` sequences
busier than the least loaded one; past the margin it goes to the least loaded replica.

The setup makes the two choices differ: request A (prefix P) runs alone, so it lands on
replica 0 (the lowest index among equally loaded ones); a long stream S with another prompt
then also lands on replica 0; request B (prefix P + another question) then sees replica 0
holding one sequence and replica 1 none. With the default margin (8) B follows its prefix to
replica 0 and reports the prefix as cached; with margin 0 it goes to idle replica 1, where
nothing is cached.
"""
import pytest
import requests

from support import MODEL_NAME, Cluster, Stream, wait_until

WORDS = "amber basin cedar delta ember fjord granite harbor iris juniper kestrel lagoon".split()


def _prefix(seed: int) -> str:
    words = [WORDS[(seed * 7 + i * 5) % len(WORDS)] for i in range(160)]
    return f"Document {seed}: " + " ".join(words)


def _cached_tokens(cluster, prompt: str) -> int:
    r = requests.post(cluster.url("/v1/completions"), timeout=120, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _shared_prefix_cached(cluster, seed: int) -> int:
    prefix = _prefix(seed)
    assert _cached_tokens(cluster, prefix + " Question one: which word comes first?") == 0
    s = Stream(cluster, {"model": MODEL_NAME, "prompt": f"Unrelated story number {seed}:", "max_tokens": 200,
                         "temperature": 0, "ignore_eos": True})
    wait_until(lambda: s.tokens_seen >= 2 or s.ended, 60, "the long stream to be under way")
    assert s.ended is None, s.ended
    cached = _cached_tokens(cluster, prefix + " Question two: which word comes last?")
    assert s.join(120) and s.ended == "done", s.ended
    return cached


@pytest.mark.parametrize("margin", [None, 0])
def test_a_shared_prefix_follows_its_replica_within_the_margin(tmp_path, margin):
    args = "" if margin is None else f"--affinity-margin {margin}"
    c = Cluster(f"affinity_{margin}", tmp_path, coordinator_args=args, serve_args=("--workers", "2"))
    try:
        cached = [_shared_prefix_cached(c, seed) for seed in range(3)]
    finally:
        leftovers = c.stop()
    assert not leftovers, leftovers
    if margin is None:
        assert all(n >= 128 for n in cached), f"B should find its prefix cached on replica 0: {cached}"
    else:
        assert cached == [0, 0, 0], f"past the margin B should go to the idle replica: {cached}"
