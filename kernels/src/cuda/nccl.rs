//! NCCL collectives between the GPUs of a tensor-parallel group, through cudarc's `nccl`
//! bindings (libnccl is loaded at run time, like the other CUDA libraries).
//!
//! Rank 0 makes an [`NcclId`], the coordinator relays it, and every rank joins the
//! communicator from its own thread or process ([`Device::nccl_join`]). Collectives are
//! queued on the device's one stream, so they are ordered with the kernels around them and
//! can be recorded into a CUDA graph ([`Device::capture`]) like any other op.
//!
//! The communicator is wrapped here rather than through cudarc's `Comm`, whose constructor
//! and `Drop` panic on bad arguments and failed teardown: every failure here is a
//! [`KernelError::Device`] naming the op and NCCL's result code.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtrMut};
use cudarc::nccl::sys;

use super::device::{dev_err, Buf, Device};
use super::nccl_id::{NcclId, NCCL_ID_BYTES};
use crate::KernelError;

/// One rank's membership of an NCCL communicator, bound to the [`Device`] that joined it.
///
/// Dropping it aborts the communicator locally (`ncclCommAbort`: never waits for the other
/// ranks, so a dead peer cannot hang shutdown). Synchronise the device and drop any
/// [`Graph`](super::Graph) that recorded its collectives first.
pub struct NcclComm {
    comm: sys::ncclComm_t,
    /// Keeps the device's context alive until the communicator's resources are freed.
    ctx: Arc<CudaContext>,
    rank: usize,
    world: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time; `NcclComm` is
// not `Sync`, and every use goes through `&NcclComm` with the owning device's stream.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// This member's rank, `0..world()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the communicator.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The raw communicator, for the other NCCL calls of this crate.
    pub(crate) fn raw(&self) -> sys::ncclComm_t {
        self.comm
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Teardown errors have nowhere to go; the process keeps running either way.
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `comm` came from a successful ncclCommInitRank and is dropped once.
        let _ = unsafe { cudarc::nccl::result::comm_abort(self.comm) };
    }
}

/// NCCL's result code as a [`KernelError::Device`] for `op`.
pub(crate) fn nccl_err(op: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> KernelError {
    // cudarc's `NcclError` prints no detail: show the result code itself.
    move |e| KernelError::Device { op, detail: format!("NCCL returned {:?}", e.0) }
}

/// cudarc panics when libnccl cannot be opened: check first.
fn check_libnccl(op: &'static str) -> Result<(), KernelError> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(KernelError::Device {
            op,
            detail: "libnccl (NCCL 2.x, e.g. libnccl.so) could not be loaded; install NCCL or add it to \
                     the library path"
                .into(),
        })
    }
}

impl Device {
    /// A fresh unique id (needs libnccl, not a device). Associated fn.
    pub fn nccl_unique_id() -> Result<NcclId, KernelError> {
        const OP: &str = "nccl_unique_id";
        check_libnccl(OP)?;
        let raw = cudarc::nccl::result::get_uniqueid().map_err(nccl_err(OP))?;
        // `c_char` is i8 or u8 by platform: reinterpret each byte.
        Ok(NcclId(raw.internal.map(|c| c as u8)))
    }

    /// Joins communicator `id` as `rank` of `world` on this device's stream; blocks until
    /// every rank has joined.
    pub fn nccl_join(&self, id: &NcclId, rank: usize, world: usize) -> Result<NcclComm, KernelError> {
        const OP: &str = "nccl_join";
        let ranks = i32::try_from(world).ok().filter(|&w| w >= 1);
        let me = i32::try_from(rank).ok().filter(|_| rank < world);
        let (Some(ranks), Some(me)) = (ranks, me) else {
            return Err(KernelError::Shape { op: OP, detail: format!("rank {rank} of a world of {world}") });
        };
        check_libnccl(OP)?;
        let ctx = self.stream.context().clone();
        // NCCL picks the communicator's GPU from the thread's current context.
        ctx.bind_to_thread().map_err(dev_err(OP))?;
        let mut raw = sys::ncclUniqueId { internal: [0; NCCL_ID_BYTES] };
        for (dst, &b) in raw.internal.iter_mut().zip(id.0.iter()) {
            *dst = b as _;
        }
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the id is passed by value.
        unsafe { cudarc::nccl::result::comm_init_rank(&mut comm, ranks, raw, me) }.map_err(nccl_err(OP))?;
        if comm.is_null() {
            return Err(KernelError::Device { op: OP, detail: "NCCL returned no communicator".into() });
        }
        Ok(NcclComm { comm, ctx, rank, world })
    }

    /// In-place sum all-reduce over the communicator, queued on the device's stream (so it
    /// is ordered with the kernels and can be captured in a CUDA graph).
    pub fn all_reduce_sum(&self, comm: &NcclComm, buf: &mut Buf<half::bf16>) -> Result<(), KernelError> {
        self.all_reduce_in_place("nccl_all_reduce_bf16", comm, buf, sys::ncclDataType_t::ncclBfloat16)
    }

    /// [`Device::all_reduce_sum`] on f32 buffers.
    pub fn all_reduce_sum_f32(&self, comm: &NcclComm, buf: &mut Buf<f32>) -> Result<(), KernelError> {
        self.all_reduce_in_place("nccl_all_reduce_f32", comm, buf, sys::ncclDataType_t::ncclFloat32)
    }

    /// Errors unless `comm` was joined on this device.
    pub(crate) fn comm_on_this_device(&self, op: &'static str, comm: &NcclComm) -> Result<(), KernelError> {
        if comm.ctx.ordinal() != self.ordinal() {
            return Err(KernelError::Device {
                op,
                detail: format!(
                    "the communicator was joined on GPU {}, not this device (GPU {})",
                    comm.ctx.ordinal(),
                    self.ordinal()
                ),
            });
        }
        Ok(())
    }

    fn all_reduce_in_place<T>(
        &self,
        op: &'static str,
        comm: &NcclComm,
        buf: &mut Buf<T>,
        dtype: sys::ncclDataType_t,
    ) -> Result<(), KernelError> {
        self.comm_on_this_device(op, comm)?;
        // Every rank must queue the collective, also with no elements.
        let count = buf.len();
        let s = &self.stream;
        s.context().bind_to_thread().map_err(dev_err(op))?;
        let (ptr, _record) = buf.inner.device_ptr_mut(s);
        let p = ptr as *mut c_void;
        // SAFETY: `p` holds `count` elements of `dtype` on this device and stays alive while
        // the stream uses it (the caller owns `buf` for the collective's duration, as for
        // every op on this stream); `comm` is live and bound to this device.
        unsafe {
            cudarc::nccl::result::all_reduce(
                p,
                p,
                count,
                dtype,
                sys::ncclRedOp_t::ncclSum,
                comm.comm,
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(nccl_err(op))?;
        Ok(())
    }
}

/// A rank's communicator moves with its worker thread.
const _: () = {
    const fn send<T: Send>() {}
    send::<NcclComm>();
};
