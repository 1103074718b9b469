"""Tool calling round trips against `tessera serve` on SmolLM2 (whose chat template has no tool
support, so Tessera's fallback format of docs/tools.md is used), each driven by an official
client: the model is made to call a named tool (a 135M model would not call one reliably by
itself; a forced call is enforced by constrained decoding), the call comes back as
`tool_calls` / a `tool_use` block with arguments that follow the tool's schema, streamed the
same as not, and the tool's result sent back yields a final text answer."""
import json

import anthropic
import pytest

from support import MODEL_NAME

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
                    "input_schema": WEATHER_SCHEMA}]
QUESTION = "What is the weather in Paris right now?"


def check_args(args: dict):
    assert isinstance(args.get("city"), str) and len(args["city"]) <= 20, args
    assert args.get("unit") in ("celsius", "fahrenheit"), args
    assert set(args) == {"city", "unit"}, args


def bare_prompt_len(cluster) -> int:
    """Tokens of the question alone: a prompt carrying the call and its result is longer."""
    return len(cluster.post("/tokenize", {"messages": [{"role": "user", "content": QUESTION}]}).json()["tokens"])


def test_openai_tool_round_trip(client, cluster):
    messages = [{"role": "user", "content": QUESTION}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=OPENAI_TOOLS, tool_choice=forced,
                                       temperature=0, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    check_args(json.loads(call.function.arguments))

    # Streamed: the same call (greedy), assembled from index/id/name then argument deltas.
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=OPENAI_TOOLS,
                                            tool_choice=forced, temperature=0, max_tokens=64, stream=True)
    name, args, finish, pieces = None, "", None, 0
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                assert d.index == 0
                if d.function.name:
                    name = d.function.name
                pieces += 1
                args += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert (name, args, finish) == ("get_weather", call.function.arguments, "tool_calls")
    assert pieces > 2, "arguments should arrive in several deltas"

    # The result goes back; with tool_choice none the model answers in text.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=OPENAI_TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=24)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.usage.prompt_tokens > bare_prompt_len(cluster) + 20


def test_anthropic_tool_round_trip(cluster):
    claude = anthropic.Anthropic(base_url=cluster.url(""), api_key="unused", max_retries=0, timeout=120)
    kw = {"model": MODEL_NAME, "max_tokens": 64, "tools": ANTHROPIC_TOOLS,
          "tool_choice": {"type": "tool", "name": "get_weather"}, "extra_body": {"temperature": 0}}
    messages = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(messages=messages, **kw)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    check_args(uses[0].input)

    with claude.messages.stream(messages=messages, **kw) as stream:
        streamed = stream.get_final_message()
    s_uses = [b for b in streamed.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in s_uses] == [(uses[0].name, uses[0].input)]
    assert streamed.stop_reason == "tool_use"

    messages += [{"role": "assistant", "content": [b.model_dump() for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": [{"type": "text", "text": "18 degrees, clear sky"}]}]}]
    final = claude.messages.create(messages=messages, **{**kw, "tool_choice": {"type": "none"}, "max_tokens": 24})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
    assert final.usage.input_tokens > bare_prompt_len(cluster) + 20


def test_unknown_named_tool_is_rejected(client, cluster):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTION}],
                                       tools=OPENAI_TOOLS, tool_choice={"type": "function", "function": {"name": "x"}},
                                       max_tokens=4)
    assert e.value.body["param"] == "tool_choice"



def test_auto_with_a_strict_tool_is_text_or_valid_calls(client, cluster):
    """Under `auto`, a strict tool's calls are held to its schema while text stays free. Cold,
    the 135M model answers in text, which must not be read as a call. With the bytes of
    `<tool_call>` pushed up by logit_bias it starts a call, and the grammar must then finish
    it as a valid one (one call: `parallel_tool_calls` false)."""
    tools = [{"type": "function", "function": {**OPENAI_TOOLS[0]["function"], "strict": True}}]
    messages = [{"role": "user", "content": QUESTION}]
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools, temperature=1.0,
                                           seed=seed, max_tokens=48)
        choice = r.choices[0]
        assert "<tool_call>" not in (choice.message.content or ""), choice
        for call in choice.message.tool_calls or []:
            assert call.function.name == "get_weather"
            if choice.finish_reason == "tool_calls":
                check_args(json.loads(call.function.arguments))

    tag = cluster.post("/tokenize", {"prompt": "<tool_call>", "add_special_tokens": False}).json()["tokens"]
    bias = {str(t): 12 for t in tag}
    calls = 0
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools, temperature=0.8,
                                           seed=seed, max_tokens=96, logit_bias=bias, parallel_tool_calls=False)
        choice = r.choices[0]
        assert "<tool_call>" not in (choice.message.content or ""), choice
        if choice.message.tool_calls:
            calls += 1
            assert choice.finish_reason == "tool_calls", choice
            [call] = choice.message.tool_calls
            assert call.function.name == "get_weather"
            check_args(json.loads(call.function.arguments))
    assert calls > 0, "the biased model never started a call"
