//! Tool calling in Anthropic's `POST /v1/messages` (and the prompt of `count_tokens`):
//! reading `tools` (`input_schema`), `tool_choice` and the `tool_use` / `tool_result` blocks
//! of the conversation; and, when tools are active, the response: `tool_use` content blocks
//! after the text and stop reason `tool_use`, or streamed as blocks opened as they come
//! (`content_block_start` of a `tool_use` block, then `input_json_delta` deltas with
//! `partial_json`, then `content_block_stop`).
//!
//! A call whose arguments did not close into a JSON object (only when the output was cut by
//! `max_tokens` or, without a forced call, malformed) has `input: {}` in the non-streaming
//! message; streamed, its `partial_json` is what the model wrote.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{Stream, StreamExt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::openai::Prepared;
use super::parser::ToolCallParser;
use super::render::render;
use super::spec::{anthropic_messages, anthropic_tools};
use super::stream::{collect, tool_stream, ToolItem, ToolItemEvent};
use crate::anthropic::convert::stop_reason;
use crate::anthropic::errors::AnthropicError;
use crate::anthropic::types::{ContentBlock, MessageResponse};
use crate::app::AppState;
use crate::body::parse_json;
use crate::choice::ApiFinish;
use crate::error::ApiError;
use crate::generate::ChoiceItem;

/// The tool-related fields of a Messages (or count_tokens) body.
#[derive(Debug, Deserialize)]
struct Fields {
    system: Option<Value>,
    messages: Vec<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
}

/// Validates the conversation (text, `tool_use`, `tool_result` blocks) and the tools, and
/// renders the prompt.
pub fn prepare(state: &AppState, body: &[u8]) -> Result<Prepared, ApiError> {
    let f: Fields = parse_json(body)?;
    let tools = anthropic_tools(f.tools.as_ref(), f.tool_choice.as_ref())?;
    let turns = anthropic_messages(f.system.as_ref(), &f.messages)?;
    let rendered = render(state.codec(), &turns, &tools, true).map_err(|e| ApiError::from_codec(e, "messages"))?;
    Ok(Prepared { tools, syntax: rendered.syntax, prompt: rendered.text })
}

/// `stop_reason`: `tool_use` when the message called a tool and stopped by itself.
fn reason(finish: Option<ApiFinish>, stop_sequence: Option<&str>, calls: usize) -> &'static str {
    match (finish, stop_sequence) {
        (Some(ApiFinish::Stop) | None, None) if calls > 0 => "tool_use",
        _ => stop_reason(finish, stop_sequence),
    }
}

/// The choice through the tool-call parser (`toolu_…` ids).
pub fn parse_choice(
    choice: impl Stream<Item = ChoiceItem> + Send + 'static,
    prepared: &Prepared,
) -> impl Stream<Item = ToolItem> + Send + 'static {
    tool_stream(choice, ToolCallParser::new(prepared.syntax, prepared.tools.names()), "toolu")
}

/// The non-streaming message: the text block (left out when empty and there are calls), then
/// one `tool_use` block per call.
pub async fn respond(
    mut message: MessageResponse,
    choice: impl Stream<Item = ToolItem> + Send + 'static,
) -> Result<Response, AnthropicError> {
    let r = collect(vec![choice]).await?.pop().ok_or_else(|| ApiError::Internal("no choice result".to_owned()))?;
    message.usage.output_tokens = r.completion_tokens;
    if r.calls.is_empty() || !r.text.trim().is_empty() {
        message.content.push(ContentBlock::text(r.text));
    }
    let calls = r.calls.len();
    for c in r.calls {
        let input = match serde_json::from_str::<Value>(&c.arguments) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                tracing::warn!(tool = %c.name, "tool call arguments are not a JSON object; sent as {{}}");
                json!({})
            }
        };
        message.content.push(ContentBlock::ToolUse { id: c.id, name: c.name, input });
    }
    message.stop_reason = Some(reason(r.finish, r.stop_sequence.as_deref(), calls));
    message.stop_sequence = r.stop_sequence;
    Ok(Json(message).into_response())
}

/// The event stream of a message with tools: blocks are opened when their first piece comes
/// (a text block on text, a `tool_use` block on a call's start) and closed before the next.
pub fn sse(
    start: MessageResponse,
    choice: impl Stream<Item = ToolItem> + Send + 'static,
    keep_alive: Duration,
) -> Response {
    let events = async_stream::stream! {
        yield event("message_start", &json!({"type": "message_start", "message": start}));
        yield event("ping", &json!({"type": "ping"}));
        let mut choice = Box::pin(choice);
        // The index of the next block, and whether a text block / a tool block is open.
        let mut next = 0usize;
        let mut open: Option<&'static str> = None;
        while let Some(item) = choice.next().await {
            match item.event {
                ToolItemEvent::Text { text, .. } if text.is_empty() => {}
                ToolItemEvent::Text { text, .. } => {
                    if open != Some("text") {
                        if open.take().is_some() {
                            yield stop_block(next - 1);
                        }
                        yield event("content_block_start", &json!({
                            "type": "content_block_start", "index": next,
                            "content_block": {"type": "text", "text": ""}
                        }));
                        next += 1;
                        open = Some("text");
                    }
                    yield event("content_block_delta", &json!({
                        "type": "content_block_delta", "index": next - 1,
                        "delta": {"type": "text_delta", "text": text}
                    }));
                }
                ToolItemEvent::Start { id, name, .. } => {
                    if open.take().is_some() {
                        yield stop_block(next - 1);
                    }
                    yield event("content_block_start", &json!({
                        "type": "content_block_start", "index": next,
                        "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}
                    }));
                    next += 1;
                    open = Some("tool_use");
                }
                ToolItemEvent::Args { delta, .. } => {
                    yield event("content_block_delta", &json!({
                        "type": "content_block_delta", "index": next - 1,
                        "delta": {"type": "input_json_delta", "partial_json": delta}
                    }));
                }
                ToolItemEvent::End { .. } => {
                    if open.take().is_some() {
                        yield stop_block(next - 1);
                    }
                }
                ToolItemEvent::Finished { reason: finish, completion_tokens, stop_sequence, calls, .. } => {
                    if open.take().is_some() {
                        yield stop_block(next - 1);
                    }
                    if next == 0 {
                        // No content at all: one empty text block, as for a plain message.
                        yield event("content_block_start", &json!({
                            "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}
                        }));
                        yield stop_block(0);
                    }
                    let delta = json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": reason(Some(finish), stop_sequence.as_deref(), calls), "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": completion_tokens},
                    });
                    yield event("message_delta", &delta);
                    yield event("message_stop", &json!({"type": "message_stop"}));
                    return;
                }
                ToolItemEvent::Failed(e) => {
                    let error = AnthropicError(ApiError::from(e));
                    error.0.log();
                    yield event("error", &error.body());
                    return;
                }
            }
        }
    };
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}

fn stop_block(index: usize) -> Result<Event, Infallible> {
    event("content_block_stop", &json!({"type": "content_block_stop", "index": index}))
}

fn event<T: Serialize>(name: &str, value: &T) -> Result<Event, Infallible> {
    // Serializing these plain values cannot fail; an empty object keeps the stream well formed.
    Ok(Event::default().event(name).data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned())))
}
