//! Server-sent events for streamed responses, shared by chat and completions: merges the
//! choices' streams, renders each item as a chunk through the endpoint's `ChunkRenderer`,
//! appends the usage chunk when asked, then `data: [DONE]`. A choice that fails midway ends
//! the stream with one `data: {"error": {...}}` event (the body a non-streamed error has) and
//! then `data: [DONE]`, as vLLM does, so clients that read until the terminator end cleanly
//! and see why; the other choices' streams are dropped with it, so the engine aborts them.
//! A client that disconnects drops them too: hyper drops the body, and with it everything
//! below.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, Stream, StreamExt};
use serde::Serialize;

use crate::choice::{ApiFinish, ChoiceError, TokenLogprob};
use crate::error::ApiError;
use crate::generate::{ChoiceEvent, ChoiceItem, UsageTally};
use crate::openai::common::Usage;

/// Builds one endpoint's chunks; each returns a value to serialize as one `data:` event.
pub trait ChunkRenderer: Send + 'static {
    type Chunk: Serialize + Send;
    /// Chunks sent before any token (chat's role deltas).
    fn opening(&mut self) -> Vec<Self::Chunk>;
    fn delta(&mut self, index: u32, text: String, logprobs: Vec<TokenLogprob>) -> Self::Chunk;
    fn finish(&mut self, index: u32, reason: ApiFinish) -> Self::Chunk;
    /// The final chunk with empty `choices` (only when `include_usage`).
    fn usage(&mut self, usage: Usage) -> Self::Chunk;
}

pub fn sse_response<R: ChunkRenderer>(
    choices: Vec<impl Stream<Item = ChoiceItem> + Send + 'static>,
    mut renderer: R,
    mut tally: UsageTally,
    include_usage: bool,
    keep_alive: Duration,
) -> Response {
    let events = async_stream::stream! {
        for chunk in renderer.opening() {
            yield data(&chunk);
        }
        let mut merged = stream::select_all(choices.into_iter().map(Box::pin));
        while let Some(item) = merged.next().await {
            match item.event {
                ChoiceEvent::Delta { text, logprobs } => yield data(&renderer.delta(item.index, text, logprobs)),
                ChoiceEvent::Finished { reason, completion_tokens, cached_tokens, .. } => {
                    tally.record(item.index, completion_tokens, cached_tokens);
                    yield data(&renderer.finish(item.index, reason));
                }
                ChoiceEvent::Failed(e) => {
                    for event in failure_events(e) {
                        yield event;
                    }
                    return;
                }
            }
        }
        if include_usage {
            yield data(&renderer.usage(tally.usage()));
        }
        yield done();
    };
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}

/// The end of a stream whose choice `e` failed midway: the error's body, then `[DONE]`.
pub fn failure_events(e: ChoiceError) -> [Result<Event, Infallible>; 2] {
    let error = ApiError::from(e);
    error.log();
    [data(&error.body()), done()]
}

/// The event that ends every OpenAI stream.
pub fn done() -> Result<Event, Infallible> {
    Ok(Event::default().data("[DONE]"))
}

fn data<T: Serialize>(value: &T) -> Result<Event, Infallible> {
    // Serializing these plain structs cannot fail; an empty object keeps the stream well formed.
    Ok(Event::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned())))
}
