//! `POST /v1/chat/completions` over the fake engine and byte codec: replies, streaming,
//! n > 1, stop strings, logprobs and usage, each checked against what the fake engine was
//! scripted to produce and what the byte codec's template must render.

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, FakeEngine, FakeStep, EOS};

fn user(content: &str) -> Value {
    json!([{ "role": "user", "content": content }])
}

fn engine_replying(text: &str, then_eos: bool, cached: u32) -> Arc<FakeEngine> {
    let mut reply = ids(text);
    if then_eos {
        reply.push(EOS);
    }
    Arc::new(FakeEngine::new(move |req| Ok(reply_steps(req, &reply, cached))))
}

/// Content deltas of one choice, in order, from a chat stream.
fn deltas(events: &[Value], index: u64) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e["choices"].as_array()?.first().cloned())
        .filter(|c| c["index"] == index && c["delta"]["content"].is_string() && c["delta"].get("role").is_none())
        .map(|c| c["delta"]["content"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test]
async fn reply_usage_and_engine_request() {
    let reply = "Hello, wörld! 🦀";
    let engine = engine_replying(reply, true, 5);
    let app = router(config(), engine.clone());
    let body = json!({
        "model": MODEL, "messages": user("Hi"), "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "seed": 11, "logit_bias": {"65": -3.5, "7": 2}, "user": "u-1", "unknown_field": {"x": 1}
    });
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("chatcmpl-") && id.len() > 20), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    assert!(v["created"].as_u64().is_some_and(|c| c > 1_700_000_000));
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 1);
    assert_eq!(choices[0]["index"], 0);
    assert_eq!(choices[0]["message"], json!({"role": "assistant", "content": reply}));
    assert_eq!(choices[0]["logprobs"], Value::Null);
    assert_eq!(choices[0]["finish_reason"], "stop");

    let prompt = chat_prompt("Hi");
    let completion = ids(reply).len() + 1; // the EOS token counts
    assert_eq!(
        v["usage"],
        json!({
            "prompt_tokens": prompt.len(), "completion_tokens": completion,
            "total_tokens": prompt.len() + completion, "prompt_tokens_details": {"cached_tokens": 5}
        })
    );

    let log = engine.log();
    assert_eq!(log.requests.len(), 1);
    let req = &log.requests[0];
    assert_eq!(req.request_id, format!("{}-0", v["id"].as_str().unwrap_or_default()));
    assert_eq!(req.prompt_ids, prompt);
    let p = &req.params;
    assert_eq!((p.temperature, p.top_p, p.top_k, p.seed), (0.7, 0.9, Some(40), Some(11)));
    assert_eq!(p.logit_bias, vec![(7, 2.0), (65, -3.5)]);
    assert_eq!(p.stop_token_ids, vec![EOS]);
    assert_eq!(p.max_tokens, MAX_MODEL_LEN - prompt.len() as u32);
    assert_eq!(p.logprobs, None);
    assert!(!p.ignore_eos);
}

#[tokio::test]
async fn max_tokens_ends_with_length_and_ignore_eos_drops_eos() {
    let engine = engine_replying("abcdefgh", false, 0);
    let app = router(config(), engine.clone());
    let body = json!({"messages": user("x"), "max_completion_tokens": 3, "max_tokens": 100,
                      "ignore_eos": true, "stop_token_ids": [100, 33]});
    let v = post_json(&app, "/v1/chat/completions", &body).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], "abc");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let p = &engine.log().requests[0].params;
    assert_eq!((p.max_tokens, p.ignore_eos), (3, true));
    assert_eq!(p.stop_token_ids, vec![33, 100]);
}

