//! Launchers of the shared kernels on an AMD GPU, sized by [`super::launch`] for the device's
//! wavefront. So far RMSNorm, the first op of a model step, as the end-to-end example; the rest
//! of CUDA's ops.rs (rope, embedding, the fused QKV preparation, sampling) take their shapes
//! from the same module once written. Attention is attention.rs.

use std::ffi::c_void;

use half::bf16;

use super::device::{DevBuf, Device};
use super::launch;
use crate::error::check;
use crate::KernelError;

/// Threads of the block-per-row norm (as CUDA's launcher uses).
const NORM_BLOCK_THREADS: u32 = 256;
/// Warps per block of the warp-per-row norm.
const NORM_ROWS_PER_BLOCK: u32 = 8;
/// Rows up to this wide take a warp each (the kernel's register path covers them).
const NORM_WARP_MAX_DIM: usize = 1024;

fn arg<T>(v: &T) -> *mut c_void {
    (v as *const T).cast_mut().cast()
}

/// `out = rms_norm(x) * w` over rows of `dim` (x, out `[n_rows, dim]`, w `[dim]`, bf16).
pub fn rms_norm(
    dev: &Device,
    out: &mut DevBuf<bf16>,
    x: &DevBuf<bf16>,
    w: &DevBuf<bf16>,
    n_rows: usize,
    eps: f32,
) -> Result<(), KernelError> {
    const OP: &str = "hip_rms_norm";
    let dim = w.len();
    check(dim > 0 && n_rows > 0 && n_rows <= i32::MAX as usize && dim <= i32::MAX as usize, OP, || {
        format!("{n_rows} rows of {dim}")
    })?;
    check(x.len() == n_rows * dim && out.len() == x.len(), OP, || {
        format!("x {} and out {} for {n_rows} rows of {dim}", x.len(), out.len())
    })?;
    let wave = dev.wavefront_size();
    let (name, shape) = if dim <= NORM_WARP_MAX_DIM {
        ("rms_norm_warp", launch::warp_per_row(n_rows, NORM_ROWS_PER_BLOCK, wave)?)
    } else {
        ("rms_norm_block", launch::block_per_row(n_rows, NORM_BLOCK_THREADS, wave)?)
    };
    let kernel = dev.function("norm", name)?;
    let (o, xp, wp) = (out.device_ptr(), x.device_ptr(), w.device_ptr());
    let (rows, d) = (n_rows as i32, dim as i32);
    let mut args = [arg(&o), arg(&xp), arg(&wp), arg(&rows), arg(&d), arg(&eps)];
    // SAFETY: the arguments match rms_norm_{warp,block}(bf16*, const bf16*, const bf16*, int,
    // int, float) in norm.cu and the buffers hold the checked sizes.
    unsafe { dev.launch(kernel, shape, &mut args) }
}
