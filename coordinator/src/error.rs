//! Errors of the coordinator core: a bad scheduler config, a request that cannot be
//! admitted (the caller maps these to HTTP once, at the gateway edge), the block pool
//! running dry, and a step delta that does not fit the worker-side tables it updates.

/// A [`crate::config::SchedulerConfig`] that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A size that must be at least one is zero.
    #[error("scheduler config: {0} must be at least 1")]
    Zero(&'static str),
    /// More blocks than the block manager keeps state for ([`crate::config::MAX_BLOCKS`]).
    #[error("scheduler config: num_blocks {0} is too large (at most {max})", max = crate::config::MAX_BLOCKS)]
    TooManyBlocks(usize),
    /// Every running sequence must be able to decode in the same step.
    #[error(
        "scheduler config: max_num_batched_tokens ({budget}) must be at least max_num_seqs ({seqs}) \
         so every running sequence can decode in one step"
    )]
    BudgetBelowSeqs { budget: usize, seqs: usize },
}

/// Why [`crate::scheduler::Scheduler::add`] refused a sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The waiting queue is full: overload, worth retrying later (HTTP 429 or 503).
    #[error("server overloaded: {max_waiting} requests are already waiting")]
    QueueFull { max_waiting: usize },
    /// A prompt with no tokens has nothing to compute logits from.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` of zero would finish before doing anything.
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    /// The prompt alone exceeds the model's context.
    #[error("prompt has {len} tokens, more than the maximum context length of {max_model_len}")]
    PromptTooLong { len: usize, max_model_len: usize },
    /// Even alone on the replica, the sequence would outgrow the KV memory.
    #[error(
        "the request needs up to {needed_blocks} KV blocks ({tokens} tokens), more than the \
         {num_blocks} blocks this replica has; shorten the prompt or max_tokens"
    )]
    ExceedsKvCapacity { tokens: usize, needed_blocks: usize, num_blocks: usize },
    /// Sequence ids are chosen by the caller and must be unique among live sequences.
    #[error("sequence id {0} is already in use")]
    DuplicateId(u64),
}

impl AdmissionError {
    /// True when the request itself is fine and the refusal is about load (queue full):
    /// the caller should answer 429/503 rather than 400.
    pub fn is_overload(&self) -> bool {
        matches!(self, AdmissionError::QueueFull { .. })
    }
}

/// The block pool cannot satisfy a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// Not enough free or evictable blocks; nothing was changed.
    #[error("out of KV blocks: need {needed}, {available} available")]
    OutOfBlocks { needed: usize, available: usize },
}

/// A step delta that does not match the tables it is applied to (see
/// [`crate::batch::TableMirror`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeltaError {
    /// Blocks appended to, or a run of, a sequence the receiver does not know.
    #[error("step delta names unknown sequence {0}")]
    UnknownSequence(u64),
    /// A new sequence whose id the receiver still holds.
    #[error("step delta starts sequence {0}, which is already known")]
    AlreadyKnown(u64),
}
