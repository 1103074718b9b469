//! What one step runs, in the delta form the `Step` stream carries (`worker.proto`):
//! sequences to forget, sequences starting with their full block table, block ids
//! appended to known sequences, and the runs themselves. Workers keep each sequence's
//! table between steps, so a decode step sends a few ids instead of every table.
//!
//! [`TableMirror`] is the receiving side: it applies deltas the way a worker must (forget
//! `finished` first, then start `new_seqs`, then `appends`) and yields the full tables; the
//! scheduler's own full view is [`crate::scheduler::Scheduler::chunks`]. Tests check the
//! two agree step by step.

use std::collections::HashMap;

use crate::error::DeltaError;

/// A sequence the worker has not seen (new, or re-admitted after a preemption).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewSeq {
    /// The sequence.
    pub seq_id: u64,
    /// Its whole block table so far.
    pub block_table: Vec<u32>,
    /// Tokens generated before a preemption (empty for a fresh sequence); they are also
    /// re-run as prefill, this tells the sampler's penalties they were output.
    pub prior_output: Vec<u32>,
}

/// Blocks appended to a known sequence's table since the worker last saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockAppend {
    /// The sequence, known to the worker.
    pub seq_id: u64,
    /// Ids to append to its table, in order.
    pub block_ids: Vec<u32>,
}

/// One sequence's work in a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqRun {
    /// The sequence, known to the worker once this step's deltas are applied.
    pub seq_id: u64,
    /// Token ids to run, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Position of `tokens[0]`; earlier positions are in the KV cache.
    pub first_pos: usize,
    /// Logits wanted, one token to sample after the last: true for decodes and for the
    /// chunk that completes a (re)prefill, false for earlier prefill chunks.
    pub sample: bool,
    /// The tokens are (re)prefill, known at admission, rather than a decode of the token
    /// sampled in the previous step.
    pub is_prompt: bool,
    /// A lookahead decode: `tokens` is empty and the one token run is the one the worker
    /// samples for this sequence in the step before (still executing when this was built).
    pub from_previous: bool,
}

impl SeqRun {
    /// Tokens this run computes (a lookahead decode's one is not in `tokens`).
    pub fn num_tokens(&self) -> usize {
        tessera_proto::run_tokens(self.tokens.len(), self.from_previous)
    }
}

/// A step for the workers. Apply in this order: `finished`, `new_seqs`, `appends`, then
/// run `runs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScheduledBatch {
    /// Increases by one per step.
    pub step_id: u64,
    /// Sequences whose worker state can be dropped: finished, aborted or preempted since
    /// the previous step.
    pub finished: Vec<u64>,
    /// Sequences starting in this step.
    pub new_seqs: Vec<NewSeq>,
    /// Blocks added to sequences the worker already knows.
    pub appends: Vec<BlockAppend>,
    /// The work, decodes and prefill chunks mixed, in scheduling order.
    pub runs: Vec<SeqRun>,
}

impl ScheduledBatch {
    /// Tokens run in this step (what the token budget limits).
    pub fn num_tokens(&self) -> usize {
        self.runs.iter().map(SeqRun::num_tokens).sum()
    }

    /// Runs that sample a token; the worker's reply has one output per run, in this order.
    pub fn num_samples(&self) -> usize {
        self.runs.iter().filter(|r| r.sample).count()
    }
}

/// The full-table view of one run: what a forward pass needs (cf. the worker's `SeqChunk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkView<'a> {
    /// The sequence.
    pub seq_id: u64,
    /// Token ids to run, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`.
    pub first_pos: usize,
    /// The sequence's whole block table, covering at least `first_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Sample a token after the last one (logits of the last row only).
    pub sample: bool,
}

/// Per-sequence block tables rebuilt from step deltas, as a worker keeps them.
#[derive(Debug, Clone, Default)]
pub struct TableMirror {
    tables: HashMap<u64, Vec<u32>>,
}

impl TableMirror {
    /// No sequences known.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies a step's deltas: forgets `finished`, starts `new_seqs`, extends `appends`,
    /// then checks every run names a known sequence.
    pub fn apply(&mut self, batch: &ScheduledBatch) -> Result<(), DeltaError> {
        for id in &batch.finished {
            self.tables.remove(id).ok_or(DeltaError::UnknownSequence(*id))?;
        }
        for s in &batch.new_seqs {
            if self.tables.insert(s.seq_id, s.block_table.clone()).is_some() {
                return Err(DeltaError::AlreadyKnown(s.seq_id));
            }
        }
        for a in &batch.appends {
            self.tables.get_mut(&a.seq_id).ok_or(DeltaError::UnknownSequence(a.seq_id))?.extend(&a.block_ids);
        }
        match batch.runs.iter().find(|r| !self.tables.contains_key(&r.seq_id)) {
            Some(r) => Err(DeltaError::UnknownSequence(r.seq_id)),
            None => Ok(()),
        }
    }

    /// The table of sequence `id`, if known.
    pub fn table(&self, id: u64) -> Option<&[u32]> {
        self.tables.get(&id).map(Vec::as_slice)
    }

    /// Number of sequences known.
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    /// True when no sequence is known.
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}
