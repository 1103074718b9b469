//! Constrained decoding for Tessera (structured outputs): everything that touches the
//! `llguidance` grammar engine lives here, so the gateway and the worker share one idea of
//! what a constraint is and how it is checked.
//!
//! - [`Vocabulary`]: the model's tokens as byte strings (special tokens marked), built once
//!   per model from the tokenizer and turned into llguidance's token trie.
//! - [`Compiler`]: one per model (cheap to clone); compiles a [`Constraint`] into a
//!   per-sequence [`SeqMatcher`] under limits that make pathological grammars fail fast,
//!   and [`Compiler::check`]s one within a wall-clock budget (the gateway's 400).
//! - [`SeqMatcher`]: the grammar state of one sequence: the packed allowed-token bitmask for
//!   the next token ([`SeqMatcher::fill_mask`]), [`SeqMatcher::commit`] of the sampled token,
//!   and [`SeqMatcher::is_finished`] (then only the end-of-sequence ids are allowed).
//!
//! Masks are `u32` words, bit `t % 32` of word `t / 32` set when token `t` is allowed
//! ([`mask_words`] words for a vocabulary of `n` ids). The matcher never rolls back: every
//! committed token was allowed by the mask it was sampled under.

mod compiler;
mod complexity;
mod constraint;
mod error;
mod matcher;
mod vocab;

pub use compiler::{Compiler, Limits, DRY_RUN_STEPS};
pub use complexity::MAX_UNROLLED;
pub use constraint::Constraint;
pub use error::ConstrainError;
pub use matcher::{mask_allows, mask_words, SeqMatcher};
pub use vocab::Vocabulary;
