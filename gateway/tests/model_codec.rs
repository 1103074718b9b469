//! `ModelCodec` over the default model (SmolLM2-135M-Instruct, ChatML template) behind the
//! real router: the prompt sent to the engine must be the ChatML text written out by hand,
//! tokenized; streamed text over real byte-level BPE pieces must equal whole-sequence
//! decoding; the model's end-of-generation ids must be in the stop set. Skipped (with a
//! message) when the model file is absent, as tessera-model's own model tests are.

#![cfg(feature = "model")]

mod common;

use std::sync::{Arc, OnceLock};

use axum::http::StatusCode;
use common::{post_json, Reply};
use serde_json::{json, Value};
use tessera_gateway::testing::{reply_steps, FakeEngine};
use tessera_gateway::{app, AppState, Codec, GatewayConfig, ModelCodec};

#[path = "../../tests/support/default_model.rs"]
mod default_model;
use default_model::default_model as model_path;

/// Loaded once: the codec leaks its tokenizer by design.
fn codec() -> Option<Arc<ModelCodec>> {
    static CODEC: OnceLock<Option<Arc<ModelCodec>>> = OnceLock::new();
    CODEC
        .get_or_init(|| {
            let path = model_path()?;
            Some(Arc::new(ModelCodec::load_gguf(&path, "smollm2").unwrap_or_else(|e| panic!("{e}"))))
        })
        .clone()
}

const REPLY: &str = "Ça va? 日本語 👋 — fine, thanks!";

#[tokio::test]
async fn chat_through_the_model_codec() {
    let Some(codec) = codec() else { return };
    let reply_ids = codec.encode_prompt(REPLY, false).expect("encode");
    // Some character must span several tokens for the streaming check to mean anything.
    let pieces: Vec<Vec<u8>> = reply_ids.iter().map(|&id| codec.token_bytes(id).expect("piece")).collect();
    assert!(pieces.iter().any(|p| std::str::from_utf8(p).is_err()), "no split character in {REPLY:?}");
    assert_eq!(pieces.concat(), REPLY.as_bytes());

    let mut reply = reply_ids.clone();
    reply.extend(codec.eos_token_ids().first());
    let engine = Arc::new(FakeEngine::new(move |req| Ok(reply_steps(req, &reply, 0))));
    let state = AppState::new(GatewayConfig::new(2048), engine.clone(), codec.clone()).expect("state");
    let router = app(state);

    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]);
    let v = post_json(&router, "/v1/chat/completions", &json!({"messages": messages})).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], REPLY);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let want_prompt = codec.encode_prompt(chatml, true).expect("encode");
    let req = &engine.log().requests[0];
    assert_eq!(req.prompt_ids, want_prompt);
    assert_eq!(v["usage"]["prompt_tokens"], want_prompt.len());
    let im_end = codec.encode_prompt("<|im_end|>", false).expect("encode");
    assert_eq!(im_end.len(), 1, "<|im_end|> is one special token");
    assert!(req.params.stop_token_ids.contains(&im_end[0]));

    // /tokenize gives the same ids for the same conversation.
    let t = post_json(&router, "/tokenize", &json!({"messages": messages})).await.json();
    assert_eq!(t["tokens"], json!(want_prompt));

    // Streaming: deltas never split a character and add up to the whole decode.
    let body = json!({"messages": messages, "stream": true, "logprobs": true});
    let r: Reply = post_json(&router, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.events();
    let deltas: Vec<&str> = events
        .iter()
        .filter(|e| e["choices"][0]["delta"].get("role").is_none())
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(deltas.concat(), codec.decode(&reply_ids, true).expect("decode"));
    assert!(deltas.len() > 5);
    let bytes: Vec<u8> = events
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .flat_map(|t| t["bytes"].as_array().cloned().unwrap_or_default())
        .filter_map(|b: Value| b.as_u64().map(|b| b as u8))
        .collect();
    assert_eq!(bytes, REPLY.as_bytes());
}

#[tokio::test]
async fn completions_prompt_and_detokenize() {
    let Some(codec) = codec() else { return };
    let engine = Arc::new(FakeEngine::replying(codec.encode_prompt("ok", false).expect("encode")));
    let router = app(AppState::new(GatewayConfig::new(2048), engine.clone(), codec.clone()).expect("state"));
    let v = post_json(&router, "/v1/completions", &json!({"prompt": "The capital of France is"})).await.json();
    assert_eq!(v["choices"][0]["text"], "ok");
    let want = codec.encode_prompt("The capital of France is", true).expect("encode");
    assert_eq!(engine.log().requests[0].prompt_ids, want);
    let r = post_json(&router, "/detokenize", &json!({"tokens": want})).await.json();
    assert_eq!(r["prompt"], "The capital of France is");
}
