//! NCCL point-to-point and gather collectives: the pipeline's activation hand-off between
//! stages (`send` / `recv` of the residual stream) and the vocab-parallel LM head's
//! all-gather of logit shards. Like the all-reduce in `nccl.rs`, every call is queued on
//! the device's one stream, so it is ordered with the kernels around it and can be
//! recorded into a CUDA graph.

use std::ffi::c_void;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;

use super::device::{dev_err, Buf, Device};
use super::nccl::{nccl_err, NcclComm};
use super::Elem;
use crate::KernelError;

/// NCCL's name for an element type we send (bf16 activations, f32 logits).
pub trait NcclElem: Elem {
    const DTYPE: sys::ncclDataType_t;
}

impl NcclElem for half::bf16 {
    const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclBfloat16;
}

impl NcclElem for f32 {
    const DTYPE: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
}

impl Device {
    /// Queues sending the first `count` elements of `buf` to rank `peer` of `comm`, which
    /// must queue a matching [`Device::nccl_recv`] of `count` elements.
    pub fn nccl_send<T: NcclElem>(
        &self,
        comm: &NcclComm,
        buf: &Buf<T>,
        count: usize,
        peer: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "nccl_send";
        let peer = self.p2p_check(OP, comm, buf.len(), count, peer)?;
        let s = &self.stream;
        let (ptr, _record) = buf.inner.device_ptr(s);
        // SAFETY: `ptr` holds at least `count` elements of `T::DTYPE` on this device and
        // outlives the queued send (the caller keeps `buf` for the step, as for every op);
        // `comm` is live and bound to this device (checked).
        unsafe {
            cudarc::nccl::result::send(
                ptr as *const c_void,
                count,
                T::DTYPE,
                peer,
                comm.raw(),
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(nccl_err(OP))?;
        Ok(())
    }

    /// Queues receiving `count` elements from rank `peer` of `comm` into the start of `buf`.
    pub fn nccl_recv<T: NcclElem>(
        &self,
        comm: &NcclComm,
        buf: &mut Buf<T>,
        count: usize,
        peer: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "nccl_recv";
        let peer = self.p2p_check(OP, comm, buf.len(), count, peer)?;
        let s = &self.stream;
        let (ptr, _record) = buf.inner.device_ptr_mut(s);
        // SAFETY: as in `nccl_send`; `ptr` is writable for `count` elements.
        unsafe {
            cudarc::nccl::result::recv(
                ptr as *mut c_void,
                count,
                T::DTYPE,
                peer,
                comm.raw(),
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(nccl_err(OP))?;
        Ok(())
    }

    /// `out[r * local.len() ..][.. local.len()]` = rank `r`'s `local`, for every rank of
    /// `comm` (all ranks pass the same length; `out` holds `world * local.len()`).
    pub fn nccl_all_gather<T: NcclElem>(
        &self,
        comm: &NcclComm,
        local: &Buf<T>,
        out: &mut Buf<T>,
    ) -> Result<(), KernelError> {
        const OP: &str = "nccl_all_gather";
        self.comm_on_this_device(OP, comm)?;
        let count = local.len();
        crate::error::check(out.len() == count * comm.world(), OP, || {
            format!("{} ranks x {count} elements do not fill an output of {}", comm.world(), out.len())
        })?;
        let s = &self.stream;
        s.context().bind_to_thread().map_err(dev_err(OP))?;
        let (src, _r1) = local.inner.device_ptr(s);
        let (dst, _r2) = out.inner.device_ptr_mut(s);
        // SAFETY: `src` holds `count` and `dst` `world * count` elements of `T::DTYPE` on
        // this device, alive for the queued call; `comm` is live and bound here.
        unsafe {
            cudarc::nccl::result::all_gather(
                src as *const c_void,
                dst as *mut c_void,
                count,
                T::DTYPE,
                comm.raw(),
                s.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(nccl_err(OP))?;
        Ok(())
    }

    /// Checks a send/recv's arguments; returns the peer as NCCL's `int`.
    fn p2p_check(
        &self,
        op: &'static str,
        comm: &NcclComm,
        len: usize,
        count: usize,
        peer: usize,
    ) -> Result<i32, KernelError> {
        self.comm_on_this_device(op, comm)?;
        crate::error::check(count <= len, op, || format!("{count} elements from a buffer of {len}"))?;
        let p = i32::try_from(peer).ok().filter(|_| peer < comm.world() && peer != comm.rank());
        let p = p.ok_or_else(|| KernelError::Shape {
            op,
            detail: format!(
                "peer {peer} is not another rank of a world of {} (this is rank {})",
                comm.world(),
                comm.rank()
            ),
        })?;
        self.stream.context().bind_to_thread().map_err(dev_err(op))?;
        Ok(p)
    }
}
