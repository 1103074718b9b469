//! Sampling on the GPU for the executor: each sampled row's parameters, penalty counts
//! and logit bias go up as small arrays, the kernel picks every row's token (and top-N
//! logprobs), and only those come back: the `[rows, vocab]` logits never leave the GPU.
//!
//! Same semantics as the CPU [`Sampler`](crate::sampling::Sampler) (bias, penalties,
//! logprobs before temperature, greedy / temperature / top-k / top-p / min-p); the random
//! stream is the kernel's, keyed by the sequence's seed and draw index, so a seeded
//! sequence replays exactly on the GPU backend (not the same draws as on the CPU one).
//!
//! Constrained rows (structured outputs) carry a [`MaskCell`] that the executor's mask
//! thread fills during the forward pass; their packed bitmasks go up together and one
//! launch bans the disallowed tokens before the sampling kernel. A step without
//! constrained rows uploads and launches nothing extra.

use std::sync::Arc;

use tessera_kernels::cuda::{Buf, Completion, Device, Elem, SampleOutput, SampleParams, SamplePaths, SampledRow};

use crate::constrained::MaskCell;
use crate::error::WorkerError;
use crate::sampling::{merged_bias, Sampled, SamplingError, SamplingParams, MAX_LOGPROBS};

/// What one row needs besides its logits.
#[derive(Debug, Clone)]
pub struct RowRequest {
    pub params: SampleParams,
    /// `(token, 1 + occurrences in the output)` of each distinct token of the history, when
    /// a penalty is on (the kernel's entry: repetition on all, presence and frequency on the
    /// output occurrences).
    pub penalties: Vec<(u32, u32)>,
    pub bias: Vec<(u32, f32)>,
    /// The row's allowed-token mask, being computed beside the forward pass (constrained
    /// sequences only).
    pub mask: Option<Arc<MaskCell>>,
}

impl RowRequest {
    /// The request of a sequence with `params`, at stream position `(seed, draw)`, whose
    /// history (prompt and generated tokens) is `history` (read only for penalties), its
    /// last `generated` tokens the output. Token ids are checked against `vocab` here, as
    /// the CPU sampler does.
    pub fn new(
        params: &SamplingParams,
        seed: u64,
        draw: u64,
        history: &[u32],
        generated: usize,
        vocab: usize,
    ) -> Result<Self, SamplingError> {
        let check = |what, token: u32| {
            if (token as usize) < vocab {
                Ok(())
            } else {
                Err(SamplingError::TokenOutOfVocab { what, token, vocab })
            }
        };
        for &(t, _) in &params.logit_bias {
            check("logit_bias", t)?;
        }
        let penalise =
            params.repetition_penalty != 1.0 || params.presence_penalty != 0.0 || params.frequency_penalty != 0.0;
        let mut penalties = Vec::new();
        if penalise {
            // (token, whether this occurrence is output), grouped by token.
            let split = history.len().saturating_sub(generated);
            let mut sorted: Vec<(u32, bool)> = history.iter().enumerate().map(|(i, &t)| (t, i >= split)).collect();
            sorted.sort_unstable();
            for run in sorted.chunk_by(|a, b| a.0 == b.0) {
                check("history", run[0].0)?;
                let out = run.iter().filter(|e| e.1).count();
                penalties.push((run[0].0, 1 + out as u32));
            }
        }
        // `min_tokens`' ban rides on the bias entries as -inf (the kernel adds each entry,
        // and x + -inf is -inf, the CPU sampler's ban); the kernel takes one entry per token
        // (a sequence's sampler merged the bias already; a banned id with a bias merges here).
        let ban = params.min_tokens_ban(generated);
        let bias = if ban.is_empty() {
            merged_bias(&params.logit_bias).into_owned()
        } else {
            for &t in ban {
                check("min_tokens_stop_ids", t)?;
            }
            let banned = ban.iter().map(|&t| (t, f32::NEG_INFINITY));
            merged_bias(&params.logit_bias.iter().copied().chain(banned).collect::<Vec<_>>()).into_owned()
        };
        Ok(RowRequest {
            params: SampleParams {
                seed,
                draw,
                temperature: params.temperature,
                top_k: params.top_k,
                top_p: params.top_p,
                min_p: params.min_p,
                repetition_penalty: params.repetition_penalty,
                presence_penalty: params.presence_penalty,
                frequency_penalty: params.frequency_penalty,
                n_logprobs: params.logprobs.unwrap_or(0).min(MAX_LOGPROBS) as u32,
            },
            penalties,
            bias,
            mask: None,
        })
    }
}

