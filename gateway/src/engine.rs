//! The gateway's view of whatever generates tokens: the `Engine` trait and the messages that
//! cross it. Only token ids cross (DESIGN.md: text never leaves the gateway). The gRPC client
//! to the coordinator implements this trait; tests use `testing::FakeEngine`.
//!
//! Contract:
//! - `generate` admits one sequence and returns the receiving end of its event channel, or an
//!   error at once when the engine cannot take it (overloaded, unavailable, bad request).
//! - Events arrive in order: at most one `PromptInfo` (before the first token), then `Token`s,
//!   then exactly one `Finished` or one `Error`, after which the sender is dropped.
//! - Every sampled token is sent as a `Token`, including the one that ended the sequence
//!   (an id from `stop_token_ids`); the gateway leaves that one out of the text.
//! - **Dropping the receiver means the client went away** (or the gateway matched a stop string
//!   and needs no more tokens): the engine must abort the sequence and free its KV blocks at
//!   its next step. It notices through a failed send or `Sender::closed()`.

use futures::future::BoxFuture;
use tokio::sync::mpsc;

/// The events of one sequence, in the order the engine produced them.
pub type EventStream = mpsc::Receiver<EngineEvent>;

/// How to sample one sequence; already validated and resolved by the gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingSpec {
    /// 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// `None` = off.
    pub top_k: Option<u32>,
    /// In [0, 1]; 0 = off.
    pub min_p: f32,
    /// vLLM's multiplicative penalty, > 0; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI's additive penalties in [-2, 2]; 0 = off.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// (token id, bias added to its logit), ids < vocab size, biases in [-100, 100], sorted by id.
    pub logit_bias: Vec<(u32, f32)>,
    /// `None` = the engine picks a random seed.
    pub seed: Option<u64>,
    /// Completion tokens at most, >= 1; prompt + this fits the model's context.
    pub max_tokens: u32,
    /// vLLM's `min_tokens`: until the sequence has this many completion tokens the engine
    /// never samples one of `stop_token_ids` (and the gateway matches no stop string).
    /// 0 = off; at most `max_tokens` when the request gave that.
    pub min_tokens: u32,
    /// The complete set of ids that end the sequence, sorted and deduplicated: the request's
    /// `stop_token_ids` plus the model's end-of-sequence ids unless `ignore_eos`. The engine
    /// stops on exactly these (and `max_tokens`) and adds none of its own.
    pub stop_token_ids: Vec<u32>,
    /// Whether the model's EOS ids were left out of `stop_token_ids` (for logs and metrics).
    pub ignore_eos: bool,
    /// `Some(k)`: send each sampled token's logprob plus the `k` most likely alternatives.
    pub logprobs: Option<u32>,
    /// Constrained decoding (structured outputs): the grammar the output must follow, already
    /// compile-checked by the gateway. `None` = free sampling.
    pub constraint: Option<Constraint>,
}

/// A grammar for constrained decoding, passed unchanged to the worker that samples
/// (`tessera.worker.v1.Constraint`); the gateway checks it compiles first.
pub use tessera_constrain::Constraint;

/// One sequence to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// Unique per sequence: the response id plus the choice index (`chatcmpl-…-1`).
    pub request_id: String,
    pub prompt_ids: Vec<u32>,
    pub params: SamplingSpec,
}

/// Why a sequence ended, as the engine saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A token from `stop_token_ids` was sampled.
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The engine gave the sequence up (shutdown, its worker was lost without a replacement).
    Abort,
    /// The engine failed while running it.
    Error,
}

/// What the engine reports about one sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// How many prompt tokens were served from the prefix cache.
    PromptInfo { cached_tokens: u32 },
    /// A sampled token; `logprob` and `top` (id, logprob; most likely first) when requested.
    Token { id: u32, logprob: Option<f32>, top: Vec<(u32, f32)> },
    /// The end of the sequence; the counts are the engine's (the gateway keeps its own too).
    Finished { reason: FinishReason, prompt_tokens: u32, completion_tokens: u32 },
    /// The sequence failed; nothing follows.
    Error(EngineError),
}

/// Why the engine could not take or finish a sequence. Mapped to HTTP once, in `error.rs`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// Queues are full: try again later (HTTP 429).
    #[error("the engine is overloaded; retry in {retry_after_s} s")]
    Overloaded { retry_after_s: u32 },
    /// No replica can serve now (starting, failing over) (HTTP 503).
    #[error("the engine is unavailable; retry in {retry_after_s} s")]
    Unavailable { retry_after_s: u32 },
    /// The engine rejected the request's contents (HTTP 400).
    #[error("{0}")]
    InvalidRequest(String),
    /// Anything else (HTTP 500 with a generic message; the detail goes to the log).
    #[error("engine error: {0}")]
    Internal(String),
}

/// Something that generates tokens for sequences. Shared by all requests: `Arc<dyn Engine>`.
pub trait Engine: Send + Sync + 'static {
    /// Admits one sequence; see the module documentation for the event contract.
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, EngineError>>;

    /// Whether the engine can take requests now (`GET /ready`).
    fn ready(&self) -> bool;

    /// The engine's latest load figures, if it reports any (`GET /metrics`).
    fn stats(&self) -> Option<EngineStats> {
        None
    }
}

/// Load figures of the engine behind the gateway, summed over its replicas.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Sequences in the running set.
    pub running: u32,
    /// Sequences waiting for admission.
    pub waiting: u32,
    /// KV blocks in use and in total.
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
}
