//! Host launcher of the random fill (`kernels/cuda/init.cu`): synthetic models get their
//! weights generated on the device, bit-identical to the CPU reference
//! [`crate::cpu::random::uniform`], instead of uploading gigabytes from the host.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::device::{dev_err, Buf, Device};
use crate::error::check;
use crate::KernelError;
use half::bf16;

/// Threads per block.
const BLOCK: usize = 256;
/// Grid cap: the kernel is grid-stride, this fills 132 SMs many times.
const MAX_GRID: usize = 1 << 16;

impl Device {
    /// Fills `buf` with `bf16(uniform(seed, i, lo, hi))` for every element `i`
    /// ([`crate::cpu::random::uniform`]): bit-identical to the CPU reference.
    pub fn fill_uniform(&self, buf: &mut Buf<bf16>, seed: u64, lo: f32, hi: f32) -> Result<(), KernelError> {
        const OP: &str = "cuda_fill_uniform";
        check(lo.is_finite() && hi.is_finite() && lo <= hi && (hi - lo).is_finite(), OP, || {
            format!("bounds [{lo}, {hi}) must be finite, ordered, and their difference finite")
        })?;
        if buf.is_empty() {
            return Ok(());
        }
        let n = buf.len() as u64;
        // One thread per 8-value vector (at least one block for the tail of short buffers).
        let blocks = (buf.len() / 8).div_ceil(BLOCK).clamp(1, MAX_GRID) as u32;
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK as u32, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.fill_uniform);
        b.arg(&mut buf.inner).arg(&n).arg(&seed).arg(&lo).arg(&hi);
        // SAFETY: argument types and order match the kernel, which writes only indices below
        // n = buf.len() (16-byte stores to a 256-byte-aligned allocation, then the tail).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }
}
