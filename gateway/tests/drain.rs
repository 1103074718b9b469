//! Graceful drain: once started, `/ready` and every new request get 503 with `Retry-After`
//! (`/health` still answers), while a stream admitted before runs to its end and counts as
//! in flight until its body is finished; `idle` completes only then.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use http_body_util::BodyExt;
use serde_json::json;
use tessera_gateway::app::{app, AppState};
use tessera_gateway::testing::{reply_steps, ByteCodec, FakeEngine};
use tower::ServiceExt;

#[tokio::test]
async fn draining_refuses_new_work_and_lets_streams_finish() {
    let engine = Arc::new(FakeEngine::new(|req| Ok(reply_steps(req, &ids("abcdef"), 0))));
    let state = AppState::new(config(), engine, Arc::new(ByteCodec::new(MODEL))).unwrap();
    let drain = state.drain().clone();
    let app = app(state);
    let body = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": true});
    let streaming = app.clone().oneshot(post("/v1/completions", body.to_string())).await.unwrap();
    assert_eq!(streaming.status(), StatusCode::OK);
    assert_eq!(drain.in_flight(), 1, "the stream counts until its body ends");

    drain.start();
    let refused = send(&app, post("/v1/completions", body.to_string())).await;
    assert_error(&refused, StatusCode::SERVICE_UNAVAILABLE, "server_error", None);
    assert!(refused.headers.get("retry-after").is_some_and(|v| v.to_str().unwrap().parse::<u32>().unwrap() >= 1));
    assert_eq!(send(&app, get("/ready")).await.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(send(&app, get("/health")).await.status, StatusCode::OK);
    assert_eq!(drain.in_flight(), 1, "refused requests are not counted");

    let idle = tokio::spawn({
        let drain = drain.clone();
        async move { drain.idle().await }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!idle.is_finished(), "idle while the stream is open");
    let text = String::from_utf8(streaming.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    let events = sse_data(&text);
    let streamed: String = events.iter().filter_map(|e| e["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, "abcdef", "the admitted stream ran to its end");
    assert!(text.trim_end().ends_with("data: [DONE]"));
    tokio::time::timeout(Duration::from_secs(1), idle).await.expect("idle once the stream ended").unwrap();
    assert_eq!(drain.in_flight(), 0);
}
