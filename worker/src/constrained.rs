//! Constrained decoding (structured outputs) in the worker: each constrained sequence keeps
//! a grammar matcher (tessera-constrain), and every step computes the allowed-token masks
//! of its constrained sampled rows on a separate thread *while the forward pass runs*; the
//! sampler then bans what the mask does not allow and the sampled token is committed to
//! the matcher. Unconstrained steps do none of this.
//!
//! A matcher is compiled lazily, on the mask thread of the sequence's first sampling step,
//! and after a re-admission (preemption, migration) it first replays the tokens the
//! sequence generated before. A grammar that fails ends its own sequence with an error
//! (`StepOutput::errors`), never the step.
//!
//! The ranks that sample (every tensor rank of the last pipeline stage) keep matchers:
//! the service gives only their executors a [`Grammars`]. All of them mask alike, so
//! they sample the same token, which each runs in its own lookahead decode.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use tessera_constrain::{mask_words, Compiler, ConstrainError, Constraint, Limits, SeqMatcher, Vocabulary};
use tessera_model::bundle::ModelBundle;
use tessera_model::tokenizer::Tokenizer;

/// The served model's grammar compiler, built on first use from its tokenizer (a few
/// hundred milliseconds, once per load).
pub struct Grammars {
    source: Option<PathBuf>,
    compiler: OnceLock<Result<Compiler, String>>,
}

impl Grammars {
    /// The compiler of the model at `path` (a GGUF file or a Hugging Face directory),
    /// built when first needed.
    pub fn for_model(path: PathBuf) -> Self {
        Grammars { source: Some(path), compiler: OnceLock::new() }
    }

    /// An already built compiler (tests, `tessera generate`).
    pub fn from_compiler(c: Compiler) -> Self {
        let cell = OnceLock::new();
        let _ = cell.set(Ok(c));
        Grammars { source: None, compiler: cell }
    }

    pub fn compiler(&self) -> Result<&Compiler, String> {
        self.compiler
            .get_or_init(|| {
                let path = self.source.as_ref().ok_or("no model to build a grammar compiler from")?;
                let bundle = ModelBundle::open(path).map_err(|e| format!("the model's tokenizer: {e}"))?;
                let vocab = vocabulary(&bundle.tokenizer).map_err(|e| e.to_string())?;
                Compiler::new(vocab, Limits::default()).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| format!("constrained decoding is unavailable: {e}"))
    }
}

/// The grammar engine's view of `tok`: each token's bytes, control tokens marked, the
/// end-of-generation ids as what a finished grammar allows.
pub fn vocabulary(tok: &Tokenizer) -> Result<Vocabulary, ConstrainError> {
    Vocabulary::from_pieces(tok.vocab_size(), tok.stop_token_ids(), |id| {
        let piece = tok.token_to_piece(id).unwrap_or_default();
        // A control token renders as nothing when special tokens are skipped.
        let special = !piece.is_empty() && tok.decode_bytes(&[id], true).map(|b| b.is_empty()).unwrap_or(true);
        (piece, special)
    })
}

/// One sequence's grammar state.
pub enum SeqGrammar {
    /// Not compiled yet; the last `replay` tokens of its history were generated before this
    /// admission and are committed first.
    Pending {
        constraint: Constraint,
        replay: usize,
    },
    Active(Box<SeqMatcher>),
    /// Ended with this error (reported for the sequence, which the coordinator then ends).
    Failed(String),
}

/// What a mask computation produced.
enum MaskState {
    Waiting,
    Ready(Vec<u32>),
    Failed,
}

/// A mask computed beside the forward pass; whoever samples the row waits for it.
pub struct MaskCell {
    state: Mutex<MaskState>,
    ready: Condvar,
}

impl std::fmt::Debug for MaskCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let what = match &*s {
            MaskState::Waiting => "waiting",
            MaskState::Ready(_) => "ready",
            MaskState::Failed => "failed",
        };
        f.write_str(what)
    }
}

impl MaskCell {
    fn new() -> Arc<Self> {
        Arc::new(MaskCell { state: Mutex::new(MaskState::Waiting), ready: Condvar::new() })
    }

    fn set(&self, s: MaskState) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = s;
        self.ready.notify_all();
    }

    /// Blocks until the mask is computed; `None` when it failed (the row's sequence ends
    /// with an error, so it may be sampled without a mask). Takes the mask: the second
    /// call returns `None`.
    pub fn wait_take(&self) -> Option<Vec<u32>> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        while matches!(*s, MaskState::Waiting) {
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        match std::mem::replace(&mut *s, MaskState::Failed) {
            MaskState::Ready(m) => Some(m),
            _ => None,
        }
    }
}

