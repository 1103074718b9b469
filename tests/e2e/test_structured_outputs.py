"""Structured outputs (`response_format`), driven with the official openai client against
`tessera serve`: 50 generated JSON schemas (nested objects, arrays, enums, bounded numbers,
required fields, patterns) sampled at temperature 1 must each yield JSON that parses and
validates with `jsonschema`; `json_object` yields an object; invalid schemas and
pathological patterns are a 400 within a second, as is a schema over 1 MiB; and one
constrained request in a batch of 32 leaves the 31 free greedy answers exactly as they are
without it.

The schemas bound every string (`maxLength`), array (`maxItems`), object
(`additionalProperties: false`) and number (`multipleOf` a power of two besides its range), so
a finished output is short and max_tokens is never the reason an output stops."""
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import requests

from support import MODEL_NAME, assert_openai_error

NAMES = ["id", "name", "title", "age", "score", "tags", "kind", "city", "items", "price", "count", "active",
         "owner", "level", "notes", "color", "size", "rank", "email", "zip"]
WORDS = ["red", "green", "blue", "alpha", "beta", "small", "large", "north", "south", "yes", "no", "maybe"]
MAX_TOKENS = 400


def _leaf(r: random.Random) -> dict:
    kind = r.choice(["string", "string", "integer", "number", "boolean", "enum", "pattern", "null_or_int"])
    if kind == "string":
        s = {"type": "string", "maxLength": r.randint(3, 12)}
        if r.random() < 0.4:
            s["minLength"] = 1
        return s
    if kind == "integer":
        lo = r.randint(-100, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(1, 500)}
    if kind == "number":
        # A bound on the value does not bound the digits: at temperature 1 a small model can
        # write a fraction until max_tokens (seen: 12.5000001250000125665...). A step that
        # is exact in binary (so jsonschema's float check is exact too) bounds them.
        lo = r.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + r.randint(1, 100), "multipleOf": r.choice([1, 0.5, 0.25])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values = r.sample(WORDS, r.randint(2, 5))
        if r.random() < 0.3:
            values.append(r.randint(0, 9))
        return {"enum": values}
    if kind == "pattern":
        return {"type": "string", "pattern": r.choice(["^[a-z]{2,6}$", "^[A-Z][a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$"])}
    return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}


def _value(r: random.Random, depth: int) -> dict:
    roll = r.random()
    if depth < 2 and roll < 0.2:
        return _object(r, depth + 1)
    if depth < 2 and roll < 0.4:
        a = {"type": "array", "items": _value(r, depth + 1), "maxItems": r.randint(1, 3)}
        if r.random() < 0.5:
            a["minItems"] = 1
        return a
    return _leaf(r)


def _object(r: random.Random, depth: int) -> dict:
    names = r.sample(NAMES, r.randint(1, 4))
    props = {n: _value(r, depth) for n in names}
    required = [n for n in names if r.random() < 0.7] or [names[0]]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int = 50) -> list:
    r = random.Random(20261130)
    out, texts = [], []
    while len(out) < n:
        s = _object(r, 0)
        t = json.dumps(s, sort_keys=True)
        if t not in texts:
            out.append(s)
            texts.append(t)
    # Varied for real: nesting and every leaf kind somewhere.
    joined = "".join(texts)
    for needle in ['"type": "array"', '"enum"', '"minimum"', '"pattern"',
                   '"type": "number"', '"required"']:
        assert needle in joined, needle
    assert sum('"properties": {' in t[1:] and t.count('"type": "object"') > 1 for t in texts) >= 5
    return out


def _constrained(client, schema: dict, seed: int):
    # The grammar, not the prompt, makes the output valid; a short prompt keeps prefill cheap.
    prompt = f"Reply with a JSON object with the keys {', '.join(schema['properties'])}."
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=1.0,
        seed=seed, response_format={"type": "json_schema",
                                    "json_schema": {"name": f"schema_{seed}", "schema": schema, "strict": True}})


def test_50_schemas_sampled_at_temperature_1_validate(cluster):
    client = cluster.client()
    all_schemas = schemas()
    with ThreadPoolExecutor(25) as pool:
        results = list(pool.map(lambda i: _constrained(client, all_schemas[i], i), range(len(all_schemas))))
    failures = []
    for i, (schema, r) in enumerate(zip(all_schemas, results)):
        choice = r.choices[0]
        text = choice.message.content
        try:
            assert choice.finish_reason == "stop", f"finish_reason {choice.finish_reason}"
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append((i, str(e)[:200], text[:300], json.dumps(schema)[:300]))
    assert not failures, f"{len(failures)} of 50 invalid, e.g. {failures[:3]}"


