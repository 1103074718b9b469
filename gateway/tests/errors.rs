//! Every error path: validation (status, type and `param` for each field), authentication,
//! unknown models and routes, body limits, engine refusals with `Retry-After`, and failures
//! in the middle of a generation (streamed and not).

mod common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, FakeEngine, FakeStep, EOS, VOCAB};
use tessera_gateway::{EngineError, EngineEvent};

fn ok_engine() -> Arc<FakeEngine> {
    Arc::new(FakeEngine::replying(ids("fine")))
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hello"}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test]
async fn chat_validation_errors_name_their_param() {
    let mut cfg = config();
    cfg.max_prompt_tokens = 64;
    cfg.max_choices = 4;
    let engine = ok_engine();
    let app = router(cfg, engine.clone());
    let cases: Vec<(Value, &str)> = vec![
        (json!({"model": MODEL}), "messages"),
        (json!({"messages": []}), "messages"),
        (chat(json!({"temperature": 2.5})), "temperature"),
        (chat(json!({"temperature": -0.1})), "temperature"),
        (chat(json!({"temperature": "hot"})), "temperature"),
        (chat(json!({"top_p": 0})), "top_p"),
        (chat(json!({"top_p": 1.01})), "top_p"),
        (chat(json!({"top_k": -2})), "top_k"),
        (chat(json!({"min_p": 1.5})), "min_p"),
        (chat(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (chat(json!({"frequency_penalty": 2.5})), "frequency_penalty"),
        (chat(json!({"presence_penalty": -2.01})), "presence_penalty"),
        (chat(json!({"logit_bias": {"999999": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"abc": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": 100.5}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": "x"}})), "logit_bias.5"),
        (chat(json!({"n": 0})), "n"),
        (chat(json!({"n": 5})), "n"),
        (chat(json!({"stop": ["a", "b", "c", "d", "e"]})), "stop"),
        (chat(json!({"stop": 3})), "stop"),
        (chat(json!({"stop": ["ok", 1]})), "stop"),
        (chat(json!({"stop": [""]})), "stop"),
        (chat(json!({"stop_token_ids": [-1]})), "stop_token_ids"),
        (chat(json!({"stop_token_ids": [VOCAB]})), "stop_token_ids"),
        (chat(json!({"max_tokens": 0})), "max_tokens"),
        (chat(json!({"max_completion_tokens": -3})), "max_completion_tokens"),
        (chat(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs"),
        (chat(json!({"top_logprobs": 2})), "top_logprobs"),
        (chat(json!({"stream_options": {"include_usage": true}})), "stream_options"),
        (chat(json!({"stream": "yes"})), "stream"),
        (chat(json!({"seed": 1.5})), "seed"),
        (chat(json!({"min_tokens": -1})), "min_tokens"),
        (chat(json!({"min_tokens": 5, "max_tokens": 4})), "min_tokens"),
        (chat(json!({"min_tokens": 5, "max_completion_tokens": 4})), "min_tokens"),
        (chat(json!({"min_tokens": "5"})), "min_tokens"),
        // A grammar, once complete, allows only the stop ids min_tokens bans.
        (chat(json!({"min_tokens": 2, "response_format": {"type": "json_object"}})), "min_tokens"),
        // Without max_tokens, min_tokens must fit what the context leaves.
        (chat(json!({"min_tokens": MAX_MODEL_LEN})), "min_tokens"),
        // vLLM fields this server does not implement are refused, not ignored.
        (
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                   "continue_final_message": true, "add_generation_prompt": true}),
            "continue_final_message",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
                   "continue_final_message": true}),
            "continue_final_message",
        ),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": 5}]}),
            "messages[1].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
            "messages[0].content[0]",
        ),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        // The byte codec's template refuses a conversation that opens with the assistant.
        (json!({"messages": [{"role": "assistant", "content": "x"}]}), "messages"),
        (json!({"messages": [{"role": "user", "content": "y".repeat(80)}]}), "messages"),
        (chat(json!({"max_tokens": MAX_MODEL_LEN})), "messages"),
    ];
    for (body, param) in cases {
        let r = post_json(&app, "/v1/chat/completions", &body).await;
        let error = assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some(param));
        assert!(!error["message"].as_str().unwrap_or_default().is_empty());
    }
    // Nothing reached the engine.
    assert!(engine.log().requests.is_empty());
}

