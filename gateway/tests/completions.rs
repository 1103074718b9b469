//! `POST /v1/completions`: every prompt form, batching with n, legacy logprobs, echo and
//! streaming.

mod common;

use std::sync::Arc;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, FakeEngine, BOS, EOS};

/// Replies "<prompt length>:" followed by the seed, so each choice shows what it was given.
fn echo_engine() -> Arc<FakeEngine> {
    Arc::new(FakeEngine::new(|req| {
        let text = format!("{}:{}", req.prompt_ids.len(), req.params.seed.unwrap_or(0));
        Ok(reply_steps(req, &[ids(&text), vec![EOS]].concat(), 1))
    }))
}

#[tokio::test]
async fn string_prompt() {
    let engine = echo_engine();
    let app = router(config(), engine.clone());
    let r = post_json(&app, "/v1/completions", &json!({"model": MODEL, "prompt": "Once upon", "seed": 3})).await;
    assert_eq!(r.status, StatusCode::OK);
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    assert_eq!(v["choices"], json!([{"index": 0, "text": "10:3", "logprobs": null, "finish_reason": "stop"}]));
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 1}})
    );
    // Completions prompts get BOS; the stop set is the model's EOS.
    let req = &engine.log().requests[0];
    assert_eq!(req.prompt_ids, [vec![BOS], ids("Once upon")].concat());
    assert_eq!(req.params.stop_token_ids, vec![EOS]);
}

#[tokio::test]
async fn token_prompts_and_batches() {
    let engine = echo_engine();
    let app = router(config(), engine.clone());
    let v = post_json(&app, "/v1/completions", &json!({"prompt": [7, 8, 9]})).await.json();
    assert_eq!(v["choices"][0]["text"], "3:0");
    assert_eq!(engine.log().requests[0].prompt_ids, vec![7, 8, 9]);

    // Two prompts x n = 2: choice p*n + i, seeds seed + i, prompt tokens counted per prompt.
    let body = json!({"prompt": ["a", "bcd"], "n": 2, "seed": 100});
    let v = post_json(&app, "/v1/completions", &body).await.json();
    let texts: Vec<&str> =
        v["choices"].as_array().into_iter().flatten().map(|c| c["text"].as_str().unwrap_or("")).collect();
    assert_eq!(texts, vec!["2:100", "2:101", "4:100", "4:101"]);
    let indices: Vec<u64> = v["choices"].as_array().into_iter().flatten().filter_map(|c| c["index"].as_u64()).collect();
    assert_eq!(indices, vec![0, 1, 2, 3]);
    assert_eq!(v["usage"]["prompt_tokens"], 6);
    assert_eq!(v["usage"]["completion_tokens"], 4 * 6);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2);

    let v = post_json(&app, "/v1/completions", &json!({"prompt": [[1, 2], [3]]})).await.json();
    assert_eq!(v["choices"][0]["text"], "2:0");
    assert_eq!(v["choices"][1]["text"], "1:0");
}

#[tokio::test]
async fn legacy_logprobs() {
    let reply = "hé";
    let tokens = ids(reply);
    let app = router(config(), Arc::new(FakeEngine::replying([tokens.clone(), vec![EOS]].concat())));
    let v = post_json(&app, "/v1/completions", &json!({"prompt": "x", "logprobs": 2})).await.json();
    let lp = &v["choices"][0]["logprobs"];
    let strs: Vec<String> = tokens.iter().map(|&t| String::from_utf8_lossy(&[t as u8]).into_owned()).collect();
    assert_eq!(lp["tokens"], json!(strs));
    let want_lp: Vec<f32> = (0..tokens.len()).map(|k| -((k + 1) as f32) / 8.0).collect();
    assert_eq!(lp["token_logprobs"], json!(want_lp));
    // Offsets count the characters of the token strings before each token.
    assert_eq!(lp["text_offset"], json!([0, 1, 2]));
    // The sampled token is always there besides the alternatives (OpenAI: up to logprobs + 1).
    let first_top = json!({"h": -1.0 / 8.0, "i": -2.0 / 8.0, "j": -3.0 / 8.0});
    assert_eq!(lp["top_logprobs"][0], first_top);
    assert_eq!(lp["top_logprobs"].as_array().map(Vec::len), Some(3));
}

