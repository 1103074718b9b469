//! Wire types shared by chat and completions: the sampling fields both requests carry, and
//! `usage`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The fields chat and completions requests share. Parsed from the same body as the
/// endpoint's own struct (unknown fields are ignored by both), so there is no `flatten`,
/// which would hide the path of a bad field.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// A string or a list of at most 4 strings.
    pub stop: Option<Value>,
    /// vLLM extension.
    pub stop_token_ids: Option<Vec<i64>>,
    pub seed: Option<i64>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM extensions.
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub ignore_eos: Option<bool>,
    /// Ends the text after the matched stop string instead of before it.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM extension: completion tokens produced before EOS, a stop id or a stop string
    /// may end the sequence; at most `max_tokens`.
    pub min_tokens: Option<i64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// Token id (as a string) -> bias in [-100, 100].
    pub logit_bias: Option<HashMap<String, f64>>,
    /// Accepted and ignored (end-user id for abuse tracking).
    pub user: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// OpenAI writes the logprob of an impossible token as -9999.0; JSON has no -inf.
pub fn wire_logprob(logprob: f32) -> f32 {
    if logprob.is_finite() {
        logprob
    } else {
        -9999.0
    }
}
