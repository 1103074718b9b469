"""Prefix caching: a second request that shares a long (~600-token) prefix with an earlier
one reports the shared blocks in `usage.prompt_tokens_details.cached_tokens` and gets its
first token sooner, since only the new suffix is prefilled.

Each try uses a fresh random prefix (so nothing earlier in the session can have cached
it): the first request with it is cold, the second, with another suffix, warm. Time to
first token is the time to the first streamed chunk of /v1/completions (which sends nothing
before the first generated text). Medians over a few tries absorb noise on a busy machine."""
import random
import statistics
import time

import requests

from support import MODEL_NAME, sse_events

WORDS = ("river stone cloud lantern orchard harbor meadow copper signal garden winter thunder candle "
         "marble valley feather compass engine silver forest window ladder canyon violet ember "
         "glacier saddle prism beacon quarry falcon tundra anchor velvet summit whistle").split()
TRIES = 3
PREFIX_TOKENS = 600


def _prefix(cluster, seed):
    rng = random.Random(seed)
    text = "Notes:"
    while len(cluster.tokenize(text)) < PREFIX_TOKENS:
        text += " " + " ".join(rng.choice(WORDS) for _ in range(50)) + "."
    return text


def _ttft_and_usage(cluster, prompt):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    with requests.post(cluster.url("/v1/completions"), json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for event in sse_events(r):
            assert "error" not in event, event
            if ttft is None and event["choices"]:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    assert ttft is not None and usage is not None
    return ttft, usage


def test_shared_prefix_is_served_from_the_cache(cluster):
    cold, warm = [], []
    for t in range(TRIES):
        prefix = _prefix(cluster, seed=1000 + t)
        ttft, usage = _ttft_and_usage(cluster, prefix + " Question one: what comes first?")
        cold.append(ttft)
        assert usage["prompt_tokens"] >= PREFIX_TOKENS
        ttft, usage = _ttft_and_usage(cluster, prefix + " Question two: which is the longest word?")
        warm.append(ttft)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert 512 <= cached < usage["prompt_tokens"], usage
    print(f"TTFT cold {cold} warm {warm}")
    assert statistics.median(warm) < statistics.median(cold), f"warm TTFTs {warm} not below cold {cold}"
