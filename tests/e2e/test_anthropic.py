"""Anthropic's Messages API through the official `anthropic` client: a message streamed and
not (the same greedy text and stop reason either way), `system`, stop sequences ->
`stop_reason: "stop_sequence"`, `max_tokens`, `count_tokens` (equal to the templated prompt's
length from /tokenize), errors in Anthropic's shape (BadRequestError, NotFoundError), and
`x-api-key` auth on a cluster started with `--api-key`."""
import anthropic
import pytest
import requests

from support import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
SYSTEM = "You are a helpful assistant."


def client_for(cluster, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", cluster.api_key or "unused")
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 120)
    return anthropic.Anthropic(base_url=cluster.url(""), **kw)


@pytest.fixture(scope="module")
def claude(cluster):
    return client_for(cluster)


# This client version takes the sampling fields (temperature, top_p, top_k) only as extra_body.
GREEDY = {"extra_body": {"temperature": 0}}


def greedy(claude, **kw):
    kw = {"model": MODEL_NAME, "max_tokens": 24, "messages": MESSAGES, **GREEDY, **kw}
    return claude.messages.create(**kw)


def test_message_non_streaming(claude, cluster):
    m = greedy(claude, system=SYSTEM)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME
    assert m.id.startswith("msg_")
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    chat = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    ids = cluster.post("/tokenize", {"messages": chat}).json()["tokens"]
    assert m.usage.input_tokens == len(ids)
    assert 1 <= m.usage.output_tokens <= 24


def test_max_tokens_stop_reason(claude):
    m = greedy(claude, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


@pytest.mark.parametrize("how", ["stream_helper", "create_stream"])
def test_streaming_matches_non_streaming(claude, how):
    full = greedy(claude)
    kw = {"model": MODEL_NAME, "max_tokens": 24, "messages": MESSAGES, **GREEDY}
    if how == "stream_helper":
        with claude.messages.stream(**kw) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.content[0].text == text
        assert final.stop_reason == full.stop_reason
        assert final.usage.output_tokens == full.usage.output_tokens
        assert final.usage.input_tokens == full.usage.input_tokens
    else:
        events = list(claude.messages.create(stream=True, **kw))
        types = [e.type for e in events]
        # The client drops `ping` events; test_stream_event_names sees them raw.
        assert types[:2] == ["message_start", "content_block_start"]
        assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert set(types[2:-3]) <= {"content_block_delta"}
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
        assert events[-2].delta.stop_reason == full.stop_reason
    assert text == full.content[0].text


def test_stream_event_names(cluster):
    body = {"model": MODEL_NAME, "max_tokens": 8, "messages": MESSAGES, "stream": True, "temperature": 0}
    r = requests.post(cluster.url("/v1/messages"), json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"], names
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
    assert set(names[3:-3]) <= {"content_block_delta"}, names


def test_stop_sequence(claude):
    full = greedy(claude, max_tokens=32).content[0].text
    words = full.split()
    assert len(words) >= 6, f"greedy answer too short to pick a stop sequence from: {full!r}"
    stop = " " + words[len(words) // 2]
    m = greedy(claude, max_tokens=32, stop_sequences=["@@never@@", stop])
    assert m.content[0].text == full[: full.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_count_tokens(claude, cluster):
    r = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=MESSAGES)
    chat = [{"role": "system", "content": SYSTEM}, *MESSAGES]
    assert r.input_tokens == len(cluster.post("/tokenize", {"messages": chat}).json()["tokens"])


def test_errors_in_anthropic_shape(claude, cluster):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_NAME, max_tokens=0, messages=MESSAGES)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=[{"role": "user", "content": [image]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    # max_tokens is required (the client insists too, so send the body by hand).
    r = requests.post(cluster.url("/v1/messages"), json={"model": MODEL_NAME, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    r = requests.post(cluster.url("/v1/messages"), headers={"anthropic-version": "v1"},
                      json={"model": MODEL_NAME, "max_tokens": 4, "messages": MESSAGES}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key(guarded_cluster):
    m = client_for(guarded_cluster).messages.create(model=MODEL_NAME, max_tokens=4, messages=MESSAGES)
    assert m.content[0].type == "text"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client_for(guarded_cluster, api_key="nope").messages.create(model=MODEL_NAME, max_tokens=4, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"