/// Values in range as JSON numbers that the `f32` sent to the engine cannot hold: 0 reads
/// as "unset" there, infinity as nothing usable. Representable extremes pass unchanged.
#[tokio::test]
async fn sampling_values_are_checked_as_the_engine_gets_them() {
    let engine = ok_engine();
    let app = router(config(), engine.clone());
    let cases = [
        (json!({"top_p": 1e-46}), "top_p"),
        (json!({"repetition_penalty": 1e39}), "repetition_penalty"),
        (json!({"repetition_penalty": 1e-50}), "repetition_penalty"),
    ];
    for (extra, param) in cases {
        let r = post_json(&app, "/v1/chat/completions", &chat(extra)).await;
        let error = assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some(param));
        assert!(error["message"].as_str().is_some_and(|m| m.contains("32-bit")), "{error}");
    }
    assert!(engine.log().requests.is_empty());
    let extra = json!({"top_p": 1e-30, "repetition_penalty": 1e38, "temperature": 0.7});
    let r = post_json(&app, "/v1/chat/completions", &chat(extra)).await;
    assert_eq!(r.status, StatusCode::OK);
    let p = &engine.log().requests[0].params;
    assert_eq!((p.top_p, p.repetition_penalty, p.temperature), (1e-30, 1e38, 0.7));
}

/// "5", "05" and "+5" all name token 5: which bias would apply is the map's order's choice.
#[tokio::test]
async fn logit_bias_refuses_a_token_named_twice() {
    let engine = ok_engine();
    let app = router(config(), engine.clone());
    for bias in [json!({"5": 1, "05": -1}), json!({"+5": 1, "5": 2, "7": 0})] {
        let r = post_json(&app, "/v1/chat/completions", &chat(json!({"logit_bias": bias}))).await;
        let error = assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("logit_bias"));
        assert!(error["message"].as_str().is_some_and(|m| m.contains("token 5")), "{error}");
    }
    assert!(engine.log().requests.is_empty());
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({"logit_bias": {"05": 1, "7": 2}}))).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(engine.log().requests[0].params.logit_bias, vec![(5, 1.0), (7, 2.0)]);
}

#[tokio::test]
async fn context_errors_explain_the_numbers() {
    let app = router(config(), ok_engine());
    let prompt = chat_prompt("hello").len() as u32;
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({"max_tokens": MAX_MODEL_LEN - prompt + 1}))).await;
    let error = assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("messages"));
    assert_eq!(error["code"], "context_length_exceeded");
    let message = error["message"].as_str().unwrap_or_default();
    for number in [MAX_MODEL_LEN + 1, MAX_MODEL_LEN, prompt] {
        assert!(message.contains(&number.to_string()), "{message}");
    }
    // Exactly filling the context is fine.
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({"max_tokens": MAX_MODEL_LEN - prompt}))).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn malformed_json_is_400_without_param() {
    let app = router(config(), ok_engine());
    for body in ["{", "[]", "{\"messages\": []} trailing", ""] {
        let r = send(&app, post("/v1/chat/completions", body)).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", None);
    }
}

#[tokio::test]
async fn completions_validation_errors() {
    let mut cfg = config();
    cfg.max_choices = 4;
    let app = router(cfg, ok_engine());
    let cases: Vec<(Value, &str)> = vec![
        (json!({}), "prompt"),
        (json!({"prompt": null}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": [1, "a"]}), "prompt"),
        (json!({"prompt": ["a", 1]}), "prompt"),
        (json!({"prompt": [VOCAB]}), "prompt"),
        (json!({"prompt": [[1], [-1]]}), "prompt"),
        (json!({"prompt": [1.5]}), "prompt"),
        (json!({"prompt": ["a", "b", "c"], "n": 2}), "n"),
        (json!({"prompt": "x", "logprobs": 6}), "logprobs"),
        (json!({"prompt": "x", "logprobs": -1}), "logprobs"),
        // echo would return the prompt's logprobs too, which the engine does not compute.
        (json!({"prompt": "x", "echo": true, "logprobs": 0}), "echo"),
        (json!({"prompt": "x", "echo": true, "logprobs": 2}), "echo"),
        (json!({"prompt": "x", "min_tokens": 1, "response_format": {"type": "json_object"}}), "min_tokens"),
        (json!({"prompt": ["x", "y"], "min_tokens": MAX_MODEL_LEN}), "min_tokens"),
        (json!({"prompt": "x", "echo": 1}), "echo"),
        (json!({"prompt": "x", "suffix": "tail"}), "suffix"),
        (json!({"prompt": "x", "best_of": 3}), "best_of"),
        (json!({"prompt": "x", "max_tokens": MAX_MODEL_LEN}), "prompt"),
        (json!({"prompt": "x", "temperature": 3}), "temperature"),
    ];
    for (body, param) in cases {
        let r = post_json(&app, "/v1/completions", &body).await;
        assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some(param));
    }
}

#[tokio::test]
async fn unknown_model_and_route_are_404() {
    let app = router(config(), ok_engine());
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({"model": "gpt-9"}))).await;
    let error = assert_error(&r, StatusCode::NOT_FOUND, "invalid_request_error", Some("model"));
    assert_eq!(error["code"], "model_not_found");
    assert!(error["message"].as_str().unwrap_or_default().contains("gpt-9"));
    let r = post_json(&app, "/v1/completions", &json!({"model": "other", "prompt": "x"})).await;
    assert_error(&r, StatusCode::NOT_FOUND, "invalid_request_error", Some("model"));
    let r = post_json(&app, "/tokenize", &json!({"model": "other", "prompt": "x"})).await;
    assert_error(&r, StatusCode::NOT_FOUND, "invalid_request_error", Some("model"));

    let r = send(&app, get("/v1/nope")).await;
    let error = assert_error(&r, StatusCode::NOT_FOUND, "invalid_request_error", None);
    assert!(error["message"].as_str().unwrap_or_default().contains("/v1/nope"));
    let r = send(&app, get("/v1/chat/completions")).await;
    assert_error(&r, StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", None);
}