#[tokio::test]
async fn streaming_completion_with_usage() {
    let app = router(config(), echo_engine());
    let body = json!({"prompt": "abc", "stream": true, "stream_options": {"include_usage": true}, "logprobs": 0});
    let r = post_json(&app, "/v1/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    let chunks = &events[..events.len() - 1];
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, "4:0");
    let offsets: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["text_offset"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(offsets, vec![json!(0), json!(1), json!(2)]);
    // logprobs 0: no alternatives, but the sampled token's own entry.
    let tops: Vec<Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["top_logprobs"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(tops, vec![json!({"4": -1.0 / 8.0}), json!({":": -2.0 / 8.0}), json!({"0": -3.0 / 8.0})]);
    let finish = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!((finish["text"].as_str(), finish["finish_reason"].as_str()), (Some(""), Some("stop")));
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["total_tokens"], 4 + 4);
}

/// `echo`: each choice's text is its prompt's followed by the completion; a text prompt is
/// echoed as given (not with the BOS its ids got), a token-id prompt decoded with its special
/// tokens. The usage still counts only the generated tokens as completion.
#[tokio::test]
async fn echo_puts_the_prompt_before_the_completion() {
    let app = router(config(), echo_engine());
    let v = post_json(&app, "/v1/completions", &json!({"prompt": "Once upon", "echo": true})).await.json();
    assert_eq!(v["choices"][0]["text"], "Once upon10:0");
    assert_eq!(v["usage"]["completion_tokens"], 5);

    let body = json!({"prompt": ["a", "bcd"], "n": 2, "seed": 7, "echo": true});
    let v = post_json(&app, "/v1/completions", &body).await.json();
    let texts: Vec<&str> =
        v["choices"].as_array().into_iter().flatten().map(|c| c["text"].as_str().unwrap_or("")).collect();
    assert_eq!(texts, vec!["a2:7", "a2:8", "bcd4:7", "bcd4:8"]);

    let prompt: Vec<u32> = [vec![BOS], ids("hé")].concat();
    let v = post_json(&app, "/v1/completions", &json!({"prompt": [prompt, ids("x")], "echo": true})).await.json();
    assert_eq!(v["choices"][0]["text"], "<|bos|>hé4:0");
    assert_eq!(v["choices"][1]["text"], "x1:0");

    // echo: false is the plain completion.
    let v = post_json(&app, "/v1/completions", &json!({"prompt": "ab", "echo": false})).await.json();
    assert_eq!(v["choices"][0]["text"], "3:0");
}

/// Streamed, `echo` sends each choice's prompt text first, in a chunk of its own before any
/// token, then the completion as usual.
#[tokio::test]
async fn streamed_echo_sends_the_prompt_first() {
    let app = router(config(), echo_engine());
    let body = json!({"prompt": ["ab", "BCD"], "n": 2, "echo": true, "stream": true});
    let events = post_json(&app, "/v1/completions", &body).await.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    let chunks = &events[..events.len() - 1];
    let first: Vec<(u64, &str)> = chunks[..4]
        .iter()
        .map(|c| (c["choices"][0]["index"].as_u64().unwrap_or(99), c["choices"][0]["text"].as_str().unwrap_or("?")))
        .collect();
    assert_eq!(first, vec![(0, "ab"), (1, "ab"), (2, "BCD"), (3, "BCD")]);
    assert!(chunks[..4].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    for (index, want) in [(0, "ab3:0"), (1, "ab3:0"), (2, "BCD4:0"), (3, "BCD4:0")] {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == index)
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        assert_eq!(text, want, "choice {index}");
    }
}
