//! What can go wrong while building a tokenizer or running it. Every variant names the
//! metadata key, token id or file involved, so a bad model is diagnosable from the message.

use std::path::PathBuf;

/// A tokenizer that cannot be built, or input it cannot handle.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer metadata: required key `{0}` is missing")]
    MissingKey(&'static str),
    #[error("tokenizer metadata: `{key}` should be {expected}")]
    WrongType { key: &'static str, expected: &'static str },
    #[error("unsupported tokenizer model `{0}` (Tessera supports `gpt2` BPE and `llama` SentencePiece)")]
    UnsupportedModel(String),
    #[error("unsupported pre-tokenizer `{0}` (supported: {supported})", supported = super::pretokenize::SUPPORTED_NAMES)]
    UnsupportedPreTokenizer(String),
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),
    #[error("token id {id} is outside the vocabulary (size {size})")]
    TokenOutOfRange { id: u32, size: usize },
    #[error("pre-tokenizer pattern `{pattern}` failed: {reason}")]
    Regex { pattern: String, reason: String },
    #[error("no token for byte {0:#04x}: the vocabulary has neither a byte token nor an unknown token")]
    NoByteToken(u8),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error("Hugging Face tokenizer: {0}")]
    Hf(String),
}

/// Shorthand for this module's results.
pub type Result<T> = std::result::Result<T, TokenizerError>;
