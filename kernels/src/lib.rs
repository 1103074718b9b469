//! Tessera's kernel API: a narrow set of ops (`rms_norm`, `rope`, `matmul`, attention,
//! `silu_mul`, embedding, ...) and the tensor formats they read.
//!
//! `cpu` is the reference implementation and the engine of GPU-less machines; every other
//! platform is checked against it. `cuda` (feature `cuda`) runs bf16 ops on NVIDIA GPUs and
//! exists in every build: without the feature its `Device::new` says so.

pub mod cpu;
pub mod cuda;
pub mod error;
pub mod hip;
pub mod quant;

pub use error::KernelError;
pub use quant::{GgmlType, Weight};
