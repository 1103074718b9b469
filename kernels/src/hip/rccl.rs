//! RCCL collectives between the AMD GPUs of a tensor-parallel group. RCCL implements NCCL's
//! API, so the id that names a communicator is the same 128 bytes ([`NcclId`], relayed as hex
//! by the coordinator as for CUDA) and the calls below are NCCL's, resolved from librccl at
//! run time: without it every entry point is a clear "RCCL is not available" error.
//! Collectives are queued on the device's stream, ordered with its kernels.

use std::sync::Arc;

use half::bf16;

use super::device::{DevBuf, Device};
use super::ffi::{self, c_str, nccl, NcclComm, RawNcclId, RcclApi};
use super::Elem;
use crate::cuda::{NcclId, NCCL_ID_BYTES};
use crate::KernelError;

fn check(api: &RcclApi, op: &'static str, code: i32) -> Result<(), KernelError> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString accepts any code.
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string (or null).
    let msg = unsafe { c_str((api.ncclGetErrorString)(code), "unknown error") };
    Err(KernelError::Device { op, detail: format!("RCCL error {code}: {msg}") })
}

/// A fresh id for rank 0 to hand to the group.
pub fn unique_id() -> Result<NcclId, KernelError> {
    let api = ffi::rccl()?;
    let mut id = [0u8; NCCL_ID_BYTES];
    // SAFETY: `id` holds the 128 bytes of an ncclUniqueId.
    check(&api, "rccl_unique_id", unsafe { (api.ncclGetUniqueId)(id.as_mut_ptr()) })?;
    Ok(NcclId(id))
}

/// Element types the collectives carry, with their NCCL data type.
pub trait RcclElem: Elem {
    const NCCL_TYPE: i32;
}
impl RcclElem for bf16 {
    const NCCL_TYPE: i32 = nccl::BFLOAT16;
}
impl RcclElem for f32 {
    const NCCL_TYPE: i32 = nccl::FLOAT32;
}
impl RcclElem for u32 {
    const NCCL_TYPE: i32 = nccl::UINT32;
}

/// One rank's membership of an RCCL communicator. Dropping it aborts the communicator
/// locally (never waits for a dead peer).
pub struct RcclComm {
    api: Arc<RcclApi>,
    comm: NcclComm,
    rank: usize,
    world: usize,
}

// SAFETY: a communicator may be used from any thread, one at a time; not `Sync`.
unsafe impl Send for RcclComm {}

impl RcclComm {
    /// Joins the communicator `id` as `rank` of `world` on `dev` (blocks until every rank has
    /// joined).
    pub fn join(dev: &Device, id: &NcclId, rank: usize, world: usize) -> Result<Self, KernelError> {
        if world == 0 || rank >= world || world > i32::MAX as usize {
            return Err(KernelError::Shape { op: "rccl_join", detail: format!("rank {rank} of {world}") });
        }
        let api = ffi::rccl()?;
        dev.bind()?;
        let mut comm: NcclComm = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the id is passed by value as NCCL declares it.
        let code =
            unsafe { (api.ncclCommInitRank)(&mut comm, world as i32, RawNcclId { internal: id.0 }, rank as i32) };
        check(&api, "rccl_join", code)?;
        Ok(RcclComm { api, comm, rank, world })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// In-place sum of `buf` over the ranks.
    pub fn all_reduce_sum<T: RcclElem>(&self, dev: &Device, buf: &mut DevBuf<T>) -> Result<(), KernelError> {
        dev.bind()?;
        let p = buf.device_ptr();
        // SAFETY: in place on a live buffer of `len` elements, queued on the device's stream.
        let code =
            unsafe { (self.api.ncclAllReduce)(p, p, buf.len(), T::NCCL_TYPE, nccl::SUM, self.comm, dev.stream()) };
        check(&self.api, "rccl_all_reduce", code)
    }

    /// `out` = every rank's `local` in rank order (`out.len() == world * local.len()`).
    pub fn all_gather<T: RcclElem>(
        &self,
        dev: &Device,
        local: &DevBuf<T>,
        out: &mut DevBuf<T>,
    ) -> Result<(), KernelError> {
        if out.len() != local.len() * self.world {
            return Err(KernelError::Shape {
                op: "rccl_all_gather",
                detail: format!("out {} != {} ranks x {}", out.len(), self.world, local.len()),
            });
        }
        dev.bind()?;
        // SAFETY: sizes checked above; queued on the device's stream.
        let code = unsafe {
            (self.api.ncclAllGather)(
                local.device_ptr(),
                out.device_ptr(),
                local.len(),
                T::NCCL_TYPE,
                self.comm,
                dev.stream(),
            )
        };
        check(&self.api, "rccl_all_gather", code)
    }

    /// Sends `buf` to rank `to` (matched by a [`RcclComm::recv`] of the same length there).
    pub fn send<T: RcclElem>(&self, dev: &Device, to: usize, buf: &DevBuf<T>) -> Result<(), KernelError> {
        self.peer_ok("rccl_send", to)?;
        dev.bind()?;
        // SAFETY: live buffer; queued on the device's stream.
        let code = unsafe {
            (self.api.ncclSend)(buf.device_ptr(), buf.len(), T::NCCL_TYPE, to as i32, self.comm, dev.stream())
        };
        check(&self.api, "rccl_send", code)
    }

    /// Receives `buf.len()` elements from rank `from`.
    pub fn recv<T: RcclElem>(&self, dev: &Device, from: usize, buf: &mut DevBuf<T>) -> Result<(), KernelError> {
        self.peer_ok("rccl_recv", from)?;
        dev.bind()?;
        // SAFETY: live buffer; queued on the device's stream.
        let code = unsafe {
            (self.api.ncclRecv)(buf.device_ptr(), buf.len(), T::NCCL_TYPE, from as i32, self.comm, dev.stream())
        };
        check(&self.api, "rccl_recv", code)
    }

    fn peer_ok(&self, op: &'static str, peer: usize) -> Result<(), KernelError> {
        if peer < self.world && peer != self.rank {
            Ok(())
        } else {
            Err(KernelError::Shape { op, detail: format!("peer {peer} from rank {} of {}", self.rank, self.world) })
        }
    }
}

impl Drop for RcclComm {
    fn drop(&mut self) {
        // SAFETY: from a successful ncclCommInitRank, aborted once.
        let _ = unsafe { (self.api.ncclCommAbort)(self.comm) };
    }
}
