"""Batch invariance: a greedy request gives exactly the same text whether it runs alone or
batched with 31 others (different prompts, so different lengths and prefill/decode mixes in
each step), the `n` choices of one greedy request are identical to each other, and choice
`i` of a seeded request is what seed + i gives alone.

Each prompt is first sent alone (one at a time), then all 32 at once from threads."""
from concurrent.futures import ThreadPoolExecutor

from support import MODEL_NAME, admin_addresses, greedy_text, parse_metrics, scrape

SUBJECTS = ["the ocean", "a red bicycle", "quantum computers", "my grandmother's garden", "the Roman empire",
            "volcanoes", "a lost key", "jazz music", "the moon landing", "honey bees", "a rainy Tuesday",
            "chess openings", "the first computer", "a mountain village", "paper airplanes", "deep sea fish"]
PROMPTS = ([f"Write one sentence about {s}." for s in SUBJECTS]
           + [f"Here is a short fact about {s}:" for s in SUBJECTS])
MAX_TOKENS = 24


def _run(client, prompt):
    return greedy_text(client, prompt, MAX_TOKENS)


def _multi_sequence_steps(cluster) -> float:
    """Coordinator steps so far that ran more than one sequence (its `tessera:batch_size`
    histogram: all observations minus those in the `le="1"` bucket)."""
    samples = parse_metrics(scrape(f"http://{admin_addresses(cluster)['coordinator'][-1]}/metrics"))
    count = sum(v for k, v in samples.items() if k.startswith("tessera:batch_size_count"))
    ones = sum(v for k, v in samples.items() if k.startswith("tessera:batch_size_bucket{") and 'le="1"' in k)
    return count - ones


def test_32_concurrent_greedy_requests_equal_their_solo_runs(cluster):
    client = cluster.client()
    assert len(set(PROMPTS)) == 32
    alone = [_run(client, p) for p in PROMPTS]
    assert all(alone), "an empty solo answer"
    batched_before = _multi_sequence_steps(cluster)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: _run(client, p), PROMPTS))
    differ = [(p, a, t) for p, a, t in zip(PROMPTS, alone, together) if a != t]
    assert not differ, f"{len(differ)} of 32 differ when batched, e.g. {differ[:3]}"
    # The comparison means something only if the requests did share steps.
    assert _multi_sequence_steps(cluster) - batched_before >= MAX_TOKENS, "the 32 requests were never batched"


def test_greedy_choices_of_one_request_are_identical(cluster):
    client = cluster.client()
    messages = [{"role": "user", "content": "Say hello"}]
    solo = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       n=4)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts == [solo.choices[0].message.content] * 4


def test_seeded_choices_equal_solo_runs_with_seed_plus_index(cluster):
    client = cluster.client()
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Write a short story about a lighthouse."}],
              max_tokens=MAX_TOKENS, temperature=1.0)
    r = client.chat.completions.create(n=3, seed=500, **kw)
    texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    alone = [client.chat.completions.create(seed=500 + i, **kw).choices[0].message.content for i in range(3)]
    assert texts == alone