#[tokio::test]
async fn stream_sends_role_deltas_finish_and_done() {
    let reply = "Hé 🦀!";
    let app = router(config(), engine_replying(reply, true, 0));
    let r = post_json(&app, "/v1/chat/completions", &json!({"messages": user("Hi"), "stream": true})).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.headers["content-type"], "text/event-stream");
    let events = r.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    let chunks = &events[..events.len() - 1];
    let id = chunks[0]["id"].as_str().expect("id");
    for c in chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], MODEL);
        assert!(c.get("usage").is_none(), "usage only with include_usage: {c}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    // One byte per token: each character arrives whole, once its last byte is in.
    let expected: Vec<String> = reply.chars().map(String::from).collect();
    assert_eq!(deltas(chunks, 0), expected);
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["delta"], json!({}));
    assert_eq!(last["finish_reason"], "stop");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
}

fn seeded_engine() -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(|req| {
        let text = format!("seed {}", req.params.seed.unwrap_or(0));
        Ok(reply_steps(req, &ids(&text), 0))
    }))
}

#[tokio::test]
async fn n_two_runs_two_seeded_sequences() {
    let engine = seeded_engine();
    let app = router(config(), engine.clone());
    let v = post_json(&app, "/v1/chat/completions", &json!({"messages": user("Hi"), "n": 2, "seed": 41})).await.json();
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 2);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["message"]["content"], format!("seed {}", 41 + i));
    }
    let prompt = chat_prompt("Hi").len();
    assert_eq!(v["usage"]["prompt_tokens"], prompt); // counted once
    assert_eq!(v["usage"]["completion_tokens"], 14);
    let log = engine.log();
    let mut seen: Vec<(String, Option<u64>)> =
        log.requests.iter().map(|r| (r.request_id.clone(), r.params.seed)).collect();
    seen.sort();
    let id = v["id"].as_str().unwrap_or_default();
    assert_eq!(seen, vec![(format!("{id}-0"), Some(41)), (format!("{id}-1"), Some(42))]);
}

#[tokio::test]
async fn n_two_streams_both_choices() {
    let app = router(config(), seeded_engine());
    let body = json!({"messages": user("Hi"), "n": 2, "seed": 7, "stream": true});
    let events = post_json(&app, "/v1/chat/completions", &body).await.events();
    for i in 0..2u64 {
        let role =
            events.iter().filter(|e| e["choices"][0]["index"] == i && e["choices"][0]["delta"]["role"] == "assistant");
        assert_eq!(role.count(), 1);
        assert_eq!(deltas(&events, i).concat(), format!("seed {}", 7 + i));
        let finish =
            events.iter().filter(|e| e["choices"][0]["index"] == i && e["choices"][0]["finish_reason"] == "stop");
        assert_eq!(finish.count(), 1);
    }
}

#[tokio::test]
async fn stop_string_split_over_tokens_is_cut() {
    // Every byte is a token, so each stop string below spans several tokens.
    let cases = [
        ("The answer is 42.</ans> trailing", vec!["</ans>"], "The answer is 42."),
        ("Hello, wörld and more", vec!["xyz", "wörld"], "Hello, "),
        ("a</b</an", vec!["</ans>"], "a</b</an"), // never completes: released at the end
    ];
    for (reply, stops, want) in cases {
        for stream in [false, true] {
            let app = router(config(), engine_replying(reply, true, 0));
            let body = json!({"messages": user("q"), "stop": stops, "stream": stream});
            let r = post_json(&app, "/v1/chat/completions", &body).await;
            let (content, finish) = if stream {
                let events = r.events();
                let finish = events.iter().find_map(|e| e["choices"][0]["finish_reason"].as_str().map(str::to_owned));
                (deltas(&events, 0).concat(), finish)
            } else {
                let v = r.json();
                let c = &v["choices"][0];
                (
                    c["message"]["content"].as_str().unwrap_or_default().to_owned(),
                    c["finish_reason"].as_str().map(str::to_owned),
                )
            };
            assert_eq!(content, want, "reply {reply:?} stops {stops:?} stream {stream}");
            assert_eq!(finish.as_deref(), Some("stop"));
        }
    }
}

