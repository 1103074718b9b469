//! The knobs of one replica's scheduler. Names follow vLLM's engine arguments where one
//! exists, so an operator's intuition carries over.

use crate::error::ConfigError;

/// Most KV blocks a replica's pool may have. The block manager keeps ~70 bytes of state
/// per block, allocated up front from the count the workers report, so a worker reporting
/// a wild count (up to `u32::MAX`) must be refused rather than abort the coordinator on
/// hundreds of GB. 2^24 blocks (~1.2 GB of that state) is far above any real pool: an
/// H200's 141 GB holds ~0.4 M blocks of 16 positions of the smallest supported model
/// (SmolLM2-135M, 23 KB of K/V per position). Also below `u32::MAX`, which block ids
/// travel as and which is reserved.
pub const MAX_BLOCKS: usize = 1 << 24;

/// Limits the scheduler works within.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences in the running set (and so in one step).
    pub max_num_seqs: usize,
    /// Token budget of one step: prefill chunk tokens plus one per decode.
    pub max_num_batched_tokens: usize,
    /// Most sequences waiting for admission; `add` refuses more (overload, 429/503).
    pub max_waiting: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// KV blocks of the replica (what the workers allocated).
    pub num_blocks: usize,
    /// Longest sequence (prompt + output) the model serves.
    pub max_model_len: usize,
    /// Largest prefill chunk of one sequence in one step; 0 means only the token budget
    /// limits it. Lower values let several long prompts progress side by side.
    pub long_prefill_threshold: usize,
    /// Batches executing at once (over disjoint sequences). 1 for one worker; a pipeline
    /// of P stages keeps P in flight so every stage has work.
    pub max_in_flight: usize,
    /// Decode lookahead (a replica without pipeline stages): while a step runs, the next one may
    /// already decode its sampling sequences once more, on the token the worker is
    /// sampling for them now (`SeqRun::from_previous`), so the worker starts it as soon as
    /// it finishes the first instead of waiting for the coordinator's round trip. Needs
    /// `max_in_flight >= 2`.
    pub lookahead: bool,
    /// Bytes a step's newly admitted sequences may add to its message: each new sequence
    /// carries its sampling parameters (a structured-output constraint can be 1 MiB) and
    /// its cached and generated tokens. Admission stops before a sequence that would pass
    /// it (the first of a step always goes), so a step stays well inside the gRPC message
    /// limit (`tessera_proto::MAX_MESSAGE_BYTES`, 64 MiB) however many such requests
    /// arrive together; the rest wait for the next step.
    pub max_step_new_bytes: usize,
}

/// Default of [`SchedulerConfig::max_step_new_bytes`]: half the gRPC message limit, the
/// other half left to the step's runs and block tables.
pub const DEFAULT_STEP_NEW_BYTES: usize = 32 << 20;

impl SchedulerConfig {
    /// A config for a pool of `num_blocks` blocks of `block_size` positions and a model of
    /// `max_model_len` context, with vLLM-like defaults for the rest: 256 sequences,
    /// 2048 tokens per step, 4096 waiting, chunks limited only by the budget.
    pub fn new(block_size: usize, num_blocks: usize, max_model_len: usize) -> Self {
        SchedulerConfig {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_waiting: 4096,
            block_size,
            num_blocks,
            max_model_len,
            long_prefill_threshold: 0,
            max_in_flight: 1,
            lookahead: false,
            max_step_new_bytes: DEFAULT_STEP_NEW_BYTES,
        }
    }

    /// Checks that the limits can work together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("max_num_seqs", self.max_num_seqs),
            ("max_in_flight", self.max_in_flight),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_model_len", self.max_model_len),
            ("max_step_new_bytes", self.max_step_new_bytes),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.num_blocks > MAX_BLOCKS {
            return Err(ConfigError::TooManyBlocks(self.num_blocks));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(ConfigError::BudgetBelowSeqs { budget: self.max_num_batched_tokens, seqs: self.max_num_seqs });
        }
        Ok(())
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}
