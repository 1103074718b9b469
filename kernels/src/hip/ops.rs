//! Launchers of the shared row and elementwise kernels on an AMD GPU (norm.cu, embedding.cu,
//! activation.cu), sized by [`super::launch`] for the device's wavefront. Arguments are
//! checked by the rules CUDA's launchers use (crate::launch_checks). The fused Q/K/V
//! preparation is qkv.rs, attention attention.rs, GEMMs blas.rs.

use std::ffi::c_void;

use half::bf16;

use super::device::{DevBuf, Device};
use super::launch::{self, LaunchShape};
use crate::launch_checks::{embedding_shape, norm_args, silu_packed_shape, to_u32};
use crate::KernelError;

/// Threads of the block-per-row norm and of the gather and elementwise kernels (as CUDA's
/// launchers use).
const BLOCK_THREADS: u32 = 256;
/// Warps per block of the warp-per-row norm.
const NORM_ROWS_PER_BLOCK: u32 = 8;
/// Rows up to this wide take a warp each (the kernel's register path covers them).
const NORM_WARP_MAX_DIM: usize = 1024;

pub(crate) fn arg<T>(v: &T) -> *mut c_void {
    (v as *const T).cast_mut().cast()
}

/// The norm kernel for rows of `dim` (`rms_norm` or `add_rms_norm`, the `_warp` or
/// `_block` variant) and its launch shape.
pub fn norm_launch(base: &str, n_rows: usize, dim: usize, wave: u32) -> Result<(String, LaunchShape), KernelError> {
    if dim <= NORM_WARP_MAX_DIM {
        Ok((format!("{base}_warp"), launch::warp_per_row(n_rows, NORM_ROWS_PER_BLOCK, wave)?))
    } else {
        Ok((format!("{base}_block"), launch::block_per_row(n_rows, BLOCK_THREADS, wave)?))
    }
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
    let Some((rows, d)) = norm_args(OP, (out.len(), None, x.len(), w.len()), n_rows, eps)? else {
        return Ok(());
    };
    let (name, shape) = norm_launch("rms_norm", n_rows, w.len(), dev.wavefront_size())?;
    let kernel = dev.function("norm", &name)?;
    let (o, xp, wp) = (out.device_ptr(), x.device_ptr(), w.device_ptr());
    let mut args = [arg(&o), arg(&xp), arg(&wp), arg(&rows), arg(&d), arg(&eps)];
    // SAFETY: the arguments match rms_norm_{warp,block}(bf16*, const bf16*, const bf16*, int,
    // int, float) in norm.cu and the buffers hold the checked sizes.
    unsafe { dev.launch(kernel, shape, &mut args) }
}

/// The pre-norm residual add, fused: `residual = bf16(residual + x)`, then `out =
/// rms_norm(residual) * w` (all `[n_rows, dim]` but `w`).
pub fn add_rms_norm(
    dev: &Device,
    out: &mut DevBuf<bf16>,
    residual: &mut DevBuf<bf16>,
    x: &DevBuf<bf16>,
    w: &DevBuf<bf16>,
    n_rows: usize,
    eps: f32,
) -> Result<(), KernelError> {
    const OP: &str = "hip_add_rms_norm";
    let lens = (out.len(), Some(residual.len()), x.len(), w.len());
    let Some((rows, d)) = norm_args(OP, lens, n_rows, eps)? else {
        return Ok(());
    };
    let (name, shape) = norm_launch("add_rms_norm", n_rows, w.len(), dev.wavefront_size())?;
    let kernel = dev.function("norm", &name)?;
    let (o, r, xp, wp) = (out.device_ptr(), residual.device_ptr(), x.device_ptr(), w.device_ptr());
    let mut args = [arg(&o), arg(&r), arg(&xp), arg(&wp), arg(&rows), arg(&d), arg(&eps)];
    // SAFETY: add_rms_norm_{warp,block}(bf16*, bf16*, const bf16*, const bf16*, int, int,
    // float); every buffer holds n_rows x dim values (w: dim), checked above.
    unsafe { dev.launch(kernel, shape, &mut args) }
}