/// vLLM's `min_tokens`: the engine is asked for it (it keeps EOS and the stop ids from being
/// sampled), and a stop string completed by one of the first `min_tokens` tokens ends
/// nothing, streamed or not; one completed by a later token still does.
#[tokio::test]
async fn min_tokens_reaches_the_engine_and_defers_stop_strings() {
    // One token per byte: "##" completes at tokens 3, 6 and 9.
    let reply = "a##b##c##d";
    for (min_tokens, want) in [(0, "a"), (2, "a"), (3, "a##b"), (8, "a##b##c"), (9, reply)] {
        for stream in [false, true] {
            let engine = engine_replying(reply, true, 0);
            let app = router(config(), engine.clone());
            let body = json!({"messages": user("q"), "stop": ["##"], "min_tokens": min_tokens, "stream": stream});
            let r = post_json(&app, "/v1/chat/completions", &body).await;
            assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
            let content = if stream {
                deltas(&r.events(), 0).concat()
            } else {
                r.json()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned()
            };
            assert_eq!(content, want, "min_tokens {min_tokens} stream {stream}");
            assert_eq!(engine.log().requests[0].params.min_tokens, min_tokens);
        }
    }
    // min_tokens up to max_tokens (or without one) is fine.
    let engine = engine_replying("ok", true, 0);
    let app = router(config(), engine.clone());
    for body in [
        json!({"messages": user("q"), "min_tokens": 7, "max_tokens": 7}),
        json!({"messages": user("q"), "min_tokens": 7, "max_completion_tokens": 9}),
        json!({"messages": user("q"), "min_tokens": 7}),
    ] {
        assert_eq!(post_json(&app, "/v1/chat/completions", &body).await.status, StatusCode::OK, "{body}");
    }
    assert!(engine.log().requests.iter().all(|r| r.params.min_tokens == 7));
}

/// vLLM's `include_stop_str_in_output`: the text ends after the stop string instead of
/// before it, streamed or not.
#[tokio::test]
async fn include_stop_str_in_output_keeps_the_stop_string() {
    for stream in [false, true] {
        let app = router(config(), engine_replying("The answer is 42.</ans> trailing", true, 0));
        let body =
            json!({"messages": user("q"), "stop": ["</ans>"], "include_stop_str_in_output": true, "stream": stream});
        let r = post_json(&app, "/v1/chat/completions", &body).await;
        let content = if stream {
            deltas(&r.events(), 0).concat()
        } else {
            r.json()["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_owned()
        };
        assert_eq!(content, "The answer is 42.</ans>", "stream {stream}");
    }
}

/// vLLM's `continue_final_message`: the prompt ends inside the final assistant message, right
/// after its text, with no generation prompt (add_generation_prompt defaults to false then).
#[tokio::test]
async fn continue_final_message_ends_the_prompt_inside_the_assistant_turn() {
    let engine = engine_replying(" name", true, 0);
    let app = router(config(), engine.clone());
    let body = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, my"}
    ], "continue_final_message": true});
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.json()["choices"][0]["message"]["content"], " name");
    assert_eq!(engine.log().requests[0].prompt_ids, ids("<|bos|><|user|>Hi\n<|assistant|>Hello, my"));
    // Without it, the same messages close the assistant turn and open a new one.
    let body = json!({"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, my"}
    ]});
    post_json(&app, "/v1/chat/completions", &body).await;
    let want = ids("<|bos|><|user|>Hi\n<|assistant|>Hello, my\n<|assistant|>");
    assert_eq!(engine.log().requests[1].prompt_ids, want);
}

#[tokio::test]
async fn stop_string_as_plain_string_and_held_text_before_length() {
    let app = router(config(), engine_replying("xy </an", false, 0));
    let body = json!({"messages": user("q"), "stop": "</ans>", "max_tokens": 7});
    let v = post_json(&app, "/v1/chat/completions", &body).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], "xy </an");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

