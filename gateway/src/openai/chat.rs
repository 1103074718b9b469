//! `POST /v1/chat/completions`: the request, the response, and the streamed chunks.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::Usage;

/// The chat-only fields; the sampling fields are parsed separately (`SamplingFields`).
#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessageIn>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Newer name of `max_tokens`; wins when both are given.
    pub max_completion_tokens: Option<i64>,
    /// vLLM extension (default true, false with `continue_final_message`).
    pub add_generation_prompt: Option<bool>,
    /// vLLM extension: the model continues the final (assistant) message instead of
    /// starting a new one.
    pub continue_final_message: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of content parts (`{"type": "text", "text": ...}`), or null.
    pub content: Option<Value>,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
pub struct AssistantMessage {
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `include_usage`; then null on every chunk but the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// `{}` on the final chunk of a choice.
#[derive(Debug, Default, Serialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

// ---- Tool calling (tools/openai.rs): the request fields and the response shapes of a chat
// ---- completion whose tools are active (message / delta with `tool_calls`).

/// The tool fields of a chat body, read on their own (unknown fields ignored); `messages`
/// again as raw JSON for `tool_calls`, `tool_call_id` and `name`.
#[derive(Debug, Deserialize)]
pub struct ToolFields {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct ToolChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ToolChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Serialize)]
pub struct ToolChatChoice {
    pub index: u32,
    pub message: ToolAssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: &'static str,
}

/// `content` is null when the model only called tools.
#[derive(Debug, Serialize)]
pub struct ToolAssistantMessage {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    /// The arguments' JSON text.
    pub arguments: String,
}

#[derive(Debug, Serialize)]
pub struct ToolChatChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ToolChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct ToolChunkChoice {
    pub index: u32,
    pub delta: ToolDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Default, Serialize)]
pub struct ToolDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallDelta>,
}

/// A streamed piece of call `index`: the first carries `id`, `type` and the name (with empty
/// arguments), the rest argument text.
#[derive(Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}
