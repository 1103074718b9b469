//! Turns one row of logits into the next token: OpenAI-style sampling parameters,
//! their validation, and a per-sequence [`Sampler`] with its own seeded RNG.
//!
//! Order of operations (llama.cpp / vLLM):
//! 1. `logit_bias` is added; while the output is shorter than `min_tokens`, the ids that
//!    would end the sequence are banned (-inf), vLLM's `min_tokens` (its stop checks wait
//!    as long; here the ids simply cannot be drawn, so nothing downstream has to);
//! 2. repetition penalty (HF / llama.cpp: a positive logit is divided by it, a
//!    negative one multiplied) on every token of the sequence, prompt and output; then
//!    presence and frequency penalties (OpenAI: `logit -= count * frequency_penalty +
//!    (count > 0) * presence_penalty`) with `count` the token's occurrences in the output
//!    only, as vLLM counts them (counting the prompt too, a chat's template tokens, one
//!    per message, would push the end-of-turn token down and replies would not end);
//! 3. log-probabilities are taken here: log-softmax of the logits after 1-2, before
//!    temperature and truncation (what vLLM reports by default);
//! 4. temperature below [`GREEDY_TEMPERATURE`] (0 in practice) is greedy: the argmax,
//!    lowest id on ties; otherwise logits are divided by the temperature, then top-k,
//!    top-p and min-p truncate the candidates, which are renormalised and drawn from.
//!
//! Cost per call is O(vocab) plus O(k log k) for what must be sorted: top-k uses
//! `select_nth_unstable`, and top-p sorts only a growing prefix of candidates until it
//! holds `top_p` of the mass, so a 150k vocabulary is never fully sorted in practice.

use std::cmp::Ordering;
use std::hash::{BuildHasher, Hasher};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// Temperatures below this are treated as 0 (greedy), as vLLM does: dividing by a
/// smaller one only overflows towards the same argmax.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Largest `logprobs` (top-N alternatives per token) accepted, OpenAI's `top_logprobs` bound.
pub const MAX_LOGPROBS: usize = 20;

/// Out-of-range parameters or unusable inputs.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("{name} = {value} is out of range (allowed: {allowed})")]
    OutOfRange { name: &'static str, value: f64, allowed: &'static str },
    #[error("{what} token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfVocab { what: &'static str, token: u32, vocab: usize },
    #[error("logits row is empty")]
    EmptyLogits,
    #[error("logit of token {token} is {value}; logits must be finite or -inf")]
    BadLogit { token: usize, value: f32 },
    #[error("every token has probability 0 (all logits -inf after bias and penalties)")]
    AllBanned,
}

/// How to pick tokens. Field ranges are OpenAI's (see [`SamplingParams::validate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it. `0..=2`.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: u32,
    /// Keep the smallest most-likely set holding this much probability. `(0, 1]`, 1 = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely one's. `0..=1`, 0 = off.
    pub min_p: f32,
    /// Divides positive / multiplies negative logits of tokens seen in the prompt or the
    /// output. `> 0`, 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token seen in the output. `-2..=2`.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the output. `-2..=2`.
    pub frequency_penalty: f32,
    /// `(token, bias)` added to the logits first; -100 effectively bans, +100 forces. `-100..=100`.
    pub logit_bias: Vec<(u32, f32)>,
    /// RNG seed; `None` draws one from the process's random state.
    pub seed: Option<u64>,
    /// Return this many most likely alternatives with each token. `..=MAX_LOGPROBS`.
    pub logprobs: Option<usize>,
    /// Constrained decoding: the grammar the output must follow. The sampler itself ignores
    /// it; the executor masks the logits first (`constrained.rs`).
    pub constraint: Option<tessera_constrain::Constraint>,
    /// vLLM's `min_tokens`: until the output holds this many tokens, `min_tokens_stop_ids`
    /// get -inf. 0 = off.
    pub min_tokens: u32,
    /// The ids that end the sequence (EOS, the request's stop ids), banned before `min_tokens`.
    pub min_tokens_stop_ids: Vec<u32>,
}