/// One constrained sampled row of a step: its sequence's grammar, moved out of the
/// executor for the step, and the cell its mask goes to.
pub struct MaskJob {
    pub run: usize,
    pub seq_id: u64,
    pub grammar: SeqGrammar,
    /// Tokens to commit before the mask (a re-admitted sequence's earlier output).
    replay: Vec<u32>,
    pub cell: Arc<MaskCell>,
    words: usize,
}

impl MaskJob {
    /// The job of run `run` (sequence `seq_id`) whose history up to and including this
    /// run's tokens is `history` (for a pending grammar's replay); `vocab` logits per row.
    pub fn new(
        run: usize,
        seq_id: u64,
        grammar: SeqGrammar,
        history: impl FnOnce(usize) -> Vec<u32>,
        vocab: usize,
    ) -> Self {
        let replay = match &grammar {
            SeqGrammar::Pending { replay, .. } if *replay > 0 => history(*replay),
            _ => Vec::new(),
        };
        MaskJob { run, seq_id, grammar, replay, cell: MaskCell::new(), words: mask_words(vocab) }
    }

    /// Compiles (if pending), replays, and computes the mask into the cell. A failure
    /// (or a panic in the grammar engine) marks the grammar failed and the cell failed.
    fn compute(&mut self, grammars: Option<&Grammars>) {
        let grammar = std::mem::replace(&mut self.grammar, SeqGrammar::Failed(String::new()));
        let replay = std::mem::take(&mut self.replay);
        let words = self.words;
        let r = catch_unwind(AssertUnwindSafe(move || -> Result<(SeqMatcher, Vec<u32>), String> {
            let mut m = match grammar {
                SeqGrammar::Active(m) => *m,
                SeqGrammar::Pending { constraint, .. } => {
                    let g = grammars.ok_or("constrained decoding is not available on this worker")?;
                    let mut m = g.compiler()?.compile(&constraint).map_err(|e| e.to_string())?;
                    m.replay(&replay).map_err(|e| e.to_string())?;
                    m
                }
                SeqGrammar::Failed(e) => return Err(e),
            };
            let mut mask = vec![0u32; words];
            m.fill_mask(&mut mask).map_err(|e| e.to_string())?;
            Ok((m, mask))
        }));
        match r {
            Ok(Ok((m, mask))) => {
                self.grammar = SeqGrammar::Active(Box::new(m));
                self.cell.set(MaskState::Ready(mask));
            }
            Ok(Err(e)) => {
                self.grammar = SeqGrammar::Failed(e);
                self.cell.set(MaskState::Failed);
            }
            Err(_) => {
                self.grammar = SeqGrammar::Failed("the grammar engine failed".into());
                self.cell.set(MaskState::Failed);
            }
        }
    }
}

/// Computes every job's mask in order (one thread: a step rarely has more than a few
/// constrained rows, and the forward pass has the other cores).
pub fn compute_masks(jobs: &mut [MaskJob], grammars: Option<&Grammars>) {
    for j in jobs {
        j.compute(grammars);
    }
}

/// Sets the logits of every token `mask` does not allow to -inf (`mask` covers
/// `logits.len()` ids; ids past it are banned).
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits >> b & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};

    #[test]
    fn apply_mask_bans_exactly_the_cleared_bits() {
        let mut r = ChaCha8Rng::seed_from_u64(3);
        for vocab in [1usize, 31, 32, 33, 1000, 49_152] {
            let logits: Vec<f32> = (0..vocab).map(|_| (r.next_u32() % 2000) as f32 / 100.0 - 10.0).collect();
            // A mask one word short of the vocabulary for odd sizes: the ids past it are banned.
            let words = if vocab % 2 == 1 { vocab / 32 } else { vocab.div_ceil(32) };
            let mask: Vec<u32> = (0..words).map(|_| r.next_u32() & r.next_u32()).collect();
            let mut got = logits.clone();
            apply_mask(&mut got, &mask);
            for t in 0..vocab {
                let allowed = t / 32 < mask.len() && (mask[t / 32] >> (t % 32)) & 1 == 1;
                let want = if allowed { logits[t] } else { f32::NEG_INFINITY };
                assert_eq!(got[t].to_bits(), want.to_bits(), "vocab {vocab} token {t}");
            }
        }
    }

    #[test]
    fn a_mask_cell_hands_its_mask_to_one_waiter() {
        let cell = MaskCell::new();
        let setter = cell.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            setter.set(MaskState::Ready(vec![7, 9]));
        });
        assert_eq!(cell.wait_take(), Some(vec![7, 9]));
        assert_eq!(cell.wait_take(), None);
        t.join().expect("setter");
        let failed = MaskCell::new();
        failed.set(MaskState::Failed);
        assert_eq!(failed.wait_take(), None);
    }
}
