//! GEMMs through rocBLAS, loaded at run time: `out[m, n] = x[m, k] · w[n, k]ᵀ` with bf16
//! inputs, bf16 or f32 output and f32 accumulation, the CUDA backend's convention (weights stored one
//! output feature per row). On HIP every m goes here; CUDA's tensor-core GEMV for m <= 8 has
//! no AMD version (kernels/cuda/gemv.cu is NVIDIA only).
//!
//! rocBLAS is column-major. A row-major `[r, c]` matrix is a column-major `c × r` one, so the
//! product is computed as outᵀ (n × m) = (w as k × n)ᵀ · (x as k × m): op(A) = transpose on w,
//! op(B) = none on x, leading dimensions k, k and n.

use std::ffi::c_void;
use std::sync::Arc;

use half::bf16;

use super::device::{DevBuf, Device};
use super::ffi::{self, rocblas, RocblasApi, RocblasHandle};
use crate::error::check;
use crate::KernelError;

/// A rocBLAS handle bound to one device's stream.
pub struct Blas {
    api: Arc<RocblasApi>,
    handle: RocblasHandle,
}

// SAFETY: a rocBLAS handle may move between threads; `Blas` is not `Sync`.
unsafe impl Send for Blas {}

fn status(op: &'static str, code: i32) -> Result<(), KernelError> {
    if code == 0 {
        Ok(())
    } else {
        // Codes from rocblas-types.h: 1 invalid handle, 2 not implemented, 3 invalid pointer,
        // 4 invalid size, 5 memory error, 6 internal error.
        Err(KernelError::Device { op, detail: format!("rocBLAS status {code}") })
    }
}

impl Blas {
    /// Loads rocBLAS (a clear error when absent) and binds a handle to `dev`'s stream.
    pub fn new(dev: &Device) -> Result<Self, KernelError> {
        let api = ffi::rocblas()?;
        dev.bind()?;
        let mut handle: RocblasHandle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the device is current.
        status("rocblas_create_handle", unsafe { (api.rocblas_create_handle)(&mut handle) })?;
        let blas = Blas { api, handle };
        // SAFETY: live handle and the device's live stream.
        status("rocblas_set_stream", unsafe { (blas.api.rocblas_set_stream)(blas.handle, dev.stream()) })?;
        Ok(blas)
    }

    /// `out = x · wᵀ` (see the module comment for the shapes), bf16 out.
    pub fn gemm(
        &self,
        dev: &Device,
        out: &mut DevBuf<bf16>,
        x: &DevBuf<bf16>,
        w: &DevBuf<bf16>,
        dims: (usize, usize, usize),
    ) -> Result<(), KernelError> {
        self.gemm_ex(dev, (out.device_ptr(), out.len(), rocblas::DATATYPE_BF16_R), x, w, dims)
    }

    /// `out = x · wᵀ` with f32 out (the LM head's logits): rocBLAS's bf16-in, f32-out mode.
    pub fn gemm_f32(
        &self,
        dev: &Device,
        out: &mut DevBuf<f32>,
        x: &DevBuf<bf16>,
        w: &DevBuf<bf16>,
        dims: (usize, usize, usize),
    ) -> Result<(), KernelError> {
        self.gemm_ex(dev, (out.device_ptr(), out.len(), rocblas::DATATYPE_F32_R), x, w, dims)
    }

    /// The GEMM into `out` = (device pointer, elements, rocBLAS data type).
    fn gemm_ex(
        &self,
        dev: &Device,
        (out, out_len, out_type): (*mut c_void, usize, i32),
        x: &DevBuf<bf16>,
        w: &DevBuf<bf16>,
        (m, n, k): (usize, usize, usize),
    ) -> Result<(), KernelError> {
        const OP: &str = "hip_gemm";
        let fits = |v: usize| v > 0 && v <= i32::MAX as usize;
        check(fits(m) && fits(n) && fits(k), OP, || format!("m {m}, n {n}, k {k}: each must be in 1..2^31"))?;
        check(x.len() == m * k && w.len() == n * k && out_len == m * n, OP, || {
            format!("x {} (m*k {}), w {} (n*k {}), out {out_len} (m*n {})", x.len(), m * k, w.len(), n * k, m * n)
        })?;
        dev.bind()?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (m, n, k) = (m as i32, n as i32, k as i32);
        let bf = rocblas::DATATYPE_BF16_R;
        // SAFETY: the buffers hold the sizes checked above and `out` is of `out_type`; alpha
        // and beta are host f32 (the handle's default pointer mode) alive for the call; C
        // and D are the same buffer.
        let code = unsafe {
            (self.api.rocblas_gemm_ex)(
                self.handle,
                rocblas::OPERATION_TRANSPOSE,
                rocblas::OPERATION_NONE,
                n,
                m,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                w.device_ptr(),
                bf,
                k,
                x.device_ptr(),
                bf,
                k,
                (&beta as *const f32).cast::<c_void>(),
                out,
                out_type,
                n,
                out,
                out_type,
                n,
                rocblas::DATATYPE_F32_R,
                rocblas::GEMM_ALGO_STANDARD,
                0,
                0,
            )
        };
        status(OP, code)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created by rocblas_create_handle, destroyed once.
        let _ = unsafe { (self.api.rocblas_destroy_handle)(self.handle) };
    }
}
