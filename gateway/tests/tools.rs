//! Tool calling over the fake engine and the byte codec (whose template has no tool support,
//! so the fallback format of docs/tools.md is used): scripted model outputs with calls come
//! back as OpenAI `tool_calls` / Anthropic `tool_use` blocks, streamed and not; tool turns
//! render into the prompt; forced calls set the grammar; bad tool requests are 400s.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::http::StatusCode;
use common::*;
use serde_json::{json, Value};
use tessera_gateway::engine::Constraint;
use tessera_gateway::testing::{reply_steps, FakeEngine, EOS};
use tessera_gateway::GatewayConfig;

const WEATHER_ARGS: &str = r#"{"city": "Paris", "when": {"day": "mon}day"}}"#;
const TIME_ARGS: &str = r#"{"tz": "CET"}"#;

/// Text, then two calls in the fallback (Hermes) syntax, then EOS.
fn two_calls() -> String {
    format!(
        "Let me check.\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {WEATHER_ARGS}}}\n</tool_call>\n\
         <tool_call>\n{{\"name\": \"get_time\", \"arguments\": {TIME_ARGS}}}\n</tool_call>"
    )
}

fn app_replying(text: &str) -> (axum::Router, Arc<FakeEngine>) {
    let mut reply = ids(text);
    reply.push(EOS);
    let engine = Arc::new(FakeEngine::new(move |req| Ok(reply_steps(req, &reply, 0))));
    (router(GatewayConfig::new(8192), engine.clone()), engine)
}

fn openai_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"tz": {"type": "string"}}}}},
    ])
}

fn anthropic_tools() -> Value {
    json!([
        {"name": "get_weather", "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}},
    ])
}

fn chat_body(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": openai_tools()});
    if let (Some(b), Some(extra)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(extra.clone());
    }
    b
}

fn prompt_text(engine: &FakeEngine, k: usize) -> String {
    let ids = &engine.log().requests[k].prompt_ids;
    String::from_utf8_lossy(&ids.iter().filter(|&&id| id < 256).map(|&id| id as u8).collect::<Vec<_>>()).into_owned()
}

fn json_eq(a: &str, b: &str) -> bool {
    serde_json::from_str::<Value>(a).ok() == serde_json::from_str::<Value>(b).ok()
        && serde_json::from_str::<Value>(a).is_ok()
}

#[tokio::test]
async fn openai_calls_in_a_message() {
    let (app, engine) = app_replying(&two_calls());
    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], "Let me check.\n");
    let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
    assert_eq!(calls.len(), 2, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["function"]["arguments"], WEATHER_ARGS);
    assert_eq!(calls[1]["function"]["name"], "get_time");
    assert_eq!(calls[1]["function"]["arguments"], TIME_ARGS);
    let id0 = calls[0]["id"].as_str().unwrap_or_default();
    assert!(id0.starts_with("call_") && id0 != calls[1]["id"].as_str().unwrap_or_default(), "{v}");

    // The fallback format: the tools listed in a system turn of the byte codec's template.
    let prompt = prompt_text(&engine, 0);
    assert!(prompt.starts_with("<|system|># Tools\n"), "{prompt}");
    assert!(prompt.contains("\"name\":\"get_weather\"") && prompt.contains("<tool_call>"), "{prompt}");
    assert!(prompt.ends_with("<|user|>Weather?\n<|assistant|>"), "{prompt}");
    assert_eq!(engine.log().requests[0].params.constraint, None);
}

