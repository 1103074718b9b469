//! The worker's step executor: per-sequence state kept between steps, and one step =
//! apply the deltas (finished, new sequences, appended blocks), run the batch in one
//! forward pass, sample where asked.
//!
//! Plain synchronous code; the gRPC service (`service.rs`) feeds it from the step stream
//! on a blocking thread, so a slow forward pass never stalls the async runtime.
//!
//! Constrained sequences (structured outputs, `constrained.rs`): their masks are computed
//! on a scoped thread during the forward pass and applied before sampling; a step without
//! constrained sampled rows spawns nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tessera_kernels::cpu::par;

use crate::backend::Backend;
use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::constrained::{apply_mask, compute_masks, Grammars, MaskJob, SeqGrammar};
use crate::cuda::RowRequest;
use crate::error::WorkerError;
use crate::sampling::{Sampled, Sampler, SamplingError, SamplingParams};

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
    /// `tokens` is empty: the run's one token is the one this executor sampled for the
    /// sequence in the previous step (a lookahead decode, sent before that token was back).
    pub from_previous: bool,
}

impl Run {
    /// Tokens this run computes (a lookahead decode's one is filled in by `step`).
    pub fn num_tokens(&self) -> usize {
        tessera_proto::run_tokens(self.tokens.len(), self.from_previous)
    }
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
    /// Sequences that failed on their own (their constraint): no sampled token, this error.
    pub errors: Vec<(u64, String)>,
    pub forward_us: u64,
    pub sample_us: u64,
}

struct SeqState {
    block_table: Vec<u32>,
    sampler: Sampler,
    /// Every token run so far (prompt and generated), counted by the penalties.
    history: Vec<u32>,
    /// Tokens it generated before this admission (they arrive as part of its prompt runs).
    prior_generated: usize,
    /// Its prompt's length, known at its first sampling run: the tokens then run, less
    /// `prior_generated`. Everything after it is output, which the presence and frequency
    /// penalties count.
    prompt_len: Option<usize>,
    /// The token sampled in this sequence's latest sampling run (lookahead decodes run it).
    last_sampled: Option<u32>,
}

impl SeqState {
    /// How many of the tokens before position `end` (a sampling run's end) are output.
    fn output_before(&self, end: usize) -> usize {
        let prompt = self.prompt_len.unwrap_or_else(|| end.saturating_sub(self.prior_generated));
        end.saturating_sub(prompt)
    }
}

/// A loaded model with its KV memory and live sequences.
pub struct Executor {
    backend: Backend,
    seqs: HashMap<u64, SeqState>,
    /// Grammar state of the constrained sequences (apart from `seqs`, so a step can move
    /// it to the mask thread while the batch borrows the block tables).
    grammar: HashMap<u64, SeqGrammar>,
    /// The grammar compiler; only on the ranks that sample (the last pipeline stage's).
    grammars: Option<Arc<Grammars>>,
    /// Most tokens a step may run (what the Load asked for; the GPU backends kept
    /// activation memory for that many).
    max_step_tokens: usize,
}

impl Executor {
    pub fn new(backend: Backend) -> Self {
        Executor { backend, seqs: HashMap::new(), grammar: HashMap::new(), grammars: None, max_step_tokens: usize::MAX }
    }

    /// Steps running more than `n` tokens are refused (default: no limit beyond the KV
    /// cache's slots, which the backends check).
    pub fn with_max_step_tokens(mut self, n: usize) -> Self {
        self.max_step_tokens = n;
        self
    }

