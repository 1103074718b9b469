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
// Used by the GPU launchers only; a CPU-only build keeps it for its tests.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
mod launch_checks;
pub mod quant;

pub use error::KernelError;
pub use quant::{GgmlType, Weight};
