//! What can be wrong with a GGUF file. Every variant says where: the key or tensor being
//! read and, for structural problems, the byte offset, so a bad file can be inspected
//! with a hex dump.

use std::path::PathBuf;

/// A GGUF file that cannot be read or written.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: starts with {found}, expected \"GGUF\"")]
    BadMagic { found: String },
    #[error("unsupported GGUF version {0} (Tessera reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("big-endian GGUF files are not supported (version field reads {0} when byte-swapped)")]
    BigEndian(u32),
    #[error("file ends early while reading {what} at offset {offset}: {need} bytes needed, {left} left")]
    Truncated { what: String, offset: u64, need: u64, left: u64 },
    #[error("{what} at offset {offset} claims {count} entries, but the {left} bytes left cannot hold more than {max}")]
    CountTooLarge { what: String, offset: u64, count: u64, left: u64, max: u64 },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("{what} at offset {offset} has unknown value type id {id}")]
    BadValueType { what: String, offset: u64, id: u32 },
    #[error("{what} at offset {offset} is a bool stored as {byte}, expected 0 or 1")]
    BadBool { what: String, offset: u64, byte: u8 },
    #[error("{what} at offset {offset} nests arrays deeper than {max} levels")]
    TooDeep { what: String, offset: u64, max: usize },
    #[error("metadata key `{0}` appears twice")]
    DuplicateKey(String),
    #[error("metadata `{key}`: {reason}")]
    BadMeta { key: String, reason: String },
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("tensor name `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("cannot write GGUF: {0}")]
    Write(String),
    #[error("cannot write GGUF: {0}")]
    WriteIo(#[from] std::io::Error),
}
