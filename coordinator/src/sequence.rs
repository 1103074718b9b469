//! One request's state as the scheduler sees it: token ids (prompt, then output), how many
//! of them have KV in the cache, its block table, and when it must stop.
//!
//! Prompt and output live in one buffer (`tokens`, the first `prompt_len` of which are the
//! prompt), because a chunk to run can span both: after a preemption the generated tokens
//! are re-prefilled together with the prompt. Everything here is step-agnostic; the
//! scheduler decides what runs.

use crate::block_manager::BlockManager;
use crate::prefix_hash;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Sampled an EOS id (unless `ignore_eos`) or one of its stop ids.
    Stop,
    /// Reached `max_tokens`, or the model's context length.
    Length,
    /// Cancelled by the caller (client disconnect).
    Aborted,
    /// The step that ran it failed (worker error, missing output).
    Error,
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    /// Queued, never admitted.
    Waiting,
    /// Admitted: holds blocks, gets work every step the budget allows.
    Running,
    /// Evicted from the running set under KV pressure; queued again, will recompute.
    Preempted,
    /// Done; its blocks are released.
    Finished(FinishReason),
}

/// When to stop generating, decided by the coordinator after each sampled token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopCriteria {
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// The model's end-of-sequence ids; ignored when `ignore_eos`.
    pub eos_ids: Vec<u32>,
    /// Extra ids that end the sequence (always honoured).
    pub stop_ids: Vec<u32>,
    /// Keep generating through EOS (benchmarks).
    pub ignore_eos: bool,
}

impl StopCriteria {
    /// Stop after `max_tokens` or at one of `eos_ids`.
    pub fn new(max_tokens: usize, eos_ids: Vec<u32>) -> Self {
        StopCriteria { max_tokens, eos_ids, stop_ids: Vec::new(), ignore_eos: false }
    }
}

/// The prefix-cache bookkeeping of one sequence (see `block_manager`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixChain {
    /// Chained hash of each full block of the sequence's tokens, `[len / block_size]`.
    /// Depends only on the tokens, so it survives preemption.
    pub hashes: Vec<u64>,
    /// Leading blocks of the current table already offered to the cache.
    pub registered: usize,
    /// Cache entry that stands for the prefix through block `registered - 1` (the parent
    /// link of the next block to register); `None` at the start of the chain.
    pub tail: Option<u64>,
}

impl PrefixChain {
    /// Forgets the registration progress (the table was freed); keeps the hashes.
    pub fn reset(&mut self) {
        self.registered = 0;
        self.tail = None;
    }
}

/// A request being served.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Caller-chosen id, unique among live sequences.
    pub id: u64,
    /// Prompt then output token ids.
    tokens: Vec<u32>,
    /// Number of prompt tokens at the start of `tokens`.
    prompt_len: usize,
    /// Where the sequence is in its life.
    pub status: SeqStatus,
    /// Tokens whose KV is in the cache (positions `0..num_computed`).
    pub num_computed: usize,
    /// Prompt tokens served from the prefix cache at first admission (for usage reports).
    pub num_cached_prompt: usize,
    /// KV block ids; position `p` lives in block `block_table[p / block_size]`.
    pub block_table: Vec<u32>,
    /// When to stop.
    pub stop: StopCriteria,
    /// Caller's arrival tick (any monotonic clock); informational, order is FIFO by `add`.
    pub arrival: u64,
    /// Times this sequence was preempted.
    pub num_preemptions: u32,
    /// Prefix-cache hashes and registration progress.
    pub prefix: PrefixChain,
    /// `len()` when the sequence was last admitted: positions before it are (re)prefill,
    /// positions from it on are decodes.
    pub(crate) prefill_len: usize,
    /// Whether the worker holds state for this sequence (it has been sent as new).
    pub(crate) worker_known: bool,
    /// Leading entries of `block_table` the worker has been sent.
    pub(crate) blocks_sent: usize,
    /// Executing batches this sequence is part of (2 with a lookahead decode in flight).
    pub(crate) in_flight: u8,
    /// Bytes its first step message carries besides tokens and block ids (its sampling
    /// parameters); see [`SchedulerConfig::max_step_new_bytes`](crate::config::SchedulerConfig).
    pub wire_bytes: usize,
}

