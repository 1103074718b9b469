//! Continuous batching for one model replica: which sequences run in the next step, with
//! how many tokens each, and what happens after the step's tokens come back.
//!
//! Policy (after vLLM v1; nano-vllm for the shape):
//! - A step has a token budget (`max_num_batched_tokens`) and a sequence cap
//!   (`max_num_seqs`). A sequence's work is always "its next `n` tokens": a prompt, the
//!   rest of a chunked prompt, a re-prefill after preemption, or one decode token. Only
//!   the run that reaches the end of the known tokens samples.
//! - **Running sequences first**, in admission order. Every running decode gets its one
//!   token: budget for all decodes is reserved before any prefill chunk is sized, so a
//!   long prompt never stalls them. Running prefills take their next chunk from what is
//!   left (capped by `long_prefill_threshold` when set).
//! - When a running sequence needs a block and none is left, a prefill chunk first shrinks
//!   to the blocks there are; otherwise the **most recently admitted** running sequence is
//!   preempted (recompute: its blocks are freed, often staying cached, and it goes back
//!   to the head of the waiting queue to re-prefill prompt + output) and allocation is
//!   retried. A sequence may preempt itself when it is the newest, or when every newer one
//!   is still executing (pipelined or lookahead batches are never victims), the oldest
//!   included; `add` refuses anything that cannot fit alone, so a preempted sequence can
//!   always be re-admitted once the others' blocks return.
//! - **Then waiting sequences**, strictly FIFO, while the budget, the sequence cap, the
//!   blocks and the step message's room for new sequences (`max_step_new_bytes`: their
//!   sampling parameters and tokens) allow; the head waits if it does not fit (no skipping
//!   ahead). Admission reuses the longest cached prefix. Nothing is admitted in a step that
//!   preempted, and admission never preempts.
//! - At most `max_in_flight` batches execute at once (1 unless the replica is a pipeline,
//!   whose stages each work on a different batch, or 2 with decode lookahead): `schedule`
//!   returns `None` while that many await `postprocess`, and never picks a sequence whose
//!   previous batch is still executing (its next token is unknown and its blocks are being
//!   written) except for a lookahead decode (below), nor preempts one. `postprocess`
//!   consumes batches in the order they were scheduled. KV counts as
//!   computed, and full blocks enter the prefix cache, only in `postprocess`, after the
//!   step really ran.
//! - Decode lookahead (`lookahead`, a replica without pipeline stages, `max_in_flight` 2): a
//!   sequence executing the run that samples its next token may also get the run after it
//!   in the next batch, on that token (the worker fills it in), if its KV slot can be had
//!   without preempting and the token cannot be its last (`max_tokens`, `max_model_len`);
//!   only while the pool has a free block per running sequence and nothing was preempted
//!   earlier in the step, since an executing sequence cannot be preempted.
//!   So the worker holds the next step when it finishes one. When the executing step
//!   ends the sequence (a stop id, an abort), the lookahead's token is dropped.
//! - Stop conditions (EOS/stop ids unless `ignore_eos`, `max_tokens`, `max_model_len`)
//!   are decided in `postprocess`.
//! - `abort` frees a sequence's blocks at once, unless it is in the batch executing now:
//!   then it is marked aborted and its blocks are freed by the next `postprocess` (the
//!   workers may still be writing them), which emits no token for it.

use std::collections::{HashMap, VecDeque};

use crate::batch::{BlockAppend, NewSeq, ScheduledBatch, SeqRun};
use crate::block_manager::BlockManager;
use crate::config::SchedulerConfig;
use crate::error::{AdmissionError, ConfigError};
use crate::prefix_hash::BuildU64Hasher;
use crate::sequence::{SeqStatus, Sequence};

mod inspect;
mod postprocess;

pub use inspect::SchedulerStats;
pub use postprocess::{SeqUpdate, StepOutput};

/// The scheduler of one replica. Plain data: an async loop owns it and talks to workers.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    blocks: BlockManager,
    seqs: HashMap<u64, Sequence, BuildU64Hasher>,
    /// Waiting and preempted sequences, admission order (preempted ones at the front).
    waiting: VecDeque<u64>,
    /// Running sequences in admission order; the last is preempted first.
    running: Vec<u64>,
    /// The executing batches, oldest first: (sequence, tokens run).
    in_flight: VecDeque<Vec<(u64, usize)>>,
    /// Sequences the workers may forget, sent with the next batch.
    released: Vec<u64>,
    next_step: u64,
    preemptions: u64,
}

impl Scheduler {
    /// An empty scheduler over a fresh block pool.
    pub fn new(cfg: SchedulerConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(Scheduler {
            blocks: BlockManager::new(cfg.num_blocks, cfg.block_size),
            cfg,
            seqs: HashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: VecDeque::new(),
            released: Vec::new(),
            next_step: 0,
            preemptions: 0,
        })
    }

