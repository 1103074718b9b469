//! The CUDA platform: CUDA C kernels (`kernels/cuda/*.cu`) compiled at start by NVRTC for
//! the device's exact arch (`sm_90a` on Hopper) and cached on disk, cuBLASLt for GEMMs.
//! Storage is bf16, arithmetic f32; every op is checked against [`crate::cpu`].
//!
//! The API is the same whether or not the `cuda` feature is compiled in, so callers never
//! write `#[cfg]`: without it [`Device::new`] returns [`KernelError::NotCompiled`] and the
//! other types cannot be constructed. With it, the CUDA libraries are loaded at run time
//! (cudarc's dynamic loading): the binary builds and starts on machines without a toolkit,
//! and `Device::new` there is a clear error, not a crash.
//!
//! Submodules: `arch` and `module_cache` (pure, always built and tested); with the feature,
//! `sources` (the embedded .cu text), `nvrtc` (compile + cache), `device` (context, stream,
//! buffers, loaded kernels), `ops` (launchers), `gemm` (cuBLASLt), `gemv` (the decode GEMM
//! for at most 8 rows, which `gemm` routes to), `attention` (paged attention launchers),
//! `qkv` (fused Q/K/V preparation), `init` (random fill), `inputs` (a decode step's small
//! inputs: pinned staging, its copies, the packed upload's split), `marks` (GPU timestamps
//! for benchmarks), `sampling` (token sampling), `nccl` (all-reduce across the GPUs of a
//! tensor-parallel group), `nccl_p2p` (pipeline send/recv and the all-gather of logit
//! shards), `ipc_allreduce` (the one-shot all-reduce over peer memory); without it, `stub`.
//! Always built: `copy2d` (the strided block copy's bounds), `paged` (the attention batch
//! description and split planning), `qkv_args` (the inputs of the fused Q/K/V preparation),
//! `sample_params` (sampling parameters and results, CPU copies of the kernel's rules) and
//! `nccl_id` (the id that names an NCCL communicator, relayed between ranks as hex).
//!
//! [`KernelError::NotCompiled`]: crate::KernelError::NotCompiled

pub mod arch;
mod copy2d;
pub mod module_cache;
pub mod paged;

#[cfg(feature = "cuda")]
mod attention;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod gemm;
#[cfg(feature = "cuda")]
mod gemv;
#[cfg(feature = "cuda")]
mod gemv_fused;
#[cfg(feature = "cuda")]
mod graph;
#[cfg(feature = "cuda")]
mod init;
#[cfg(feature = "cuda")]
mod inputs;
#[cfg(feature = "cuda")]
mod launch_ex;
#[cfg(feature = "cuda")]
mod marks;
#[cfg(feature = "cuda")]
mod nccl;
// One-shot all-reduce over peer memory (small TP messages); `ipc_record` (always built)
// holds its setup records and region layout.
#[cfg(feature = "cuda")]
mod ipc_allreduce;
#[cfg(not(feature = "cuda"))]
mod ipc_allreduce_stub;
pub mod ipc_record;
mod nccl_id;
#[cfg(feature = "cuda")]
mod nccl_p2p;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod qkv;
pub(crate) mod qkv_args;
pub mod sample_params;
#[cfg(feature = "cuda")]
mod sampling;
// The HIP backend (crate::hip) compiles the same sources.
#[cfg(any(feature = "cuda", feature = "hip"))]
pub(crate) mod sources;
#[cfg(not(feature = "cuda"))]
mod stub;
// Constrained decoding's logit mask (`Device::apply_token_mask`; stubbed without the feature).
mod token_mask;

pub use arch::Arch;
/// Most chunks `Device::matmul_parts` cuts a GEMM's inner dimension into.
pub const MAX_SPLITS: usize = 8;
#[cfg(feature = "cuda")]
pub use attention::DecodeWorkspace;
pub use copy2d::Copy2d;
#[cfg(feature = "cuda")]
pub use device::{Buf, Device, RopeCache};
#[cfg(feature = "cuda")]
pub use graph::Graph;
#[cfg(feature = "cuda")]
pub use inputs::HostStage;
#[cfg(feature = "cuda")]
pub use ipc_allreduce::{IpcAllReduce, ONESHOT_BLOCKS, ONESHOT_DEFAULT_MAX_BYTES, ONESHOT_TIMEOUT_NS};
#[cfg(not(feature = "cuda"))]
pub use ipc_allreduce_stub::{IpcAllReduce, ONESHOT_BLOCKS, ONESHOT_DEFAULT_MAX_BYTES, ONESHOT_TIMEOUT_NS};
#[cfg(feature = "cuda")]
pub use marks::Marks;
pub use module_cache::{ImageKind, ModuleCache, ModuleReport};
#[cfg(feature = "cuda")]
pub use nccl::NcclComm;
pub use nccl_id::{NcclId, NCCL_ID_BYTES};
#[cfg(feature = "cuda")]
pub use nccl_p2p::NcclElem;
pub use paged::{DecodePlan, PagedBatch, HEAD_DIMS};
pub use qkv_args::QkvPrep;
pub use sample_params::{SampleParams, SamplePaths, SampledRow, FROM_SAMPLED};
#[cfg(feature = "cuda")]
pub use sampling::{Completion, SampleOutput};
#[cfg(not(feature = "cuda"))]
pub use stub::{Buf, Completion, DecodeWorkspace, Device, Graph, HostStage, Marks, NcclComm, RopeCache, SampleOutput};

/// `bf16` as the CUDA platform stores activations and weights.
pub use half::bf16;

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
    impl Sealed for u32 {}
}

/// Element types a device buffer can hold: `bf16` tensors, `f32` tables, `u32` ids and
/// positions.
#[cfg(feature = "cuda")]
pub trait Elem:
    sealed::Sealed + Copy + Send + Sync + 'static + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits
{
}
/// Element types a device buffer can hold: `bf16` tensors, `f32` tables, `u32` ids and
/// positions.
#[cfg(not(feature = "cuda"))]
pub trait Elem: sealed::Sealed + Copy + Send + Sync + 'static {}

impl Elem for half::bf16 {}
impl Elem for f32 {}
impl Elem for u32 {}

#[cfg(test)]
mod tests {
    /// Without the feature the backend reports itself as not compiled, by name.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn device_new_without_feature_is_not_compiled() {
        match super::Device::new(0) {
            Err(crate::KernelError::NotCompiled(name)) => assert_eq!(name, "cuda"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("a device without the cuda feature"),
        }
    }
}
