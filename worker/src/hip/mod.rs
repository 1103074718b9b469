//! The HIP backend of the worker (AMD GPUs): [`HipModel`] runs one model on one GPU over the
//! kernels of `tessera_kernels::hip` (the CUDA kernel sources compiled by hipRTC, rocBLAS
//! GEMMs); logits come back to the host and are sampled by the CPU sampler. `--device hip[:N]`
//! asks for it; `--device auto` takes it when the runtime sees an AMD GPU (and no NVIDIA one).
//! [`probe`] opens the GPU and compiles (or reads from the cache) every kernel module for its
//! arch, so a worker learns at start whether the toolchain works.
//!
//! Without the `hip` feature every entry point says HIP was not compiled in ([`NOT_COMPILED`]).
//! Not here yet: tensor/pipeline parallelism (RCCL exists in the kernels crate), graphs, GPU
//! sampling. Nothing of it has run on an AMD GPU (see model.rs).

#[cfg(feature = "hip")]
mod model;
#[cfg(not(feature = "hip"))]
mod stub;

#[cfg(feature = "hip")]
pub use model::{unsupported, HipModel, HEAD_DIMS};
#[cfg(not(feature = "hip"))]
pub use stub::HipModel;

use tessera_kernels::KernelError;

use crate::error::WorkerError;

/// The message of a build without the `hip` feature.
pub const NOT_COMPILED: &str = "HIP support was not compiled in (build with --features hip)";

/// Maps the kernels' "not compiled" error to [`NOT_COMPILED`]; other errors pass through.
fn worker_error(e: KernelError) -> WorkerError {
    match e {
        KernelError::NotCompiled("hip") => WorkerError::Unavailable(NOT_COMPILED.into()),
        e => WorkerError::Kernel(e),
    }
}

/// AMD GPUs the HIP runtime sees: 0 without the feature, without the runtime or without a GPU
/// (what `--device auto` asks).
pub fn gpu_count() -> usize {
    tessera_kernels::hip::device_count().unwrap_or(0)
}

/// Opens AMD GPU `ordinal` and loads every kernel module for its arch; returns a one-line
/// description (device, arch, wavefront, modules and how many came from the cache).
pub fn probe(ordinal: usize) -> Result<String, WorkerError> {
    #[cfg(feature = "hip")]
    {
        let mut dev = tessera_kernels::hip::Device::new(ordinal).map_err(worker_error)?;
        let cache = tessera_kernels::cuda::ModuleCache::default_location();
        let reports = dev.load_modules(&cache).map_err(worker_error)?;
        let hits = reports.iter().filter(|r| r.cache_hit).count();
        let ms: f64 = reports.iter().map(|r| r.millis).sum();
        Ok(format!(
            "{} (GPU {ordinal}, {}, {}-lane wavefronts): {} kernel modules ({hits} from {}) in {ms:.0} ms",
            dev.name(),
            dev.arch(),
            dev.wavefront_size(),
            reports.len(),
            cache.dir().display()
        ))
    }
    #[cfg(not(feature = "hip"))]
    {
        let _ = ordinal;
        Err(worker_error(KernelError::NotCompiled("hip")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(not(feature = "hip"))]
    #[test]
    fn without_the_feature_the_probe_and_the_loader_say_how_to_build() {
        let msg = probe(0).expect_err("a HIP device without the feature").to_string();
        assert_eq!(msg, NOT_COMPILED);
        assert_eq!(gpu_count(), 0);
    }

    #[cfg(feature = "hip")]
    #[test]
    fn with_the_feature_a_machine_without_an_amd_gpu_gets_a_clear_error() {
        match probe(0) {
            Ok(found) => eprintln!("skipped: an AMD GPU is present: {found}"),
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.contains("not compiled"), "{msg}");
                assert!(msg.contains("HIP runtime"), "{msg}");
                assert_eq!(gpu_count(), 0);
            }
        }
    }

    #[cfg(feature = "hip")]
    #[test]
    fn head_dims_outside_the_attention_kernel_are_refused_before_the_gpu() {
        let mut c = crate::cuda::shapes::synthetic_config("smollm2-135m").expect("a known shape");
        assert_eq!(c.head_dim, 64);
        assert!(unsupported(&c).is_none());
        c.head_dim = 96;
        let why = unsupported(&c).expect("96 is not instantiated");
        assert!(why.contains("head_dim 96"), "{why}");
    }
}
