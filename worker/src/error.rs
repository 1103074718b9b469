//! Errors of the worker crate: loading a model, running a forward pass, sampling.

use tessera_kernels::KernelError;
use tessera_model::error::ModelError;

/// What the worker reports to its caller.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Sampling(#[from] crate::sampling::SamplingError),
    /// A tensor's shape disagrees with the config (wrong file, or a file that lies).
    #[error("tensor {name}: expected {expected}, found {found}")]
    TensorShape { name: String, expected: String, found: String },
    /// A tensor- or pipeline-parallel peer failed, timed out or broke the protocol.
    #[error("collective: {0}")]
    Collective(String),
    /// The device asked for cannot be used by this build or machine (the message says why).
    #[error("{0}")]
    Unavailable(String),
    /// A batch that cannot be run (token id out of range, block table too short...).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
}
