//! A decode step's small inputs, moved to the device in as few driver calls as possible:
//! page-locked host staging ([`HostStage`]), the copies from it ([`Device::write_staged`],
//! [`Device::write_2d`]) and the kernel that splits a packed upload into its arrays
//! ([`Device::unpack4`]); and the way back for its small outputs ([`Device::read_staged`]).
//!
//! Why: a copy from pageable memory makes the driver stage it through its own pinned buffer
//! before the call returns, ~5-7 µs of host time each; a copy from page-locked memory is
//! only queued. A graph step's ids, positions, slots and context lengths are therefore
//! written into one pinned `[4, b]` array, uploaded in one copy and split on the device;
//! the block-table mirror shares the stage, so one event covers both copies. The other way,
//! a copy into pageable memory returns only once it has run, so reading several small
//! arrays back costs one round trip each, with the GPU idle in between; into a stage the
//! copies are only queued, and one wait covers them all.
//!
//! A copy from a stage reads it when the stream gets there, not when it is queued, so a
//! stage must not be rewritten before then: every copy records the stage's event after it,
//! and [`HostStage::as_mut_slice`] waits for that event (between decode steps the copies
//! have long finished, so the wait returns at once). The event is ours: cudarc's pinned
//! slice keeps one too, but records it only when the context tracks events, which ours
//! does not, and syncs it on every access, so the stage keeps the memory's address instead.
//!
//! A kernel may also write a stage directly (`Device::stage_kernel_address`: page-locked
//! memory is mapped into the device's address space), which saves a small result's copy
//! back: on an H200 a 16-byte copy queued after the kernel that wrote its source started
//! ~5 µs after that kernel ended and ran 1.6 µs (RESULTS 2026-12-04).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, DevicePtrMut, PinnedHostSlice, PushKernelArg};

use super::device::{dev_err, Buf, Device, Src2d};
use super::{Copy2d, Elem};
use crate::error::check;
use crate::KernelError;

/// Page-locked host memory that copies to the device read asynchronously.
pub struct HostStage<T> {
    /// Owns the allocation (freed on drop); accessed only through `ptr`.
    _mem: PinnedHostSlice<T>,
    ptr: *mut T,
    len: usize,
    /// Recorded after each queued copy that reads or writes the stage.
    read: CudaEvent,
    /// The stream (address of the device's `CudaStream`) every copy from the stage is
    /// queued on: the event tracks one stream's order, so copies on another are refused.
    stream: usize,
    /// The address kernels reach the memory at (`cuMemHostGetDevicePointer`), when the
    /// driver gave one.
    device_addr: Option<u64>,
}

// SAFETY: the stage owns its memory as a Vec would (`ptr` is `_mem`'s); shared access only
// reads it, mutable access needs `&mut self`.
unsafe impl<T: Send> Send for HostStage<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for HostStage<T> {}

impl<T: Elem> HostStage<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents (no wait: only copies to the device read the stage; after a
    /// [`Device::read_staged`], or a kernel that wrote the stage through its mapped
    /// address, synchronize the stream first).
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements (zero-filled at allocation) that
        // live as long as `self`; the host writes them only through `&mut self`, and the
        // device's writes (a queued copy back, a kernel through the mapped address) are
        // waited for before the contents are read, as documented above.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The contents for writing, once every queued copy that reads them has run.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T], KernelError> {
        self.read.synchronize().map_err(dev_err("cuda_host_stage"))?;
        // SAFETY: as in `as_slice`, and no queued copy reads the memory any more.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl<T> Drop for HostStage<T> {
    /// Frees the memory (the fields' drop) only after the copies that read it.
    fn drop(&mut self) {
        // An error here means the context is lost, and its copies with it.
        let _ = self.read.synchronize();
    }
}

