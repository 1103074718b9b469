//! `POST /v1/completions` (the legacy text API): request, response and streamed chunks
//! (which have the same shape as the response, with `object` "text_completion").

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::common::Usage;

/// The completions-only fields; the sampling fields are parsed separately.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// A string, a list of strings, a list of token ids, or a list of lists of token ids.
    pub prompt: Option<Value>,
    /// Number of alternatives per position, 0..=5.
    pub logprobs: Option<i64>,
    /// The text of each choice starts with its prompt's (refused with `logprobs`).
    pub echo: Option<bool>,
    /// Unsupported: rejected when set, rather than silently ignored.
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Always present on the response; on chunks as for chat (`ChatCompletionChunk::usage`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Parallel lists, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Token text -> logprob of the alternatives at each position.
    pub top_logprobs: Vec<Map<String, Value>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<u32>,
}
