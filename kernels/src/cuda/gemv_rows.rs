//! The LM head of a one-token step on gemv_rows.cu: whole rows of W per CTA in address order
//! with streaming loads, f32 out. `gemm_into` sends it one-row f32 products whose weight is
//! past the ring GEMV's limit (the vocabulary-sized LM heads), unless `TESSERA_GEMV_ROWS=0`
//! (for A/B runs against cuBLASLt).

use std::ffi::c_void;

use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::bf16;
use super::device::{dev_err, Buf, Device};
use super::gemm::check_gemm_operands;
use super::launch_ex::launch_ex;
use crate::KernelError;

/// Threads per CTA (ROWS_THREADS in the .cu).
const THREADS: u32 = 256;
/// Widest row: 8 values per 16-byte vector, THREADS vectors per x vector a thread holds, at
/// most 4 of those (gemv_rows_x1..x4).
const MAX_COLS: usize = 8 * THREADS as usize * 4;

/// The four widths' kernels and how many CTAs of each fit an SM.
pub(crate) struct RowsKernels {
    funcs: Vec<(CudaFunction, u32)>,
    enabled: bool,
}

impl RowsKernels {
    pub(crate) fn load(f: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>) -> Result<Self, KernelError> {
        let funcs = (1..=4)
            .map(|xv| {
                let func = f("gemv_rows", &format!("gemv_rows_x{xv}"))?;
                let per_sm = func
                    .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
                    .map_err(dev_err("cuda_gemv_rows"))?;
                Ok((func, per_sm))
            })
            .collect::<Result<_, KernelError>>()?;
        Ok(RowsKernels { funcs, enabled: std::env::var("TESSERA_GEMV_ROWS").as_deref() != Ok("0") })
    }
}

/// Whether the kernel takes an f32 product of `m` rows of x against W `[rows, cols]`.
pub(crate) fn shape_fits(m: usize, rows: usize, cols: usize) -> bool {
    m == 1 && cols > 0 && cols.is_multiple_of(8) && cols <= MAX_COLS && rows > 0 && i32::try_from(rows).is_ok()
}

impl Device {
    /// Whether `gemm_into` routes this f32 product here (see the module comment).
    pub(crate) fn gemv_rows_applies(&self, m: usize, rows: usize, cols: usize) -> bool {
        self.kernels.gemv_rows.enabled && shape_fits(m, rows, cols)
    }

    /// [`Device::matmul_f32`] of one row of x always through gemv_rows.cu, whatever the
    /// weight's size (tests and benchmarks); shapes it does not take are errors.
    #[doc(hidden)]
    pub fn matmul_f32_rows(
        &self,
        out: &mut Buf<f32>,
        x: &Buf<bf16>,
        m: usize,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_gemv_rows";
        check_gemm_operands(OP, x, m, w, rows, cols, out.len(), rows)?;
        if !shape_fits(m, rows, cols) {
            return Err(KernelError::Shape {
                op: OP,
                detail: format!("m={m} {rows}x{cols}: one row, cols % 8 == 0, cols <= {MAX_COLS}"),
            });
        }
        self.gemv_rows_into(&mut out.inner, x, w, rows, cols)
    }

    /// `out[..rows] = x · Wᵀ` for one row of x, `out` an f32 buffer (`gemm_into`'s `out_f32`);
    /// the caller checked the buffers against the shape.
    pub(crate) fn gemv_rows_into<T>(
        &self,
        out: &mut CudaSlice<T>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
        rows: usize,
        cols: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_gemv_rows";
        if !shape_fits(1, rows, cols) {
            return Err(KernelError::Shape { op: OP, detail: format!("1 x {rows}x{cols}") });
        }
        let xv = cols.div_ceil(8 * THREADS as usize);
        let (func, per_sm) = &self.kernels.gemv_rows.funcs[xv - 1];
        // Rows per CTA round, as the .cu's R.
        let per_round = match xv {
            1 => 8,
            2 => 4,
            _ => 2,
        };
        let wave = self.sm_count * (*per_sm).max(1) as usize;
        let grid = rows.div_ceil(per_round).min(wave) as u32;
        let s = &self.stream;
        let (op, _g1) = out.device_ptr_mut(s);
        let (xp, _g2) = x.inner.device_ptr(s);
        let (wp, _g3) = w.inner.device_ptr(s);
        let (mut op, mut xp, mut wp): (sys::CUdeviceptr, sys::CUdeviceptr, sys::CUdeviceptr) = (op, xp, wp);
        let (mut ri, mut ci) = (rows as i32, cols as i32);
        let mut params: [*mut c_void; 5] = [
            (&mut op as *mut sys::CUdeviceptr).cast(),
            (&mut xp as *mut sys::CUdeviceptr).cast(),
            (&mut wp as *mut sys::CUdeviceptr).cast(),
            (&mut ri as *mut i32).cast(),
            (&mut ci as *mut i32).cast(),
        ];
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `params` points at live locals matching the kernel's (float*, const bf16*,
        // const bf16*, int, int); the caller checked out (>= rows), x (>= cols) and w (>=
        // rows x cols); cols % 8 == 0 keeps the 16-byte loads aligned and in bounds, and
        // cols <= 2048 xv is what gemv_rows_x<xv> holds in registers; a plain launch.
        unsafe { launch_ex(OP, s, func, cfg, false, &mut params) }
    }
}
