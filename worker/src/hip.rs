//! `--device hip[:N]`: what a worker can do on an AMD GPU today. The kernel-level HIP backend
//! (tessera_kernels::hip: hipRTC-compiled kernels, rocBLAS, RCCL) exists, but the model forward
//! pass (crate::cuda) is written against `kernels::cuda::Device`, so no model runs on HIP yet.
//! [`probe`] opens the GPU and compiles (or reads from the cache) every kernel module for its
//! arch, so a HIP machine learns at start whether the toolchain works; the worker then stops
//! with a message saying the forward pass is missing, instead of accepting Loads it cannot run.

use tessera_kernels::KernelError;

use crate::error::WorkerError;

/// The message of a build without the `hip` feature.
pub const NOT_COMPILED: &str = "HIP support was not compiled in (build with --features hip)";

/// What the worker says after a successful probe: why it still cannot serve.
pub const NO_FORWARD_PASS: &str = "the HIP backend has kernels, GEMM and collectives but no model forward pass yet \
     (issue 9: worker/src/cuda is written against the CUDA device); run this worker with --device cpu or on an \
     NVIDIA GPU";

/// Maps the kernels' "not compiled" error to [`NOT_COMPILED`]; other errors pass through.
fn worker_error(e: KernelError) -> WorkerError {
    match e {
        KernelError::NotCompiled("hip") => WorkerError::Unavailable(NOT_COMPILED.into()),
        e => WorkerError::Kernel(e),
    }
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
    fn without_the_feature_the_probe_says_how_to_build() {
        let msg = probe(0).err().expect("a HIP device without the feature").to_string();
        assert_eq!(msg, NOT_COMPILED);
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
            }
        }
    }
}