impl Default for SamplingParams {
    /// OpenAI's API defaults: temperature 1, no truncation, no penalties, i.e. an
    /// unbiased draw from `softmax(logits)`.
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            logprobs: None,
            constraint: None,
            min_tokens: 0,
            min_tokens_stop_ids: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Deterministic argmax decoding (temperature 0), everything else neutral.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks every field against its range; NaN is never in range.
    pub fn validate(&self) -> Result<(), SamplingError> {
        fn range(name: &'static str, v: f32, ok: bool, allowed: &'static str) -> Result<(), SamplingError> {
            if ok {
                Ok(())
            } else {
                Err(SamplingError::OutOfRange { name, value: f64::from(v), allowed })
            }
        }
        let t = self.temperature;
        range("temperature", t, (0.0..=2.0).contains(&t), "0 to 2")?;
        range("top_p", self.top_p, self.top_p > 0.0 && self.top_p <= 1.0, "greater than 0, at most 1")?;
        range("min_p", self.min_p, (0.0..=1.0).contains(&self.min_p), "0 to 1")?;
        let rp = self.repetition_penalty;
        range("repetition_penalty", rp, rp.is_finite() && rp > 0.0, "finite, greater than 0")?;
        let pp = self.presence_penalty;
        range("presence_penalty", pp, (-2.0..=2.0).contains(&pp), "-2 to 2")?;
        let fp = self.frequency_penalty;
        range("frequency_penalty", fp, (-2.0..=2.0).contains(&fp), "-2 to 2")?;
        for &(_, b) in &self.logit_bias {
            range("logit_bias", b, (-100.0..=100.0).contains(&b), "-100 to 100")?;
        }
        if let Some(n) = self.logprobs {
            if n > MAX_LOGPROBS {
                return Err(SamplingError::OutOfRange { name: "logprobs", value: n as f64, allowed: "0 to 20" });
            }
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_TEMPERATURE
    }

    fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// The ids to ban when the sequence has `generated` output tokens: its stop ids while
    /// that is fewer than `min_tokens`, else none.
    pub fn min_tokens_ban(&self, generated: usize) -> &[u32] {
        if generated < self.min_tokens as usize {
            &self.min_tokens_stop_ids
        } else {
            &[]
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of `token` (after bias and penalties, before temperature/truncation);
    /// 0 when the parameters do not ask for logprobs (`SamplingParams::logprobs` is `None`).
    pub logprob: f32,
    /// The `logprobs` most likely tokens with theirs, most likely first, ties by lower id;
    /// empty when not asked for.
    pub top: Vec<(u32, f32)>,
}

/// The sampling state of one sequence: its parameters, its RNG (so a seeded sequence
/// replays exactly) and scratch buffers reused across steps.
pub struct Sampler {
    params: SamplingParams,
    /// The resolved seed (drawn from OS randomness when the request gave none).
    seed: u64,
    /// Non-greedy draws made so far (the position in the random stream).
    draws: u64,
    rng: ChaCha8Rng,
    /// `[vocab]`: 1 + occurrences in the output for each token of the current history;
    /// all zero between calls.
    counts: Vec<u32>,
    /// Distinct tokens of the current history.
    seen: Vec<u32>,
    /// Candidate token ids.
    idx: Vec<u32>,
    /// `[vocab]` `exp((logit - max) / T)` of the current candidates.
    weight: Vec<f32>,
}

/// `bias` with one entry per token, in token order, the biases of a repeated token summed
/// in their order; borrowed when it already is (one pass). A client's map cannot repeat a
/// token, but a list can, and a linear search per entry made a vocabulary-sized list
/// quadratic on every step.
pub fn merged_bias(bias: &[(u32, f32)]) -> std::borrow::Cow<'_, [(u32, f32)]> {
    if bias.windows(2).all(|w| w[0].0 < w[1].0) {
        return std::borrow::Cow::Borrowed(bias);
    }
    let mut sorted = bias.to_vec();
    sorted.sort_by_key(|e| e.0); // stable: a token's biases keep their order
    let mut out: Vec<(u32, f32)> = Vec::with_capacity(sorted.len());
    for (t, b) in sorted {
        match out.last_mut() {
            Some(last) if last.0 == t => last.1 += b,
            _ => out.push((t, b)),
        }
    }
    std::borrow::Cow::Owned(out)
}

impl Sampler {
    /// A sampler for one sequence; fails on out-of-range parameters.
    pub fn new(mut params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        // Once per sequence: every step then adds (and the GPU sampler uploads) one entry
        // per token, in token order.
        params.logit_bias = merged_bias(&params.logit_bias).into_owned();
        let seed = params.seed.unwrap_or_else(|| {
            // std's RandomState is keyed from OS randomness, once per process and
            // distinct per instance.
            std::collections::hash_map::RandomState::new().build_hasher().finish()
        });
        Ok(Self {
            params,
            seed,
            draws: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
            counts: Vec::new(),
            seen: Vec::new(),
            idx: Vec::new(),
            weight: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Continues the random stream after `draws` earlier samples, as if this sampler had
    /// made them: a sequence preempted (or migrated) and re-created elsewhere keeps the
    /// tokens its seed gives. Every non-greedy `sample` consumes exactly one 64-bit draw
    /// (two ChaCha words); greedy sampling draws nothing.
    pub fn resume_at(&mut self, draws: u64) {
        if !self.params.is_greedy() {
            self.draws = draws;
            self.rng.set_word_pos(2 * u128::from(draws));
        }
    }

    /// The resolved seed and the index of the next draw: what a sampler on another device
    /// (the GPU's, keyed by (seed, draw)) needs to continue this sequence's stream.
    pub fn stream_position(&self) -> (u64, u64) {
        (self.seed, self.draws)
    }

    /// Records a draw made elsewhere (on the GPU) so the stream position advances as if
    /// this sampler had made it.
    pub fn note_external_draw(&mut self) {
        if !self.params.is_greedy() {
            self.draws += 1;
            self.rng.set_word_pos(2 * u128::from(self.draws));
        }
    }

    /// Whether any of the repetition, presence or frequency penalties is on.
    pub fn penalises(&self) -> bool {
        self.params.has_penalties()
    }

    /// Picks the next token from `logits` (`[vocab]`; finite or -inf), given the
    /// sequence's `history` (prompt + generated so far; read only when a penalty is on),
    /// whose last `generated` tokens are the sequence's output (more than its length: all).
    /// On return `logits` holds the biased and penalised values (before temperature).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], generated: usize) -> Result<Sampled, SamplingError> {
        let vocab = logits.len();
        if vocab == 0 {
            return Err(SamplingError::EmptyLogits);
        }
        if let Some((token, &value)) = logits.iter().enumerate().find(|(_, v)| v.is_nan() || **v == f32::INFINITY) {
            return Err(SamplingError::BadLogit { token, value });
        }
        let in_vocab = |what, token: u32| {
            if (token as usize) < vocab {
                Ok(())
            } else {
                Err(SamplingError::TokenOutOfVocab { what, token, vocab })
            }
        };
        for &(token, _) in &self.params.logit_bias {
            in_vocab("logit_bias", token)?;
        }
        let ban = self.params.min_tokens_ban(generated);
        ban.iter().try_for_each(|&t| in_vocab("min_tokens_stop_ids", t))?;
        let penalise = self.params.has_penalties();
        if penalise {
            history.iter().try_for_each(|&t| in_vocab("history", t))?;
        }

        for &(token, bias) in &self.params.logit_bias {
            logits[token as usize] += bias;
        }
        for &token in ban {
            logits[token as usize] = f32::NEG_INFINITY;
        }
        if penalise {
            self.apply_penalties(logits, history, generated);
        }

        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(SamplingError::AllBanned);
        }
        if !max.is_finite() {
            let token = logits.iter().position(|v| !v.is_finite() && *v > 0.0).unwrap_or(0);
            return Err(SamplingError::BadLogit { token, value: max });
        }
        // log-sum-exp of the processed logits, for the reported logprobs: one `exp` per
        // vocabulary entry (49k for SmolLM2, about as many as a decode step's attention
        // spends), so only when the request asked for logprobs.
        let wanted = self.params.logprobs.is_some();
        let lse = if wanted {
            f64::from(max) + logits.iter().map(|&l| f64::from((l - max).exp())).sum::<f64>().ln()
        } else {
            0.0
        };
        let logprob = |t: u32| (f64::from(logits[t as usize]) - lse) as f32;

        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.draws += 1;
            self.draw(logits, max)
        };
        let top = match self.params.logprobs {
            Some(n) if n > 0 => {
                let n = n.min(vocab);
                self.idx.clear();
                self.idx.extend(0..vocab as u32);
                let desc = desc_by(logits);
                if n < vocab {
                    self.idx.select_nth_unstable_by(n - 1, desc);
                }
                self.idx.truncate(n);
                self.idx.sort_unstable_by(desc);
                self.idx.iter().map(|&t| (t, logprob(t))).collect()
            }
            _ => Vec::new(),
        };
        Ok(Sampled { token, logprob: if wanted { logprob(token) } else { 0.0 }, top })
    }

    /// Repetition on the tokens of `history`, then presence and frequency penalties on those
    /// of its last `generated` (all ids already checked to be in the vocabulary).
    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32], generated: usize) {
        let p = &self.params;
        if self.counts.len() != logits.len() {
            self.counts.clear();
            self.counts.resize(logits.len(), 0);
        }
        self.seen.clear();
        for &t in history {
            let c = &mut self.counts[t as usize];
            if *c == 0 {
                self.seen.push(t);
                *c = 1;
            }
        }
        for &t in &history[history.len().saturating_sub(generated)..] {
            self.counts[t as usize] += 1;
        }
        for &t in &self.seen {
            let (l, c) = (&mut logits[t as usize], &mut self.counts[t as usize]);
            let out = *c - 1; // occurrences in the output
                              // A tiny penalty (any value > 0 is valid) can push a positive logit past f32's
                              // range: held at the largest finite value, the token is as certain as asked
                              // and the logprobs stay defined. A negative one may reach -inf: a ban.
            if *l > 0.0 {
                *l = (*l / p.repetition_penalty).min(f32::MAX);
            } else {
                *l *= p.repetition_penalty;
            }
            // The GPU kernel's operations exactly (sampling.cu): the same bits.
            *l -= out as f32 * p.frequency_penalty + if out > 0 { p.presence_penalty } else { 0.0 };
            *c = 0;
        }
    }

