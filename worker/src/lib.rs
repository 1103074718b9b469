//! The worker: loads a model's weights, keeps its KV cache and runs the forward pass
//! through `tessera-kernels`, then samples the next tokens.

pub mod backend;
pub mod batch;
pub mod collective;
pub mod constrained;
pub mod cuda;
pub mod error;
pub mod executor;
mod gpu_store;
pub mod hip;
pub mod kv_cache;
pub mod llama;
pub mod metrics;
pub mod op_profile;
pub mod parallel;
pub mod sampling;
pub mod service;
pub mod session;
pub mod shard;
mod step_index;
pub mod step_trace;
pub mod step_watch;
pub mod weights;

pub use error::WorkerError;

/// The default model for unit tests (one lookup rule for every crate's tests).
#[cfg(test)]
#[path = "../../tests/support/default_model.rs"]
mod test_model_path;