impl Sequence {
    /// A waiting sequence for `prompt`. `arrival` is the caller's tick.
    pub fn new(id: u64, prompt: Vec<u32>, stop: StopCriteria, arrival: u64) -> Self {
        let prompt_len = prompt.len();
        Sequence {
            id,
            tokens: prompt,
            prompt_len,
            status: SeqStatus::Waiting,
            num_computed: 0,
            num_cached_prompt: 0,
            block_table: Vec::new(),
            stop,
            arrival,
            num_preemptions: 0,
            prefix: PrefixChain::default(),
            prefill_len: 0,
            worker_known: false,
            blocks_sent: 0,
            in_flight: 0,
            wire_bytes: 0,
        }
    }

    /// The same sequence, declaring `bytes` of sampling parameters for its first step
    /// message.
    pub fn with_wire_bytes(mut self, bytes: usize) -> Self {
        self.wire_bytes = bytes;
        self
    }

    /// What admitting this sequence adds to a step message, at most: its sampling
    /// parameters, its tokens twice (the prefix-cache hits and the prior output it is sent
    /// with are both parts of them) and a block id per `block_size` positions, 4 bytes
    /// each, plus framing.
    pub(crate) fn admission_bytes(&self, block_size: usize) -> usize {
        let len = self.len();
        self.wire_bytes.saturating_add(4 * (2 * len + len.div_ceil(block_size.max(1)))).saturating_add(64)
    }

    /// Total tokens: prompt plus output.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// True for a sequence with no tokens at all (never admitted: `add` refuses it).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Prompt then output token ids.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The prompt's token ids.
    pub fn prompt(&self) -> &[u32] {
        &self.tokens[..self.prompt_len]
    }

    /// Generated token ids so far.
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Number of prompt tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt_len
    }

    /// Tokens still to run before the next token can be sampled: the rest of the prompt
    /// (or of the re-prefill after a preemption), or 1 for a decode.
    pub fn remaining(&self) -> usize {
        self.len().saturating_sub(self.num_computed)
    }

    /// Prefill tokens still to run (0 once the sequence decodes).
    pub fn remaining_prefill(&self) -> usize {
        self.prefill_len.saturating_sub(self.num_computed)
    }

    /// Whether the next run of this sequence is a single decode token.
    pub fn is_decoding(&self) -> bool {
        self.status == SeqStatus::Running && self.num_computed >= self.prefill_len && self.remaining() == 1
    }

    /// Whether a lookahead decode may follow the one executing batch of this running
    /// sequence: that batch runs its decode (which samples the next token), and neither
    /// that token nor the lookahead's can end it by length.
    pub(crate) fn lookahead_ok(&self, max_model_len: usize) -> bool {
        self.status == SeqStatus::Running
            && self.in_flight == 1
            && self.remaining() == 1
            && self.num_computed >= self.prefill_len
            && self.output().len() + 2 <= self.stop.max_tokens
            && self.len() + 2 <= max_model_len
    }

    /// Whether the sequence has ended.
    pub fn is_finished(&self) -> bool {
        matches!(self.status, SeqStatus::Finished(_))
    }

    /// Appends a sampled token.
    pub fn push_output(&mut self, token: u32) {
        self.tokens.push(token);
    }

    /// Brings the prefix hashes up to date with the tokens.
    pub fn update_hashes(&mut self, block_size: usize) {
        prefix_hash::extend_chain(&mut self.prefix.hashes, &self.tokens, block_size);
    }

    /// Registers this sequence's newly completed full blocks in the prefix cache.
    pub fn cache_computed_blocks(&mut self, blocks: &mut BlockManager) {
        self.update_hashes(blocks.block_size());
        blocks.cache_full_blocks(&self.block_table, &self.tokens, &mut self.prefix, self.num_computed);
    }

    /// Whether the last output token ends the sequence, given the model's context length.
    /// A stop id wins over a length limit reached by the same token.
    pub fn check_stop(&self, max_model_len: usize) -> Option<FinishReason> {
        let out = self.output();
        let last = *out.last()?;
        if self.stop.stop_ids.contains(&last) || (!self.stop.ignore_eos && self.stop.eos_ids.contains(&last)) {
            return Some(FinishReason::Stop);
        }
        if out.len() >= self.stop.max_tokens || self.len() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Most positions whose KV this sequence can ever need: the whole prompt, and every
    /// token but the last of the longest output [`check_stop`](Self::check_stop) allows
    /// (the last sampled token is never run).
    pub fn max_kv_len(&self, max_model_len: usize) -> usize {
        let longest = self.prompt_len.saturating_add(self.stop.max_tokens).min(max_model_len);
        longest.saturating_sub(1).max(self.prompt_len)
    }
}