impl RowRequest {
    /// Argmax, no adjustments, no logprobs (benchmarks' greedy decoding).
    pub fn greedy() -> Self {
        RowRequest { params: SampleParams::greedy(), penalties: Vec::new(), bias: Vec::new(), mask: None }
    }
}

/// A device copy of a per-step host array, reallocated only when it no longer fits and
/// uploaded only when it changed: steady decode (the same requests, no penalties) queues no
/// copy at all. Each copy from pageable memory costs host time (~5-7 µs, inputs.rs) and
/// its own DMA after the step's graph on the stream, ahead of the sampling kernel.
struct Staged<T> {
    buf: Option<Buf<T>>,
    /// What the front of `buf` holds (empty when unknown: nothing uploaded yet, or a
    /// failed copy). Only `put` writes these buffers; the kernels read them.
    last: Vec<T>,
}

impl<T: Elem + PartialEq> Staged<T> {
    const fn new() -> Self {
        Staged { buf: None, last: Vec::new() }
    }

    /// Writes `host` to the front of the buffer, unless it holds exactly that already.
    /// `exact`: the buffer must have exactly `host.len()` elements (arrays the kernel sizes
    /// by the row count); otherwise at least as many (entry lists, which may be longer than
    /// their offsets use).
    fn put(&mut self, dev: &Device, host: &[T], exact: bool) -> Result<&Buf<T>, WorkerError> {
        let fits = |b: &Buf<T>| if exact { b.len() == host.len() } else { b.len() >= host.len() };
        let mut buf = match self.buf.take() {
            Some(b) if fits(&b) => b,
            _ => {
                self.last.clear();
                dev.alloc(if exact { host.len() } else { host.len().next_power_of_two() })?
            }
        };
        // `last` holds values only after a completed copy into this very buffer (a new one
        // cleared it), so an equal `last` means the buffer already holds `host`.
        if self.last.as_slice() != host {
            self.last.clear();
            dev.write_at(&mut buf, 0, host)?;
            self.last.extend_from_slice(host);
        }
        Ok(self.buf.insert(buf))
    }
}

/// A sampling queued by [`GpuSampler::queue`] whose rows [`GpuSampler::finish`] reads.
#[must_use = "a queued sampling's rows are read by GpuSampler::finish"]
pub struct QueuedSample {
    slot: usize,
    /// Waits for its rows on the GPU.
    done: Completion,
    /// The sampler's queue count at this one (a later queue into the slot, after this one
    /// was dropped unread, makes it stale).
    ticket: u64,
}

impl QueuedSample {
    /// A handle that waits, from any thread, until the rows are written on the GPU.
    pub fn completion(&self) -> Completion {
        self.done.clone()
    }
}

/// The kernel's output buffers (grown to the largest step seen) and its staged inputs.
///
/// Two output sets are used in turn, so a step's sampling can be queued while the step
/// before's rows are still unread (the engine's overlapped decode loop: the next step's
/// inputs name those rows' tokens on the device, [`GpuSampler::last_tokens`]).
pub struct GpuSampler {
    outs: [Option<SampleOutput>; 2],
    /// Samplings queued so far, and the count at each set's latest (see
    /// [`QueuedSample::ticket`]).
    queued: u64,
    tickets: [u64; 2],
    /// The slot of the last queued sampling and its rows (`None` before the first).
    last: Option<(usize, usize)>,
    params: Staged<SampleParams>,
    pen_offsets: Staged<u32>,
    pen_tokens: Staged<u32>,
    pen_counts: Staged<u32>,
    bias_offsets: Staged<u32>,
    bias_tokens: Staged<u32>,
    bias_values: Staged<f32>,
    /// Packed masks of the constrained rows, `[rows, ceil(vocab / 32)]`, and their row ids.
    mask_words: Staged<u32>,
    mask_rows: Staged<u32>,
}

