"""The OpenAI API through the official `openai` client: chat and completions, streamed and
not, `n`, stop strings, `max_tokens`, logprobs, seeds, `stream_options.include_usage`, and
vLLM's `echo` and `min_tokens`.

Expectations are derived from the server's own greedy output where the exact text cannot be
known in advance (e.g. a stop string is picked from the middle of a greedy answer and the
stopped answer must be exactly the text before it)."""
import math

import pytest
import requests

from support import MODEL_NAME

STORY = "Once upon a time, in a small village by the sea, there lived"
CHAT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def test_models_lists_the_served_model(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    health = requests.get(cluster.url("/health"), timeout=10)
    assert health.status_code == 200


def test_chat_non_streaming(client, cluster):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content.strip(), "empty answer"
    assert choice.finish_reason in ("stop", "length")
    # prompt_tokens is what the gateway's own tokenizer makes of the rendered chat.
    ids = cluster.post("/tokenize", {"messages": CHAT}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks, "no chunks"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert all(c.usage is None for c in chunks), "usage sent without include_usage"


def test_completions_non_streaming_and_streaming(client):
    full = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=16, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.choices[0].text.strip()
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=16, temperature=0,
                                            stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completions_token_id_prompt_equals_text_prompt(client, cluster):
    ids = cluster.tokenize(STORY, special=True)
    by_text = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=10, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].text == by_text.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_n_2_gives_two_choices(client, stream):
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=1.0, seed=11, n=2)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert sorted(c.index for c in r.choices) == [0, 1]
        assert all(c.message.content for c in r.choices)
        assert all(c.finish_reason in ("stop", "length") for c in r.choices)
        # Both choices count; the prompt counts once.
        lengths = [10 if c.finish_reason == "length" else 1 for c in r.choices]
        assert sum(lengths) <= r.usage.completion_tokens <= 20
        ids = client.chat.completions.create(**{**kw, "n": 1}).usage.prompt_tokens
        assert r.usage.prompt_tokens == ids
        texts = {c.index: c.message.content for c in r.choices}
    else:
        texts, finishes = {0: "", 1: ""}, {}
        for chunk in client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                assert c.index in (0, 1)
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    assert c.index not in finishes, "two finish chunks for one choice"
                    finishes[c.index] = c.finish_reason
        assert sorted(finishes) == [0, 1]
        assert all(texts.values())
    # Choice i is sampled with seed + i: two different samples, the same ones every time.
    # (That choice i equals what seed + i gives alone is in test_batch_invariance.py.)
    assert texts[0] != texts[1]
    again = client.chat.completions.create(**kw)
    assert {c.index: c.message.content for c in again.choices} == texts


def _greedy_with_stop(client, chat: bool, stream: bool, stop=None, max_tokens=32):
    kw = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0, stream=stream)
    if stop is not None:
        kw["stop"] = stop
    if chat:
        r = client.chat.completions.create(messages=CHAT, **kw)
        if not stream:
            return r.choices[0].message.content, r.choices[0].finish_reason
        pieces = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in r if c.choices]
    else:
        r = client.completions.create(prompt=STORY, **kw)
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in r if c.choices]
    return "".join(p for p, _ in pieces), [f for _, f in pieces if f][-1]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_cuts_the_text(client, chat, stream):
    full, _ = _greedy_with_stop(client, chat, stream=False)
    words = full.split()
    assert len(words) >= 6, f"greedy answer too short to pick a stop string from: {full!r}"
    # A word from the middle, with its leading space: the answer must end right before it.
    stop = " " + words[len(words) // 2]
    expected = full[: full.index(stop)]
    text, finish = _greedy_with_stop(client, chat, stream, stop=[stop, "@@never@@"])
    assert stop not in text
    assert text == expected
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_echo_puts_the_prompt_before_the_completion(client, stream):
    want, _ = _greedy_with_stop(client, chat=False, stream=False, max_tokens=8)
    r = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0, echo=True,
                                  stream=stream)
    text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert text == STORY + want


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_min_tokens_defers_a_stop_string(client, chat):
    """vLLM's `min_tokens`: a stop string completed within the first `min_tokens` tokens does
    not end the answer, so with `min_tokens` = `max_tokens` greedy runs to the length limit."""
    full, finish = _greedy_with_stop(client, chat, stream=False)
    assert finish == "length", f"the greedy answer ended early: {full!r}"
    stop = " " + full.split()[len(full.split()) // 2]
    stopped, _ = _greedy_with_stop(client, chat, stream=False, stop=[stop])
    assert stopped != full
    kw = dict(model=MODEL_NAME, max_tokens=32, temperature=0, stop=[stop], extra_body={"min_tokens": 32})
    if chat:
        text = client.chat.completions.create(messages=CHAT, **kw).choices[0].message.content
    else:
        text = client.completions.create(prompt=STORY, **kw).choices[0].text
    assert text == full


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_gives_length(client, stream):
    r = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=7, temperature=0, stream=stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
        assert finishes == ["length"]
    else:
        assert r.choices[0].finish_reason == "length"
        usage = r.usage
    assert usage.completion_tokens == 7
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_chat_logprobs_shape_and_greedy_choice(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert r.choices[0].finish_reason == "length"
    assert len(content) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 5
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), "top_logprobs not most likely first"
        assert all(lp <= 0 for lp in tops) and sum(math.exp(lp) for lp in tops) <= 1 + 1e-4
        # Greedy: the chosen token is the most likely one.
        assert e.logprob == pytest.approx(max(tops), abs=1e-5)
        assert e.token == e.top_logprobs[0].token
        assert bytes(e.bytes) == e.token.encode()
        assert len({t.token for t in e.top_logprobs}) == 5


def test_chat_logprobs_without_top(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(e.top_logprobs == [] and e.logprob <= 0 for e in content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape_and_greedy_choice(client):
    r = client.completions.create(model=MODEL_NAME, prompt=STORY, max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    text = r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == text
    for i, (tok, chosen, top) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)):
        assert lp.text_offset[i] == len("".join(lp.tokens[:i]))
        assert len(top) == 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert top[tok] == pytest.approx(chosen, abs=1e-5)


def test_seed_reproducibility(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me about your favourite animal."}],
              max_tokens=24, temperature=1.0)
    first = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    second = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    assert first == second, "same seed, different text"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(seed=1234, stream=True, **kw) if c.choices)
    assert streamed == first, "same seed, different text when streamed"
    others = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)]
    assert any(o != first for o in others), "different seeds all gave the same text at temperature 1"


def test_stream_options_include_usage(client, cluster):
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    prompt = cluster.post("/tokenize", {"messages": CHAT}).json()["count"]
    assert last.usage.prompt_tokens == prompt
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == prompt + 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()


def test_tokenize_detokenize_round_trip(cluster):
    text = "Tessera serves SmolLM2 — with ünïcode and 12345 numbers."
    ids = cluster.tokenize(text)
    assert len(ids) > 5
    r = cluster.post("/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == text
