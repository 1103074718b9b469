//! The HIP platform for AMD GPUs, behind the `hip` cargo feature: the SAME kernel sources as
//! CUDA (kernels/cuda/*.cu) compiled at start by hipRTC for the device's gfx arch through a
//! small compatibility header (kernels/hip/compat.h), cached on disk like the CUDA modules,
//! GEMMs through rocBLAS and collectives through RCCL.
//!
//! Every ROCm library is loaded at run time (libloading, hand-declared functions; ffi.rs says
//! why not the `hip-sys` crate), so a `--features hip` binary builds without ROCm and starts on
//! any machine; there [`Device::new`] is a clear "not available" error. Without the feature,
//! [`Device::new`] returns [`KernelError::NotCompiled`]`("hip")`.
//!
//! State (issue 9): device memory, module compile + load + launch, rocBLAS GEMMs (bf16 or
//! f32 out), RCCL collectives, launch shapes for 64-lane wavefronts, and launchers for every
//! op of the worker's forward pass (worker/src/hip): RMSNorm and its fused residual add, the
//! embedding gather, SwiGLU, the fused Q/K/V preparation (qkv.cu's general kernel) and paged
//! attention. attention.cu's tensor-core prefill/decode and gemv.cu are NVIDIA only: the HIP
//! build of attention.cu compiles a portable kernel instead (`attention`), and every GEMM goes
//! to rocBLAS. The sampling kernels compile for HIP but have no launcher here (the HIP worker
//! samples on the host). Nothing here has run on an AMD GPU: CI compiles every module for
//! gfx90a and runs the GPU-free tests; the GPU tests (kernels/tests/hip_*.rs) need
//! TESSERA_HIP_TESTS=1.
//!
//! Submodules: `gfx` (arch parsing) and `launch` (launch shapes), pure and always built; with
//! the feature `ffi` (the loaded libraries), `sources` (compat header + CUDA sources), `rtc`
//! (hipRTC compile + cache), `device`, `ops` (row and elementwise ops), `qkv`, `attention`,
//! `blas` (rocBLAS), `rccl`;
//! without it `stub`.
//!
//! [`KernelError::NotCompiled`]: crate::KernelError::NotCompiled

pub mod gfx;
pub mod launch;

#[cfg(feature = "hip")]
pub mod attention;
#[cfg(feature = "hip")]
mod blas;
#[cfg(feature = "hip")]
mod device;
#[cfg(feature = "hip")]
pub mod ffi;
#[cfg(feature = "hip")]
pub mod ops;
#[cfg(feature = "hip")]
pub mod qkv;
#[cfg(feature = "hip")]
mod rccl;
#[cfg(feature = "hip")]
pub mod rtc;
#[cfg(feature = "hip")]
pub mod sources;
#[cfg(not(feature = "hip"))]
mod stub;

#[cfg(feature = "hip")]
pub use blas::Blas;
#[cfg(feature = "hip")]
pub use device::{device_count, DevBuf, Device, Kernel};
pub use gfx::GfxArch;
pub use launch::LaunchShape;
#[cfg(feature = "hip")]
pub use qkv::{QkvInputs, RopeTable};
#[cfg(feature = "hip")]
pub use rccl::{unique_id as rccl_unique_id, RcclComm, RcclElem};
#[cfg(not(feature = "hip"))]
pub use stub::{device_count, Device};

pub use half::bf16;

/// Element types a HIP device buffer can hold: the CUDA platform's (`bf16`, `f32`, `u32`),
/// one sealed list for both backends.
pub use crate::cuda::Elem;

#[cfg(test)]
mod tests {
    /// Without the feature the backend reports itself as not compiled, by name.
    #[cfg(not(feature = "hip"))]
    #[test]
    fn device_new_without_feature_is_not_compiled() {
        match super::Device::new(0) {
            Err(crate::KernelError::NotCompiled(name)) => assert_eq!(name, "hip"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a device without the hip feature"),
        }
        assert!(matches!(super::device_count(), Err(crate::KernelError::NotCompiled("hip"))));
    }
}