impl GpuSampler {
    pub fn new() -> Self {
        GpuSampler {
            outs: [None, None],
            queued: 0,
            tickets: [0; 2],
            last: None,
            params: Staged::new(),
            pen_offsets: Staged::new(),
            pen_tokens: Staged::new(),
            pen_counts: Staged::new(),
            bias_offsets: Staged::new(),
            bias_tokens: Staged::new(),
            bias_values: Staged::new(),
            mask_words: Staged::new(),
            mask_rows: Staged::new(),
        }
    }

    /// Samples the first `requests.len()` rows of `logits` (`[padded rows, vocab]`; rows
    /// past the requests are a graph's padding and sampled greedily, unused): queues the
    /// sampling and waits for its rows.
    pub fn sample(
        &mut self,
        dev: &Device,
        logits: &mut Buf<f32>,
        vocab: usize,
        requests: &[RowRequest],
    ) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
        let q = self.queue(dev, logits, vocab, requests)?;
        self.finish(q)
    }

    /// The device's sampled token ids of the last queued sampling, `[rows]` valid, and
    /// `rows` (`None` before the first). Work queued after that sampling reads them in
    /// order; they stay until the sampling after next.
    pub fn last_tokens(&self) -> Option<(&Buf<u32>, usize)> {
        let (slot, rows) = self.last?;
        Some((self.outs[slot].as_ref()?.tokens(), rows))
    }

    /// Queues the sampling of the first `requests.len()` rows of `logits` (as
    /// [`GpuSampler::sample`]) into the output set the previous call did not use, and the
    /// read of its rows, without waiting. At most two samplings are outstanding: a third
    /// waits for (and drops) the unread rows of the first, whose output set it reuses.
    pub fn queue(
        &mut self,
        dev: &Device,
        logits: &mut Buf<f32>,
        vocab: usize,
        requests: &[RowRequest],
    ) -> Result<QueuedSample, WorkerError> {
        let padded = logits.len() / vocab.max(1);
        if requests.len() > padded {
            return Err(WorkerError::InvalidBatch(format!(
                "{} rows to sample, {padded} rows of logits",
                requests.len()
            )));
        }
        // The set the last sampling did not use; after a failed call (no last), one with no
        // unread rows, else the older.
        let unread = |o: &Option<SampleOutput>| o.as_ref().is_some_and(|o| o.is_queued());
        let slot = match self.last {
            Some((s, _)) => 1 - s,
            None if !unread(&self.outs[0]) => 0,
            None if !unread(&self.outs[1]) => 1,
            None => usize::from(self.tickets[1] < self.tickets[0]),
        };
        // Until this call succeeds no tokens are the last ones.
        self.last = None;
        // This set's rows of two samplings ago, if their caller dropped them unread.
        if let Some(o) = self.outs[slot].as_mut().filter(|o| o.is_queued()) {
            o.take()?;
        }
        let out = match self.outs[slot].take() {
            Some(o) if o.max_rows() >= padded => o,
            _ => dev.sample_output(padded.max(1), MAX_LOGPROBS)?,
        };
        let out = self.outs[slot].insert(out);
        let mut params: Vec<SampleParams> = requests.iter().map(|r| r.params).collect();
        params.resize(padded, SampleParams::greedy());
        let csr = |lists: &mut dyn Iterator<Item = usize>| -> Vec<u32> {
            let mut offsets = vec![0u32];
            for n in lists {
                let last = *offsets.last().unwrap_or(&0);
                offsets.push(last + n as u32);
            }
            offsets.resize(padded + 1, *offsets.last().unwrap_or(&0));
            offsets
        };
        let pen_offsets = csr(&mut requests.iter().map(|r| r.penalties.len()));
        let bias_offsets = csr(&mut requests.iter().map(|r| r.bias.len()));
        // Entry arrays are never empty (a device buffer cannot be).
        let mut pen_tokens: Vec<u32> = requests.iter().flat_map(|r| r.penalties.iter().map(|p| p.0)).collect();
        let mut pen_counts: Vec<u32> = requests.iter().flat_map(|r| r.penalties.iter().map(|p| p.1)).collect();
        let mut bias_tokens: Vec<u32> = requests.iter().flat_map(|r| r.bias.iter().map(|p| p.0)).collect();
        let mut bias_values: Vec<f32> = requests.iter().flat_map(|r| r.bias.iter().map(|p| p.1)).collect();
        for v in [&mut pen_tokens, &mut pen_counts, &mut bias_tokens] {
            if v.is_empty() {
                v.push(0);
            }
        }
        if bias_values.is_empty() {
            bias_values.push(0.0);
        }
        // Padding rows are greedy without entries: split rows.
        let rows = params.iter().enumerate().map(|(i, &p)| match requests.get(i) {
            Some(r) => (p, r.bias.len(), r.penalties.len()),
            None => (p, 0, 0),
        });
        let paths = SamplePaths::for_rows(vocab, rows);
        apply_masks(&mut self.mask_words, &mut self.mask_rows, dev, logits, vocab, requests)?;
        dev.sample_paths(
            out,
            logits,
            vocab,
            self.params.put(dev, &params, true)?,
            self.pen_offsets.put(dev, &pen_offsets, true)?,
            // Paired lists (tokens with counts, tokens with values) always have equal
            // lengths, so their buffers grow together and stay equal, as the kernel checks.
            self.pen_tokens.put(dev, &pen_tokens, false)?,
            self.pen_counts.put(dev, &pen_counts, false)?,
            self.bias_offsets.put(dev, &bias_offsets, true)?,
            self.bias_tokens.put(dev, &bias_tokens, false)?,
            self.bias_values.put(dev, &bias_values, false)?,
            paths,
        )?;
        let with_top = requests.iter().any(|r| r.params.n_logprobs > 0);
        out.queue_read(dev, requests.len(), with_top)?;
        self.queued += 1;
        self.tickets[slot] = self.queued;
        self.last = Some((slot, requests.len()));
        Ok(QueuedSample { slot, done: out.completion(), ticket: self.tickets[slot] })
    }

    /// Waits for `q`'s rows (its sampling only: work queued after it goes on) and reads them.
    pub fn finish(&mut self, q: QueuedSample) -> Result<Vec<Result<Sampled, SamplingError>>, WorkerError> {
        let out = self.outs[q.slot].as_mut().filter(|o| o.is_queued() && self.tickets[q.slot] == q.ticket);
        let Some(out) = out else {
            return Err(WorkerError::InvalidBatch("a queued sampling read twice, or after two later ones".into()));
        };
        Ok(out.take()?.into_iter().map(to_sampled).collect())
    }
}