    /// A random draw at the parameters' temperature after top-k, top-p and min-p.
    /// `max` is the largest logit (finite).
    fn draw(&mut self, logits: &[f32], max: f32) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let desc = desc_by(logits);
        let idx = &mut self.idx;
        idx.clear();
        idx.extend((0..logits.len() as u32).filter(|&t| logits[t as usize] > f32::NEG_INFINITY));
        let k = p.top_k as usize;
        if k > 0 && k < idx.len() {
            idx.select_nth_unstable_by(k - 1, desc);
            idx.truncate(k);
        }

        // Relative to the max, so the most likely candidate weighs exactly 1.
        if self.weight.len() != logits.len() {
            self.weight.clear();
            self.weight.resize(logits.len(), 0.0);
        }
        let weight = &mut self.weight;
        for &t in idx.iter() {
            weight[t as usize] = ((logits[t as usize] - max) * inv_t).exp();
        }
        let mass = |ids: &[u32]| ids.iter().map(|&t| f64::from(weight[t as usize])).sum::<f64>();

        if p.top_p < 1.0 {
            let target = f64::from(p.top_p) * mass(idx);
            let keep = top_p_prefix(idx, weight, desc, target);
            idx.truncate(keep);
        }
        if p.min_p > 0.0 {
            idx.retain(|&t| weight[t as usize] >= p.min_p);
        }

