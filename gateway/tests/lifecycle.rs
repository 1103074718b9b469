//! Readiness, the auxiliary routes, aborts (client disconnects, stop strings) and serving on
//! a real loopback socket with graceful shutdown.

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, ByteCodec, FakeEngine, FakeStep, BOS, EOS};
use tessera_gateway::{serve_on, AppState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

#[tokio::test]
async fn ready_follows_the_engine_and_health_does_not() {
    let engine = Arc::new(FakeEngine::replying(ids("x")));
    let app = router(config(), engine.clone());
    assert_eq!(send(&app, get("/ready")).await.status, StatusCode::OK);
    engine.set_ready(false);
    let r = send(&app, get("/ready")).await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "server_error", None);
    assert_eq!(send(&app, get("/health")).await.status, StatusCode::OK);
    engine.set_ready(true);
    assert_eq!(send(&app, get("/ready")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn models_tokenize_detokenize() {
    let mut cfg = config();
    cfg.served_model_name = Some("served-name".into());
    let app = router(cfg, Arc::new(FakeEngine::replying(ids("x"))));
    let v = send(&app, get("/v1/models")).await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "served-name");
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["max_model_len"], MAX_MODEL_LEN);

    let v = post_json(&app, "/tokenize", &json!({"prompt": "hé<|eos|>", "return_token_strs": true})).await.json();
    let want = [vec![BOS], ids("hé"), vec![EOS]].concat();
    assert_eq!(v["tokens"], json!(want));
    assert_eq!(v["count"], want.len());
    assert_eq!(v["max_model_len"], MAX_MODEL_LEN);
    assert_eq!(v["token_strs"], json!(["<|bos|>", "h", "\u{FFFD}", "\u{FFFD}", "<|eos|>"]));

    let v =
        post_json(&app, "/tokenize", &json!({"model": "served-name", "messages": [{"role": "user", "content": "q"}]}))
            .await
            .json();
    assert_eq!(v["tokens"], json!(chat_prompt("q")));
    assert_eq!(v["token_strs"], Value::Null);

    let r = post_json(&app, "/tokenize", &json!({"prompt": "a", "messages": []})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("prompt"));

    let v = post_json(&app, "/detokenize", &json!({"tokens": want})).await.json();
    assert_eq!(v["prompt"], "<|bos|>hé<|eos|>");
    let r = post_json(&app, "/detokenize", &json!({"tokens": [1, -5]})).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("tokens"));
}

/// A sequence that sends a few tokens and then never ends by itself.
fn endless_engine() -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(|req| {
        let mut steps = reply_steps(req, &ids("abc"), 0);
        steps.pop();
        steps.push(FakeStep::Hold);
        Ok(steps)
    }))
}

#[tokio::test]
async fn dropping_a_stream_aborts_the_sequence() {
    let engine = endless_engine();
    let app = router(config(), engine.clone());
    let body = json!({"messages": [{"role": "user", "content": "q"}], "stream": true, "n": 2});
    let response = app.oneshot(post("/v1/chat/completions", body.to_string())).await.expect("response");
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    let mut seen = String::new();
    while !(seen.contains("\"c\"") && seen.matches("\"content\":\"c\"").count() == 2) {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame()).await.expect("a frame in time");
        let frame = frame.expect("stream still open").expect("frame");
        if let Ok(data) = frame.into_data() {
            seen.push_str(&String::from_utf8_lossy(&data));
        }
    }
    assert!(engine.log().aborted.is_empty());
    drop(body); // the client goes away
    for req in engine.log().requests {
        assert!(engine.wait_for_abort(&req.request_id, Duration::from_secs(5)).await, "{} not aborted", req.request_id);
    }
}

#[tokio::test]
async fn dropping_a_pending_response_aborts_the_sequence() {
    let engine = endless_engine();
    let app = router(config(), engine.clone());
    let body = json!({"prompt": "q"});
    let pending = app.oneshot(post("/v1/completions", body.to_string()));
    assert!(tokio::time::timeout(Duration::from_millis(100), pending).await.is_err(), "should still be generating");
    let id = engine.log().requests[0].request_id.clone();
    assert!(engine.wait_for_abort(&id, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn a_matched_stop_string_aborts_the_sequence() {
    let engine = endless_engine();
    let app = router(config(), engine.clone());
    let body = json!({"prompt": "q", "stop": ["bc"]});
    let v =
        tokio::time::timeout(Duration::from_secs(5), post_json(&app, "/v1/completions", &body)).await.expect("in time");
    assert_eq!(v.json()["choices"][0]["text"], "a");
    assert_eq!(v.json()["choices"][0]["finish_reason"], "stop");
    assert_eq!(v.json()["usage"]["completion_tokens"], 3);
    let id = engine.log().requests[0].request_id.clone();
    assert!(engine.wait_for_abort(&id, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn serves_on_loopback_and_shuts_down_gracefully() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let engine = Arc::new(FakeEngine::replying(ids("pong")));
    let state = AppState::new(config(), engine, Arc::new(ByteCodec::new(MODEL))).expect("state");
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_on(listener, state, async {
        let _ = stop_rx.await;
    }));

    let body = json!({"prompt": "ping"}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut response))
        .await
        .expect("in time")
        .expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"text\":\"pong\""), "{response}");

    let _ = stop_tx.send(());
    let result = tokio::time::timeout(Duration::from_secs(5), server).await.expect("shut down in time");
    assert!(matches!(result, Ok(Ok(()))));
}