/// Streamed: content deltas, then per call one delta with id/type/name and argument deltas
/// that add up to the arguments.
#[tokio::test]
async fn openai_calls_streamed() {
    let (app, _) = app_replying(&two_calls());
    let body = chat_body(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let r = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(r.status, StatusCode::OK);
    let events = r.events();
    assert_eq!(events.last(), Some(&Value::from("[DONE]")));
    let usage = &events[events.len() - 2]["usage"];
    assert_eq!(usage["completion_tokens"], ids(&two_calls()).len() + 1, "{usage}");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut calls: BTreeMap<u64, (String, String, String)> = BTreeMap::new();
    let mut finish = Value::Null;
    let mut arg_chunks = 0;
    for e in &events[..events.len() - 1] {
        let choice = &e["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str() {
            content.push_str(t);
        }
        for piece in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = piece["index"].as_u64().unwrap_or(99);
            let entry = calls.entry(index).or_default();
            if let Some(id) = piece["id"].as_str() {
                assert!(entry.0.is_empty(), "id sent twice: {e}");
                assert_eq!(piece["type"], "function");
                entry.0 = id.to_owned();
                entry.1 = piece["function"]["name"].as_str().unwrap_or_default().to_owned();
            } else {
                assert!(!entry.0.is_empty(), "arguments before the call's start: {e}");
                arg_chunks += 1;
            }
            entry.2.push_str(piece["function"]["arguments"].as_str().unwrap_or_default());
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(content, "Let me check.\n");
    assert_eq!(finish, "tool_calls");
    let calls: Vec<_> = calls.into_values().collect();
    assert_eq!(calls.len(), 2);
    assert!(calls[0].0.starts_with("call_"));
    assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("get_weather", WEATHER_ARGS));
    assert_eq!((calls[1].1.as_str(), calls[1].2.as_str()), ("get_time", TIME_ARGS));
    // One token per byte: the arguments arrive in many pieces, not at the end.
    assert!(arg_chunks > 10, "{arg_chunks}");
}

/// The assistant's calls and the tool results go back into the prompt (fallback format);
/// a plain answer then has no tool_calls and finish reason `stop`.
#[tokio::test]
async fn openai_tool_results_round_trip() {
    let (app, engine) = app_replying("It is 18C in Paris.");
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    ]);
    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({"messages": messages}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "It is 18C in Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    let prompt = prompt_text(&engine, 0);
    let want = "<|user|>Weather?\n\
                <|assistant|><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>\n\
                <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n\
                <|user|><tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>\n<|assistant|>";
    assert!(prompt.ends_with(want), "{prompt}");
}

#[tokio::test]
async fn forced_calls_set_a_grammar_and_none_parses_nothing() {
    let (app, engine) = app_replying(&two_calls());
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let r = post_json(&app, "/v1/chat/completions", &chat_body(named)).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let Some(Constraint::Lark(g)) = engine.log().requests[0].params.constraint.clone() else {
        panic!("no grammar: {:?}", engine.log().requests[0].params.constraint)
    };
    assert!(g.contains("get_time") && !g.contains("get_weather"), "{g}");

    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({"tool_choice": "required"}))).await;
    assert_eq!(r.status, StatusCode::OK);
    let Some(Constraint::Lark(g)) = engine.log().requests[1].params.constraint.clone() else { panic!("no grammar") };
    assert!(g.contains("get_time") && g.contains("get_weather"), "{g}");

    // none: no tools in the prompt, the call syntax stays plain text.
    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({"tool_choice": "none"}))).await;
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], two_calls());
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!prompt_text(&engine, 2).contains("# Tools"));
    assert_eq!(engine.log().requests[2].params.constraint, None);
}

#[tokio::test]
async fn bad_tool_requests_are_400() {
    let (app, _) = app_replying("x");
    let unknown = json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}});
    let r = post_json(&app, "/v1/chat/completions", &chat_body(unknown)).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("tool_choice"));
    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({"tools": [], "tool_choice": "required"}))).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("tool_choice"));
    let no_id = json!({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "content": "noon"}]});
    let r = post_json(&app, "/v1/chat/completions", &chat_body(no_id)).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("messages[2].tool_call_id"));
    let bad_tool = json!({"tools": [{"type": "function", "function": {"name": "has space"}}]});
    let r = post_json(&app, "/v1/chat/completions", &chat_body(bad_tool)).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("tools[0].function.name"));
    let with_format = json!({"tool_choice": "required", "response_format": {"type": "json_object"}});
    let r = post_json(&app, "/v1/chat/completions", &chat_body(with_format)).await;
    assert_error(&r, StatusCode::BAD_REQUEST, "invalid_request_error", Some("tool_choice"));
}

fn messages_body(extra: Value) -> Value {
    let mut b = json!({"model": MODEL, "max_tokens": 400, "tools": anthropic_tools(),
        "messages": [{"role": "user", "content": "Weather?"}]});
    if let (Some(b), Some(extra)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(extra.clone());
    }
    b
}

