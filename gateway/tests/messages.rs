//! Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens` over the fake engine and
//! byte codec: the message shape and usage, the template rendering (system + messages),
//! stop sequences -> `stop_reason`, the streamed event order, request validation and the
//! error shape, `x-api-key` and `anthropic-version`.

mod common;

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::*;
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, FakeEngine, FakeStep, EOS};
use tessera_gateway::EngineError;

fn engine_replying(text: &str, then_eos: bool) -> Arc<FakeEngine> {
    let mut reply = ids(text);
    if then_eos {
        reply.push(EOS);
    }
    Arc::new(FakeEngine::new(move |req| Ok(reply_steps(req, &reply, 0))))
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]});
    if let (Some(b), Some(extra)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(extra.clone());
    }
    b
}

/// `(event name, data)` of each SSE event, in order.
fn named_events(reply: &Reply) -> Vec<(String, Value)> {
    String::from_utf8_lossy(&reply.body)
        .split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_owned(), serde_json::from_str(data).expect("event JSON")))
        })
        .collect()
}

/// Asserts Anthropic's error body and returns `error`.
fn assert_anthropic_error(reply: &Reply, status: StatusCode, error_type: &str) -> Value {
    assert_eq!(reply.status, status, "body: {}", String::from_utf8_lossy(&reply.body));
    let body = reply.json();
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], error_type, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    body["error"].clone()
}

#[tokio::test]
async fn message_shape_usage_and_template() {
    let engine = engine_replying("Hello, wörld!", true);
    let app = router(config(), engine.clone());
    let b = body(json!({
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "temperature": 0.5, "top_p": 0.9, "top_k": 40, "metadata": {"user_id": "u-1"},
    }));
    let r = post_json(&app, "/v1/messages", &b).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["content"], json!([{"type": "text", "text": "Hello, wörld!"}]));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    let prompt = ids("<|bos|><|system|>Be brief.\n<|user|>Hi\n<|assistant|>");
    assert_eq!(v["usage"]["input_tokens"], prompt.len());
    assert_eq!(v["usage"]["output_tokens"], ids("Hello, wörld!").len() + 1);
    let log = engine.log();
    assert_eq!(log.requests[0].prompt_ids, prompt);
    let p = &log.requests[0].params;
    assert_eq!((p.temperature, p.top_p, p.top_k, p.max_tokens), (0.5, 0.9, Some(40), 64));

    let r = post_json(
        &app,
        "/v1/messages/count_tokens",
        &json!({"model": MODEL, "system": "Be brief.", "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json(), json!({"input_tokens": prompt.len()}));
}

#[tokio::test]
async fn stop_sequences_and_max_tokens_set_stop_reason() {
    let app = router(config(), engine_replying("The answer is 42.</ans> more", true));
    let v = post_json(&app, "/v1/messages", &body(json!({"stop_sequences": ["zz", "</ans>"]}))).await.json();
    assert_eq!(v["content"][0]["text"], "The answer is 42.");
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "</ans>");

    let v = post_json(&app, "/v1/messages", &body(json!({"max_tokens": 3}))).await.json();
    assert_eq!(v["content"][0]["text"], "The");
    assert_eq!(v["stop_reason"], "max_tokens");
    assert_eq!(v["usage"]["output_tokens"], 3);
}

#[tokio::test]
async fn stream_sends_anthropic_events_in_order() {
    let app = router(config(), engine_replying("ab</s>c", true));
    let r = post_json(&app, "/v1/messages", &body(json!({"stream": true, "stop_sequences": ["</s>"]}))).await;
    assert_eq!(r.status, StatusCode::OK);
    let events = named_events(&r);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names.iter().filter(|n| **n == "content_block_delta").count();
    assert!(deltas >= 1, "{names:?}");
    let mut want = vec!["message_start", "content_block_start", "ping"];
    want.extend(std::iter::repeat_n("content_block_delta", deltas));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want);
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    let start = &events[0].1["message"];
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(start["usage"]["input_tokens"], chat_prompt("Hi").len());
    assert_eq!(events[1].1["content_block"], json!({"type": "text", "text": ""}));
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap_or_default().to_owned()
        })
        .collect();
    assert_eq!(text, "ab");
    let delta = &events[names.len() - 2].1;
    assert_eq!(delta["delta"], json!({"stop_reason": "stop_sequence", "stop_sequence": "</s>"}));
    assert_eq!(delta["usage"]["output_tokens"], ids("ab</s>").len());
}

