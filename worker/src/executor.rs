//! The worker's step executor: per-sequence state kept between steps, and one step =
//! apply the deltas (finished, new sequences, appended blocks), run the batch in one
//! forward pass, sample where asked.
//!
//! Plain synchronous code; the gRPC service (`service.rs`) feeds it from the step stream
//! on a blocking thread, so a slow forward pass never stalls the async runtime.

use std::collections::HashMap;
use std::time::Instant;

use crate::backend::Backend;
use crate::batch::{LogitsWanted, SeqChunk};
use crate::cuda::RowRequest;
use crate::error::WorkerError;
use crate::sampling::{Sampled, Sampler, SamplingParams};

/// A sequence the executor has not seen before.
#[derive(Debug, Clone)]
pub struct NewSequence {
    pub seq_id: u64,
    pub params: SamplingParams,
    pub block_table: Vec<u32>,
    /// Tokens already in its KV blocks before its first run (prefix-cache hit).
    pub cached_tokens: Vec<u32>,
    /// Tokens it generated before this (re-)admission; its sampler resumes after them.
    pub num_generated: u64,
}

/// One sequence's work in a step.
#[derive(Debug, Clone)]
pub struct Run {
    pub seq_id: u64,
    /// Tokens at positions `first_pos..`.
    pub tokens: Vec<u32>,
    pub first_pos: usize,
    /// Sample after the last token.
    pub sample: bool,
}

/// A step's input: deltas, then the batch.
#[derive(Debug, Clone, Default)]
pub struct StepInput {
    pub finished: Vec<u64>,
    pub new_sequences: Vec<NewSequence>,
    /// `(seq_id, block ids appended to its table)`.
    pub appends: Vec<(u64, Vec<u32>)>,
    pub runs: Vec<Run>,
}

/// A step's result: one sampled token per run that asked, in run order.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    pub sampled: Vec<(u64, Sampled)>,
    pub forward_us: u64,
    pub sample_us: u64,
}

struct SeqState {
    block_table: Vec<u32>,
    sampler: Sampler,
    /// Every token run so far (prompt and generated), counted by the penalties.
    history: Vec<u32>,
}

/// A loaded model with its KV memory and live sequences.
pub struct Executor {
    backend: Backend,
    seqs: HashMap<u64, SeqState>,
}

impl Executor {
    pub fn new(backend: Backend) -> Self {
        Executor { backend, seqs: HashMap::new() }
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    pub fn num_blocks(&self) -> usize {
        self.backend.num_blocks()
    }

    pub fn block_size(&self) -> usize {
        self.backend.block_size()
    }

    /// Sequences with state on this worker.
    pub fn live_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// Runs one step. A bad step (unknown sequence, bad ids) is an error and changes no
    /// sequence's state beyond the deltas already applied.
    pub fn step(&mut self, input: StepInput) -> Result<StepOutput, WorkerError> {
        for id in &input.finished {
            self.seqs.remove(id);
        }
        for s in input.new_sequences {
            if self.seqs.contains_key(&s.seq_id) {
                return Err(WorkerError::InvalidBatch(format!("sequence {} already exists", s.seq_id)));
            }
            let mut sampler = Sampler::new(s.params)?;
            sampler.resume_at(s.num_generated);
            self.seqs.insert(s.seq_id, SeqState { block_table: s.block_table, sampler, history: s.cached_tokens });
        }
        for (id, blocks) in input.appends {
            let st = self.seqs.get_mut(&id).ok_or_else(|| unknown(id))?;
            st.block_table.extend(blocks);
        }
        if input.runs.is_empty() {
            return Ok(StepOutput::default());
        }
        let gpu = matches!(self.backend, Backend::Cuda(..));
        // A pipeline stage before the last runs its layers and passes the activations on;
        // the last stage samples.
        let samples = self.backend.samples();
        let vocab = self.backend.config().vocab_size;
        let mut chunks = Vec::with_capacity(input.runs.len());
        // GPU backend: what each sampled row needs, built while the histories are borrowed.
        let mut requests = Vec::new();
        for r in &input.runs {
            let st = self.seqs.get(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            if st.history.len() < r.first_pos {
                return Err(WorkerError::InvalidBatch(format!(
                    "sequence {}: run starts at position {} but only {} earlier tokens are known",
                    r.seq_id,
                    r.first_pos,
                    st.history.len()
                )));
            }
            if gpu && r.sample {
                let (seed, draw) = st.sampler.stream_position();
                let mut history = Vec::new();
                if st.sampler.penalises() {
                    history.extend_from_slice(&st.history[..r.first_pos]);
                    history.extend_from_slice(&r.tokens);
                }
                requests.push(RowRequest::new(st.sampler.params(), seed, draw, &history, vocab)?);
            }
            chunks.push(SeqChunk {
                tokens: &r.tokens,
                first_pos: r.first_pos,
                block_table: &st.block_table,
                logits: if r.sample { LogitsWanted::Last } else { LogitsWanted::None },
            });
        }
        let t0 = Instant::now();
        let (mut logits, mut gpu_sampled) = match &mut self.backend {
            Backend::Cuda(m, sampler) => (None, Some(m.forward_sample(&chunks, &requests, sampler)?.into_iter())),
            backend => (Some(backend.forward(&chunks)?), None),
        };
        let forward_us = t0.elapsed().as_micros() as u64;

        let t1 = Instant::now();
        let mut sampled = Vec::new();
        for (i, r) in input.runs.iter().enumerate() {
            let st = self.seqs.get_mut(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            // History covers exactly the positions now in the cache.
            st.history.truncate(r.first_pos);
            st.history.extend_from_slice(&r.tokens);
            if !r.sample || !samples {
                continue;
            }
            match (&mut logits, &mut gpu_sampled) {
                (Some(l), _) => sampled.push((r.seq_id, st.sampler.sample(l.chunk_mut(i), &st.history)?)),
                (None, Some(g)) => {
                    let s = g.next().ok_or_else(|| WorkerError::InvalidBatch("missing sampled row".into()))?;
                    st.sampler.note_external_draw();
                    sampled.push((r.seq_id, s));
                }
                (None, None) => return Err(WorkerError::InvalidBatch("no logits were computed".into())),
            }
        }
        Ok(StepOutput { sampled, forward_us, sample_us: t1.elapsed().as_micros() as u64 })
    }
}

fn unknown(id: u64) -> WorkerError {
    WorkerError::InvalidBatch(format!("unknown sequence {id}"))
}