#[tokio::test]
async fn api_keys_guard_every_route_but_health_and_ready() {
    let mut cfg = config();
    cfg.api_keys = vec!["sk-first".into(), "sk-second".into()];
    let app = router(cfg, ok_engine());
    let with_key = |mut req: axum::http::Request<axum::body::Body>, key: &str| {
        req.headers_mut().insert("authorization", key.parse().expect("header"));
        req
    };
    let body = chat(json!({})).to_string();

    let r = send(&app, post("/v1/chat/completions", body.clone())).await;
    let error = assert_error(&r, StatusCode::UNAUTHORIZED, "invalid_request_error", None);
    assert_eq!(error["code"], "invalid_api_key");
    assert_eq!(r.headers["www-authenticate"], "Bearer");
    for bad in ["Bearer sk-third", "Bearer sk-firs", "Basic sk-first", "sk-first"] {
        let r = send(&app, with_key(post("/v1/chat/completions", body.clone()), bad)).await;
        assert_error(&r, StatusCode::UNAUTHORIZED, "invalid_request_error", None);
    }
    for path in ["/v1/models", "/tokenize"] {
        let req = if path == "/tokenize" { post(path, "{\"prompt\": \"a\"}") } else { get(path) };
        assert_eq!(send(&app, req).await.status, StatusCode::UNAUTHORIZED, "{path}");
    }
    for good in ["Bearer sk-first", "bearer sk-second"] {
        let r = send(&app, with_key(post("/v1/chat/completions", body.clone()), good)).await;
        assert_eq!(r.status, StatusCode::OK, "{good}");
    }
    assert_eq!(send(&app, get("/health")).await.status, StatusCode::OK);
    assert_eq!(send(&app, get("/ready")).await.status, StatusCode::OK);
}

#[tokio::test]
async fn oversized_body_is_413() {
    let mut cfg = config();
    cfg.max_body_bytes = 4096;
    let app = router(cfg, ok_engine());
    let body = chat(json!({"user": "u".repeat(5000)}));
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    let error = assert_error(&r, StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", None);
    assert!(error["message"].as_str().unwrap_or_default().contains("4096"));
    // Just under the limit passes.
    let small = chat(json!({"user": "u".repeat(3000)}));
    assert_eq!(post_json(&app, "/v1/chat/completions", &small).await.status, StatusCode::OK);
}

#[tokio::test]
async fn engine_refusals_are_429_and_503_with_retry_after() {
    let cases = [
        (EngineError::Overloaded { retry_after_s: 7 }, StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "7"),
        (EngineError::Unavailable { retry_after_s: 30 }, StatusCode::SERVICE_UNAVAILABLE, "server_error", "30"),
    ];
    for (refusal, status, error_type, retry) in cases {
        for stream in [false, true] {
            let err = refusal.clone();
            let app = router(config(), Arc::new(FakeEngine::new(move |_| Err(err.clone()))));
            let r = post_json(&app, "/v1/chat/completions", &chat(json!({"stream": stream}))).await;
            assert_error(&r, status, error_type, None);
            assert_eq!(r.headers["retry-after"], retry);
        }
    }
    let app = router(config(), Arc::new(FakeEngine::new(|_| Err(EngineError::InvalidRequest("bad bias".into())))));
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "x"})).await;
    let error = assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", None);
    assert_eq!(error["message"], "bad bias");
}

#[tokio::test]
async fn a_refused_choice_aborts_the_admitted_ones() {
    let engine = Arc::new(FakeEngine::new(|req| {
        if req.request_id.ends_with("-1") {
            Err(EngineError::Overloaded { retry_after_s: 2 })
        } else {
            Ok(vec![FakeStep::Hold])
        }
    }));
    let app = router(config(), engine.clone());
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({"n": 2}))).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    let first = engine.log().requests[0].request_id.clone();
    assert!(engine.wait_for_abort(&first, Duration::from_secs(5)).await, "{first} not aborted");
}

