//! The Messages API's server-sent events for one streamed message: `message_start` (empty
//! content, input token count), `content_block_start` (text block 0), `ping`, a
//! `content_block_delta` with a `text_delta` per piece of text, `content_block_stop`,
//! `message_delta` (stop reason, stop sequence, output tokens) and `message_stop`. A failure
//! midway ends the stream with one `event: error` in Anthropic's error shape. Dropping the
//! stream (client gone) drops the choice stream, which aborts the sequence.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{Stream, StreamExt};
use serde::Serialize;
use serde_json::json;

use super::convert::stop_reason;
use super::errors::AnthropicError;
use super::types::MessageResponse;
use crate::error::ApiError;
use crate::generate::{ChoiceEvent, ChoiceItem};

/// Streams one choice as Anthropic events; `start` is the message `message_start` carries.
pub fn sse_response(
    start: MessageResponse,
    choice: impl Stream<Item = ChoiceItem> + Send + 'static,
    keep_alive: Duration,
) -> Response {
    let events = async_stream::stream! {
        yield event("message_start", &json!({"type": "message_start", "message": start}));
        yield event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        );
        yield event("ping", &json!({"type": "ping"}));
        let mut choice = Box::pin(choice);
        while let Some(item) = choice.next().await {
            match item.event {
                ChoiceEvent::Delta { text, .. } if text.is_empty() => {}
                ChoiceEvent::Delta { text, .. } => {
                    let delta = json!({
                        "type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}
                    });
                    yield event("content_block_delta", &delta);
                }
                ChoiceEvent::Finished { reason, completion_tokens, stop_sequence, .. } => {
                    yield event("content_block_stop", &json!({"type": "content_block_stop", "index": 0}));
                    let delta = json!({
                        "type": "message_delta",
                        "delta": {"stop_reason": stop_reason(Some(reason), stop_sequence.as_deref()), "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": completion_tokens},
                    });
                    yield event("message_delta", &delta);
                    yield event("message_stop", &json!({"type": "message_stop"}));
                    return;
                }
                ChoiceEvent::Failed(e) => {
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

fn event<T: Serialize>(name: &str, value: &T) -> Result<Event, Infallible> {
    // Serializing these plain values cannot fail; an empty object keeps the stream well formed.
    Ok(Event::default().event(name).data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned())))
}