impl Device {
    /// A zero-filled page-locked host array of `len` elements. Not write-combined: the
    /// host reads it too (a graph's block-table mirror is compared every step).
    pub fn alloc_stage<T: Elem>(&self, len: usize) -> Result<HostStage<T>, KernelError> {
        const OP: &str = "cuda_alloc_stage";
        let ctx = self.stream.context();
        // SAFETY: the memory is zero-filled below before anything reads it; `T` is valid as
        // all-zero bits (`Elem`).
        let mut mem = unsafe { ctx.alloc_pinned_with_flags::<T>(len, 0) }.map_err(dev_err(OP))?;
        let ptr = mem.as_mut_ptr().map_err(dev_err(OP))?;
        // SAFETY: `ptr` points at `len` elements of `T` that nothing else references yet.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        let read = ctx.new_event(None).map_err(dev_err(OP))?;
        let mut addr: cudarc::driver::sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is the start of a live page-locked allocation of this context (made
        // current by the allocation above); the call only writes `addr`.
        let mapped = unsafe { cudarc::driver::sys::cuMemHostGetDevicePointer_v2(&mut addr, ptr.cast(), 0) };
        let device_addr = (mapped == cudarc::driver::sys::CUresult::CUDA_SUCCESS && addr != 0).then_some(addr);
        Ok(HostStage { _mem: mem, ptr, len, read, stream: Arc::as_ptr(&self.stream) as usize, device_addr })
    }

    /// The address a kernel of this device writes `stage` through, if the driver mapped
    /// it (`None`: copy results back with [`Device::read_staged`] instead). Refuses another
    /// device's stage. Crate-only: the caller queues the kernel, synchronizes the stream
    /// before reading the stage and keeps the stage (borrowed mutably) alive until then,
    /// as `SampleOutput::read` does.
    pub(crate) fn stage_kernel_address<T>(&self, stage: &mut HostStage<T>) -> Result<Option<u64>, KernelError> {
        self.check_stage("cuda_stage_kernel_address", stage)?;
        Ok(stage.device_addr)
    }

    /// Refuses a stage made by another device (another stream), before any copy is queued.
    fn check_stage<T>(&self, op: &'static str, src: &HostStage<T>) -> Result<(), KernelError> {
        check(src.stream == Arc::as_ptr(&self.stream) as usize, op, || {
            "the stage belongs to another device's stream".to_string()
        })
    }

    /// Marks `src` as read by the copy just queued. Should the event fail to record, waits
    /// for the stream instead, so the stage is never handed out or freed under a copy.
    fn mark_read<T>(&self, op: &'static str, src: &HostStage<T>) -> Result<(), KernelError> {
        src.read.record(&self.stream).map_err(dev_err(op)).inspect_err(|_| {
            // An error here too means the context is lost, and the copy with it.
            let _ = self.stream.synchronize();
        })
    }

    /// Queues a copy of `src[from..from + dst.len()]` into `dst`.
    pub fn write_staged<T: Elem>(&self, dst: &mut Buf<T>, src: &HostStage<T>, from: usize) -> Result<(), KernelError> {
        const OP: &str = "cuda_write_staged";
        self.check_stage(OP, src)?;
        let host = from.checked_add(dst.len()).and_then(|end| src.as_slice().get(from..end));
        let Some(host) = host else {
            return Err(KernelError::Shape {
                op: OP,
                detail: format!("{} elements at {from} of a stage of {}", dst.len(), src.len()),
            });
        };
        // A plain slice to cudarc: page-locked, so the copy is queued, not staged.
        self.stream.memcpy_htod(host, &mut dst.inner).map_err(dev_err(OP))?;
        self.mark_read(OP, src)
    }

    /// Queues a copy of `src[..n]` into `dst[..n]`. The values are there once the stream
    /// has been synchronized ([`Device::synchronize`]); until then `dst` must not be read.
    pub fn read_staged<T: Elem>(&self, dst: &mut HostStage<T>, src: &Buf<T>, n: usize) -> Result<(), KernelError> {
        const OP: &str = "cuda_read_staged";
        self.check_stage(OP, dst)?;
        check(n <= src.len() && n <= dst.len(), OP, || {
            format!("{n} elements from a buffer of {} into a stage of {}", src.len(), dst.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let host = &mut dst.as_mut_slice()?[..n];
        // A plain slice to cudarc: page-locked, so the copy is queued, not waited for.
        self.stream.memcpy_dtoh(&src.inner.slice(..n), host).map_err(dev_err(OP))?;
        self.mark_read(OP, dst)
    }

    /// Queues a `[rows, width]` block of the host matrix `src` into the device matrix `dst`
    /// as one strided 2-D copy (a graph's changed block-table entries); see [`Copy2d`].
    pub fn write_2d<T: Elem>(&self, dst: &mut Buf<T>, src: &HostStage<T>, c: &Copy2d) -> Result<(), KernelError> {
        const OP: &str = "cuda_write_2d";
        self.check_stage(OP, src)?;
        check(c.fits(src.len(), dst.len()), OP, || {
            format!("{c:?} does not fit a stage of {} / dst of {} elements", src.len(), dst.len())
        })?;
        let (dp, _w) = dst.inner.device_ptr_mut(&self.stream);
        // SAFETY: the host block lies in the stage and the device block in `dst` (checked
        // above); the stage outlives the copy (its drop waits for `read`, recorded next).
        unsafe { self.queue_2d(OP, Src2d::Host(src.ptr.cast_const().cast()), dp, c, std::mem::size_of::<T>()) }?;
        self.mark_read(OP, src)
    }

    /// Replaces each of the first `n` entries of `ids` that is [`FROM_SAMPLED`]` | row` with
    /// `sampled[row]`, on the device (queued: the previous step's sampling, queued before
    /// it, has written `sampled` by then). A flagged row at or past `rows` becomes token 0:
    /// callers check their rows first, this only keeps a bad one in bounds.
    ///
    /// [`FROM_SAMPLED`]: super::FROM_SAMPLED
    pub fn take_sampled_ids(
        &self,
        ids: &mut Buf<u32>,
        n: usize,
        sampled: &Buf<u32>,
        rows: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_take_sampled_ids";
        check(n <= ids.len() && rows <= sampled.len(), OP, || {
            format!("{n} ids of a buffer of {}, {rows} rows of {}", ids.len(), sampled.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let too_big = |what: &str, v: usize| KernelError::Shape { op: OP, detail: format!("{what} {v} exceeds u32") };
        let n32 = u32::try_from(n).map_err(|_| too_big("n", n))?;
        let rows32 = u32::try_from(rows).map_err(|_| too_big("rows", rows))?;
        const BLOCK: u32 = 256;
        let mut l = self.stream.launch_builder(&self.kernels.take_sampled_ids);
        l.arg(&mut ids.inner).arg(&n32).arg(&sampled.inner).arg(&rows32);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (n32.div_ceil(BLOCK).min(1024), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads and writes the first `n` elements of `ids` and reads
        // `sampled` only below `rows` (both within their buffers, checked above).
        unsafe { l.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// Splits `packed`, `[4, n]`, into `out[0..4]` of `n` elements each (row `k` into
    /// `out[k]`), on the device.
    pub fn unpack4(&self, packed: &Buf<u32>, out: [&mut Buf<u32>; 4]) -> Result<(), KernelError> {
        const OP: &str = "cuda_unpack4";
        let n = out[0].len();
        check(out.iter().all(|o| o.len() == n) && packed.len() == 4 * n, OP, || {
            let lens: Vec<usize> = out.iter().map(|o| o.len()).collect();
            format!("packed has {} elements, outputs {lens:?} (want 4 x n)", packed.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let n32 = u32::try_from(n).map_err(|_| KernelError::Shape { op: OP, detail: format!("{n} elements") })?;
        const BLOCK: u32 = 256;
        let [a, b, c, d] = out;
        let mut l = self.stream.launch_builder(&self.kernels.unpack4_u32);
        l.arg(&packed.inner).arg(&n32).arg(&mut a.inner).arg(&mut b.inner).arg(&mut c.inner).arg(&mut d.inner);
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (n32.div_ceil(BLOCK).min(1024), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the kernel reads `4 n` elements of `packed` and writes `n` of each output
        // (lengths checked above).
        unsafe { l.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }
}