    /// This executor samples and enforces constraints with `g` (every tensor rank of the
    /// last pipeline stage: they must sample alike). Without it constraints are ignored
    /// (ranks before the last stage, which sample nothing).
    pub fn with_grammars(mut self, g: Arc<Grammars>) -> Self {
        self.grammars = Some(g);
        self
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

    fn seq_limits(&self) -> SeqLimits {
        let max_tokens = self.backend.config().max_position.max(1);
        let max_table = max_tokens.div_ceil(self.block_size().max(1)).saturating_add(1);
        SeqLimits { num_blocks: self.num_blocks(), max_table, max_tokens }
    }

    /// Runs one step. A bad step (unknown sequence, bad ids) is an error and changes no
    /// sequence's state beyond the deltas already applied.
    pub fn step(&mut self, mut input: StepInput) -> Result<StepOutput, WorkerError> {
        // A lookahead run's token is filled in below: it counts as one.
        let tokens = input.runs.iter().fold(0usize, |n, r| n.saturating_add(r.tokens.len().max(1)));
        if tokens > self.max_step_tokens {
            return Err(WorkerError::InvalidBatch(format!(
                "{tokens} tokens in one step, more than the {} this worker was loaded for (max_step_tokens)",
                self.max_step_tokens
            )));
        }
        for id in &input.finished {
            self.seqs.remove(id);
            self.grammar.remove(id);
        }
        let limits = self.seq_limits();
        for mut s in input.new_sequences {
            if self.seqs.contains_key(&s.seq_id) {
                return Err(WorkerError::InvalidBatch(format!("sequence {} already exists", s.seq_id)));
            }
            check_table_len(s.seq_id, s.block_table.len(), limits)?;
            check_seq_blocks(s.seq_id, &s.block_table, s.cached_tokens.len(), limits)?;
            // Only the ranks that sample enforce constraints; the grammar takes the text
            // (the sampler does not read it, and it may be megabytes).
            let constraint = if self.grammars.is_some() { s.params.constraint.take() } else { None };
            // Parameters first: a refused sequence leaves no grammar behind for a later
            // sequence of the same id to inherit.
            let mut sampler = Sampler::new(s.params)?;
            if let Some(c) = constraint {
                let replay = usize::try_from(s.num_generated).unwrap_or(usize::MAX);
                self.grammar.insert(s.seq_id, SeqGrammar::Pending { constraint: c, replay });
            }
            sampler.resume_at(s.num_generated);
            let st = SeqState {
                block_table: s.block_table,
                sampler,
                history: s.cached_tokens,
                prior_generated: usize::try_from(s.num_generated).unwrap_or(usize::MAX),
                prompt_len: None,
                last_sampled: None,
            };
            self.seqs.insert(s.seq_id, st);
        }
        for (id, blocks) in input.appends {
            let st = self.seqs.get_mut(&id).ok_or_else(|| unknown(id))?;
            let table = st.block_table.len().saturating_add(blocks.len());
            check_table_len(id, table, limits).and_then(|()| check_seq_blocks(id, &blocks, 0, limits))?;
            st.block_table.extend(blocks);
        }
        if input.runs.is_empty() {
            return Ok(StepOutput::default());
        }
        // Lookahead decodes run the token sampled for them in the previous step.
        for r in input.runs.iter_mut().filter(|r| r.from_previous) {
            let st = self.seqs.get(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            let t = st.last_sampled.ok_or_else(|| {
                WorkerError::InvalidBatch(format!("sequence {}: a lookahead run but no token sampled before", r.seq_id))
            })?;
            r.tokens = vec![t];
        }
        let gpu = matches!(self.backend, Backend::Cuda(..));
        // A pipeline stage before the last runs its layers and passes the activations on;
        // the last stage samples.
        let samples = self.backend.samples();
        let vocab = self.backend.config().vocab_size;
        let mut chunks = Vec::with_capacity(input.runs.len());
        // GPU backend: what each sampled row needs, built while the histories are borrowed.
        let mut requests = Vec::new();
        let mut sampled_ids = std::collections::HashSet::new();
        let mut refused: HashMap<u64, SamplingError> = HashMap::new();
        for r in &input.runs {
            let st = self.seqs.get(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            // One draw per sequence and step: a second would need the sampler twice at once.
            if r.sample && !sampled_ids.insert(r.seq_id) {
                return Err(WorkerError::InvalidBatch(format!("sequence {} is sampled twice in one step", r.seq_id)));
            }
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
                // A row the GPU sampler cannot take (a token id past the vocabulary in its
                // bias or history) fails its sequence alone, as on the CPU: a greedy
                // placeholder keeps the rows aligned and its draw is dropped.
                let generated = st.output_before(r.first_pos + r.tokens.len());
                match RowRequest::new(st.sampler.params(), seed, draw, &history, generated, vocab) {
                    Ok(req) => requests.push(req),
                    Err(e) => {
                        requests.push(RowRequest::greedy());
                        refused.insert(r.seq_id, e);
                    }
                }
            }
            chunks.push(SeqChunk {
                tokens: &r.tokens,
                first_pos: r.first_pos,
                block_table: &st.block_table,
                logits: if r.sample { LogitsWanted::Last } else { LogitsWanted::None },
            });
        }
        // The constrained rows' grammars move to the mask thread for the step.
        let mut jobs = Vec::new();
        if samples && !self.grammar.is_empty() {
            let mut request = 0;
            for (i, r) in input.runs.iter().enumerate() {
                if !r.sample {
                    continue;
                }
                let row = request;
                request += 1;
                // Every run's sequence was checked above; a failed grammar is reported
                // again below with nothing to compute.
                let Some(st) = self.seqs.get(&r.seq_id) else { continue };
                let g = match self.grammar.remove(&r.seq_id) {
                    None => continue,
                    Some(g @ SeqGrammar::Failed(_)) => {
                        self.grammar.insert(r.seq_id, g);
                        continue;
                    }
                    Some(g) => g,
                };
                let history = |n: usize| {
                    let all: Vec<u32> = st.history[..r.first_pos].iter().chain(&r.tokens).copied().collect();
                    all[all.len().saturating_sub(n)..].to_vec()
                };
                let job = MaskJob::new(i, r.seq_id, g, history, vocab);
                if let Some(req) = requests.get_mut(row) {
                    req.mask = Some(job.cell.clone());
                }
                jobs.push(job);
            }
        }
        let t0 = Instant::now();
        let grammars = self.grammars.clone();
        let backend = &mut self.backend;
        let forward = move || match backend {
            Backend::Cuda(m, sampler) => Ok((None, Some(m.forward_sample(&chunks, &requests, sampler)?.into_iter()))),
            backend => Ok((Some(backend.forward(&chunks)?), None)),
        };
        let result: Result<_, WorkerError> = if jobs.is_empty() {
            forward()
        } else {
            std::thread::scope(|s| {
                let masks = s.spawn(|| compute_masks(&mut jobs, grammars.as_deref()));
                let r = forward();
                // compute_masks catches the grammar engine's panics; a panic here is a bug.
                masks.join().map_err(|_| WorkerError::InvalidBatch("the mask thread panicked".into()))?;
                r
            })
        };
        // Grammars go back before any error is returned.
        let mut masks: HashMap<usize, Option<Vec<u32>>> = HashMap::with_capacity(jobs.len());
        for j in jobs {
            masks.insert(j.run, j.cell.wait_take());
            self.grammar.insert(j.seq_id, j.grammar);
        }
        let (mut logits, mut gpu_sampled) = result?;
        let forward_us = t0.elapsed().as_micros() as u64;

        let t1 = Instant::now();
        let mut sampled = Vec::new();
        let mut errors = Vec::new();
        // History covers exactly the positions now in the cache.
        let mut picks = Vec::new();
        for (i, r) in input.runs.iter().enumerate() {
            let st = self.seqs.get_mut(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            st.history.truncate(r.first_pos);
            st.history.extend_from_slice(&r.tokens);
            if r.sample {
                let prompt = st.history.len() - st.output_before(st.history.len());
                st.prompt_len = Some(prompt);
            }
            if r.sample && samples {
                picks.push(i);
            }
        }
        let draws: Vec<Result<Sampled, SamplingError>> = match (&mut logits, &mut gpu_sampled) {
            (Some(l), _) => draw_rows(&mut self.seqs, l, &input.runs, &picks, &mut masks)?,
            (None, Some(g)) => {
                let mut out = Vec::with_capacity(picks.len());
                for &i in &picks {
                    let id = input.runs[i].seq_id;
                    let st = self.seqs.get_mut(&id).ok_or_else(|| unknown(id))?;
                    let s = g.next().ok_or_else(|| WorkerError::InvalidBatch("missing sampled row".into()))?;
                    match refused.remove(&id) {
                        Some(e) => out.push(Err(e)),
                        None => {
                            st.sampler.note_external_draw();
                            out.push(s);
                        }
                    }
                }
                out
            }
            (None, None) if !picks.is_empty() => {
                return Err(WorkerError::InvalidBatch("no logits were computed".into()));
            }
            (None, None) => Vec::new(),
        };
        for (&i, drawn) in picks.iter().zip(draws) {
            let r = &input.runs[i];
            let st = self.seqs.get_mut(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            // A sequence whose logits cannot be sampled (every token banned, say) fails
            // alone, as a failed grammar does; the batch goes on.
            let s = match drawn {
                Ok(s) => s,
                Err(e) => {
                    errors.push((r.seq_id, e.to_string()));
                    continue;
                }
            };
            st.last_sampled = Some(s.token);
            if let Some(g) = if self.grammar.is_empty() { None } else { self.grammar.get_mut(&r.seq_id) } {
                if let SeqGrammar::Active(m) = g {
                    if let Err(e) = m.commit(s.token) {
                        *g = SeqGrammar::Failed(e.to_string());
                    }
                }
                if let SeqGrammar::Failed(e) = g {
                    errors.push((r.seq_id, e.clone()));
                    continue;
                }
            }
            sampled.push((r.seq_id, s));
        }
        let sample_us = t1.elapsed().as_micros() as u64;
        if let (Some(l), Backend::Cpu { model, .. }) = (logits, &self.backend) {
            model.recycle_logits(l.data);
        }
        Ok(StepOutput { sampled, errors, forward_us, sample_us })
    }
}

/// The draws of the runs `picks` (indices into `runs`) from their logit rows, after their
/// grammar masks: the sequences in parallel when there are several (each sampler and row
/// belongs to one sequence; a greedy draw is a few passes over the vocabulary, ~16
/// sequences' worth of which held up a CPU step's other threads), in `picks`' order.
fn draw_rows(
    seqs: &mut HashMap<u64, SeqState>,
    logits: &mut Logits,
    runs: &[Run],
    picks: &[usize],
    masks: &mut HashMap<usize, Option<Vec<u32>>>,
) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
    let mut rows: Vec<Option<&mut [f32]>> =
        logits.rows_mut().map_err(WorkerError::InvalidBatch)?.into_iter().map(Some).collect();
    let at: HashMap<u64, usize> = picks.iter().enumerate().map(|(j, &i)| (runs[i].seq_id, j)).collect();
    let mut states: Vec<Option<&mut SeqState>> = (0..picks.len()).map(|_| None).collect();
    for (id, st) in seqs.iter_mut() {
        if let Some(&j) = at.get(id) {
            states[j] = Some(st);
        }
    }
    // One job per draw: its sequence, logit row, mask and (after the draw) the result;
    // each task takes its own job, so nothing is locked.
    let mut jobs: Vec<Job> = Vec::with_capacity(picks.len());
    for (j, &i) in picks.iter().enumerate() {
        // A sequence sampled twice in one step is refused before the forward pass; the
        // second run would find no state here.
        let st = states[j].take().ok_or_else(|| {
            WorkerError::InvalidBatch(format!("sequence {} is sampled twice in one step", runs[i].seq_id))
        })?;
        let row = rows
            .get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| WorkerError::InvalidBatch(format!("no logits for run {i} (sequence {})", runs[i].seq_id)))?;
        let mask = if masks.is_empty() { None } else { masks.remove(&i).flatten() };
        jobs.push((st, row, mask, None));
    }
    let draw = |_: usize, part: &mut [Job]| {
        for (st, row, mask, out) in part.iter_mut() {
            if let Some(m) = mask {
                apply_mask(row, m);
            }
            let generated = st.output_before(st.history.len());
            let SeqState { sampler, history, .. } = &mut **st;
            *out = Some(sampler.sample(row, history, generated));
        }
    };
    if jobs.len() > 1 {
        par::for_each_chunk_mut(&mut jobs, 1, draw);
    } else {
        draw(0, &mut jobs);
    }
    jobs.into_iter().map(|job| job.3.ok_or_else(|| WorkerError::InvalidBatch("a draw did not run".into()))).collect()
}

/// A draw of [`draw_rows`]: the sequence, its logit row, its grammar mask, the result.
type Job<'a> = (&'a mut SeqState, &'a mut [f32], Option<Vec<u32>>, Option<Result<Sampled, SamplingError>>);

/// What one sequence's state on this worker may hold. Tables and cached tokens arrive
/// ahead of the runs that read them, so without these bounds a message could park tables
/// and histories of any size here (~4 bytes per entry, kept until the sequence finishes).
#[derive(Debug, Clone, Copy)]
struct SeqLimits {
    /// Blocks of the KV cache: every table entry must name one.
    num_blocks: usize,
    /// Longest table: the blocks of the model's context, plus one (a lookahead step may
    /// hold the slot after a sequence's last position).
    max_table: usize,
    /// Most cached tokens: the model's context.
    max_tokens: usize,
}

/// Checks a new sequence's blocks and cached tokens (or an append's blocks: `cached` 0)
/// against `l`; the table's length is [`check_table_len`]'s.
fn check_seq_blocks(id: u64, blocks: &[u32], cached: usize, l: SeqLimits) -> Result<(), WorkerError> {
    if let Some(b) = blocks.iter().find(|&&b| b as usize >= l.num_blocks) {
        return Err(WorkerError::InvalidBatch(format!(
            "sequence {id}: block {b} is not one of the cache's {} blocks",
            l.num_blocks
        )));
    }
    if cached > l.max_tokens {
        return Err(WorkerError::InvalidBatch(format!(
            "sequence {id}: {cached} cached tokens, more than the model's {} positions",
            l.max_tokens
        )));
    }
    Ok(())
}

/// Checks a whole table's length (a new sequence's, or one with an append) against `l`.
fn check_table_len(id: u64, len: usize, l: SeqLimits) -> Result<(), WorkerError> {
    if len > l.max_table {
        return Err(WorkerError::InvalidBatch(format!(
            "sequence {id}: a block table of {len} blocks, more than the model's {} positions need ({})",
            l.max_tokens, l.max_table
        )));
    }
    Ok(())
}

fn unknown(id: u64) -> WorkerError {
    WorkerError::InvalidBatch(format!("unknown sequence {id}"))
}
