//! Shared helpers for the gateway's HTTP tests: build the app over a `FakeEngine` and a
//! `ByteCodec`, send one request through `tower::ServiceExt::oneshot`, and read JSON or SSE.

#![allow(dead_code)]

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::Value;
use tessera_gateway::testing::{ByteCodec, FakeEngine};
use tessera_gateway::{app, AppState, GatewayConfig};
use tower::ServiceExt;

pub const MODEL: &str = "byte-model";
pub const MAX_MODEL_LEN: u32 = 256;

pub fn config() -> GatewayConfig {
    GatewayConfig::new(MAX_MODEL_LEN)
}

pub fn router(config: GatewayConfig, engine: Arc<FakeEngine>) -> Router {
    let state = AppState::new(config, engine, Arc::new(ByteCodec::new(MODEL))).expect("valid test config");
    app(state)
}

pub fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path).header("content-type", "application/json").body(body.into()).expect("request")
}

pub fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).expect("request")
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// The `data:` payloads of an SSE body, in order (`[DONE]` as a JSON string).
    pub fn events(&self) -> Vec<Value> {
        sse_data(&String::from_utf8_lossy(&self.body))
    }
}

pub fn sse_data(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| if d == "[DONE]" { Value::from("[DONE]") } else { serde_json::from_str(d).expect("event JSON") })
        .collect()
}

pub async fn send(app: &Router, req: Request<Body>) -> Reply {
    let response = app.clone().oneshot(req).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("body").to_bytes().to_vec();
    Reply { status, headers, body }
}

pub async fn post_json(app: &Router, path: &str, body: &Value) -> Reply {
    send(app, post(path, body.to_string())).await
}

/// Token ids of `text` in the byte codec.
pub fn ids(text: &str) -> Vec<u32> {
    ByteCodec::ids(text)
}

/// The prompt the byte codec's template renders for one user message.
pub fn chat_prompt(user: &str) -> Vec<u32> {
    ids(&format!("<|bos|><|user|>{user}\n<|assistant|>"))
}

/// Asserts an OpenAI error body and returns its `error` object.
pub fn assert_error(reply: &Reply, status: StatusCode, error_type: &str, param: Option<&str>) -> Value {
    assert_eq!(reply.status, status, "body: {}", String::from_utf8_lossy(&reply.body));
    let body = reply.json();
    let error = body.get("error").cloned().unwrap_or_else(|| panic!("no error object: {body}"));
    assert_eq!(error["type"], error_type, "{error}");
    assert_eq!(error["param"], param.map_or(Value::Null, Value::from), "{error}");
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()), "{error}");
    assert!(error.as_object().is_some_and(|o| o.contains_key("code")), "{error}");
    error
}
