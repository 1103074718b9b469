//! Structured outputs at the HTTP layer (over the byte codec and the fake engine): a valid
//! `response_format` reaches the engine as the matching `Constraint`, compile-checked
//! against the codec's vocabulary; a bad one is a 400 naming `response_format` and never
//! reaches the engine; no `response_format` means no constraint.

mod common;

use std::sync::Arc;

use common::*;
use serde_json::{json, Value};
use tessera_gateway::testing::FakeEngine;
use tessera_gateway::Constraint;

fn setup() -> (Arc<FakeEngine>, axum::Router) {
    let engine = Arc::new(FakeEngine::replying(ids("{}")));
    let app = router(config(), engine.clone());
    (engine, app)
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8});
    for (k, v) in extra.as_object().expect("object") {
        body[k] = v.clone();
    }
    body
}

#[tokio::test]
async fn response_formats_reach_the_engine_as_constraints() {
    let (engine, app) = setup();
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 9}},
                        "required": ["n"], "additionalProperties": false});
    let cases = [
        ("/v1/chat/completions", chat(json!({}))),
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "text"}}))),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "n_1", "schema": schema, "strict": true}}})),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 4,
                                   "response_format": {"type": "json_object"}}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "x", "max_tokens": 4,
                                   "structured_outputs": {"regex": "[0-9]{3}"}}),
        ),
    ];
    for (path, body) in &cases {
        let r = post_json(&app, path, body).await;
        assert_eq!(r.status, 200, "{path} {body}: {}", String::from_utf8_lossy(&r.body));
    }
    let got: Vec<Option<Constraint>> = engine.log().requests.iter().map(|r| r.params.constraint.clone()).collect();
    assert_eq!(got.len(), 5);
    assert_eq!(got[0], None);
    assert_eq!(got[1], None);
    match &got[2] {
        Some(Constraint::JsonSchema(text)) => {
            assert_eq!(serde_json::from_str::<Value>(text).expect("schema text"), schema)
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(got[3], Some(Constraint::JsonObject));
    assert_eq!(got[4], Some(Constraint::Regex("[0-9]{3}".into())));
}

#[tokio::test]
async fn bad_response_formats_are_400s_that_never_reach_the_engine() {
    let (engine, app) = setup();
    let bad = [
        json!({"type": "xml"}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(a{500}){500}"}}}),
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 2, "maximum": 1}}}),
        json!({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
    ];
    for fmt in bad {
        let r = post_json(&app, "/v1/chat/completions", &chat(json!({"response_format": fmt}))).await;
        assert_eq!(r.status, 400, "{fmt}");
        let err = &r.json()["error"];
        assert_eq!(err["param"], "response_format", "{fmt}: {err}");
        assert_eq!(err["type"], "invalid_request_error");
    }
    assert!(engine.log().requests.is_empty());
}
