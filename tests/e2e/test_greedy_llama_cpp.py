"""Greedy decoding through the whole cluster against llama.cpp, the outside reference.

tests/fixtures/generation/smollm2_greedy.jsonl holds llama.cpp's greedy continuation (with
EOS ignored, i.e. banned) and its top-5 logprobs at each step for 12 prompts, made by
gen_llama_cpp.py beside it. Each prompt's token ids go to /v1/completions as a token-id
prompt (so tokenization is not under test here), temperature 0, 16 tokens, with the
end-of-generation ids banned and `ignore_eos` as llama.cpp had them.

Two engines whose arithmetic differs in the last bits pick different tokens where the top
two are nearly tied, and from there the texts go separate ways. So: every prompt must
match llama.cpp token for token up to its first divergence, and that divergence must be a
near tie in llama.cpp's own logprobs (our token in its top 5, less than NEAR_TIE nats below
its pick); along the common part our chosen-token logprobs must agree with llama.cpp's
within LOGPROB_TOL nats (once the banned EOG tokens' mass is taken out of llama.cpp's,
which it reports before its ban). And most prompts (MIN_EXACT of 12) must match all 16
tokens."""
import json
import math
from functools import lru_cache

import pytest

from support import EOG_IDS, MODEL_NAME, REPO

FIXTURE = REPO / "tests" / "fixtures" / "generation" / "smollm2_greedy.jsonl"
N_TOKENS = 16
NEAR_TIE = 0.15
# 0.25 until the engine reproduced llama.cpp's f16 flash-attention rounding (issue 2): that
# is llama.cpp's path for decode steps and short prompts, but a prompt of 64+ tokens in one
# batch takes its tiled kernel with f32 accumulators, which we do not reproduce; on the
# 65-token chat_multiturn prompt that leaves 0.265 nats at one step (measured 2026-11-30).
LOGPROB_TOL = 0.3
# Measured 9 of 12 (2026-11-30). llama.cpp against itself (flash attention on vs off)
# agrees on only 6 of 12 prompts' first 32 tokens, so all-16-token agreement is partly
# luck at near ties; this bound catches a broad regression, the near-tie test the rest.
MIN_EXACT = 8


def _cases():
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(cluster):
    """For each fixture case: (case, our token strings, our chosen logprobs, llama.cpp's
    token strings, llama.cpp's top-5 as (string, logprob))."""
    client = cluster.client()

    @lru_cache(maxsize=None)
    def text_of(token_id):
        r = cluster.post("/detokenize", {"tokens": [token_id]})
        r.raise_for_status()
        return r.json()["prompt"]

    out = []
    for case in _cases():
        r = client.completions.create(
            model=MODEL_NAME, prompt=case["prompt_ids"], max_tokens=N_TOKENS, temperature=0, logprobs=1,
            logit_bias={str(i): -100 for i in EOG_IDS}, extra_body={"ignore_eos": True})
        choice = r.choices[0]
        assert choice.finish_reason == "length" and r.usage.completion_tokens == N_TOKENS, case["name"]
        assert r.usage.prompt_tokens == len(case["prompt_ids"])
        ours = choice.logprobs.tokens
        assert "".join(ours) == choice.text
        theirs = [text_of(t) for t in case["tokens"][:N_TOKENS]]
        top5 = [[(text_of(i), lp, i) for i, lp in step] for step in case["top5"][:N_TOKENS]]
        out.append((case, ours, choice.logprobs.token_logprobs, theirs, top5))
    return out


def _first_divergence(ours, theirs):
    return next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def test_fixture_is_present_and_complete():
    cases = _cases()
    assert len(cases) == 12
    for c in cases:
        assert len(c["tokens"]) >= N_TOKENS and len(c["top5"]) >= N_TOKENS and c["prompt_ids"], c["name"]


def test_greedy_matches_llama_cpp_until_a_near_tie(runs):
    for case, ours, our_lps, theirs, top5 in runs:
        k = _first_divergence(ours, theirs)
        common = N_TOKENS if k is None else k
        for i in range(common):
            # llama.cpp's logprobs are before its EOG ban, ours after our -100 bias: take
            # the banned tokens' mass out of llama.cpp's distribution to compare.
            eog_mass = sum(math.exp(lp) for _, lp, tid in top5[i] if tid in EOG_IDS)
            ref = next(lp for s, lp, _ in top5[i] if s == theirs[i]) - math.log1p(-eog_mass)
            assert abs(our_lps[i] - ref) < LOGPROB_TOL, (case["name"], i, our_lps[i], ref)
        if k is None:
            continue
        alts = {s: lp for s, lp, _ in top5[k]}
        assert ours[k] in alts, f"{case['name']}: at token {k} we chose {ours[k]!r}, not in llama.cpp's top 5 {alts}"
        margin = alts[theirs[k]] - alts[ours[k]]
        assert margin < NEAR_TIE, (
            f"{case['name']}: at token {k} we chose {ours[k]!r} over llama.cpp's {theirs[k]!r} "
            f"although llama.cpp ranks it {margin:.3f} nats lower; ours {''.join(ours)!r} vs {''.join(theirs)!r}")


def test_greedy_matches_llama_cpp_on_most_prompts(runs):
    exact = [case["name"] for case, ours, _, theirs, _ in runs if ours == theirs]
    differ = [(case["name"], "".join(ours), "".join(theirs)) for case, ours, _, theirs, _ in runs if ours != theirs]
    assert len(exact) >= MIN_EXACT, f"{len(exact)} of {len(runs)} match llama.cpp exactly; differing: {differ}"
