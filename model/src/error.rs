//! `ModelError`: the one error type callers of this crate see. Each reader keeps its own
//! error enum (named for its format, with offsets or keys); this wraps them unchanged.

use std::path::PathBuf;

use crate::config::ConfigError;
use crate::gguf::GgufError;
use crate::hf::HfError;
use crate::safetensors::SafeTensorsError;

/// Why a model could not be opened or a tensor not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    SafeTensors(#[from] SafeTensorsError),
    #[error(transparent)]
    Hf(#[from] HfError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("missing tensor {name} (looked up as `{looked_up}` in the {format} file)")]
    MissingTensor { name: String, looked_up: String, format: &'static str },
    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("{path}: {reason}")]
    Path { path: PathBuf, reason: String },
}