fn failing_midway(error: EngineEvent) -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(move |req| {
        let mut steps = reply_steps(req, &ids("par"), 0);
        steps.pop(); // no Finished
        steps.push(FakeStep::Send(error.clone()));
        Ok(steps)
    }))
}

/// An engine that sends `PromptInfo` and the first token of "par", then `error`.
fn failing_after_first_token(error: EngineEvent) -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(move |req| {
        let mut steps = reply_steps(req, &ids("par"), 0);
        steps.truncate(2); // PromptInfo, "p"
        steps.push(FakeStep::Send(error.clone()));
        Ok(steps)
    }))
}

/// A stream that fails after it started ends with one event holding the error object a
/// non-streamed error has (type, generic message for a 5xx, code), then `[DONE]`: on chat,
/// on chat with tools (its own stream) and on completions.
#[tokio::test]
async fn stream_failing_midway_sends_an_error_event_then_done() {
    let boom = EngineEvent::Error(EngineError::Internal("worker 3 died: boom".into()));
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let cases = [
        ("/v1/chat/completions", chat(json!({"stream": true})), "/choices/0/delta/content"),
        ("/v1/chat/completions", chat(json!({"stream": true, "tools": tools})), "/choices/0/delta/content"),
        ("/v1/completions", json!({"prompt": "x", "stream": true}), "/choices/0/text"),
    ];
    for (path, body, text_at) in cases {
        // Room for the tool listing the template adds to the prompt.
        let app = router(tessera_gateway::GatewayConfig::new(8192), failing_after_first_token(boom.clone()));
        let r = post_json(&app, path, &body).await;
        assert_eq!(r.status, StatusCode::OK);
        let events = r.events();
        let text: String = events.iter().filter_map(|e| e.pointer(text_at).and_then(Value::as_str)).collect();
        assert_eq!(text, "p", "{path}: {events:?}");
        let [.., error, done] = events.as_slice() else { panic!("{path}: too few events: {events:?}") };
        assert_eq!(done, &Value::from("[DONE]"), "{path}");
        assert_eq!(error["error"]["type"], "server_error", "{path}: {error}");
        assert_eq!(error["error"]["message"], "The server had an error while processing your request.");
        assert!(error["error"].as_object().is_some_and(|o| o.contains_key("code")), "{error}");
        assert!(!error.to_string().contains("boom"), "internal detail leaked: {error}");
        assert_eq!(events.iter().filter(|e| e.get("error").is_some()).count(), 1, "{path}");
        assert!(events.iter().all(|e| e["choices"][0]["finish_reason"].is_null()), "{path}");
    }

    // A client error keeps its message and type; a stream the engine just drops is an error
    // too, never a silent success.
    let app =
        router(config(), failing_after_first_token(EngineEvent::Error(EngineError::InvalidRequest("bad".into()))));
    let events = post_json(&app, "/v1/completions", &json!({"prompt": "x", "stream": true})).await.events();
    assert_eq!(
        events[events.len() - 2]["error"],
        json!({"message": "bad", "type": "invalid_request_error", "param": null, "code": null})
    );
    let engine = Arc::new(FakeEngine::new(|req| {
        let mut steps = reply_steps(req, &ids("cut"), 0);
        steps.pop();
        Ok(steps)
    }));
    let app = router(config(), engine);
    let events = post_json(&app, "/v1/chat/completions", &chat(json!({"stream": true}))).await.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    assert_eq!(events[events.len() - 2]["error"]["type"], "server_error");
}

#[tokio::test]
async fn non_stream_failing_midway_maps_the_engine_error() {
    let app = router(config(), failing_midway(EngineEvent::Error(EngineError::Internal("boom".into()))));
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({}))).await;
    let error = assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR, "server_error", None);
    assert!(!error["message"].as_str().unwrap_or_default().contains("boom"));

    let app = router(config(), failing_midway(EngineEvent::Error(EngineError::Unavailable { retry_after_s: 4 })));
    let r = post_json(&app, "/v1/completions", &json!({"prompt": "x"})).await;
    assert_error(&r, StatusCode::SERVICE_UNAVAILABLE, "server_error", None);
    assert_eq!(r.headers["retry-after"], "4");

    // Ids outside the vocabulary from the engine are an internal error, not a panic.
    let app = router(config(), Arc::new(FakeEngine::replying(vec![65, VOCAB + 3, EOS])));
    let r = post_json(&app, "/v1/chat/completions", &chat(json!({}))).await;
    assert_error(&r, StatusCode::INTERNAL_SERVER_ERROR, "server_error", None);
}
