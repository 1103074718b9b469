"""Every kind of bad request gets the right status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the field; API keys
guard everything but /health, /ready and /metrics; unknown routes are 404.

Raw `requests` calls, so the exact status, headers and body are checked; a few cases go
through the `openai` client too, to check it raises the matching exception."""
import json

import openai
import pytest
import requests

from conftest import API_KEY
from support import MODEL_NAME, assert_openai_error

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}

# (name, endpoint body, bad fields, expected param)
BAD_FIELDS = [
    ("temperature_3", CHAT, {"temperature": 3}, "temperature"),
    ("temperature_negative", COMPLETION, {"temperature": -0.5}, "temperature"),
    ("top_p_0", CHAT, {"top_p": 0}, "top_p"),
    ("top_p_above_1", COMPLETION, {"top_p": 1.5}, "top_p"),
    ("n_0", CHAT, {"n": 0}, "n"),
    ("n_too_many", CHAT, {"n": 1000}, "n"),
    ("max_tokens_0", CHAT, {"max_tokens": 0}, "max_tokens"),
    ("max_tokens_negative", COMPLETION, {"max_tokens": -3}, "max_tokens"),
    ("max_completion_tokens_0", CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("completion_logprobs_30", COMPLETION, {"logprobs": 30}, "logprobs"),
    ("chat_top_logprobs_30", CHAT, {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("top_logprobs_without_logprobs", CHAT, {"top_logprobs": 2}, "top_logprobs"),
    ("frequency_penalty_5", CHAT, {"frequency_penalty": 5}, "frequency_penalty"),
    ("presence_penalty_minus_3", COMPLETION, {"presence_penalty": -3}, "presence_penalty"),
    ("logit_bias_not_an_id", CHAT, {"logit_bias": {"hello": 5}}, "logit_bias"),
    ("logit_bias_outside_vocab", CHAT, {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("logit_bias_value_200", COMPLETION, {"logit_bias": {"42": 200}}, "logit_bias"),
    ("stop_five_strings", CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("stop_not_a_string", CHAT, {"stop": 5}, "stop"),
    ("stream_options_without_stream", CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    ("temperature_wrong_type", CHAT, {"temperature": "hot"}, "temperature"),
    ("bad_role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("empty_messages", CHAT, {"messages": []}, "messages"),
    ("prompt_token_outside_vocab", COMPLETION, {"prompt": [1, 2, 9999999]}, "prompt"),
    ("empty_prompt_list", COMPLETION, {"prompt": []}, "prompt"),
    # echo works, but with logprobs it would need the prompt's logprobs, not computed.
    ("echo_with_logprobs", COMPLETION, {"echo": True, "logprobs": 1}, "echo"),
    # A complete grammar allows only the stop ids that min_tokens bans.
    ("min_tokens_with_response_format", CHAT, {"min_tokens": 2, "response_format": {"type": "json_object"}},
     "min_tokens"),
    ("min_tokens_over_max_tokens", COMPLETION, {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
]


def _path(body):
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


@pytest.mark.parametrize("name,base,fields,param", BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
def test_bad_field_is_400_naming_the_field(cluster, name, base, fields, param):
    r = cluster.post(_path(base), {**base, **fields})
    assert_openai_error(r, 400, param=param, error_type="invalid_request_error")


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404(cluster, stream):
    r = cluster.post("/v1/chat/completions", {**CHAT, "model": "gpt-17", "stream": stream})
    err = assert_openai_error(r, 404, param="model", code="model_not_found", error_type="invalid_request_error")
    assert "gpt-17" in err["message"]
    r = cluster.post("/v1/completions", {**COMPLETION, "model": "gpt-17"})
    assert_openai_error(r, 404, param="model", code="model_not_found")


def test_missing_messages_and_prompt(cluster):
    r = cluster.post("/v1/chat/completions", {"model": MODEL_NAME})
    assert_openai_error(r, 400, param="messages")
    r = cluster.post("/v1/completions", {"model": MODEL_NAME})
    assert_openai_error(r, 400, param="prompt")


@pytest.mark.parametrize("body", [b'{"model": "x", "messages": [', b"not json at all", b"", b'{"messages": []} trailing'])
def test_bad_json_is_400(cluster, body):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = cluster.post(path, body)
        assert_openai_error(r, 400, error_type="invalid_request_error")


def test_context_overflow_is_400(cluster):
    # The default context is the model's: ask for more completion tokens than it holds.
    max_len = cluster.client().models.list().data[0].model_extra["max_model_len"]
    r = cluster.post("/v1/completions", {**COMPLETION, "max_tokens": max_len})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"], temperature=3)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT["messages"])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)


def test_unknown_routes_are_404_and_wrong_methods_405(cluster):
    for method, path in [("GET", "/v1/nothing"), ("POST", "/v2/chat/completions"), ("GET", "/")]:
        r = requests.request(method, cluster.url(path), timeout=10)
        assert_openai_error(r, 404, code="unknown_url")
    r = requests.get(cluster.url("/v1/chat/completions"), timeout=10)
    assert_openai_error(r, 405)


# --- a cluster with an API key, a 4 KiB body limit and a 128-token context ---


def test_api_key_required(guarded_cluster):
    c = guarded_cluster
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {API_KEY}"}):
        r = requests.post(c.url("/v1/chat/completions"), json=CHAT, headers=headers, timeout=10)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert r.headers.get("WWW-Authenticate") == "Bearer"
        r = requests.get(c.url("/v1/models"), headers=headers, timeout=10)
        assert_openai_error(r, 401, code="invalid_api_key")
    # Open routes stay open.
    for path in ("/health", "/ready", "/metrics"):
        assert requests.get(c.url(path), timeout=10).status_code == 200, path
    # The right key works, through the client too.
    r = c.post("/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    assert c.client().chat.completions.create(**CHAT).choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        c.client(api_key="nope").models.list()


def test_body_over_limit_is_413(guarded_cluster):
    c = guarded_cluster
    big = {**COMPLETION, "prompt": "word " * 2000}
    assert len(json.dumps(big)) > 4096
    r = c.post("/v1/completions", big)
    assert_openai_error(r, 413, code="request_too_large")
    # Just under the limit is parsed (and then refused for its length in tokens, not bytes).
    r = c.post("/v1/completions", {**COMPLETION, "prompt": "word " * 700})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")


def test_prompt_longer_than_max_model_len_is_400(guarded_cluster):
    c = guarded_cluster
    long_text = " ".join(f"w{i}" for i in range(200))
    assert len(c.tokenize(long_text)) > 128
    r = c.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": long_text}]})
    assert_openai_error(r, 400, param="messages", code="context_length_exceeded")
    r = c.post("/v1/completions", {**COMPLETION, "prompt": long_text})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
    # A prompt that fits, with max_tokens that does not.
    r = c.post("/v1/completions", {**COMPLETION, "prompt": "Hello there", "max_tokens": 127})
    assert_openai_error(r, 400, param="prompt", code="context_length_exceeded")
    r = c.post("/v1/completions", {**COMPLETION, "prompt": "Hello there", "max_tokens": 8})
    assert r.status_code == 200, r.text
