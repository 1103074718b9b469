//! The gateway's request metrics over a `FakeEngine`: each outcome is counted once, the
//! totals add up (requests = successes + failures + cancellations + rejections), TTFT is
//! observed once per request that produced a token, and the token counters match usage.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use http_body_util::BodyExt;
use serde_json::json;
use tessera_gateway::engine::{EngineError, EngineEvent};
use tessera_gateway::testing::{reply_steps, FakeEngine, FakeStep};
use tower::ServiceExt;

/// The samples of a `/metrics` answer, by name with labels.
async fn metrics(app: &axum::Router) -> HashMap<String, f64> {
    let r = send(app, get("/metrics")).await;
    assert_eq!(r.status, StatusCode::OK);
    String::from_utf8_lossy(&r.body)
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(k, v)| (k.to_owned(), v.parse().expect("a number"))))
        .collect()
}

fn m(all: &HashMap<String, f64>, key: &str) -> f64 {
    *all.get(key).unwrap_or_else(|| panic!("no sample {key}"))
}

fn sum_prefix(all: &HashMap<String, f64>, prefix: &str) -> f64 {
    all.iter().filter(|(k, _)| k.starts_with(prefix)).map(|(_, v)| v).sum()
}

/// Replies "abc" to prompts other than "hold", which sends one token then waits forever,
/// and "fail", which fails after one token.
fn engine() -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(|req| {
        let prompt = String::from_utf8_lossy(&req.prompt_ids.iter().map(|&b| b as u8).collect::<Vec<_>>()).into_owned();
        if prompt.contains("refuse") {
            return Err(EngineError::Overloaded { retry_after_s: 1 });
        }
        let mut steps = reply_steps(req, &ids("abc"), 0);
        if prompt.contains("hold") {
            steps.truncate(2);
            steps.push(FakeStep::Hold);
        } else if prompt.contains("fail") {
            steps.truncate(2);
            steps.push(FakeStep::Send(EngineEvent::Error(EngineError::Internal("boom".into()))));
        }
        Ok(steps)
    }))
}

#[tokio::test]
async fn outcomes_add_up_to_the_requests() {
    let app = router(config(), engine());
    // 3 successes (one stream with n = 2, one length-limited), usage completion tokens 3 + 3*2 + 2.
    let mut completion_tokens = 0;
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "x"})).await;
    completion_tokens += r.json()["usage"]["completion_tokens"].as_u64().unwrap();
    let r = post_json(
        &app,
        "/v1/completions",
        &json!({"prompt": "x", "n": 2, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let usage = r.events().iter().rev().find(|e| e.get("usage").is_some_and(|u| !u.is_null())).cloned().unwrap();
    completion_tokens += usage["usage"]["completion_tokens"].as_u64().unwrap();
    let r = post_json(
        &app,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}),
    )
    .await;
    assert_eq!(r.json()["choices"][0]["finish_reason"], "length");
    completion_tokens += r.json()["usage"]["completion_tokens"].as_u64().unwrap();
    // 2 rejections: an invalid request and an overloaded engine.
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "x", "temperature": -1})).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "refuse"})).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    // 2 failures after a token: streamed and not.
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "fail", "stream": true})).await;
    assert_eq!(r.status, StatusCode::OK);
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "fail"})).await;
    assert_eq!(r.status, StatusCode::INTERNAL_SERVER_ERROR);
    // 1 cancellation: a stream dropped after its first token.
    let response = app.clone().oneshot(post("/v1/completions", json!({"prompt": "hold", "stream": true}).to_string()));
    let mut body = response.await.expect("response").into_body();
    let frame = tokio::time::timeout(Duration::from_secs(5), body.frame()).await.expect("a frame in time");
    assert!(frame.is_some());
    drop(body);

    let all = metrics(&app).await;
    assert_eq!(m(&all, "tessera:requests_total"), 8.0);
    assert_eq!(m(&all, "tessera:request_success_total{finished_reason=\"stop\"}"), 2.0);
    assert_eq!(m(&all, "tessera:request_success_total{finished_reason=\"length\"}"), 1.0);
    assert_eq!(m(&all, "tessera:request_success_total{finished_reason=\"abort\"}"), 0.0);
    assert_eq!(m(&all, "tessera:request_rejected_total{reason=\"invalid_request\"}"), 1.0);
    assert_eq!(m(&all, "tessera:request_rejected_total{reason=\"overloaded\"}"), 1.0);
    assert_eq!(m(&all, "tessera:request_failure_total{reason=\"internal\"}"), 2.0);
    assert_eq!(m(&all, "tessera:request_cancelled_total"), 1.0);
    let ended = sum_prefix(&all, "tessera:request_success_total")
        + sum_prefix(&all, "tessera:request_failure_total")
        + sum_prefix(&all, "tessera:request_rejected_total")
        + m(&all, "tessera:request_cancelled_total");
    assert_eq!(ended, m(&all, "tessera:requests_total"));
    assert_eq!(m(&all, "tessera:requests_in_progress"), 0.0);
    // Every request that got a token: 3 successes, 2 failures, 1 cancellation.
    assert_eq!(m(&all, "tessera:time_to_first_token_seconds_count"), 6.0);
    assert_eq!(m(&all, "tessera:e2e_request_latency_seconds_count"), 3.0);
    // Successes' tokens, plus one token each for the failures and the cancellation.
    assert_eq!(completion_tokens, 3 + 6 + 2);
    assert_eq!(m(&all, "tessera:generation_tokens_total"), (completion_tokens + 3) as f64);
    // Consecutive tokens within a choice: 2 + 2*2 + 1 for the successes.
    assert_eq!(m(&all, "tessera:inter_token_latency_seconds_count"), 7.0);
    assert_eq!(m(&all, "tessera:request_generation_tokens_sum"), completion_tokens as f64);
}
