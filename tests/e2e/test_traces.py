"""Traces and logs: a cluster started with `--otlp-endpoint` sends OpenTelemetry spans over
OTLP/HTTP (protobuf) to a small receiver run by this test, one trace per request across
the three processes: tessera-gateway (root, validate, tokenize, stream) -> tessera-coordinator
(generate, queue, schedule) -> tessera-worker (prefill, decode), linked by W3C trace
context, with the GenAI attributes and token usage of the response. JSON log lines carry
the trace id. Without an endpoint nothing is sent and no trace id is logged.

The batch exporters flush every 100 ms here (OTEL_BSP_SCHEDULE_DELAY) so spans arrive fast.
"""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from support import MODEL_NAME, Cluster, sse_events

SERVICES = ("tessera-gateway", "tessera-coordinator", "tessera-worker")
MAX_TOKENS = 5
WAIT_S = 15.0


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """An OTLP/HTTP collector in miniature: POST /v1/traces with a protobuf
    ExportTraceServiceRequest; keeps every span with its service name."""

    def __init__(self, port: int = 0):
        self.spans: list[dict] = []
        self.posts = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces" and self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    receiver._take(body)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _take(self, body: bytes) -> None:
        req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in req.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "service": resource.get("service.name"),
                        "pid": resource.get("process.pid"),
                        "trace_id": s.trace_id.hex(),
                        "span_id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "name": s.name,
                        "kind": s.kind,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "status": s.status.code,
                    })
        with self.lock:
            self.posts += 1
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def root_with(self, key: str, value) -> dict | None:
        with self.lock:
            return next((s for s in self.spans if s["attrs"].get(key) == value and s["service"] == SERVICES[0]), None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _start_cluster(name, tmp_path_factory, serve_args):
    mp = pytest.MonkeyPatch()
    # Inherited by `tessera serve` and its children; restored once they have started.
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    mp.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    try:
        return Cluster(name, tmp_path_factory.mktemp(name), serve_args=serve_args)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(receiver, tmp_path_factory):
    c = _start_cluster("traced", tmp_path_factory, ("--otlp-endpoint", receiver.url, "--log-format", "json"))
    yield c
    leftovers = c.stop()
    assert not leftovers, f"traced: {leftovers}\n{c.log_tail()}"


def _wait_for_trace(receiver, response_id, completion_tokens):
    """The whole trace of the response `response_id` once every process's spans are in."""
    deadline = time.monotonic() + WAIT_S
    spans = []
    while time.monotonic() < deadline:
        root = receiver.root_with("gen_ai.response.id", response_id)
        if root is not None:
            spans = receiver.trace(root["trace_id"])
            names = [(s["service"], s["name"]) for s in spans]
            decodes = names.count(("tessera-worker", "decode"))
            if ("tessera-coordinator", "generate") in names and decodes >= completion_tokens - 1:
                time.sleep(0.3)  # stragglers of the same batch
                return root, receiver.trace(root["trace_id"])
        time.sleep(0.1)
    raise AssertionError(f"no complete trace for {response_id} within {WAIT_S} s; have {len(spans)} spans")


def _one(spans, service, name):
    found = [s for s in spans if s["service"] == service and s["name"] == name]
    assert len(found) == 1, f"{service}/{name}: {len(found)} spans"
    return found[0]


def _check_trace(root, spans, usage, finish, operation, max_tokens):
    by_id = {s["span_id"]: s for s in spans}
    assert {s["service"] for s in spans} == set(SERVICES), {s["service"] for s in spans}
    assert len({s["trace_id"] for s in spans}) == 1

    # Gateway: the root and its phases.
    assert root["name"] == f"{operation} {MODEL_NAME}"
    assert root["kind"] == 2  # SPAN_KIND_SERVER
    attrs = root["attrs"]
    assert attrs["gen_ai.operation.name"] == operation
    assert attrs["gen_ai.request.model"] == MODEL_NAME
    assert attrs["gen_ai.request.max_tokens"] == max_tokens
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == [finish]
    assert attrs["http.response.status_code"] == 200
    for phase in ("validate", "tokenize", "stream"):
        assert _one(spans, "tessera-gateway", phase)["parent"] == root["span_id"], phase
    stream = _one(spans, "tessera-gateway", "stream")

    # Coordinator: generate under the gateway's stream phase, queue and schedule under it.
    generate = _one(spans, "tessera-coordinator", "generate")
    assert generate["parent"] == stream["span_id"]
    assert generate["kind"] == 2
    g = generate["attrs"]
    assert g["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert g["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert g["gen_ai.response.finish_reasons"] == [finish]
    assert _one(spans, "tessera-coordinator", "queue")["parent"] == generate["span_id"]
    schedules = [s for s in spans if s["name"] == "schedule"]
    assert schedules and all(s["parent"] == generate["span_id"] for s in schedules)
    assert {s["attrs"]["tessera.step.kind"] for s in schedules} == {"prefill", "decode"}

    # Worker: one span per step the sequence ran in, children of the coordinator's span;
    # the prompt's tokens not found in the prefix cache prefilled, then one decode per
    # token after the first.
    work = [s for s in spans if s["service"] == "tessera-worker"]
    assert work and all(s["parent"] == generate["span_id"] for s in work)
    prefill = [s for s in work if s["name"] == "prefill"]
    decode = [s for s in work if s["name"] == "decode"]
    assert len(prefill) + len(decode) == len(work)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert sum(s["attrs"]["tessera.tokens"] for s in prefill) == usage["prompt_tokens"] - cached
    assert len(decode) == usage["completion_tokens"] - 1
    assert all(s["attrs"]["tessera.tokens"] == 1 for s in decode)
    assert len(schedules) == len(work)

    # Every span is closed, inside its parent's interval (one clock: one machine).
    slack = 50_000_000  # 50 ms, for the end of a parent recorded before a child's export
    for s in spans:
        assert 0 < s["start"] <= s["end"], s
        assert s["status"] != 2, s  # STATUS_CODE_ERROR
        parent = by_id.get(s["parent"])
        if parent is not None:
            assert parent["start"] - slack <= s["start"] and s["end"] <= parent["end"] + slack, (parent, s)


def _json_log_lines(cluster):
    cluster.log.flush()
    out = []
    for line in cluster.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def _request_log(cluster, trace_id):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [l for l in _json_log_lines(cluster) if l.get("message") == "request finished"]
        match = [l for l in lines if l.get("trace_id") == trace_id]
        if match:
            return match[0], lines
        time.sleep(0.1)
    raise AssertionError(f"no 'request finished' log line with trace_id {trace_id}")


def test_streamed_chat_is_one_trace_over_three_processes(traced, receiver):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    response_id, usage, finish = None, None, None
    with requests.post(traced.url("/v1/chat/completions"), json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200, r.text
        for event in sse_events(r):
            assert "error" not in event, event
            response_id = event["id"]
            for choice in event["choices"]:
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    assert usage["completion_tokens"] == MAX_TOKENS and finish == "length"
    root, spans = _wait_for_trace(receiver, response_id, MAX_TOKENS)
    _check_trace(root, spans, usage, finish, "chat", MAX_TOKENS)
    assert root["attrs"]["tessera.stream"] is True

    # The gateway's log line for the request carries the trace id and its root span.
    line, _ = _request_log(traced, root["trace_id"])
    assert line["span_id"] == root["span_id"]
    assert line["level"] == "INFO" and line["target"].startswith("tessera_gateway")
    assert line["output_tokens"] == MAX_TOKENS and line["status"] == 200


def test_non_streamed_completion_and_a_callers_traceparent(traced, receiver):
    caller_trace, caller_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(traced.url("/v1/completions"), json=body, timeout=60,
                      headers={"traceparent": f"00-{caller_trace}-{caller_span}-01"})
    assert r.status_code == 200, r.text
    out = r.json()
    root, spans = _wait_for_trace(receiver, out["id"], 3)
    # The client's span is the root's parent: the whole request joined the client's trace.
    assert root["trace_id"] == caller_trace and root["parent"] == caller_span
    _check_trace(root, spans, out["usage"], "length", "text_completion", 3)
    assert root["attrs"]["tessera.stream"] is False


def test_non_streamed_chat_and_separate_requests_get_separate_traces(traced, receiver):
    ids = []
    for question in ("Say hi.", "Say bye."):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": 2,
                "temperature": 0, "ignore_eos": True}
        r = traced.post("/v1/chat/completions", body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        root, spans = _wait_for_trace(receiver, out["id"], 2)
        _check_trace(root, spans, out["usage"], "length", "chat", 2)
        ids.append(root["trace_id"])
    assert ids[0] != ids[1]


def test_a_refused_request_is_a_failed_span(traced, receiver):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "temperature": 7}
    r = traced.post("/v1/chat/completions", body, timeout=60)
    assert r.status_code == 400
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        with receiver.lock:
            failed = [s for s in receiver.spans if s["service"] == "tessera-gateway" and s["parent"] == ""
                      and s["attrs"].get("http.response.status_code") == 400]
        if failed:
            break
        time.sleep(0.1)
    assert failed, "no span for the refused request"
    assert failed[0]["status"] == 2 and failed[0]["attrs"]["error.type"] == "invalid_request_error"
    # It never reached the coordinator.
    assert {s["service"] for s in receiver.trace(failed[0]["trace_id"])} == {"tessera-gateway"}


def test_each_rank_of_a_sharded_replica_traces_its_steps_and_collectives(receiver, tmp_path_factory):
    c = _start_cluster("traced_tp3", tmp_path_factory, ("--otlp-endpoint", receiver.url, "--tp", "3"))
    try:
        body = {"model": MODEL_NAME, "prompt": "One, two,", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            root = receiver.root_with("gen_ai.response.id", out["id"])
            spans = receiver.trace(root["trace_id"]) if root else []
            work = [s for s in spans if s["service"] == "tessera-worker" and s["name"] in ("prefill", "decode")]
            if len(work) == 3 * out["usage"]["completion_tokens"]:
                break
            time.sleep(0.1)
        generate = _one(spans, "tessera-coordinator", "generate")
        ranks = {s["pid"] for s in work}
        assert len(ranks) == 3, ranks
        by_rank = {pid: [s for s in work if s["pid"] == pid] for pid in ranks}
        for pid, steps in by_rank.items():
            assert [s["name"] for s in sorted(steps, key=lambda s: s["start"])] == ["prefill", "decode", "decode"]
            assert all(s["parent"] == generate["span_id"] for s in steps)
        # Each step span of each rank has one `collective` child with the step's time in them.
        collectives = [s for s in spans if s["name"] == "collective"]
        step_ids = {s["span_id"] for s in work}
        assert sorted(s["parent"] for s in collectives) == sorted(step_ids)
        assert all(s["attrs"]["tessera.collective_us"] > 0 for s in collectives)
    finally:
        leftovers = c.stop()
        assert not leftovers, f"traced_tp3: {leftovers}\n{c.log_tail()}"


def test_without_an_endpoint_nothing_is_sent(tmp_path_factory):
    # A receiver on OTLP/HTTP's default port, where a mistakenly enabled exporter would send.
    try:
        default_port = OtlpReceiver(4318)
    except OSError:
        pytest.skip("port 4318 is in use")
    try:
        c = _start_cluster("untraced", tmp_path_factory, ("--log-format", "json"))
        try:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with requests.post(c.url("/v1/chat/completions"), json=body, stream=True, timeout=60) as r:
                assert r.status_code == 200
                assert sum(1 for _ in sse_events(r)) > 0
            deadline = time.monotonic() + 5
            lines = []
            while not lines and time.monotonic() < deadline:
                lines = [l for l in _json_log_lines(c) if l.get("message") == "request finished"]
                time.sleep(0.1)
            # The request was logged, without a trace id: no span was made.
            assert len(lines) == 1 and "trace_id" not in lines[0], lines
            time.sleep(0.5)  # five export periods
            assert default_port.posts == 0 and not default_port.spans
        finally:
            leftovers = c.stop()
            assert not leftovers, f"untraced: {leftovers}\n{c.log_tail()}"
    finally:
        default_port.close()
