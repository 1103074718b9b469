//! Read-only views of the scheduler: the full-table view of a batch, counters for
//! metrics, and the consistency check the tests run after every step.

use std::collections::{HashMap, HashSet};

use super::Scheduler;
use crate::batch::{ChunkView, ScheduledBatch, SeqRun};
use crate::block_manager::BlockManager;
use crate::config::SchedulerConfig;
use crate::sequence::{FinishReason, SeqStatus, Sequence};

/// A snapshot of the scheduler's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Sequences in the running set.
    pub running: usize,
    /// Sequences waiting, preempted ones included.
    pub waiting: usize,
    /// Blocks held by at least one sequence.
    pub used_blocks: usize,
    /// Blocks neither held nor cached.
    pub free_blocks: usize,
    /// Unheld blocks kept for their cached prefix.
    pub evictable_blocks: usize,
    /// Blocks in the prefix cache, held or not.
    pub cached_blocks: usize,
    /// Preemptions since start.
    pub preemptions: u64,
    /// Steps scheduled since start.
    pub steps: u64,
    /// Tokens looked up in the prefix cache at admissions.
    pub prefix_query_tokens: u64,
    /// Of those, tokens served from cached blocks.
    pub prefix_hit_tokens: u64,
}

impl Scheduler {
    /// The full-table view of `batch`'s runs, borrowing the live tables (valid until the
    /// next `schedule`). Runs of sequences no longer live are skipped.
    pub fn chunks<'a>(&'a self, batch: &'a ScheduledBatch) -> Vec<ChunkView<'a>> {
        let view = |r: &'a SeqRun| {
            let seq = self.seqs.get(&r.seq_id)?;
            let (seq_id, first_pos, sample) = (r.seq_id, r.first_pos, r.sample);
            Some(ChunkView { seq_id, tokens: &r.tokens, first_pos, block_table: &seq.block_table, sample })
        };
        batch.runs.iter().filter_map(view).collect()
    }

    /// Whether any sequence is waiting, running or in flight.
    /// Whether a scheduled batch still awaits `postprocess`.
    pub fn has_in_flight(&self) -> bool {
        !self.in_flight.is_empty()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.in_flight.is_empty()
    }

    /// A live sequence.
    pub fn get(&self, id: u64) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// The config in use.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The block pool (read only).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// Sequences in the running set.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Ids of the running sequences, oldest admission first.
    pub fn running_ids(&self) -> &[u64] {
        &self.running
    }

    /// Sequences waiting (including preempted ones).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Blocks held by live sequences.
    pub fn num_used_blocks(&self) -> usize {
        self.blocks.num_used()
    }

    /// Preemptions since start.
    pub fn num_preemptions(&self) -> u64 {
        self.preemptions
    }

    /// All counters at once.
    pub fn stats(&self) -> SchedulerStats {
        let cache = self.blocks.stats();
        SchedulerStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_blocks: self.blocks.num_used(),
            free_blocks: self.blocks.num_free(),
            evictable_blocks: self.blocks.num_evictable(),
            cached_blocks: self.blocks.num_cached(),
            preemptions: self.preemptions,
            steps: self.next_step,
            prefix_query_tokens: cache.query_tokens,
            prefix_hit_tokens: cache.hit_tokens,
        }
    }

    /// Checks the scheduler's and the pool's invariants; for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut seen = HashSet::new();
        for (&id, want_running) in
            self.running.iter().map(|id| (id, true)).chain(self.waiting.iter().map(|id| (id, false)))
        {
            let seq = self.seqs.get(&id).ok_or(format!("queued sequence {id} is not live"))?;
            // An executing sequence may have been aborted meanwhile: the batch's
            // postprocess frees it.
            let aborted_in_flight = seq.in_flight > 0 && seq.status == SeqStatus::Finished(FinishReason::Aborted);
            let ok = if want_running {
                (seq.status == SeqStatus::Running || aborted_in_flight)
                    && seq.num_computed < seq.len()
                    && seq.block_table.len() >= self.cfg.blocks_for(seq.num_computed)
            } else {
                matches!(seq.status, SeqStatus::Waiting | SeqStatus::Preempted)
                    && seq.block_table.is_empty()
                    && seq.num_computed == 0
            };
            if !ok || !seen.insert(id) {
                return Err(format!("sequence {id} is inconsistent or queued twice: {seq:?}"));
            }
        }
        if seen.len() != self.seqs.len() || self.running.len() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} live sequences, {} queued, {} running",
                self.seqs.len(),
                seen.len(),
                self.running.len()
            ));
        }
        // Each sequence counts the executing batches it is in: one, or two with a lookahead
        // decode, never twice in one batch.
        let mut executing: HashMap<u64, u8> = HashMap::new();
        for batch in &self.in_flight {
            let mut here = HashSet::new();
            for &(id, _) in batch {
                if !here.insert(id) {
                    return Err(format!("sequence {id} is twice in one executing batch"));
                }
                *executing.entry(id).or_default() += 1;
            }
        }
        let limit = if self.cfg.lookahead { 2 } else { 1 };
        if let Some((id, _)) = self.seqs.iter().find(|(id, s)| {
            let n = executing.get(id).copied().unwrap_or(0);
            s.in_flight != n || n > limit
        }) {
            return Err(format!("sequence {id}'s in-flight count disagrees with the executing batches"));
        }
        let tables: Vec<&[u32]> =
            self.running.iter().filter_map(|id| self.seqs.get(id)).map(|s| &s.block_table[..]).collect();
        self.blocks.check_invariants(&tables)
    }
}
