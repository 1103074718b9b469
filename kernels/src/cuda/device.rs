//! One CUDA device as the engine uses it: a context, one stream that every op is queued on
//! (so ops need no events between them and the sequence can later be captured as a CUDA
//! graph), the kernel modules compiled for its arch, and cuBLASLt with its GEMM plans.
//!
//! Buffers ([`Buf`]) are typed device allocations; host transfers synchronise the stream.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;

use super::arch::Arch;
use super::module_cache::{ModuleCache, ModuleReport};
use super::nvrtc;
use super::{sources, Copy2d, Elem};
use crate::KernelError;

/// Maps any cudarc error (they do not all implement `std::error::Error`) to ours.
pub(crate) fn dev_err<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> KernelError {
    move |e| KernelError::Device { op, detail: format!("{e:?}") }
}

/// A typed device allocation of `len()` elements.
pub struct Buf<T> {
    pub(crate) inner: CudaSlice<T>,
}

impl<T> Buf<T> {
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }
}

/// Per-position (cos, sin) table of one model's RoPE on the device; see
/// [`Device::rope_cache`].
pub struct RopeCache {
    /// `[max_positions, rope_dim / 2]` (cos, sin) pairs, flattened.
    pub(crate) table: Buf<f32>,
    pub(crate) rope_dim: usize,
    pub(crate) max_positions: usize,
}

impl RopeCache {
    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    /// Positions `0..max_positions` can be rotated; larger ones produce NaN.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }
}

/// The kernels of all modules, resolved once at start.
pub(crate) struct Kernels {
    pub rms_norm_block: CudaFunction,
    pub rms_norm_warp: CudaFunction,
    pub add_rms_norm_block: CudaFunction,
    pub add_rms_norm_warp: CudaFunction,
    pub add_parts_rms_norm_block: CudaFunction,
    pub add_parts_rms_norm_warp: CudaFunction,
    pub add_residual: CudaFunction,
    pub add_residual_vec8: CudaFunction,
    pub silu_mul: CudaFunction,
    pub silu_mul_vec8: CudaFunction,
    pub embedding: CudaFunction,
    pub unpack4_u32: CudaFunction,
    pub take_sampled_ids: CudaFunction,
    pub rope: CudaFunction,
    pub qkv_rope_write: CudaFunction,
    pub qkv_rope_write_vec8: CudaFunction,
    pub fill_uniform: CudaFunction,
    pub sample_rows: CudaFunction,
    pub pack_sampled: CudaFunction,
    pub split_stats: CudaFunction,
    pub split_draw: CudaFunction,
    pub split_finish: CudaFunction,
    pub attention: super::attention::AttentionKernels,
    pub gemv: super::gemv::GemvKernels,
}

/// A CUDA device with Tessera's kernels loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) kernels: Kernels,
    pub(crate) gemm: super::gemm::Gemm,
    ordinal: usize,
    /// Multiprocessors, for grid sizing (split-KV decode).
    pub(crate) sm_count: usize,
    name: String,
    arch: Arch,
    reports: Vec<ModuleReport>,
}