        let total = mass(idx);
        let u = uniform01(&mut self.rng) * total;
        let (mut cum, mut last) = (0.0f64, None);
        for &t in idx.iter() {
            let w = weight[t as usize];
            if w > 0.0 {
                last = Some(t);
            }
            cum += f64::from(w);
            if u < cum {
                return t;
            }
        }
        // Only reached when rounding put `u` at `total`: the last candidate with weight.
        // There is one: the most likely candidate weighs exactly 1 and survives every
        // truncation.
        last.unwrap_or(0)
    }
}

/// Orders token ids by logit, highest first, then by lower id: a total order, so
/// selections and sorts are deterministic.
fn desc_by(logits: &[f32]) -> impl Fn(&u32, &u32) -> Ordering + Copy + '_ {
    move |a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b))
}

/// First highest logit's id.
/// Index of the largest logit; the lowest index among equals (greedy decoding's rule).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Sorts the front of `idx` (most likely first) until its weights reach `target`;
/// returns how many candidates that took (at least 1). Only a prefix is sorted: first
/// the top 64, then 8 times more each round, so nucleus sampling over a large
/// vocabulary sorts little more than the nucleus.
fn top_p_prefix(idx: &mut [u32], weight: &[f32], desc: impl Fn(&u32, &u32) -> Ordering + Copy, target: f64) -> usize {
    let mut m = idx.len().min(64);
    loop {
        if m < idx.len() {
            idx.select_nth_unstable_by(m - 1, desc);
        }
        idx[..m].sort_unstable_by(desc);
        let mut cum = 0.0f64;
        for (n, &t) in idx[..m].iter().enumerate() {
            cum += f64::from(weight[t as usize]);
            if cum >= target {
                return n + 1;
            }
        }
        if m == idx.len() {
            return m;
        }
        m = idx.len().min(m * 8);
    }
}

/// Uniform in `[0, 1)` with 53 random bits.
fn uniform01(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}
