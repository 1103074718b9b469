//! The non-generation routes: `/v1/models` (OpenAI) and `/tokenize`, `/detokenize` (vLLM's
//! shapes).

use serde::{Deserialize, Serialize};

use super::chat::ChatMessageIn;

#[derive(Debug, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

/// Either `prompt` (completions style) or `messages` (chat style, rendered with the template).
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Default true, so `messages` tokenize to exactly the ids a chat request sends.
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize)]
pub struct DetokenizeResponse {
    pub prompt: String,
}