#[tokio::test]
async fn anthropic_tool_use_blocks() {
    let (app, engine) = app_replying(&two_calls());
    let r = post_json(&app, "/v1/messages", &messages_body(json!({}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let content = v["content"].as_array().cloned().unwrap_or_default();
    assert_eq!(content.len(), 3, "{v}");
    assert_eq!(content[0], json!({"type": "text", "text": "Let me check.\n"}));
    assert_eq!(content[1]["type"], "tool_use");
    assert!(content[1]["id"].as_str().is_some_and(|id| id.starts_with("toolu_")), "{v}");
    assert_eq!(content[1]["name"], "get_weather");
    assert_eq!(content[1]["input"], serde_json::from_str::<Value>(WEATHER_ARGS).unwrap_or_default());
    assert_eq!(content[2]["name"], "get_time");
    assert_eq!(content[2]["input"], json!({"tz": "CET"}));
    assert!(prompt_text(&engine, 0).starts_with("<|system|># Tools\n"));

    // count_tokens counts the same prompt, tools included.
    let mut count = messages_body(json!({}));
    count.as_object_mut().map(|o| o.remove("max_tokens"));
    let r = post_json(&app, "/v1/messages/count_tokens", &count).await;
    assert_eq!(r.json()["input_tokens"], engine.log().requests[0].prompt_ids.len());
}

#[tokio::test]
async fn anthropic_tool_use_streamed() {
    let (app, _) = app_replying(&two_calls());
    let r = post_json(&app, "/v1/messages", &messages_body(json!({"stream": true}))).await;
    assert_eq!(r.status, StatusCode::OK);
    let events: Vec<(String, Value)> = String::from_utf8_lossy(&r.body)
        .split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_owned(), serde_json::from_str(data).ok()?))
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..2], ["message_start", "ping"]);
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
    // Rebuild the blocks from the events, checking each block is started, filled and stopped in turn.
    let mut blocks: Vec<(Value, String)> = Vec::new();
    let mut open: Option<u64> = None;
    for (name, data) in &events {
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "{data}");
                assert_eq!(data["index"], blocks.len());
                open = data["index"].as_u64();
                blocks.push((data["content_block"].clone(), String::new()));
            }
            "content_block_delta" => {
                assert_eq!(data["index"].as_u64(), open, "{data}");
                let d = &data["delta"];
                let piece = match d["type"].as_str() {
                    Some("text_delta") => d["text"].as_str(),
                    Some("input_json_delta") => d["partial_json"].as_str(),
                    _ => None,
                };
                if let Some(last) = blocks.last_mut() {
                    last.1.push_str(piece.unwrap_or_default());
                }
            }
            "content_block_stop" => {
                assert_eq!(data["index"].as_u64(), open, "{data}");
                open = None;
            }
            "message_delta" => assert_eq!(data["delta"]["stop_reason"], "tool_use", "{data}"),
            _ => {}
        }
    }
    assert_eq!(blocks.len(), 3, "{blocks:?}");
    assert_eq!((blocks[0].0["type"].as_str(), blocks[0].1.as_str()), (Some("text"), "Let me check.\n"));
    assert_eq!(blocks[1].0["type"], "tool_use");
    assert_eq!(blocks[1].0["name"], "get_weather");
    assert!(blocks[1].0["id"].as_str().is_some_and(|id| id.starts_with("toolu_")));
    assert!(json_eq(&blocks[1].1, WEATHER_ARGS), "{}", blocks[1].1);
    assert_eq!(blocks[2].0["name"], "get_time");
    assert!(json_eq(&blocks[2].1, TIME_ARGS), "{}", blocks[2].1);
}

