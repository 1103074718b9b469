//! The worker's step executor: per-sequence state kept between steps, and one step =
//! apply the deltas (finished, new sequences, appended blocks), run the batch in one
//! forward pass, sample where asked.
//!
//! Plain synchronous code; the gRPC service (`service.rs`) feeds it from the step stream
//! on a blocking thread, so a slow forward pass never stalls the async runtime. On the CUDA
//! backend a step can be started ([`Executor::start`]: queued on the GPU) and completed
//! later ([`Executor::complete`]: its sampled rows read), and a lookahead step can be
//! queued behind a pending one before that one's rows are read: its decodes take their
//! tokens from the GPU's sampled rows.
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
use crate::cuda::{QueuedStep, RowRequest};
use crate::error::WorkerError;
use crate::sampling::{Sampled, Sampler, SamplingError, SamplingParams};
use tessera_kernels::cuda::Completion;

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
    /// The step queued on the GPU whose rows are not read yet ([`Executor::start`]).
    pending: Option<Pending>,
    /// Whether `start` may queue a step behind the pending one (else it completes that one
    /// first).
    behind: bool,
}

impl Executor {
    pub fn new(backend: Backend) -> Self {
        Executor {
            backend,
            seqs: HashMap::new(),
            grammar: HashMap::new(),
            grammars: None,
            max_step_tokens: usize::MAX,
            pending: None,
            behind: true,
        }
    }

    /// Steps running more than `n` tokens are refused (default: no limit beyond the KV
    /// cache's slots, which the backends check).
    pub fn with_max_step_tokens(mut self, n: usize) -> Self {
        self.max_step_tokens = n;
        self
    }

