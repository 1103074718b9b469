"""Tensor and pipeline parallel serving on CPU workers joined by the TCP collective: a
replica sharded over TP=3, PP=2 and TP=3 x PP=2 worker processes (`tessera serve --tp N
--pp M`) answers exactly as one worker does, greedy token for token, alone and under 16
concurrent sessions. (Every rank computes whole output features, see
worker/src/parallel.rs, so the logits are bit-identical, not merely close.)"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from support import MODEL_NAME

PROMPTS = [f"Write one sentence about {s}." for s in
           ["the ocean", "a red bicycle", "quantum computers", "volcanoes", "jazz music", "honey bees",
            "chess openings", "paper airplanes"]] + [
           f"Here is a short fact about {s}:" for s in
           ["the moon landing", "a lost key", "the Roman empire", "deep sea fish", "a rainy Tuesday",
            "the first computer", "a mountain village", "my grandmother's garden"]]
MAX_TOKENS = 16


def _run(client, prompt):
    if prompt.endswith("."):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    return r.choices[0].text


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