/// The fake's documented logprobs: token k has -(k+1)/8; alternative j of token `id` is
/// `(id+1+j) % 256` with -(k+2+j)/8.
fn expected_chat_logprobs(tokens: &[u32], top: u32) -> Vec<Value> {
    let entry = |id: u32, lp: f32| {
        let bytes = vec![id as u8];
        json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp, "bytes": bytes})
    };
    tokens
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            let mut e = entry(id, -((k + 1) as f32) / 8.0);
            let alts: Vec<Value> =
                (0..top).map(|j| entry((id + 1 + j) % 256, -((k as u32 + 2 + j) as f32) / 8.0)).collect();
            e["top_logprobs"] = Value::from(alts);
            e
        })
        .collect()
}

#[tokio::test]
async fn logprobs_shape_non_stream_and_stream() {
    let reply = "hé";
    let tokens = ids(reply);
    let want = expected_chat_logprobs(&tokens, 2);
    let app = router(config(), engine_replying(reply, true, 0));
    let body = json!({"messages": user("q"), "logprobs": true, "top_logprobs": 2});
    let v = post_json(&app, "/v1/chat/completions", &body).await.json();
    // The EOS token ends the sequence and is not part of the content or its logprobs.
    assert_eq!(v["choices"][0]["logprobs"], json!({"content": want}));

    let mut body = body;
    body["stream"] = Value::from(true);
    let events = post_json(&app, "/v1/chat/completions", &body).await.events();
    let mut streamed = Vec::new();
    for e in &events {
        if let Some(content) = e["choices"][0]["logprobs"]["content"].as_array() {
            // "é" is two byte tokens; both entries ride on the chunk that carries it.
            let text = e["choices"][0]["delta"]["content"].as_str().unwrap_or_default();
            assert_eq!(content.len(), text.len(), "chunk {e}");
            streamed.extend(content.iter().cloned());
        }
    }
    assert_eq!(streamed, want);

    // top_logprobs = 0 still gives each token's own logprob.
    let body = json!({"messages": user("q"), "logprobs": true});
    let v = post_json(&app, "/v1/chat/completions", &body).await.json();
    assert_eq!(v["choices"][0]["logprobs"], json!({"content": expected_chat_logprobs(&tokens, 0)}));
    assert_eq!(v["choices"][0]["logprobs"]["content"][0]["top_logprobs"], json!([]));
}

#[tokio::test]
async fn include_usage_adds_a_final_usage_chunk() {
    let reply = "ok!";
    let app = router(config(), engine_replying(reply, true, 3));
    let body = json!({"messages": user("Hi"), "stream": true, "n": 2, "stream_options": {"include_usage": true}});
    let events = post_json(&app, "/v1/chat/completions", &body).await.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    let usage_chunk = &events[events.len() - 2];
    assert_eq!(usage_chunk["choices"], json!([]));
    let prompt = chat_prompt("Hi").len();
    let completion = 2 * (ids(reply).len() + 1);
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": 3}})
    );
    for e in &events[..events.len() - 2] {
        assert_eq!(e["usage"], Value::Null, "{e}");
        assert!(e.as_object().is_some_and(|o| o.contains_key("usage")), "{e}");
    }
}

#[tokio::test]
async fn content_parts_and_roles_reach_the_template() {
    let engine = engine_replying("ok", true, 0);
    let app = router(config(), engine.clone());
    let body = json!({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": null},
        {"role": "user", "content": "three"}
    ]});
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let want = ids("<|bos|><|system|>be brief\n<|user|>one\ntwo\n<|assistant|>\n<|user|>three\n<|assistant|>");
    assert_eq!(engine.log().requests[0].prompt_ids, want);
}

#[tokio::test]
async fn slow_tokens_still_stream_in_order() {
    let reply = ids("slow");
    let engine = Arc::new(FakeEngine::new(move |req| {
        let mut steps = Vec::new();
        for step in reply_steps(req, &reply, 0) {
            steps.push(FakeStep::Sleep(std::time::Duration::from_millis(5)));
            steps.push(step);
        }
        Ok(steps)
    }));
    let app = router(config(), engine);
    let events =
        post_json(&app, "/v1/chat/completions", &json!({"messages": user("q"), "stream": true})).await.events();
    assert_eq!(deltas(&events, 0), vec!["s", "l", "o", "w"]);
}
