//! Test helpers shared by the coordinator's integration tests: a fixed-seed RNG, a fake
//! model that reads its context back from a fake paged KV (so wrong block tables, wrong
//! positions or wrong prefix reuse change its output), the same model run on one sequence
//! alone as the reference, and a step driver that checks invariants after every step.
#![allow(dead_code)]

use std::collections::HashMap;

use tessera_coordinator::{
    FinishReason, ScheduledBatch, Scheduler, SchedulerConfig, SeqUpdate, Sequence, StepOutput, StopCriteria,
    TableMirror,
};

/// The fake model's vocabulary; `EOS` is one of its ids, so some sequences stop early.
pub const VOCAB: u32 = 64;
pub const EOS: u32 = 0;

/// A SplitMix64 generator: deterministic, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    /// `n` token ids in `1..vocab` (never EOS).
    pub fn tokens(&mut self, n: usize, vocab: u32) -> Vec<u32> {
        (0..n).map(|_| 1 + self.below(vocab as usize - 1) as u32).collect()
    }
}

/// The fake model: next token from the whole context (FNV-1a over the ids, then mod VOCAB).
pub fn next_token(context: &[u32]) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in context {
        for b in t.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    ((h ^ (h >> 29)) % u64::from(VOCAB)) as u32
}

/// The reference: `prompt` generated alone with the same model and stop rules, written
/// straightforwardly from the rules rather than through `Sequence`.
pub fn reference(prompt: &[u32], stop: &StopCriteria, max_model_len: usize) -> (Vec<u32>, FinishReason) {
    let mut all = prompt.to_vec();
    let mut out = Vec::new();
    loop {
        let t = next_token(&all);
        all.push(t);
        out.push(t);
        if stop.stop_ids.contains(&t) || (!stop.ignore_eos && stop.eos_ids.contains(&t)) {
            return (out, FinishReason::Stop);
        }
        if out.len() >= stop.max_tokens || all.len() >= max_model_len {
            return (out, FinishReason::Length);
        }
    }
}

/// A config with the given pool and limits, no queue bound worth hitting, no chunk cap.
pub fn config(
    block_size: usize,
    num_blocks: usize,
    budget: usize,
    max_num_seqs: usize,
    max_model_len: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_waiting: 1 << 20,
        block_size,
        num_blocks,
        max_model_len,
        long_prefill_threshold: 0,
        max_in_flight: 1,
        lookahead: false,
        max_step_new_bytes: tessera_coordinator::config::DEFAULT_STEP_NEW_BYTES,
    }
}

/// A sequence that stops only on length (no EOS ids).
pub fn seq(id: u64, prompt: Vec<u32>, max_tokens: usize) -> Sequence {
    Sequence::new(id, prompt, StopCriteria::new(max_tokens, Vec::new()), id)
}

/// Worker stand-in: keeps tables from the step deltas, writes each run's tokens into a
/// fake KV at `(table[p / bs], p % bs)`, and samples [`next_token`] over the context it
/// reads back from the KV. Asserts what a real worker would rely on.
pub struct FakeWorker {
    block_size: usize,
    /// `[num_blocks * block_size]`: the (token, position) written in each slot.
    kv: Vec<Option<(u32, usize)>>,
    pub mirror: TableMirror,
    /// Each sequence's latest sampled token, which a lookahead decode runs.
    last: HashMap<u64, u32>,
}

impl FakeWorker {
    pub fn new(cfg: &SchedulerConfig) -> Self {
        FakeWorker {
            block_size: cfg.block_size,
            kv: vec![None; cfg.num_blocks * cfg.block_size],
            mirror: TableMirror::new(),
            last: HashMap::new(),
        }
    }

    /// Runs `batch` and returns one output per sampling run, in run order.
    pub fn run(&mut self, sched: &Scheduler, batch: &ScheduledBatch) -> Vec<StepOutput> {
        let bs = self.block_size;
        self.mirror.apply(batch).expect("deltas apply");
        let chunks = sched.chunks(batch);
        assert_eq!(chunks.len(), batch.runs.len(), "full view covers every run");
        // A lookahead decode runs the token this worker sampled for it last.
        let tokens: Vec<Vec<u32>> = batch
            .runs
            .iter()
            .map(|r| {
                if r.from_previous {
                    assert!(r.tokens.is_empty() && r.sample, "a lookahead run is one sampled token");
                    vec![*self.last.get(&r.seq_id).expect("a lookahead run follows a sampling run")]
                } else {
                    r.tokens.clone()
                }
            })
            .collect();
        for ((run, chunk), run_tokens) in batch.runs.iter().zip(&chunks).zip(&tokens) {
            let table = self.mirror.table(run.seq_id).expect("run of a known sequence");
            assert_eq!(table, chunk.block_table, "delta-built table == full table of seq {}", run.seq_id);
            assert_eq!((chunk.tokens, chunk.first_pos, chunk.sample), (&run.tokens[..], run.first_pos, run.sample));
            assert!(table.len() * bs >= run.first_pos + run_tokens.len(), "table covers the run");
            for (j, &t) in run_tokens.iter().enumerate() {
                let p = run.first_pos + j;
                let b = table[p / bs];
                assert_eq!(sched.block_manager().ref_count(b), Some(1), "seq {} writes shared block {b}", run.seq_id);
                self.kv[b as usize * bs + p % bs] = Some((t, p));
            }
        }
        let mut out = Vec::new();
        for (run, run_tokens) in batch.runs.iter().zip(&tokens).filter(|(r, _)| r.sample) {
            let table = self.mirror.table(run.seq_id).expect("known");
            let end = run.first_pos + run_tokens.len();
            let context: Vec<u32> = (0..end)
                .map(|p| match self.kv[table[p / bs] as usize * bs + p % bs] {
                    Some((t, pos)) if pos == p => t,
                    other => panic!("seq {} position {p}: KV slot holds {other:?}", run.seq_id),
                })
                .collect();
            let token = next_token(&context);
            self.last.insert(run.seq_id, token);
            out.push(StepOutput { seq_id: run.seq_id, token });
        }
        out
    }
}

/// Tokens and endings gathered from `SeqUpdate`s.
#[derive(Default)]
pub struct Collected {
    pub tokens: HashMap<u64, Vec<u32>>,
    pub finished: HashMap<u64, FinishReason>,
}

impl Collected {
    pub fn record(&mut self, updates: &[SeqUpdate]) {
        for u in updates {
            assert!(!self.finished.contains_key(&u.seq_id), "update after seq {} finished", u.seq_id);
            if let Some(t) = u.token {
                self.tokens.entry(u.seq_id).or_default().push(t);
            }
            if let Some(r) = u.finished {
                self.finished.insert(u.seq_id, r);
            }
        }
    }
}

/// One schedule / run / postprocess round with invariant and budget checks; `None` when
/// nothing was scheduled.
pub fn step(sched: &mut Scheduler, worker: &mut FakeWorker, got: &mut Collected) -> Option<ScheduledBatch> {
    let batch = sched.schedule()?;
    let cfg = sched.config().clone();
    assert!(batch.num_tokens() <= cfg.max_num_batched_tokens, "budget exceeded: {}", batch.num_tokens());
    assert!(batch.runs.len() <= cfg.max_num_seqs);
    let out = worker.run(sched, &batch);
    let updates = sched.postprocess(&out);
    got.record(&updates);
    sched.check_invariants().expect("scheduler invariants");
    Some(batch)
}