impl Device {
    /// Opens GPU `ordinal` and loads the kernels, compiling them on a cache miss
    /// (cache at [`ModuleCache::default_location`]).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        Self::with_cache(ordinal, ModuleCache::default_location())
    }

    /// [`Device::new`] with an explicit module cache.
    pub fn with_cache(ordinal: usize, cache: ModuleCache) -> Result<Self, KernelError> {
        const OP: &str = "cuda_device";
        check_libraries()?;
        let count = CudaContext::device_count().map_err(dev_err(OP))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(KernelError::Device { op: OP, detail: format!("GPU {ordinal} asked for, {count} present") });
        }
        let ctx = CudaContext::new(ordinal).map_err(dev_err(OP))?;
        // One stream orders everything: cudarc's per-buffer event tracking is pure overhead.
        // SAFETY: no other stream of this context touches our buffers.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev_err(OP))?;
        let name = ctx.name().map_err(dev_err(OP))?;
        let (major, minor) = ctx.compute_capability().map_err(dev_err(OP))?;
        let arch = Arch::for_compute_capability(major.max(0) as u32, minor.max(0) as u32);
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err(OP))?;
        let sm_count = usize::try_from(sms).unwrap_or(1).max(1);
        let smem_optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(dev_err(OP))?;
        let smem_optin = usize::try_from(smem_optin).unwrap_or(0);

        let compiler = nvrtc::version()?;
        let mut modules: Vec<(&'static str, Arc<CudaModule>)> = Vec::new();
        let mut reports = Vec::new();
        for &(module, body) in sources::MODULES {
            let source = sources::full_source(body);
            let (image, report) = nvrtc::compile_cached(&cache, module, &source, arch, &compiler)?;
            let loaded = ctx.load_module(Ptx::from_binary(image)).map_err(dev_err("cuda_load_module"))?;
            modules.push((module, loaded));
            reports.push(report);
        }
        let f = |module: &str, func: &str| -> Result<CudaFunction, KernelError> {
            let m = modules.iter().find(|(n, _)| *n == module).map(|(_, m)| m).ok_or_else(|| KernelError::Device {
                op: "cuda_load_function",
                detail: format!("no module {module}"),
            })?;
            m.load_function(func).map_err(|e| KernelError::Device {
                op: "cuda_load_function",
                detail: format!("{module}.{func}: {e:?}"),
            })
        };
        let kernels = Kernels {
            rms_norm_block: f("norm", "rms_norm_block")?,
            rms_norm_warp: f("norm", "rms_norm_warp")?,
            add_rms_norm_block: f("norm", "add_rms_norm_block")?,
            add_rms_norm_warp: f("norm", "add_rms_norm_warp")?,
            add_parts_rms_norm_block: f("norm", "add_parts_rms_norm_block")?,
            add_parts_rms_norm_warp: f("norm", "add_parts_rms_norm_warp")?,
            add_residual: f("norm", "add_residual")?,
            add_residual_vec8: f("norm", "add_residual_vec8")?,
            silu_mul: f("activation", "silu_mul")?,
            silu_mul_vec8: f("activation", "silu_mul_vec8")?,
            embedding: f("embedding", "embedding")?,
            unpack4_u32: f("inputs", "unpack4_u32")?,
            take_sampled_ids: f("inputs", "take_sampled_ids")?,
            rope: f("rope", "rope")?,
            qkv_rope_write: f("qkv", "qkv_rope_write")?,
            qkv_rope_write_vec8: f("qkv", "qkv_rope_write_vec8")?,
            fill_uniform: f("init", "fill_uniform")?,
            sample_rows: f("sampling", "sample_rows")?,
            pack_sampled: f("sampling", "pack_sampled")?,
            split_stats: f("sampling_split", "split_stats")?,
            split_draw: f("sampling_split", "split_draw")?,
            split_finish: f("sampling_split", "split_finish")?,
            attention: super::attention::AttentionKernels::load(&f)?,
            gemv: super::gemv::GemvKernels::load(&f, smem_optin)?,
        };
        let gemm = super::gemm::Gemm::new(&stream)?;
        Ok(Device { ctx, stream, kernels, gemm, ordinal, sm_count, name, arch, reports })
    }

    /// Number of CUDA devices, or an error when the driver is missing.
    pub fn count() -> Result<usize, KernelError> {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(missing("libcuda (the NVIDIA driver)"));
        }
        let n = CudaContext::device_count().map_err(dev_err("cuda_device_count"))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The marketing name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The arch the kernels were compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// How each kernel module was obtained (cache hit or compile, and the time it took).
    pub fn module_reports(&self) -> &[ModuleReport] {
        &self.reports
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize), KernelError> {
        self.ctx.mem_get_info().map_err(dev_err("cuda_mem_info"))
    }

    /// A zero-filled buffer of `len` elements.
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<Buf<T>, KernelError> {
        Ok(Buf { inner: self.stream.alloc_zeros::<T>(len).map_err(dev_err("cuda_alloc"))? })
    }

    /// A zero-filled buffer of `len` elements for a model weight: its allocation is rounded
    /// up to a multiple of 2 MiB, so that the stream-ordered pool, which places a model's
    /// tensors one after another, starts the next one on a 2 MiB boundary too (without it a
    /// layer's 8 KB norm vectors shift every following matrix by 8 KB). Measured on H200
    /// (bench/RESULTS.md, 2026-12-04): batch-1 forward passes 7-25 µs shorter on both 8B
    /// shapes; why placement matters was not established. A norm vector costs 2 MiB.
    pub fn alloc_weight<T: Elem>(&self, len: usize) -> Result<Buf<T>, KernelError> {
        const ALIGN: usize = 2 << 20;
        let size = std::mem::size_of::<T>().max(1);
        let bytes = len.checked_mul(size).and_then(|b| b.checked_next_multiple_of(ALIGN));
        let Some(bytes) = bytes else {
            return Err(KernelError::Shape { op: "cuda_alloc_weight", detail: format!("{len} elements overflow") });
        };
        let whole = self.stream.alloc_zeros::<T>(bytes / size).map_err(dev_err("cuda_alloc"))?;
        let ptr = whole.leak();
        // SAFETY: `ptr` is the base of a live, zeroed allocation of at least `len` elements
        // that nothing owns since `leak`; the new slice owns it and frees it when dropped
        // (a free needs only the base address, not the length).
        let inner = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, len) };
        Ok(Buf { inner })
    }

    /// A model weight holding a copy of `host`, allocated as [`Device::alloc_weight`].
    pub fn upload_weight<T: Elem>(&self, host: &[T]) -> Result<Buf<T>, KernelError> {
        let mut b = self.alloc_weight(host.len())?;
        self.write(&mut b, host)?;
        Ok(b)
    }

    /// A new buffer holding a copy of `host`.
    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<Buf<T>, KernelError> {
        Ok(Buf { inner: self.stream.clone_htod(host).map_err(dev_err("cuda_upload"))? })
    }

    /// Overwrites `dst` with `host` (same length).
    pub fn write<T: Elem>(&self, dst: &mut Buf<T>, host: &[T]) -> Result<(), KernelError> {
        crate::error::check(dst.len() == host.len(), "cuda_write", || {
            format!("buffer has {} elements, host slice {}", dst.len(), host.len())
        })?;
        self.stream.memcpy_htod(host, &mut dst.inner).map_err(dev_err("cuda_write"))
    }

    /// Overwrites `dst[offset..offset + host.len()]` with `host`.
    pub fn write_at<T: Elem>(&self, dst: &mut Buf<T>, offset: usize, host: &[T]) -> Result<(), KernelError> {
        let end = offset.checked_add(host.len()).filter(|&e| e <= dst.len());
        let Some(end) = end else {
            return Err(KernelError::Shape {
                op: "cuda_write_at",
                detail: format!("{} elements at {offset} do not fit a buffer of {}", host.len(), dst.len()),
            });
        };
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.inner.slice_mut(offset..end);
        self.stream.memcpy_htod(host, &mut view).map_err(dev_err("cuda_write_at"))
    }

    /// Copies rows `src_row..src_row + n_rows` of `src` to rows `dst_row..` of `dst`, both
    /// seen as `[_, row_len]` (a device-to-device copy queued on the stream).
    pub fn copy_rows<T: Elem>(
        &self,
        dst: &mut Buf<T>,
        dst_row: usize,
        src: &Buf<T>,
        src_row: usize,
        n_rows: usize,
        row_len: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_copy_rows";
        let range = |row: usize| -> Option<(usize, usize)> {
            let a = row.checked_mul(row_len)?;
            Some((a, a.checked_add(n_rows.checked_mul(row_len)?)?))
        };
        let (Some((s0, s1)), Some((d0, d1))) = (range(src_row), range(dst_row)) else {
            return Err(KernelError::Shape { op: OP, detail: format!("{n_rows} rows of {row_len} overflow") });
        };
        crate::error::check(s1 <= src.len() && d1 <= dst.len(), OP, || {
            format!(
                "rows {src_row}+{n_rows} of src ({}) to {dst_row}+ of dst ({}), rows of {row_len}",
                src.len(),
                dst.len()
            )
        })?;
        if n_rows == 0 || row_len == 0 {
            return Ok(());
        }
        let from = src.inner.slice(s0..s1);
        let mut to = dst.inner.slice_mut(d0..d1);
        self.stream.memcpy_dtod(&from, &mut to).map_err(dev_err(OP))
    }

    /// Copies a `[rows, width]` block between two row-major matrices as one strided 2-D
    /// copy queued on the stream (used to slice row-parallel weights by column and to
    /// interleave logit shards); see [`Copy2d`].
    pub fn copy_2d<T: Elem>(&self, dst: &mut Buf<T>, src: &Buf<T>, c: &Copy2d) -> Result<(), KernelError> {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        const OP: &str = "cuda_copy_2d";
        crate::error::check(c.fits(src.len(), dst.len()), OP, || {
            format!("{c:?} does not fit src of {} / dst of {} elements", src.len(), dst.len())
        })?;
        let s = &self.stream;
        let (sp, _r1) = src.inner.device_ptr(s);
        let (dp, _r2) = dst.inner.device_ptr_mut(s);
        // SAFETY: both device pointers cover the checked block and stay alive while the
        // stream uses them (the caller owns both buffers, as for every op).
        unsafe { self.queue_2d(OP, Src2d::Device(sp), dp, c, std::mem::size_of::<T>()) }
    }

    /// Queues `c`'s block (elements of `e` bytes) from `src` to the device address `dst`.
    ///
    /// # Safety
    /// Both blocks must lie inside live memory (`c.fits` on their lengths) that outlives
    /// the copy: a page-locked host source is read when the stream reaches the copy, so it
    /// must stay readable and unchanged until then (pageable memory is read before the
    /// call returns).
    pub(super) unsafe fn queue_2d(
        &self,
        op: &'static str,
        src: Src2d,
        dst: u64,
        c: &Copy2d,
        e: usize,
    ) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        if c.rows == 0 || c.width == 0 {
            return Ok(());
        }
        let s = &self.stream;
        s.context().bind_to_thread().map_err(dev_err(op))?;
        let (src_type, src_host, src_device) = match src {
            Src2d::Device(p) => (sys::CUmemorytype::CU_MEMORYTYPE_DEVICE, std::ptr::null(), p + (c.src_at * e) as u64),
            // SAFETY: `src_at` lies inside the host source (the caller's `fits`).
            Src2d::Host(p) => (sys::CUmemorytype::CU_MEMORYTYPE_HOST, unsafe { p.byte_add(c.src_at * e) }, 0),
        };
        let m = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: src_type,
            srcHost: src_host,
            srcDevice: src_device,
            srcArray: std::ptr::null_mut(),
            srcPitch: c.src_pitch * e,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst + (c.dst_at * e) as u64,
            dstArray: std::ptr::null_mut(),
            dstPitch: c.dst_pitch * e,
            WidthInBytes: c.width * e,
            Height: c.rows,
        };
        // SAFETY: the caller vouches for both blocks (above).
        unsafe { sys::cuMemcpy2DAsync_v2(&m, s.cu_stream()) }.result().map_err(dev_err(op))
    }

    /// Waits for the queued work, then copies `src` to the host. Errors of earlier
    /// asynchronous launches surface here.
    pub fn download<T: Elem>(&self, src: &Buf<T>) -> Result<Vec<T>, KernelError> {
        let v = self.stream.clone_dtoh(&src.inner).map_err(dev_err("cuda_download"))?;
        self.synchronize()?;
        Ok(v)
    }

    /// Blocks until every queued op has finished; reports any asynchronous error.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        self.stream.synchronize().map_err(dev_err("cuda_synchronize"))
    }

    /// The stream's error, if any, without waiting (`cuStreamQuery`): work still queued is
    /// not an error, a sticky one (a faulted kernel) is. For deciding whether the context
    /// is lost after a failed step whose queued work may be blocked on a dead peer.
    pub fn poll_error(&self) -> Result<(), KernelError> {
        use cudarc::driver::sys;
        const OP: &str = "cuda_stream_query";
        self.stream.context().bind_to_thread().map_err(dev_err(OP))?;
        // SAFETY: the device's own stream, its context bound to this thread.
        match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_NOT_READY => Ok(()),
            e => Err(dev_err(OP)(cudarc::driver::DriverError(e))),
        }
    }

    /// Milliseconds per call of `f`, timed with CUDA events around `reps` back-to-back calls
    /// on the device's stream (the caller warms up first).
    pub fn time_ms(&self, reps: usize, mut f: impl FnMut() -> Result<(), KernelError>) -> Result<f64, KernelError> {
        use cudarc::driver::sys::CUevent_flags;
        let start = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev_err("cuda_event"))?;
        for _ in 0..reps {
            f()?;
        }
        let end = self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev_err("cuda_event"))?;
        let ms = start.elapsed_ms(&end).map_err(dev_err("cuda_event"))?;
        Ok(f64::from(ms) / reps.max(1) as f64)
    }
}

fn missing(what: &str) -> KernelError {
    KernelError::Device { op: "cuda_device", detail: format!("{what} could not be loaded; is this a CUDA machine?") }
}

/// Checks the shared libraries are there before cudarc touches them (it panics otherwise).
fn check_libraries() -> Result<(), KernelError> {
    // SAFETY: each call only tries to dlopen the library.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Err(missing("libcuda (the NVIDIA driver)"));
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Err(missing("libnvrtc"));
        }
        if !cudarc::cublaslt::sys::is_culib_present() {
            return Err(missing("libcublasLt"));
        }
    }
    Ok(())
}

/// A worker hands its device to other threads (the engine loop, a sampler thread).
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Device>();
    send_sync::<Buf<half::bf16>>();
    send_sync::<RopeCache>();
};

/// The source of [`Device::queue_2d`]: a device address or a host pointer.
pub(super) enum Src2d {
    Device(u64),
    Host(*const std::ffi::c_void),
}
