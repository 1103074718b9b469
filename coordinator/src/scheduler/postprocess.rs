//! The second half of a step: the workers' sampled tokens come back, KV is counted as
//! computed, newly full blocks enter the prefix cache, stop conditions are applied and
//! finished sequences release their blocks. Also the ways a sequence ends early: `abort`
//! (client gone) and `fail_all` (replica lost).
//!
//! A sequence that ends while its lookahead decode still executes (scheduler.rs) is freed at
//! once all the same: that batch writes only the KV slot after its last token, in a block
//! no other sequence can be given before a later batch, which the workers run after it; its
//! token is dropped when the batch comes back (the sequence is gone by then).

use super::Scheduler;
use crate::sequence::{FinishReason, SeqStatus};

/// A token sampled by the worker for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutput {
    /// The sequence the token belongs to.
    pub seq_id: u64,
    /// The sampled token id.
    pub token: u32,
}

/// What happened to one sequence in a step, for the caller to stream out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqUpdate {
    /// The sequence.
    pub seq_id: u64,
    /// The new token; `None` when the step failed for this sequence.
    pub token: Option<u32>,
    /// Set when the sequence ended with this update.
    pub finished: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache (usage reports).
    pub num_cached_prompt: usize,
}

impl Scheduler {
    /// Consumes the oldest executing batch's sampled tokens (one per run with `sample`, normally
    /// in run order; matched by id otherwise). Advances KV, caches newly full blocks,
    /// appends tokens, applies stop conditions and frees finished and aborted sequences.
    /// A run that should have sampled but has no output ends with `FinishReason::Error`.
    pub fn postprocess(&mut self, out: &[StepOutput]) -> Vec<SeqUpdate> {
        let Some(flight) = self.in_flight.pop_front() else { return Vec::new() };
        let mut updates = Vec::with_capacity(out.len());
        let mut cursor = 0;
        let mut ended = false;
        for (id, n) in flight {
            // Gone: ended by the batch before (a lookahead decode's token is dropped).
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            seq.in_flight = seq.in_flight.saturating_sub(1);
            if seq.status == SeqStatus::Finished(FinishReason::Aborted) {
                cursor += usize::from(out.get(cursor).is_some_and(|o| o.seq_id == id));
                self.finish(id);
                ended = true;
                continue;
            }
            seq.num_computed += n;
            seq.cache_computed_blocks(&mut self.blocks);
            if seq.num_computed < seq.len() {
                continue; // a prefill chunk that does not complete the prompt
            }
            let token = match out.get(cursor) {
                Some(o) if o.seq_id == id => {
                    cursor += 1;
                    Some(o.token)
                }
                _ => out.iter().find(|o| o.seq_id == id).map(|o| o.token),
            };
            let finished = match token {
                Some(t) => {
                    seq.push_output(t);
                    seq.check_stop(self.cfg.max_model_len)
                }
                None => Some(FinishReason::Error),
            };
            updates.push(SeqUpdate { seq_id: id, token, finished, num_cached_prompt: seq.num_cached_prompt });
            if finished.is_some() {
                self.finish(id);
                ended = true;
            }
        }
        if ended {
            self.running.retain(|id| self.seqs.contains_key(id));
        }
        updates
    }

    /// Ends `id`: frees its blocks, forgets it, tells the workers. Queues are the caller's.
    fn finish(&mut self, id: u64) {
        if let Some(mut seq) = self.seqs.remove(&id) {
            self.blocks.free(&mut seq.block_table);
            if seq.worker_known {
                self.released.push(id);
            }
        }
    }

    /// Cancels a sequence (client gone). Its blocks are freed now, or by the next
    /// `postprocess` if it is in the executing batch. Returns whether it was live.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(seq) = self.seqs.get_mut(&id) else { return false };
        if seq.in_flight > 0 {
            seq.status = SeqStatus::Finished(FinishReason::Aborted);
            return true;
        }
        match seq.status {
            SeqStatus::Running => self.running.retain(|&r| r != id),
            _ => self.waiting.retain(|&w| w != id),
        }
        self.finish(id);
        true
    }

    /// Ends every sequence with `FinishReason::Error` (the replica's workers are gone):
    /// frees all blocks, forgets the executing batch and what the workers were to drop.
    pub fn fail_all(&mut self) -> Vec<SeqUpdate> {
        let ids: Vec<u64> = self.running.drain(..).chain(self.waiting.drain(..)).collect();
        let updates = ids
            .iter()
            .filter_map(|&id| self.seqs.get(&id).map(|s| (id, s.num_cached_prompt)))
            .map(|(seq_id, cached)| SeqUpdate {
                seq_id,
                token: None,
                finished: Some(FinishReason::Error),
                num_cached_prompt: cached,
            })
            .collect();
        for id in ids {
            self.finish(id);
        }
        self.seqs.clear();
        self.in_flight.clear();
        self.released.clear();
        updates
    }
}