    /// Queues a sequence. Refuses, saying why, a sequence that could never run (empty,
    /// longer than the context, bigger than the whole KV pool even alone, or with
    /// `max_tokens` 0), a duplicate id, and anything when the waiting queue is full.
    /// The scheduler's bookkeeping fields of `seq` are reset.
    pub fn add(&mut self, mut seq: Sequence) -> Result<(), AdmissionError> {
        if self.seqs.contains_key(&seq.id) {
            return Err(AdmissionError::DuplicateId(seq.id));
        }
        if seq.is_empty() {
            return Err(AdmissionError::EmptyPrompt);
        }
        if seq.stop.max_tokens == 0 {
            return Err(AdmissionError::ZeroMaxTokens);
        }
        let max_model_len = self.cfg.max_model_len;
        if seq.len() > max_model_len {
            return Err(AdmissionError::PromptTooLong { len: seq.len(), max_model_len });
        }
        let tokens = seq.max_kv_len(max_model_len);
        let needed_blocks = self.cfg.blocks_for(tokens);
        if needed_blocks > self.cfg.num_blocks {
            return Err(AdmissionError::ExceedsKvCapacity { tokens, needed_blocks, num_blocks: self.cfg.num_blocks });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(AdmissionError::QueueFull { max_waiting: self.cfg.max_waiting });
        }
        let id = seq.id;
        seq.status = SeqStatus::Waiting;
        seq.num_computed = 0;
        seq.num_cached_prompt = 0;
        seq.num_preemptions = 0;
        seq.block_table.clear();
        seq.prefix = Default::default();
        seq.prefill_len = 0;
        seq.worker_known = false;
        seq.blocks_sent = 0;
        seq.in_flight = 0;
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Picks the next step's work (see the module comment for the policy). `None` when
    /// nothing can run, or while the previous batch awaits `postprocess`.
    pub fn schedule(&mut self) -> Option<ScheduledBatch> {
        if self.in_flight.len() >= self.cfg.max_in_flight {
            return None;
        }
        let bs = self.cfg.block_size;
        let threshold = self.cfg.long_prefill_threshold;
        let cap_chunk = |n: usize| if threshold > 0 { n.min(threshold) } else { n };
        let mut budget = self.cfg.max_num_batched_tokens;
        // Budget kept for the decodes not visited yet; never more than `budget`, because
        // decodes <= max_num_seqs <= max_num_batched_tokens and prefills leave it alone.
        // Lookahead only while the pool has a free block per running sequence: its slots
        // cannot be preempted until their step returns, so under KV pressure they would push
        // the preemptions onto the older sequences.
        let lookahead = self.cfg.lookahead && self.blocks.num_available() >= self.running.len();
        let max_model_len = self.cfg.max_model_len;
        let ahead_ok = |s: &Sequence| lookahead && s.lookahead_ok(max_model_len);
        let mut reserved = self
            .running
            .iter()
            .filter(|id| self.seqs.get(id).is_some_and(|s| (s.is_decoding() && s.in_flight == 0) || ahead_ok(s)))
            .count();
        let mut picked: Vec<(u64, usize)> = Vec::new();
        let mut preempted = false;

        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            if seq.in_flight > 0 {
                // Executing: at most a lookahead decode on the token being sampled, if its
                // slot can be had without preempting anyone.
                if ahead_ok(seq) && !preempted {
                    reserved = reserved.saturating_sub(1);
                    let target = seq.len() + 1;
                    if budget > 0
                        && self.seqs.get_mut(&id).is_some_and(|s| self.blocks.grow(&mut s.block_table, target).is_ok())
                    {
                        picked.push((id, 1));
                        budget -= 1;
                    }
                }
                i += 1;
                continue;
            }
            let decode = seq.is_decoding();
            reserved = reserved.saturating_sub(usize::from(decode));
            let mut n = if decode { 1 } else { cap_chunk(seq.remaining().min(budget.saturating_sub(reserved))) };
            if n == 0 {
                i += 1;
                continue;
            }
            let scheduled = loop {
                let Some(seq) = self.seqs.get_mut(&id) else { break false };
                let target = seq.num_computed + n;
                if self.blocks.grow(&mut seq.block_table, target).is_ok() {
                    break true;
                }
                if !decode {
                    let fit =
                        ((seq.block_table.len() + self.blocks.num_available()) * bs).saturating_sub(seq.num_computed);
                    if fit > 0 && self.blocks.grow(&mut seq.block_table, seq.num_computed + fit).is_ok() {
                        n = fit;
                        break true;
                    }
                }
                // The newest running sequence not executing now (an executing one's
                // blocks are being written).
                let Some(at) = self.running.iter().rposition(|v| self.seqs.get(v).is_some_and(|s| s.in_flight == 0))
                else {
                    break false;
                };
                let victim = self.running.remove(at);
                if victim != id && self.seqs.get(&victim).is_some_and(Sequence::is_decoding) {
                    reserved = reserved.saturating_sub(1);
                }
                self.preempt(victim);
                preempted = true;
                if victim == id {
                    break false;
                }
            };
            if scheduled {
                picked.push((id, n));
                budget -= n;
            }
            if self.running.get(i) == Some(&id) {
                i += 1;
            }
        }

        if !preempted {
            self.admit_waiting(&mut budget, &mut picked, cap_chunk);
        }
        if picked.is_empty() {
            return None;
        }
        Some(self.build_batch(picked))
    }

