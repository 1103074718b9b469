//! The tool-call parser over a choice's stream: each text delta goes through the choice's
//! `ToolCallParser`, and the choice's items become text, call start (with a fresh call id),
//! argument and call end items, then the finish. `collect` runs a choice to the end for the
//! non-streaming responses. Shared by the OpenAI and Anthropic handlers.

use futures::stream::{self, Stream, StreamExt};

use super::parser::{ToolCallParser, ToolEvent};
use crate::choice::{ApiFinish, ChoiceError, TokenLogprob};
use crate::error::ApiError;
use crate::generate::{ChoiceEvent, ChoiceItem};
use crate::ids::new_id;

#[derive(Debug)]
pub enum ToolItemEvent {
    /// Plain text (possibly empty when it only carries logprobs).
    Text {
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    Start {
        call: usize,
        id: String,
        name: String,
    },
    Args {
        call: usize,
        delta: String,
    },
    End {
        call: usize,
        complete: bool,
    },
    /// `calls`: how many calls the choice made.
    Finished {
        reason: ApiFinish,
        completion_tokens: u32,
        cached_tokens: Option<u32>,
        stop_sequence: Option<String>,
        calls: usize,
    },
    Failed(ChoiceError),
}

#[derive(Debug)]
pub struct ToolItem {
    pub index: u32,
    pub event: ToolItemEvent,
}

/// Runs `choice` through `parser`; call ids are `id_prefix` + 24 hex digits
/// (`call_…` for OpenAI, `toolu_…` for Anthropic).
pub fn tool_stream(
    choice: impl Stream<Item = ChoiceItem> + Send + 'static,
    parser: ToolCallParser,
    id_prefix: &'static str,
) -> impl Stream<Item = ToolItem> + Send + 'static {
    let state = (Box::pin(choice), parser);
    stream::unfold(Some(state), move |state| async move {
        let (mut choice, mut parser) = state?;
        let item = choice.next().await?;
        let index = item.index;
        let mut out = Vec::new();
        let mut done = false;
        match item.event {
            ChoiceEvent::Delta { text, logprobs } => {
                let events = parser.push(&text);
                convert(events, logprobs, id_prefix, &mut out);
            }
            ChoiceEvent::Finished { reason, completion_tokens, cached_tokens, stop_sequence } => {
                convert(parser.finish(), Vec::new(), id_prefix, &mut out);
                out.push(ToolItemEvent::Finished {
                    reason,
                    completion_tokens,
                    cached_tokens,
                    stop_sequence,
                    calls: parser.calls(),
                });
                done = true;
            }
            ChoiceEvent::Failed(e) => {
                out.push(ToolItemEvent::Failed(e));
                done = true;
            }
        }
        let items = out.into_iter().map(move |event| ToolItem { index, event });
        let next = (!done).then_some((choice, parser));
        Some((stream::iter(items), next))
    })
    .flatten()
}

/// Parser events as items; logprobs ride on the first text item, or on an empty one.
fn convert(events: Vec<ToolEvent>, mut logprobs: Vec<TokenLogprob>, id_prefix: &str, out: &mut Vec<ToolItemEvent>) {
    for e in events {
        out.push(match e {
            ToolEvent::Text(text) => ToolItemEvent::Text { text, logprobs: std::mem::take(&mut logprobs) },
            ToolEvent::Start { index, name } => ToolItemEvent::Start { call: index, id: call_id(id_prefix), name },
            ToolEvent::Args { index, delta } => ToolItemEvent::Args { call: index, delta },
            ToolEvent::End { index, complete } => ToolItemEvent::End { call: index, complete },
        });
    }
    if !logprobs.is_empty() {
        out.push(ToolItemEvent::Text { text: String::new(), logprobs });
    }
}

/// `call_` / `toolu_` + 24 hex digits.
fn call_id(prefix: &str) -> String {
    let id = new_id(prefix);
    let hex = id.rsplit('-').next().unwrap_or_default();
    format!("{prefix}_{}", &hex[..hex.len().min(24)])
}

/// One call of a finished choice.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub id: String,
    pub name: String,
    /// The JSON text of the arguments, as the model wrote it.
    pub arguments: String,
    /// Whether the call's JSON closed properly (false: cut by `max_tokens`, or malformed).
    pub complete: bool,
}

/// A finished choice with its calls.
#[derive(Debug, Default)]
pub struct ToolResult {
    pub index: u32,
    pub text: String,
    pub calls: Vec<ParsedCall>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Option<ApiFinish>,
    pub completion_tokens: u32,
    pub cached_tokens: Option<u32>,
    pub stop_sequence: Option<String>,
}

/// Runs every choice to the end; the first failure drops the others (aborting them).
pub async fn collect(streams: Vec<impl Stream<Item = ToolItem> + Send>) -> Result<Vec<ToolResult>, ApiError> {
    let runs = streams.into_iter().map(|s| async move {
        let mut s = std::pin::pin!(s);
        let mut r = ToolResult::default();
        while let Some(item) = s.next().await {
            r.index = item.index;
            match item.event {
                ToolItemEvent::Text { text, logprobs } => {
                    r.text.push_str(&text);
                    r.logprobs.extend(logprobs);
                }
                ToolItemEvent::Start { id, name, .. } => {
                    r.calls.push(ParsedCall { id, name, arguments: String::new(), complete: false })
                }
                ToolItemEvent::Args { call, delta } => {
                    if let Some(c) = r.calls.get_mut(call) {
                        c.arguments.push_str(&delta);
                    }
                }
                ToolItemEvent::End { call, complete } => {
                    if let Some(c) = r.calls.get_mut(call) {
                        c.complete = complete;
                    }
                }
                ToolItemEvent::Finished { reason, completion_tokens, cached_tokens, stop_sequence, .. } => {
                    r.finish = Some(reason);
                    r.completion_tokens = completion_tokens;
                    r.cached_tokens = cached_tokens;
                    r.stop_sequence = stop_sequence;
                }
                ToolItemEvent::Failed(e) => return Err(ApiError::from(e)),
            }
        }
        Ok(r)
    });
    futures::future::try_join_all(runs).await
}
