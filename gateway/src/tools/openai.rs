//! Tool calling in `POST /v1/chat/completions`: reading `tools`, `tool_choice`,
//! `parallel_tool_calls` and the tool turns of `messages`; the prompt; and, when tools are
//! active, the response: `message.tool_calls` (`content` null when there is no text) and
//! finish reason `tool_calls`, or streamed `delta.tool_calls` (index, id, type and name
//! first, then argument text).

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use serde::Serialize;

use super::parser::{ToolCallParser, ToolSyntax};
use super::render::render;
use super::spec::{openai_messages, openai_tools, ToolRequest};
use super::stream::{collect, tool_stream, ToolItem, ToolItemEvent};
use crate::app::AppState;
use crate::body::parse_json;
use crate::choice::ApiFinish;
use crate::error::ApiError;
use crate::generate::{ChoiceItem, UsageTally};
use crate::logprobs;
use crate::openai::chat::{
    FunctionCallOut, FunctionDelta, ToolAssistantMessage, ToolCallDelta, ToolCallOut, ToolChatChoice, ToolChatChunk,
    ToolChatCompletion, ToolChunkChoice, ToolDelta, ToolFields,
};

/// A chat request's tools and its rendered prompt.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub tools: ToolRequest,
    pub syntax: ToolSyntax,
    pub prompt: String,
}

/// How the rendered prompt ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptEnd {
    /// After the last message (`add_generation_prompt: false`).
    Closed,
    /// With the assistant's turn opened (the default).
    GenerationPrompt,
    /// Inside the final assistant message, right after its text, which the model then
    /// continues (vLLM's `continue_final_message`).
    ContinueFinal,
}

/// Validates the tool fields and tool turns of a chat body and renders the prompt.
pub fn prepare(state: &AppState, body: &[u8], end: PromptEnd) -> Result<Prepared, ApiError> {
    let f: ToolFields = parse_json(body)?;
    let tools = openai_tools(f.tools.as_ref(), f.tool_choice.as_ref(), f.parallel_tool_calls)?;
    let turns = openai_messages(&f.messages)?;
    let rendered = render(state.codec(), &turns, &tools, end == PromptEnd::GenerationPrompt)
        .map_err(|e| ApiError::from_codec(e, "messages"))?;
    let mut prompt = rendered.text;
    if end == PromptEnd::ContinueFinal {
        prompt = continue_final(prompt, &turns)?;
    }
    Ok(Prepared { tools, syntax: rendered.syntax, prompt })
}

/// `prompt` (rendered without a generation prompt) cut right after the final message's
/// text, which must be an assistant's and must appear in it (the last occurrence is taken,
/// as vLLM does): what follows is the template closing the turn.
fn continue_final(mut prompt: String, turns: &[crate::tools::spec::Turn]) -> Result<String, ApiError> {
    const P: &str = "continue_final_message";
    let last = turns
        .last()
        .filter(|t| t.role == "assistant")
        .ok_or_else(|| ApiError::invalid(P, "continue_final_message needs the final message to be the assistant's"))?;
    if last.content.is_empty() {
        return Err(ApiError::invalid(P, "continue_final_message needs text in the final assistant message"));
    }
    let at = prompt.rfind(&last.content).ok_or_else(|| {
        ApiError::invalid(P, "the final assistant message's text does not appear in the rendered prompt")
    })?;
    prompt.truncate(at + last.content.len());
    Ok(prompt)
}

/// What the response needs besides the choices.
pub struct Reply {
    pub state: AppState,
    pub id: String,
    pub created: u64,
    pub n: u32,
    pub with_logprobs: bool,
    pub include_usage: bool,
}

/// `finish_reason`: `tool_calls` when the choice called a tool and stopped by itself.
fn finish_reason(reason: ApiFinish, calls: usize) -> &'static str {
    match reason {
        ApiFinish::Stop if calls > 0 => "tool_calls",
        other => other.as_str(),
    }
}

/// The choices through the tool-call parser.
pub fn parse_choices(
    choices: Vec<impl Stream<Item = ChoiceItem> + Send + 'static>,
    prepared: &Prepared,
) -> Vec<impl Stream<Item = ToolItem> + Send + 'static> {
    choices
        .into_iter()
        .map(|c| tool_stream(c, ToolCallParser::new(prepared.syntax, prepared.tools.names()), "call"))
        .collect()
}