/// Waits for the constrained rows' masks and bans what they do not allow, in one launch
/// (staging through `words` and `ids`). A row whose mask failed is sampled unmasked (its
/// sequence ends with the error; the token is dropped).
fn apply_masks(
    mask_words: &mut Staged<u32>,
    mask_rows: &mut Staged<u32>,
    dev: &Device,
    logits: &mut Buf<f32>,
    vocab: usize,
    requests: &[RowRequest],
) -> Result<(), WorkerError> {
    if requests.iter().all(|r| r.mask.is_none()) {
        return Ok(());
    }
    let words = vocab.div_ceil(32);
    let mut packed = Vec::new();
    let mut rows = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        let Some(mut m) = r.mask.as_ref().and_then(|c| c.wait_take()) else { continue };
        m.resize(words, 0);
        packed.extend_from_slice(&m);
        rows.push(i as u32);
    }
    if rows.is_empty() {
        return Ok(());
    }
    let masks = mask_words.put(dev, &packed, false)?;
    let ids = mask_rows.put(dev, &rows, false)?;
    dev.apply_token_mask(logits, vocab, masks, ids, rows.len())?;
    Ok(())
}

impl Default for GpuSampler {
    fn default() -> Self {
        Self::new()
    }
}

/// One row's draw, or why its logits could not be sampled (that row's sequence fails
/// alone; the executor goes on with the others).
fn to_sampled(r: SampledRow) -> Result<Sampled, SamplingError> {
    if r.flags & SampledRow::ALL_BANNED != 0 {
        return Err(SamplingError::AllBanned);
    }
    if r.flags & SampledRow::BAD_LOGIT != 0 {
        return Err(SamplingError::BadLogit { token: r.token as usize, value: f32::NAN });
    }
    Ok(Sampled { token: r.token, logprob: r.logprob, top: r.top })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's penalty entries: every distinct token of the history, count 1 + its
    /// occurrences in the output (the last `generated` tokens), in token order; none when
    /// no penalty is on; a token past the vocabulary is refused.
    #[test]
    fn penalty_entries_count_output_occurrences_plus_one() {
        let params = SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() };
        // Prompt 7, 3, 7, 9; output 3, 5, 3.
        let history = [7u32, 3, 7, 9, 3, 5, 3];
        let req = RowRequest::new(&params, 1, 0, &history, 3, 10).expect("request");
        assert_eq!(req.penalties, vec![(3, 3), (5, 2), (7, 1), (9, 1)]);
        // Everything output / nothing output / more than the history (all of it).
        let all = RowRequest::new(&params, 1, 0, &history, 7, 10).expect("request");
        assert_eq!(all.penalties, vec![(3, 4), (5, 2), (7, 3), (9, 2)]);
        assert_eq!(RowRequest::new(&params, 1, 0, &history, 99, 10).expect("request").penalties, all.penalties);
        let none = RowRequest::new(&params, 1, 0, &history, 0, 10).expect("request");
        assert_eq!(none.penalties, vec![(3, 1), (5, 1), (7, 1), (9, 1)]);
        assert!(RowRequest::new(&SamplingParams::greedy(), 1, 0, &history, 3, 10)
            .expect("request")
            .penalties
            .is_empty());
        assert!(RowRequest::new(&params, 1, 0, &history, 3, 8).is_err(), "token 9 is past a vocabulary of 8");
    }

    /// `min_tokens` reaches the kernel as -inf bias entries on the stop ids (merged with a
    /// stop id's own bias, in token order) while the output is shorter, and not after.
    #[test]
    fn min_tokens_bans_stop_ids_through_the_bias_entries() {
        let params = SamplingParams {
            logit_bias: vec![(2, 1.5), (9, -3.0)],
            min_tokens: 2,
            min_tokens_stop_ids: vec![4, 9],
            ..SamplingParams::greedy()
        };
        let inf = f32::NEG_INFINITY;
        for generated in [0, 1] {
            let req = RowRequest::new(&params, 1, 0, &[], generated, 10).expect("request");
            assert_eq!(req.bias, vec![(2, 1.5), (4, inf), (9, inf)], "after {generated} tokens");
        }
        for generated in [2, 3] {
            let req = RowRequest::new(&params, 1, 0, &[], generated, 10).expect("request");
            assert_eq!(req.bias, vec![(2, 1.5), (9, -3.0)], "after {generated} tokens");
        }
        let past = SamplingParams { min_tokens_stop_ids: vec![10], ..params };
        assert!(RowRequest::new(&past, 1, 0, &[], 0, 10).is_err(), "stop id 10 is past a vocabulary of 10");
        assert!(RowRequest::new(&past, 1, 0, &[], 2, 10).is_ok(), "not banned any more, so not read");
    }
}
