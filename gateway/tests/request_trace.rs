//! Traces of generation requests, over the fake engine with spans captured in memory: the
//! root (`chat <model>` / `text_completion <model>`) with its phases, the GenAI attributes
//! and token usage, the engine called inside the `stream` phase (what the coordinator
//! client injects as `traceparent`), a client's own `traceparent`, refused requests, and
//! Anthropic's `/v1/messages` traced as a chat on its own route.

mod common;

use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use common::*;
use serde_json::json;
use tessera_gateway::testing::{reply_steps, FakeEngine};
use tessera_telemetry::trace::{self as otel, Context};
use tessera_telemetry::trace_capture::{capture, Capture, CapturedSpan};

/// An engine answering `reply` that notes the trace context it was called in.
fn engine(reply: &str, seen: Arc<Mutex<Vec<Option<String>>>>) -> Arc<FakeEngine> {
    let reply = ids(reply);
    Arc::new(FakeEngine::new(move |req| {
        seen.lock().unwrap().push(otel::traceparent(&Context::current()));
        Ok(reply_steps(req, &reply, 0))
    }))
}

/// The request's root span (by response id) and every span of its trace.
fn trace_of(capture: &Capture, response_id: &str) -> (CapturedSpan, Vec<CapturedSpan>) {
    let root = capture
        .spans()
        .into_iter()
        .find(|s| s.str("gen_ai.response.id").as_deref() == Some(response_id))
        .unwrap_or_else(|| panic!("no root span for {response_id}"));
    let spans = capture.trace(&root.trace_id);
    (root, spans)
}

fn child<'a>(spans: &'a [CapturedSpan], root: &CapturedSpan, name: &str) -> &'a CapturedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name && s.parent_span_id == root.span_id).collect();
    assert_eq!(found.len(), 1, "{name}: {found:?}");
    found[0]
}

fn strings(span: &CapturedSpan, key: &str) -> Vec<String> {
    match span.attributes.get(key) {
        Some(otel::Value::Array(otel::Array::String(v))) => v.iter().map(|s| s.to_string()).collect(),
        other => panic!("{key}: {other:?}"),
    }
}

#[tokio::test]
async fn a_streamed_chat_with_two_choices_is_one_trace_with_its_usage() {
    let capture = capture();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = router(config(), engine("Hi there", seen.clone()));
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "n": 2,
        "max_tokens": 5, "temperature": 0.5, "seed": 3, "stream": true});
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let id = r.events()[0]["id"].as_str().expect("id").to_owned();

    let (root, spans) = trace_of(&capture, &id);
    assert_eq!(root.name, format!("chat {MODEL}"));
    assert_eq!(root.parent_span_id, "0000000000000000");
    assert_eq!(root.str("gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(root.str("gen_ai.request.model").as_deref(), Some(MODEL));
    assert_eq!(root.int("gen_ai.request.max_tokens"), Some(5));
    assert_eq!(root.int("gen_ai.request.seed"), Some(3));
    assert_eq!(root.int("gen_ai.request.choice.count"), Some(2));
    assert_eq!(root.attributes.get("gen_ai.request.temperature"), Some(&otel::Value::F64(0.5)));
    // The prompt counts once; both choices' tokens count.
    assert_eq!(root.int("gen_ai.usage.input_tokens"), Some(chat_prompt("Hello").len() as i64));
    assert_eq!(root.int("gen_ai.usage.output_tokens"), Some(10));
    assert_eq!(strings(&root, "gen_ai.response.finish_reasons"), ["length", "length"]);
    assert_eq!(root.int("http.response.status_code"), Some(200));
    assert!(root.error.is_none());
    for phase in ["validate", "tokenize"] {
        child(&spans, &root, phase);
    }
    let stream = child(&spans, &root, "stream");
    assert_eq!(stream.int("gen_ai.usage.output_tokens"), Some(10));
    assert!(stream.end <= root.end);

    // Both sequences were admitted inside the `stream` span.
    let expected = format!("00-{}-{}-01", root.trace_id, stream.span_id);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, [Some(expected.clone()), Some(expected)]);
}