/// Embedding gather `out[t] = table[ids[t]]` (`table` `[vocab, dim]`, `out` `[ids, dim]`);
/// an id `>= vocab` yields a NaN row (the kernel checks, the host cannot see the ids).
pub fn embedding(
    dev: &Device,
    out: &mut DevBuf<bf16>,
    table: &DevBuf<bf16>,
    ids: &DevBuf<u32>,
    dim: usize,
) -> Result<(), KernelError> {
    const OP: &str = "hip_embedding";
    let vocab = embedding_shape(OP, out.len(), table.len(), ids.len(), dim)?;
    if ids.is_empty() {
        return Ok(());
    }
    let (n, v, d) = (to_u32(OP, "n_tokens", ids.len())?, to_u32(OP, "vocab", vocab)?, to_u32(OP, "dim", dim)?);
    let shape = launch::block_per_row(ids.len(), BLOCK_THREADS, dev.wavefront_size())?;
    let kernel = dev.function("embedding", "embedding")?;
    let (o, t, i) = (out.device_ptr(), table.device_ptr(), ids.device_ptr());
    let mut args = [arg(&o), arg(&t), arg(&i), arg(&n), arg(&v), arg(&d)];
    // SAFETY: embedding(bf16*, const bf16*, const u32*, u32, u32, u32); reads are bounded by
    // vocab, writes by n x dim (the checked out length).
    unsafe { dev.launch(kernel, shape, &mut args) }
}

/// The SwiGLU kernel for rows of `cols` read with stride `in_stride` (the 16-byte one when
/// both are multiples of 8) and its launch shape over `n_values` outputs.
pub fn silu_launch(
    n_values: usize,
    cols: usize,
    in_stride: usize,
    wave: u32,
) -> Result<(&'static str, LaunchShape), KernelError> {
    let vec = cols.is_multiple_of(8) && in_stride.is_multiple_of(8);
    let units = if vec { n_values / 8 } else { n_values };
    Ok((if vec { "silu_mul_vec8" } else { "silu_mul" }, launch::grid_stride(units, BLOCK_THREADS, wave)?))
}

/// SwiGLU on a packed gate|up GEMM output: `gate_up` `[n_rows, 2 ffn]` (gate first in each
/// row), `out` `[n_rows, ffn]`.
pub fn silu_mul_packed(
    dev: &Device,
    out: &mut DevBuf<bf16>,
    gate_up: &DevBuf<bf16>,
    n_rows: usize,
) -> Result<(), KernelError> {
    const OP: &str = "hip_silu_mul_packed";
    let ffn = silu_packed_shape(OP, out.len(), gate_up.len(), n_rows)?;
    if out.is_empty() {
        return Ok(());
    }
    let (name, shape) = silu_launch(out.len(), ffn, 2 * ffn, dev.wavefront_size())?;
    let kernel = dev.function("activation", name)?;
    let (rows, cols, stride) = (n_rows as u64, to_u32(OP, "ffn", ffn)?, 2 * ffn as u64);
    let o = out.device_ptr();
    let gate = gate_up.device_ptr();
    // SAFETY: `up` is `ffn` elements into the gate_up allocation (within it: ffn > 0).
    let up: *mut c_void = unsafe { gate.cast::<bf16>().add(ffn).cast() };
    let mut args = [arg(&o), arg(&gate), arg(&up), arg(&rows), arg(&cols), arg(&stride)];
    // SAFETY: silu_mul{,_vec8}(bf16*, const bf16*, const bf16*, u64, u32, u64); gate and up
    // rows of `ffn` at stride 2 ffn stay inside gate_up's n_rows x 2 ffn values; the vec8
    // kernel is chosen only when ffn and the stride are multiples of 8 (16-byte aligned rows).
    unsafe { dev.launch(kernel, shape, &mut args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_picks_the_warp_kernel_up_to_1024_wide() {
        for wave in [32, 64] {
            let (name, s) = norm_launch("add_rms_norm", 100, 576, wave).unwrap();
            assert_eq!(name, "add_rms_norm_warp");
            assert_eq!((s.grid[0], s.block), (13, 8 * wave));
            let (name, s) = norm_launch("rms_norm", 3, 4096, wave).unwrap();
            assert_eq!(name, "rms_norm_block");
            assert_eq!((s.grid[0], s.block), (3, 256));
        }
    }

    #[test]
    fn silu_vectorises_only_aligned_rows() {
        let (name, s) = silu_launch(3 * 1536, 1536, 3072, 64).unwrap();
        assert_eq!(name, "silu_mul_vec8");
        assert_eq!(s.grid[0], (3 * 1536 / 8usize).div_ceil(256) as u32);
        let (name, s) = silu_launch(3 * 100, 100, 200, 64).unwrap();
        assert_eq!(name, "silu_mul", "100 is no multiple of 8");
        assert_eq!(s.grid[0], 2);
        // A huge FFN step stays within the grid cap; the kernel's stride loop covers the rest.
        let (_, s) = silu_launch(8192 * 28672, 28672, 57344, 64).unwrap();
        assert_eq!(u64::from(s.grid[0]), launch::MAX_GRID);
    }
}