    /// Admits waiting sequences FIFO while budget, sequence cap, blocks and the step
    /// message's room for new sequences (`max_step_new_bytes`) allow.
    fn admit_waiting(
        &mut self,
        budget: &mut usize,
        picked: &mut Vec<(u64, usize)>,
        cap_chunk: impl Fn(usize) -> usize,
    ) {
        let bs = self.cfg.block_size;
        let mut new_bytes = 0usize;
        while let Some(&id) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_num_seqs || *budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            let bytes = seq.admission_bytes(bs);
            if new_bytes > 0 && new_bytes.saturating_add(bytes) > self.cfg.max_step_new_bytes {
                break;
            }
            seq.update_hashes(bs);
            let prefix = self.blocks.match_prefix(seq.tokens(), &seq.prefix.hashes);
            let cached = prefix.len() * bs;
            let n = cap_chunk((seq.len() - cached).min(*budget));
            let needed = self.cfg.blocks_for(cached + n) - prefix.len();
            if needed > self.blocks.available_after_prefix(&prefix) {
                break;
            }
            let len = seq.len();
            self.blocks.take_prefix(&prefix, &mut seq.block_table, &mut seq.prefix, len);
            if self.blocks.grow(&mut seq.block_table, cached + n).is_err() {
                self.blocks.free(&mut seq.block_table); // unreachable after the check above
                break;
            }
            self.waiting.pop_front();
            seq.num_computed = cached;
            if seq.num_preemptions == 0 {
                seq.num_cached_prompt = cached;
            }
            seq.prefill_len = len;
            seq.status = SeqStatus::Running;
            self.running.push(id);
            picked.push((id, n));
            *budget -= n;
            new_bytes = new_bytes.saturating_add(bytes);
        }
    }

    /// Turns the picked `(sequence, tokens)` into the step's deltas and marks it in flight;
    /// a sequence already executing in another batch runs a lookahead decode.
    fn build_batch(&mut self, picked: Vec<(u64, usize)>) -> ScheduledBatch {
        let mut batch = ScheduledBatch {
            step_id: self.next_step,
            finished: std::mem::take(&mut self.released),
            ..Default::default()
        };
        for &(id, n) in &picked {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            let first_pos = seq.num_computed;
            let table = &seq.block_table;
            if !seq.worker_known {
                batch.new_seqs.push(NewSeq {
                    seq_id: id,
                    block_table: table.clone(),
                    prior_output: seq.output().to_vec(),
                });
                seq.worker_known = true;
            } else if seq.blocks_sent < table.len() {
                batch.appends.push(BlockAppend { seq_id: id, block_ids: table[seq.blocks_sent..].to_vec() });
            }
            seq.blocks_sent = table.len();
            let lookahead = seq.in_flight > 0;
            seq.in_flight += 1;
            if lookahead {
                // Position len(): the token the executing batch is sampling now.
                batch.runs.push(SeqRun {
                    seq_id: id,
                    tokens: Vec::new(),
                    first_pos: seq.len(),
                    sample: true,
                    is_prompt: false,
                    from_previous: true,
                });
                continue;
            }
            batch.runs.push(SeqRun {
                seq_id: id,
                tokens: seq.tokens()[first_pos..first_pos + n].to_vec(),
                first_pos,
                sample: first_pos + n == seq.len(),
                is_prompt: first_pos < seq.prefill_len,
                from_previous: false,
            });
        }
        self.in_flight.push_back(picked);
        self.next_step += 1;
        batch
    }

    /// Recompute preemption: frees `id`'s blocks and queues it at the head of `waiting`.
    fn preempt(&mut self, id: u64) {
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        self.blocks.free(&mut seq.block_table);
        seq.prefix.reset();
        seq.num_computed = 0;
        seq.status = SeqStatus::Preempted;
        seq.num_preemptions += 1;
        if std::mem::take(&mut seq.worker_known) {
            self.released.push(id);
        }
        seq.blocks_sent = 0;
        self.waiting.push_front(id);
        self.preemptions += 1;
    }
}
