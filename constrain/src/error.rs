//! What can go wrong with a constraint: the client's grammar (refused before admission)
//! or a matcher that failed during generation (ends that one sequence).

/// Errors of constraint compilation and matching.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConstrainError {
    /// The schema / grammar / pattern is malformed or unsupported (the client's fault).
    #[error("invalid {kind}: {message}")]
    Invalid { kind: &'static str, message: String },
    /// Compiling it, or computing its first mask, did not finish within the budget.
    #[error("{kind} is too complex: it did not compile within {millis} ms")]
    TooSlow { kind: &'static str, millis: u64 },
    /// The vocabulary cannot be used (empty, no end-of-sequence id, ids out of range).
    #[error("vocabulary: {0}")]
    Vocabulary(String),
    /// The matcher failed during generation: a token outside the mask was committed, or
    /// the grammar engine hit a limit or an internal error.
    #[error("constraint matcher: {0}")]
    Matcher(String),
}