def test_json_object_mode_yields_an_object(cluster):
    client = cluster.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Describe a small dog as a JSON object."}],
            max_tokens=MAX_TOKENS, temperature=0.7, seed=seed, response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            # Free-form keys and strings may run to max_tokens; what came is still an object's start.
            assert r.choices[0].message.content.startswith("{")


def test_completions_take_response_format_too(cluster):
    r = cluster.client().completions.create(
        model=MODEL_NAME, prompt="A colour and a number as JSON:", max_tokens=60, temperature=1.0, seed=3,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
            "type": "object", "properties": {"colour": {"enum": WORDS[:3]}, "n": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 9}},
            "required": ["colour", "n"], "additionalProperties": False}}}})
    value = json.loads(r.choices[0].text)
    assert value["colour"] in WORDS[:3] and 1 <= value["n"] <= 9


def _deep(levels: int) -> dict:
    s = {"type": "integer"}
    for _ in range(levels):
        s = {"type": "array", "items": s}
    return s


BAD_FORMATS = [
    # Invalid requests and schemas.
    {"type": "yaml"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"name": "has space", "schema": {"type": "object"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a(b"}}},
    # Pathological: repetition that explodes when unrolled, catastrophic patterns under a
    # length bound, nesting deeper than the parser allows.
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^[a-z]{100000}$"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "^(x+x+)+y$",
                                                                     "minLength": 100000}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(.*a){25}",
                                                                     "maxLength": 100}}},
]
# Nesting deeper than any JSON parser here allows: the body itself is refused (no param).
TOO_DEEP = {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(300)}}


def test_invalid_and_pathological_schemas_are_a_400_within_a_second(cluster):
    for fmt, param in [(f, "response_format") for f in BAD_FORMATS] + [(TOO_DEEP, "<any>")]:
        for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})]:
            body = {**body, "model": MODEL_NAME, "max_tokens": 8, "response_format": fmt}
            t0 = time.monotonic()
            resp = requests.post(cluster.url(path), json=body, headers=cluster.headers(), timeout=30)
            took = time.monotonic() - t0
            assert_openai_error(resp, 400, param=param, error_type="invalid_request_error")
            assert took < 1.0, f"{path} {json.dumps(fmt)[:120]}: {took:.2f} s"


def test_a_schema_over_1_mib_is_a_400(cluster):
    # Each admitted sequence carries its constraint to the worker in the step message; a
    # schema of megabytes (here a long description, which the grammar itself ignores) is
    # refused at the gateway with the field named, before any engine sees it.
    schema = {"type": "object", "description": "x" * (2 << 20), "properties": {"n": {"type": "integer"}}}
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "A number as JSON."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    resp = requests.post(cluster.url("/v1/chat/completions"), json=body, headers=cluster.headers(), timeout=30)
    assert_openai_error(resp, 400, param="response_format", error_type="invalid_request_error")
    assert "at most 1048576" in resp.json()["error"]["message"]


SUBJECTS = ["the ocean", "a red bicycle", "quantum computers", "my grandmother's garden", "the Roman empire",
            "volcanoes", "a lost key", "jazz music", "the moon landing", "honey bees", "a rainy Tuesday",
            "chess openings", "the first computer", "a mountain village", "paper airplanes", "deep sea fish"]
FREE = ([f"Write one sentence about {s}." for s in SUBJECTS] + [f"Name three facts about {s}." for s in SUBJECTS])[:31]


def _free(client, prompt):
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                       max_tokens=24, temperature=0)
    return r.choices[0].message.content


def test_one_constrained_request_leaves_31_free_ones_unchanged(cluster):
    client = cluster.client()
    schema = schemas()[7]
    with ThreadPoolExecutor(32) as pool:
        without = list(pool.map(lambda p: _free(client, p), FREE))
    with ThreadPoolExecutor(32) as pool:
        constrained = pool.submit(_constrained, client, schema, 77)
        together = list(pool.map(lambda p: _free(client, p), FREE))
        c = constrained.result().choices[0]
    assert all(without)
    differ = [(p, a, b) for p, a, b in zip(FREE, without, together) if a != b]
    assert not differ, f"{len(differ)} of 31 free answers changed beside a constrained one, e.g. {differ[:2]}"
    jsonschema.validate(json.loads(c.message.content), schema)