/// The non-streaming `chat.completion`.
pub async fn respond(
    reply: Reply,
    choices: Vec<impl Stream<Item = ToolItem> + Send + 'static>,
    mut tally: UsageTally,
) -> Result<Response, ApiError> {
    let results = collect(choices).await?;
    let codec = reply.state.codec();
    let choices = results
        .into_iter()
        .map(|r| {
            tally.record(r.index, r.completion_tokens, r.cached_tokens);
            let calls = r.calls.len();
            let tool_calls: Vec<ToolCallOut> = r
                .calls
                .into_iter()
                .map(|c| ToolCallOut {
                    id: c.id,
                    kind: "function",
                    function: FunctionCallOut { name: c.name, arguments: c.arguments },
                })
                .collect();
            let content = if calls > 0 && r.text.trim().is_empty() { None } else { Some(r.text) };
            ToolChatChoice {
                index: r.index,
                message: ToolAssistantMessage { role: "assistant", content, tool_calls },
                logprobs: reply.with_logprobs.then(|| logprobs::chat(codec, &r.logprobs)),
                finish_reason: finish_reason(r.finish.unwrap_or(ApiFinish::Stop), calls),
            }
        })
        .collect();
    let response = ToolChatCompletion {
        id: reply.id,
        object: "chat.completion",
        created: reply.created,
        model: reply.state.model_name().to_owned(),
        choices,
        usage: tally.usage(),
    };
    Ok(Json(response).into_response())
}

impl Reply {
    fn chunk(&self, choices: Vec<ToolChunkChoice>) -> ToolChatChunk {
        ToolChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk",
            created: self.created,
            model: self.state.model_name().to_owned(),
            choices,
            usage: self.include_usage.then_some(None),
        }
    }

    fn one(&self, index: u32, delta: ToolDelta) -> ToolChatChunk {
        self.chunk(vec![ToolChunkChoice { index, delta, logprobs: None, finish_reason: None }])
    }

    /// The chunk for one item, if it makes one.
    fn item(&self, item: ToolItem, tally: &mut UsageTally) -> Option<ToolChatChunk> {
        let index = item.index;
        Some(match item.event {
            ToolItemEvent::Text { text, logprobs } => {
                let logprobs =
                    (self.with_logprobs && !logprobs.is_empty()).then(|| logprobs::chat(self.state.codec(), &logprobs));
                if text.is_empty() && logprobs.is_none() {
                    return None;
                }
                let delta = ToolDelta { content: Some(text), ..ToolDelta::default() };
                self.chunk(vec![ToolChunkChoice { index, delta, logprobs, finish_reason: None }])
            }
            ToolItemEvent::Start { call, id, name } => {
                let piece = ToolCallDelta {
                    index: call,
                    id: Some(id),
                    kind: Some("function"),
                    function: FunctionDelta { name: Some(name), arguments: String::new() },
                };
                self.one(index, ToolDelta { tool_calls: vec![piece], ..ToolDelta::default() })
            }
            ToolItemEvent::Args { call, delta } => {
                let piece = ToolCallDelta {
                    index: call,
                    id: None,
                    kind: None,
                    function: FunctionDelta { name: None, arguments: delta },
                };
                self.one(index, ToolDelta { tool_calls: vec![piece], ..ToolDelta::default() })
            }
            ToolItemEvent::End { .. } => return None,
            ToolItemEvent::Finished { reason, completion_tokens, cached_tokens, calls, .. } => {
                tally.record(index, completion_tokens, cached_tokens);
                let choice = ToolChunkChoice {
                    index,
                    delta: ToolDelta::default(),
                    logprobs: None,
                    finish_reason: Some(finish_reason(reason, calls)),
                };
                self.chunk(vec![choice])
            }
            ToolItemEvent::Failed(_) => return None,
        })
    }
}

/// The streamed response: role chunks, then text / call chunks as they come, a finish chunk
/// per choice, the usage chunk when asked, `[DONE]`. A failure ends the stream with one
/// error event and `[DONE]` (`sse::failure_events`).
pub fn sse(
    reply: Reply,
    choices: Vec<impl Stream<Item = ToolItem> + Send + 'static>,
    mut tally: UsageTally,
    keep_alive: Duration,
) -> Response {
    let events = async_stream::stream! {
        for index in 0..reply.n {
            let delta = ToolDelta { role: Some("assistant"), content: Some(String::new()), ..ToolDelta::default() };
            yield data(&reply.one(index, delta));
        }
        let mut merged = stream::select_all(choices.into_iter().map(Box::pin));
        while let Some(item) = merged.next().await {
            if let ToolItemEvent::Failed(e) = item.event {
                for event in crate::sse::failure_events(e) {
                    yield event;
                }
                return;
            }
            if let Some(chunk) = reply.item(item, &mut tally) {
                yield data(&chunk);
            }
        }
        if reply.include_usage {
            let mut chunk = reply.chunk(Vec::new());
            chunk.usage = Some(Some(tally.usage()));
            yield data(&chunk);
        }
        yield crate::sse::done();
    };
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}

fn data<T: Serialize>(value: &T) -> Result<Event, Infallible> {
    // Serializing these plain structs cannot fail; an empty object keeps the stream well formed.
    Ok(Event::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".to_owned())))
}