#[tokio::test]
async fn stream_failure_is_an_error_event() {
    let engine = Arc::new(FakeEngine::new(|_| {
        Ok(vec![
            FakeStep::Send(tessera_gateway::EngineEvent::Token { id: 65, logprob: None, top: vec![] }),
            FakeStep::Send(tessera_gateway::EngineEvent::Error(EngineError::Internal("boom".into()))),
        ])
    }));
    let app = router(config(), engine);
    let r = post_json(&app, "/v1/messages", &body(json!({"stream": true}))).await;
    let events = named_events(&r);
    let (name, data) = events.last().expect("events");
    assert_eq!(name, "error");
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");
    assert!(!String::from_utf8_lossy(&r.body).contains("boom"));
}

#[tokio::test]
async fn invalid_requests_are_400_in_anthropic_shape() {
    let app = router(config(), engine_replying("x", true));
    let cases = [
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        body(json!({"max_tokens": 0})),
        body(json!({"temperature": 1.5})),
        body(json!({"messages": []})),
        body(json!({"messages": [{"role": "system", "content": "x"}]})),
        body(json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]})),
        body(json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]})),
        body(json!({"system": 7})),
        body(json!({"stop_sequences": "x"})),
        body(json!({"stop_sequences": [""]})),
        body(json!({"stop_sequences": vec!["s"; 65]})),
        body(json!({"stop_sequences": ["x".repeat(4097)]})),
    ];
    for b in cases {
        let r = post_json(&app, "/v1/messages", &b).await;
        assert_anthropic_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error");
    }
    let r = post_json(&app, "/v1/messages", &json!({"model": MODEL})).await;
    let e = assert_anthropic_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error");
    assert!(e["message"].as_str().unwrap_or_default().contains("messages"), "{e}");
    let r = post_json(&app, "/v1/messages", &body(json!({"model": "other"}))).await;
    assert_anthropic_error(&r, StatusCode::NOT_FOUND, "not_found_error");
    let r = send(&app, post("/v1/messages", "{not json")).await;
    assert_anthropic_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error");
}

#[tokio::test]
async fn overload_is_529_overloaded_error() {
    let engine = Arc::new(FakeEngine::new(|_| Err(EngineError::Overloaded { retry_after_s: 2 })));
    let app = router(config(), engine);
    let r = post_json(&app, "/v1/messages", &body(json!({}))).await;
    assert_anthropic_error(&r, StatusCode::from_u16(529).expect("status"), "overloaded_error");
    assert_eq!(r.headers["retry-after"], "2");
}

fn with_headers(b: &Value, headers: &[(&'static str, &str)]) -> Request<Body> {
    let mut req = post("/v1/messages", b.to_string());
    for (k, v) in headers {
        req.headers_mut().insert(*k, v.parse().expect("header"));
    }
    req
}

#[tokio::test]
async fn x_api_key_and_anthropic_version_headers() {
    let mut cfg = config();
    cfg.api_keys = vec!["k1".into()];
    let app = router(cfg, engine_replying("ok", true));
    let b = body(json!({}));
    let r = send(&app, with_headers(&b, &[])).await;
    assert_anthropic_error(&r, StatusCode::UNAUTHORIZED, "authentication_error");
    let r = send(&app, with_headers(&b, &[("x-api-key", "k2")])).await;
    assert_anthropic_error(&r, StatusCode::UNAUTHORIZED, "authentication_error");
    for ok in [("x-api-key", "k1"), ("authorization", "Bearer k1")] {
        let r = send(&app, with_headers(&b, &[ok, ("anthropic-version", "2023-06-01")])).await;
        assert_eq!(r.status, StatusCode::OK, "{ok:?}");
    }
    let r = send(&app, with_headers(&b, &[("x-api-key", "k1"), ("anthropic-version", "latest")])).await;
    assert_anthropic_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error");
    // x-api-key works on the OpenAI routes too.
    let mut req = post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "Hi"}]}).to_string());
    req.headers_mut().insert("x-api-key", "k1".parse().expect("header"));
    assert_eq!(send(&app, req).await.status, StatusCode::OK);
}