    /// Whether [`Executor::start`] may queue a step behind the pending one (default: yes).
    pub fn with_queueing_behind(mut self, on: bool) -> Self {
        self.behind = on;
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
    /// sequence's state beyond the deltas already applied. Refused while a step started
    /// with [`Executor::start`] awaits [`Executor::complete`].
    pub fn step(&mut self, input: StepInput) -> Result<StepOutput, WorkerError> {
        if self.pending.is_some() {
            return Err(WorkerError::InvalidBatch("a queued step has not been completed".into()));
        }
        match self.begin(input, None)? {
            Some(out) => Ok(out),
            None => self.complete().unwrap_or_else(|| Err(WorkerError::InvalidBatch("the step was lost".into()))),
        }
    }

    /// Starts a step. On the CUDA backend it is queued on the GPU and its sampled rows are
    /// read later, by [`Executor::complete`] or by the next `start`; elsewhere it runs whole.
    /// If a step is pending, `input` is queued behind it before the pending step's rows are
    /// read when it can be: its runs of the pending step's sampled sequences are lookahead
    /// decodes, which take their tokens on the GPU, of sequences whose sampling needs no
    /// history (no penalties, no `min_tokens`, no grammar), and it finishes none of the
    /// pending step's sequences. Otherwise the pending step is completed first. So the GPU
    /// runs the next step while the host reads the last one's tokens and replies.
    pub fn start(&mut self, input: StepInput) -> Started {
        let older = match self.pending.take() {
            Some(p) if self.can_follow(&p, &input) => Some(p),
            Some(p) => {
                let previous = Some(self.finish_pending(p));
                return Started { previous, this: self.begin(input, None), queued_behind: false };
            }
            None => None,
        };
        let this = self.begin(input, older.as_ref());
        let queued_behind = older.is_some() && self.pending.is_some();
        let previous = older.map(|p| self.finish_pending(p));
        Started { previous, this, queued_behind }
    }

    /// Reads the pending step's rows (waiting for the GPU) and returns its output; `None`
    /// when no step is pending.
    pub fn complete(&mut self) -> Option<Result<StepOutput, WorkerError>> {
        let p = self.pending.take()?;
        Some(self.finish_pending(p))
    }

    /// A handle that waits until the pending step's rows are written on the GPU, from any
    /// thread (`None`: no step is pending, or it sampled nothing).
    pub fn pending_completion(&self) -> Option<Completion> {
        self.pending.as_ref().and_then(|p| p.step.completion())
    }

    /// Whether `input` can be queued behind `p` before `p`'s rows are read (see `start`).
    fn can_follow(&self, p: &Pending, input: &StepInput) -> bool {
        if !self.behind || input.finished.iter().any(|id| p.ran.contains_key(id)) {
            return false;
        }
        input.runs.iter().all(|r| {
            let Some(ran) = p.ran.get(&r.seq_id) else { return true };
            let plain = self.seqs.get(&r.seq_id).is_some_and(|st| {
                !st.sampler.penalises() && st.sampler.params().min_tokens == 0 && !self.grammar.contains_key(&r.seq_id)
            });
            r.from_previous && ran.row.is_some() && r.first_pos == ran.end && plain
        })
    }

    /// Applies `input`'s deltas, checks its runs and runs it: whole (the output) or queued
    /// on the GPU (`None`; `self.pending` holds it). With `older` (a step still pending,
    /// which `input` may follow), its sampled sequences' lookahead runs take their tokens
    /// from its rows on the GPU and their draws count its one.
    fn begin(&mut self, mut input: StepInput, older: Option<&Pending>) -> Result<Option<StepOutput>, WorkerError> {
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
            return Ok(Some(StepOutput::default()));
        }
        // The older step's row of each sequence it samples (its lookahead runs here take
        // that row's token on the GPU; their own token is filled in at completion).
        let after = |id: u64| older.and_then(|p| p.ran.get(&id)).and_then(|ran| ran.row);
        let mut fill = Vec::new();
        // Lookahead decodes run the token sampled for them in the previous step.
        for (i, r) in input.runs.iter_mut().enumerate().filter(|(_, r)| r.from_previous) {
            let st = self.seqs.get(&r.seq_id).ok_or_else(|| unknown(r.seq_id))?;
            if after(r.seq_id).is_some() {
                fill.push(i);
                // A placeholder the GPU replaces; a valid id for the checks.
                r.tokens = vec![0];
                continue;
            }
            let t = st.last_sampled.ok_or_else(|| {
                WorkerError::InvalidBatch(format!("sequence {}: a lookahead run but no token sampled before", r.seq_id))
            })?;
            r.tokens = vec![t];
        }
        let from_sampled: Vec<Option<u32>> = match fill.is_empty() {
            true => Vec::new(),
            false => input.runs.iter().map(|r| r.from_previous.then(|| after(r.seq_id)).flatten()).collect(),
        };
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
            // A run after the older step's starts where that one ends (`can_follow`), past
            // the history, which that step's completion extends.
            if after(r.seq_id).is_none() && st.history.len() < r.first_pos {
                return Err(WorkerError::InvalidBatch(format!(
                    "sequence {}: run starts at position {} but only {} earlier tokens are known",
                    r.seq_id,
                    r.first_pos,
                    st.history.len()
                )));
            }
            if gpu && r.sample {
                let (seed, mut draw) = st.sampler.stream_position();
                // The older step's draw of this sequence is not counted yet.
                draw += u64::from(after(r.seq_id).is_some());
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
            Backend::Cuda(m, sampler) => {
                Ok(Forward::Queued(m.queue_sample(&chunks, &from_sampled, &requests, sampler)?))
            }
            backend => Ok(Forward::Host(backend.forward(&chunks)?)),
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
        match result? {
            // Queued on the GPU: its rows are read at completion.
            Forward::Queued(step) => {
                // Every sampled run has a row (a refused one a greedy placeholder), in order.
                let mut rows = 0..;
                let ran = input.runs.iter().map(|r| {
                    let row = if r.sample { rows.next() } else { None };
                    (r.seq_id, Ran { end: r.first_pos + r.tokens.len(), row })
                });
                let ran = ran.collect();
                self.pending = Some(Pending { runs: input.runs, fill, refused, masks, step, t0, ran });
                Ok(None)
            }
            Forward::Host(logits) => {
                let forward_us = t0.elapsed().as_micros() as u64;
                let done = Forwarded { rows: Rows::Host(logits), refused, masks, forward_us };
                self.finish_runs(&input.runs, done).map(Some)
            }
        }
    }

    /// Reads a queued step's rows and finishes it: its lookahead runs' tokens (sampled in
    /// the step before it, known by now) go into the histories with the rest.
    fn finish_pending(&mut self, mut p: Pending) -> Result<StepOutput, WorkerError> {
        let rows = match &mut self.backend {
            Backend::Cuda(m, sampler) => m.finish_sample(p.step, sampler)?,
            _ => return Err(WorkerError::InvalidBatch("a queued step on a backend that does not queue".into())),
        };
        for &i in &p.fill {
            let r = &mut p.runs[i];
            // A sequence whose draw in the step before failed ends with that error (the
            // coordinator drops this run's token); its history takes a placeholder.
            let t = self.seqs.get(&r.seq_id).and_then(|st| st.last_sampled).unwrap_or(0);
            r.tokens = vec![t];
        }
        let forward_us = p.t0.elapsed().as_micros() as u64;
        let done = Forwarded { rows: Rows::Gpu(rows), refused: p.refused, masks: p.masks, forward_us };
        self.finish_runs(&p.runs, done)
    }

    /// A run step's post-processing: histories, draws (from the logits on the host, or
    /// the GPU's rows), grammars, the output.
    fn finish_runs(&mut self, runs: &[Run], done: Forwarded) -> Result<StepOutput, WorkerError> {
        let Forwarded { mut rows, mut refused, mut masks, forward_us } = done;
        let samples = self.backend.samples();
        let t1 = Instant::now();
        let mut sampled = Vec::new();
        let mut errors = Vec::new();
        // History covers exactly the positions now in the cache.
        let mut picks = Vec::new();
        for (i, r) in runs.iter().enumerate() {
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
        let draws: Vec<Result<Sampled, SamplingError>> = match &mut rows {
            Rows::Host(l) => draw_rows(&mut self.seqs, l, runs, &picks, &mut masks)?,
            Rows::Gpu(g) => {
                let mut g = g.drain(..);
                let mut out = Vec::with_capacity(picks.len());
                for &i in &picks {
                    let id = runs[i].seq_id;
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
        };
        for (&i, drawn) in picks.iter().zip(draws) {
            let r = &runs[i];
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
        if let (Rows::Host(l), Backend::Cpu { model, .. }) = (rows, &self.backend) {
            model.recycle_logits(l.data);
        }
        Ok(StepOutput { sampled, errors, forward_us, sample_us })
    }
}

/// What [`Executor::start`] did: the output of the step that was pending before it, if
/// one was (completed before or after this one was queued), and this step's output when it
/// ran whole (`Ok(None)`: queued, read by [`Executor::complete`] or the next `start`).
#[derive(Debug)]
pub struct Started {
    pub previous: Option<Result<StepOutput, WorkerError>>,
    pub this: Result<Option<StepOutput>, WorkerError>,
    /// This step was queued on the GPU before the previous one's rows were read.
    pub queued_behind: bool,
}

/// A step queued on the GPU whose rows the host has not read.
struct Pending {
    runs: Vec<Run>,
    /// Runs whose token was sampled in the step before this one, on the GPU: filled in
    /// from the sequence's `last_sampled` at completion.
    fill: Vec<usize>,
    refused: HashMap<u64, SamplingError>,
    masks: HashMap<usize, Option<Vec<u32>>>,
    step: QueuedStep,
    t0: Instant,
    /// What it ran of each sequence.
    ran: HashMap<u64, Ran>,
}

/// A pending step's run of one sequence: the position after it, and its row of the step's
/// sampling (`None`: not sampled).
struct Ran {
    end: usize,
    row: Option<u32>,
}

/// What a step's forward pass gave: a step queued on the GPU (CUDA backend) or the
/// logits on the host.
enum Forward {
    Queued(QueuedStep),
    Host(Logits),
}

/// What a step's draws come from: the logits on the host, or the GPU's sampled rows (in
/// the order of the step's sampled runs).
enum Rows {
    Host(Logits),
    Gpu(Vec<Result<Sampled, SamplingError>>),
}

/// A step's forward pass as its post-processing takes it: its rows, the refused rows, the
/// grammar masks, its time.
struct Forwarded {
    rows: Rows,
    refused: HashMap<u64, SamplingError>,
    masks: HashMap<usize, Option<Vec<u32>>>,
    forward_us: u64,
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