#[tokio::test]
async fn a_completion_joins_the_callers_trace() {
    let capture = capture();
    let app = router(config(), engine("abc", Arc::default()));
    let caller = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let body = json!({"model": MODEL, "prompt": ["one", "two"], "max_tokens": 2});
    let req = axum::http::Request::post("/v1/completions")
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{}-{}-01", caller.0, caller.1))
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let r = send(&app, req).await;
    assert_eq!(r.status, StatusCode::OK);
    let (root, _) = trace_of(&capture, r.json()["id"].as_str().unwrap());
    assert_eq!((root.trace_id.as_str(), root.parent_span_id.as_str()), caller);
    assert_eq!(root.name, format!("text_completion {MODEL}"));
    assert_eq!(root.int("gen_ai.usage.input_tokens"), Some((ids("one").len() + ids("two").len()) as i64 + 2));
    assert_eq!(root.int("gen_ai.usage.output_tokens"), Some(4));
}

#[tokio::test]
async fn a_refused_request_is_a_failed_root_without_a_stream() {
    let capture = capture();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = router(config(), engine("x", seen.clone()));
    let caller = "1af7651916cd43dd8448eb211c80319c";
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 9});
    let req = axum::http::Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{caller}-b7ad6b7169203331-01"))
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let r = send(&app, req).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let spans = capture.trace(caller);
    let root = spans.iter().find(|s| s.name.starts_with("chat ")).expect("root");
    assert_eq!(root.int("http.response.status_code"), Some(400));
    assert_eq!(root.str("error.type").as_deref(), Some("invalid_request_error"));
    assert!(root.error.is_some());
    assert!(spans.iter().all(|s| s.name != "stream" && s.name != "tokenize"), "{spans:?}");
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn anthropic_messages_are_traced_as_chats() {
    let capture = capture();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let app = router(config(), engine("Hi there", seen.clone()));
    let body = json!({"model": MODEL, "max_tokens": 4, "temperature": 0.25, "stream": true,
        "messages": [{"role": "user", "content": "Hello"}]});
    let r = post_json(&app, "/v1/messages", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let start = r.events().into_iter().find(|e| e["type"] == "message_start").expect("message_start");
    let id = start["message"]["id"].as_str().expect("id").to_owned();
    assert!(id.starts_with("msg_"), "{id}");

    let (root, spans) = trace_of(&capture, &id);
    assert_eq!(root.name, format!("chat {MODEL}"));
    assert_eq!(root.str("gen_ai.operation.name").as_deref(), Some("chat"));
    assert_eq!(root.str("http.route").as_deref(), Some("/v1/messages"));
    assert_eq!(root.int("gen_ai.request.max_tokens"), Some(4));
    assert_eq!(root.attributes.get("gen_ai.request.temperature"), Some(&otel::Value::F64(0.25)));
    assert_eq!(root.int("gen_ai.usage.input_tokens"), Some(chat_prompt("Hello").len() as i64));
    assert_eq!(root.int("gen_ai.usage.output_tokens"), Some(4));
    assert_eq!(strings(&root, "gen_ai.response.finish_reasons"), ["length"]);
    assert_eq!(root.int("http.response.status_code"), Some(200));
    for phase in ["validate", "tokenize"] {
        child(&spans, &root, phase);
    }
    let stream = child(&spans, &root, "stream");
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen, [Some(format!("00-{}-{}-01", root.trace_id, stream.span_id))]);

    // Refused: Anthropic's temperature range is [0, 1].
    let caller = "2af7651916cd43dd8448eb211c80319c";
    let body = json!({"model": MODEL, "max_tokens": 4, "temperature": 1.5,
        "messages": [{"role": "user", "content": "x"}]});
    let req = axum::http::Request::post("/v1/messages")
        .header("content-type", "application/json")
        .header("traceparent", format!("00-{caller}-b7ad6b7169203331-01"))
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    let r = send(&app, req).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let spans = capture.trace(caller);
    let root = spans.iter().find(|s| s.name.starts_with("chat ")).expect("root");
    assert_eq!(root.str("http.route").as_deref(), Some("/v1/messages"));
    assert_eq!(root.int("http.response.status_code"), Some(400));
    assert_eq!(root.str("error.type").as_deref(), Some("invalid_request_error"));
    assert!(spans.iter().all(|s| s.name != "stream"), "{spans:?}");
}
