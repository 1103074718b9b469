//! One grammar compiler per model: llguidance's parser factory over the model's
//! [`Vocabulary`], with limits that bound the work any one grammar can cause, so a
//! pathological schema or pattern fails fast instead of stalling a worker.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use llguidance::api::ParserLimits;
use llguidance::{Matcher, ParserFactory};

use crate::constraint::Constraint;
use crate::error::ConstrainError;
use crate::matcher::{mask_allows, mask_words, SeqMatcher};
use crate::vocab::Vocabulary;

/// Bounds on the work one grammar may cause (llguidance's "fuel" units; its documented
/// speeds are about 50k initial lexer fuel and 14k step fuel per millisecond).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Building the lexer's regex nodes for the whole grammar.
    pub initial_lexer_fuel: u64,
    /// Lexer work for one token mask.
    pub step_lexer_fuel: u64,
    /// Earley items for one token mask.
    pub step_max_items: usize,
    /// Lexer (DFA) states over the sequence's life: bounds memory.
    pub max_lexer_states: usize,
    /// Symbols in the compiled grammar (a schema's repetition bounds are expanded into it).
    pub max_grammar_size: usize,
}

impl Default for Limits {
    /// About 20 ms to build a lexer, 15 ms per mask at worst, a few megabytes per grammar.
    fn default() -> Self {
        Self {
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 200_000,
            step_max_items: 50_000,
            max_lexer_states: 100_000,
            max_grammar_size: 200_000,
        }
    }
}

/// Masks computed by [`Compiler::check`]'s dry run.
pub const DRY_RUN_STEPS: usize = 8;

/// Walks `m` for up to [`DRY_RUN_STEPS`] masks, committing a pseudo-random allowed token
/// (not an end-of-sequence id) after each.
fn dry_run(mut m: SeqMatcher, vocab: &Vocabulary) -> Result<(), ConstrainError> {
    let n = vocab.size();
    let mut mask = vec![0u32; mask_words(n)];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..DRY_RUN_STEPS {
        m.fill_mask(&mut mask)?;
        if m.is_finished() {
            break;
        }
        let allowed: Vec<u32> =
            (0..n as u32).filter(|&t| mask_allows(&mask, t) && !vocab.eos_ids().contains(&t)).collect();
        if allowed.is_empty() {
            break;
        }
        // xorshift64: any spread of choices will do, the same every time.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        m.commit(allowed[(state % allowed.len() as u64) as usize])?;
    }
    Ok(())
}

/// Compiles constraints for one model. Cheap to clone; share one per model.
#[derive(Clone)]
pub struct Compiler {
    inner: Arc<Inner>,
}

struct Inner {
    factory: ParserFactory,
    vocab: Vocabulary,
}

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiler").field("vocab", &self.inner.vocab).finish()
    }
}

impl Compiler {
    /// The compiler for `vocab` under `limits` (builds llguidance's token-slicing tables:
    /// tens of milliseconds for a 50k vocabulary, so build it once per model).
    pub fn new(vocab: Vocabulary, limits: Limits) -> Result<Self, ConstrainError> {
        let mut factory =
            ParserFactory::new_simple(vocab.env()).map_err(|e| ConstrainError::Vocabulary(e.to_string()))?;
        factory.quiet();
        let l = factory.limits_mut();
        *l = ParserLimits {
            initial_lexer_fuel: limits.initial_lexer_fuel,
            step_lexer_fuel: limits.step_lexer_fuel,
            step_max_items: limits.step_max_items,
            max_lexer_states: limits.max_lexer_states,
            max_grammar_size: limits.max_grammar_size,
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self { inner: Arc::new(Inner { factory, vocab }) })
    }

    pub fn vocab(&self) -> &Vocabulary {
        &self.inner.vocab
    }

    /// A fresh matcher for one sequence following `c`.
    pub fn compile(&self, c: &Constraint) -> Result<SeqMatcher, ConstrainError> {
        let grammar = c.to_grammar()?;
        let invalid = |message: String| ConstrainError::Invalid { kind: c.kind(), message };
        // llguidance reports errors as values, but a panic on odd input must not take the
        // caller (a worker thread) down with it.
        let parser = catch_unwind(AssertUnwindSafe(|| self.inner.factory.create_parser(grammar)))
            .map_err(|_| invalid("the grammar engine failed on it".into()))?
            .map_err(|e| invalid(e.to_string()))?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(invalid(e));
        }
        Ok(SeqMatcher::new(m, self.inner.vocab.clone()))
    }

    /// Whether `c` compiles and survives a short dry run within `budget` (the gateway's
    /// admission check): its first [`DRY_RUN_STEPS`] masks, each followed by a
    /// pseudo-random allowed token, so a grammar that only blows up once generation enters
    /// it fails here rather than in a worker. Runs on a helper thread; on timeout that
    /// thread is left to finish on its own, bounded by the [`Limits`].
    pub fn check(&self, c: &Constraint, budget: Duration) -> Result<(), ConstrainError> {
        let (tx, rx) = mpsc::channel();
        let this = self.clone();
        let job = c.clone();
        std::thread::Builder::new()
            .name("constraint-check".into())
            .spawn(move || {
                let r = this.compile(&job).and_then(|m| {
                    dry_run(m, this.vocab()).map_err(|e| match e {
                        ConstrainError::Matcher(message) => ConstrainError::Invalid { kind: job.kind(), message },
                        other => other,
                    })
                });
                let _ = tx.send(r);
            })
            .map_err(|e| ConstrainError::Matcher(format!("cannot start a check thread: {e}")))?;
        match rx.recv_timeout(budget) {
            Ok(r) => r,
            Err(_) => Err(ConstrainError::TooSlow { kind: c.kind(), millis: budget.as_millis() as u64 }),
        }
    }
}
