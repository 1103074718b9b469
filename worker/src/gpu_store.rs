//! What the GPU backends' shared host code asks of a device: bf16 buffers (from host data or
//! zeroed) and a model's RoPE table. The CUDA device implements it here, the HIP device in
//! crate::hip; the weight loader (cuda/weights.rs) and the step activations
//! (cuda/forward.rs's `Scratch`) are written once against it.

use tessera_kernels::cpu::rope::RopeParams;
use tessera_kernels::cuda::{bf16, Buf, Device, RopeCache};

use crate::error::WorkerError;

pub(crate) trait GpuStore {
    /// A device buffer of bf16 values.
    type Buf;
    /// The device's (cos, sin) table of a model's RoPE.
    type Rope;

    /// A device copy of `host`, a model weight (CUDA: allocated on 2 MiB boundaries,
    /// `Device::alloc_weight`).
    fn put(&self, host: &[bf16]) -> Result<Self::Buf, WorkerError>;
    /// `len` zeroed values.
    fn zeros(&self, len: usize) -> Result<Self::Buf, WorkerError>;
    /// The RoPE table of `params` for positions `0..positions`.
    fn rope_table(&self, params: &RopeParams, positions: usize) -> Result<Self::Rope, WorkerError>;
}

impl GpuStore for Device {
    type Buf = Buf<bf16>;
    type Rope = RopeCache;

    fn put(&self, host: &[bf16]) -> Result<Buf<bf16>, WorkerError> {
        Ok(self.upload_weight(host)?)
    }

    fn zeros(&self, len: usize) -> Result<Buf<bf16>, WorkerError> {
        Ok(self.alloc(len)?)
    }

    fn rope_table(&self, params: &RopeParams, positions: usize) -> Result<RopeCache, WorkerError> {
        Ok(self.rope_cache(params, positions)?)
    }
}
