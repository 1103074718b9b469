//! The grammar state of one sequence: which tokens may come next (a packed bitmask over the
//! logits row) and the tokens sampled so far. Forward only: every committed token must be
//! one the last mask allowed, so nothing is ever rolled back.

use llguidance::Matcher;

use crate::error::ConstrainError;
use crate::vocab::Vocabulary;

/// `u32` words in the mask of `n` token ids.
pub fn mask_words(n: usize) -> usize {
    n.div_ceil(32)
}

/// Whether `mask` allows token `t` (ids past the mask are not allowed).
pub fn mask_allows(mask: &[u32], t: u32) -> bool {
    mask.get((t / 32) as usize).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// One sequence's matcher (see the crate docs). Moves between threads; not shared.
pub struct SeqMatcher {
    m: Matcher,
    vocab: Vocabulary,
    /// Tokens committed so far.
    committed: usize,
}

impl std::fmt::Debug for SeqMatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqMatcher")
            .field("committed", &self.committed)
            .field("finished", &self.is_finished())
            .field("error", &self.m.get_error())
            .finish()
    }
}

impl SeqMatcher {
    pub(crate) fn new(m: Matcher, vocab: Vocabulary) -> Self {
        Self { m, vocab, committed: 0 }
    }

    fn failed(&self, what: &str, e: impl std::fmt::Display) -> ConstrainError {
        ConstrainError::Matcher(format!("{what} after {} tokens: {e}", self.committed))
    }

    /// Writes the allowed next tokens into `out` (bit `t` set = token `t` allowed; the words
    /// past the vocabulary are cleared, so a logits row wider than the vocabulary keeps its
    /// padding ids banned). Once the grammar is complete only the end-of-sequence ids are
    /// allowed. Takes from microseconds to a few milliseconds: run it beside the forward pass.
    pub fn fill_mask(&mut self, out: &mut [u32]) -> Result<(), ConstrainError> {
        out.fill(0);
        if self.m.is_stopped() {
            if let Some(e) = self.m.get_error() {
                return Err(self.failed("mask", e));
            }
            for &id in self.vocab.eos_ids() {
                if let Some(w) = out.get_mut((id / 32) as usize) {
                    *w |= 1 << (id % 32);
                }
            }
            return Ok(());
        }
        let mask = self.m.compute_mask().map_err(|e| self.failed("mask", e))?;
        let words = mask.as_slice();
        let n = words.len().min(out.len());
        out[..n].copy_from_slice(&words[..n]);
        if out.iter().all(|&w| w == 0) {
            return Err(self.failed("mask", "the grammar allows no token here"));
        }
        Ok(())
    }

    /// Advances the grammar by the sampled `token`, which the last mask allowed. An
    /// end-of-sequence id after the grammar completed is accepted and changes nothing.
    pub fn commit(&mut self, token: u32) -> Result<(), ConstrainError> {
        if self.m.is_stopped() {
            if let Some(e) = self.m.get_error() {
                return Err(self.failed("commit", e));
            }
            if !self.vocab.eos_ids().contains(&token) {
                return Err(self.failed("commit", format!("token {token} after the grammar was complete")));
            }
        } else {
            let taken = self.m.try_consume_tokens(&[token]).map_err(|e| self.failed("commit", e))?;
            if taken != 1 {
                return Err(self.failed("commit", format!("the grammar does not allow token {token}")));
            }
        }
        self.committed += 1;
        Ok(())
    }

    /// Commits tokens generated before this matcher existed (a sequence re-admitted after a
    /// preemption or a migration), in order.
    pub fn replay(&mut self, tokens: &[u32]) -> Result<(), ConstrainError> {
        tokens.iter().try_for_each(|&t| self.commit(t))
    }

    /// Whether the grammar is complete: only end-of-sequence ids are allowed from here.
    pub fn is_finished(&self) -> bool {
        self.m.is_stopped() && !self.m.is_error()
    }

    /// Whether the grammar may end here (an end-of-sequence id is allowed next).
    pub fn is_accepting(&mut self) -> bool {
        self.m.is_stopped() || self.m.is_accepting().unwrap_or(false)
    }

    /// Tokens committed so far.
    pub fn committed(&self) -> usize {
        self.committed
    }
}