#[tokio::test]
async fn anthropic_tool_results_and_choices() {
    let (app, engine) = app_replying("Sunny.");
    let messages = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And?"}]},
    ]);
    let r =
        post_json(&app, "/v1/messages", &messages_body(json!({"messages": messages, "tool_choice": {"type": "any"}})))
            .await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    let prompt = prompt_text(&engine, 0);
    let want =
        "<|assistant|><tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>\n\
                <|user|><tool_response>\nsunny\n</tool_response>\n<|user|>And?\n<|assistant|>";
    assert!(prompt.ends_with(want), "{prompt}");
    assert!(matches!(engine.log().requests[0].params.constraint, Some(Constraint::Lark(_))));
    // The reply has no call: text and end_turn.
    let v = r.json();
    assert_eq!(v["content"], json!([{"type": "text", "text": "Sunny."}]));
    assert_eq!(v["stop_reason"], "end_turn");

    let bad = json!({"tool_choice": {"type": "tool", "name": "nope"}});
    let r = post_json(&app, "/v1/messages", &messages_body(bad)).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert!(r.json()["error"]["message"].as_str().is_some_and(|m| m.contains("tool_choice")));
}

/// `auto` with a strict tool: the call grammar is set (strict schemas held, the other tools'
/// arguments any object); without strict tools, or with a `response_format`, it is not. A
/// strict schema llguidance cannot compile is a 400 on `tools`; a non-strict one is not read.
#[tokio::test]
async fn auto_with_strict_tools_sets_a_grammar() {
    let (app, engine) = app_replying("Sunny.");
    let impossible = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 2, "maximum": 1}}, "required": ["n"]});
    let with_strict = |strict: bool, time_schema: Value| {
        let mut t = openai_tools();
        t[0]["function"]["strict"] = json!(strict);
        t[1]["function"]["parameters"] = time_schema;
        t
    };
    let grammar = |k: usize| match engine.log().requests[k].params.constraint.clone() {
        Some(Constraint::Lark(g)) => g,
        other => panic!("request {k}: {other:?}"),
    };

    let r =
        post_json(&app, "/v1/chat/completions", &chat_body(json!({"tools": with_strict(true, impossible.clone())})))
            .await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["choices"][0]["message"]["content"], "Sunny.");
    let g = grammar(0);
    assert!(g.starts_with("start: TEXT? | open call (\"\\n<tool_call>\" call)*\n"), "{g}");
    assert!(g.contains(r#""properties":{"city":{"type":"string"}}"#) && g.contains(r#""lenient":false"#), "{g}");
    assert!(!g.contains("minimum"), "the non-strict tool's schema is not in the grammar: {g}");

    let single = json!({"tools": with_strict(true, json!({"type": "object"})), "parallel_tool_calls": false});
    assert_eq!(post_json(&app, "/v1/chat/completions", &chat_body(single)).await.status, StatusCode::OK);
    assert!(grammar(1).starts_with("start: TEXT? | open call\n"), "{}", grammar(1));

    let lax = json!({"tools": with_strict(false, impossible.clone())});
    assert_eq!(post_json(&app, "/v1/chat/completions", &chat_body(lax)).await.status, StatusCode::OK);
    assert_eq!(engine.log().requests[2].params.constraint, None);

    let formatted =
        json!({"tools": with_strict(true, json!({"type": "object"})), "response_format": {"type": "json_object"}});
    assert_eq!(post_json(&app, "/v1/chat/completions", &chat_body(formatted)).await.status, StatusCode::OK);
    assert_eq!(engine.log().requests[3].params.constraint, Some(Constraint::JsonObject));

    // Anthropic's `strict` on a tool.
    let mut tools = anthropic_tools();
    tools[1]["strict"] = json!(true);
    let r = post_json(&app, "/v1/messages", &messages_body(json!({"tools": tools}))).await;
    assert_eq!(r.status, StatusCode::OK, "{}", String::from_utf8_lossy(&r.body));
    assert!(grammar(4).contains(r#""properties":{"tz":{"type":"string"}}"#), "{}", grammar(4));
    tools[1]["strict"] = json!("yes");
    let r = post_json(&app, "/v1/messages", &messages_body(json!({"tools": tools}))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    let message = r.json()["error"]["message"].as_str().unwrap_or_default().to_owned();
    assert!(message.contains("tools[1].strict"), "{message}");

    // A strict schema that cannot be compiled.
    let mut bad = with_strict(false, json!({"type": "object"}));
    bad[0]["function"]["parameters"] = impossible;
    bad[0]["function"]["strict"] = json!(true);
    let r = post_json(&app, "/v1/chat/completions", &chat_body(json!({"tools": bad}))).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.json()["error"]["param"], "tools");
    assert_eq!(engine.log().requests.len(), 5);
}
