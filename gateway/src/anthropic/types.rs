//! Anthropic's wire types: the Messages request, the `message` response and its content
//! blocks (`text`, `tool_use`), usage, and the count_tokens request and response. Polymorphic fields (`system`,
//! `content`) stay `serde_json::Value` so `convert.rs` can name the offending field.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /v1/messages`.
#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub messages: Vec<MessageIn>,
    /// Required by Anthropic's API.
    pub max_tokens: i64,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    /// Accepted; `user_id` is only logged.
    pub metadata: Option<Metadata>,
    pub stream: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Metadata {
    pub user_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MessageIn {
    pub role: String,
    /// A string or a list of content blocks (only `text` blocks for now).
    pub content: Value,
}

/// `POST /v1/messages/count_tokens`.
#[derive(Debug, Deserialize)]
pub struct CountTokensRequest {
    pub model: Option<String>,
    pub system: Option<Value>,
    pub messages: Vec<MessageIn>,
}

#[derive(Debug, Serialize)]
pub struct CountTokensResponse {
    pub input_tokens: u32,
}

/// The `message` object (also the one `message_start` carries, with empty content).
#[derive(Debug, Clone, Serialize)]
pub struct MessageResponse {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub role: &'static str,
    pub model: String,
    pub content: Vec<ContentBlock>,
    pub stop_reason: Option<&'static str>,
    pub stop_sequence: Option<String>,
    pub usage: MessageUsage,
}

impl MessageResponse {
    pub fn new(id: String, model: String, content: Vec<ContentBlock>, usage: MessageUsage) -> Self {
        MessageResponse {
            id,
            kind: "message",
            role: "assistant",
            model,
            content,
            stop_reason: None,
            stop_sequence: None,
            usage,
        }
    }
}

/// A content block of a response: text, or a call of one of the request's tools.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text { text: String },
    ToolUse { id: String, name: String, input: Value },
}

impl ContentBlock {
    pub fn text(text: String) -> Self {
        ContentBlock::Text { text }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct MessageUsage {
    pub input_tokens: u32,
    pub output_tokens: u32,
}
