//! [`Collective`] over RCCL for the AMD GPUs of a tensor-parallel group (feature `hip`). The
//! trait moves host slices, so each call stages them through device buffers on this rank's GPU;
//! a GPU forward pass would call `kernels::hip::RcclComm` on its own device buffers instead.
//!
//! Rank 0 makes the id ([`RcclCollective::new_id`]: the same 128-byte `NcclId`, relayed as hex
//! like CUDA's), every rank joins with it. Without librccl, joining is a
//! [`CollectiveError::Setup`] that says RCCL is not available.
//!
//! Against the trait's contract: `all_reduce_sum` is bit-identical on every rank (RCCL hands
//! every rank the same reduced values), but the order of additions is RCCL's, not rank order.
//! Failures are fail-stop as for TCP: after a device or RCCL error every call is `Broken`.

use tessera_kernels::cuda::NcclId;
use tessera_kernels::hip::{self, DevBuf, Device, RcclComm, RcclElem};
use tessera_kernels::KernelError;

use super::{Collective, CollectiveError};

/// One rank of an RCCL group, with the GPU its buffers are staged on.
pub struct RcclCollective {
    dev: Device,
    comm: RcclComm,
    broken: Option<String>,
}

impl RcclCollective {
    /// A fresh id for rank 0 to hand to the group.
    pub fn new_id() -> Result<NcclId, CollectiveError> {
        hip::rccl_unique_id().map_err(|e| CollectiveError::Setup(e.to_string()))
    }

    /// Joins group `id` as `rank` of `world` on AMD GPU `ordinal` (blocks until all ranks join).
    pub fn join(ordinal: usize, id: &NcclId, rank: usize, world: usize) -> Result<Self, CollectiveError> {
        let setup = |e: KernelError| CollectiveError::Setup(e.to_string());
        let dev = Device::new(ordinal).map_err(setup)?;
        let comm = RcclComm::join(&dev, id, rank, world).map_err(setup)?;
        Ok(RcclCollective { dev, comm, broken: None })
    }

    /// Runs `f` unless an earlier call failed; a failure marks the collective broken.
    fn run<R>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&Device, &RcclComm) -> Result<R, KernelError>,
    ) -> Result<R, CollectiveError> {
        if let Some(why) = &self.broken {
            return Err(CollectiveError::Broken(why.clone()));
        }
        f(&self.dev, &self.comm).map_err(|e| {
            let detail = e.to_string();
            self.broken = Some(format!("{op}: {detail}"));
            CollectiveError::Device { op, detail }
        })
    }

    fn peer_ok(&self, op: &'static str, peer: usize) -> Result<(), CollectiveError> {
        if peer < self.comm.world() && peer != self.comm.rank() {
            Ok(())
        } else {
            Err(CollectiveError::InvalidArgument {
                op,
                detail: format!("peer {peer} from rank {} of {}", self.comm.rank(), self.comm.world()),
            })
        }
    }
}

fn send_buf<T: RcclElem>(dev: &Device, comm: &RcclComm, to: usize, data: &[T]) -> Result<(), KernelError> {
    let buf: DevBuf<T> = dev.upload(data)?;
    comm.send(dev, to, &buf)?;
    dev.synchronize()
}

fn recv_buf<T: RcclElem>(dev: &Device, comm: &RcclComm, from: usize, len: usize) -> Result<Vec<T>, KernelError> {
    let mut buf = dev.alloc::<T>(len)?;
    comm.recv(dev, from, &mut buf)?;
    dev.download(&buf)
}

impl Collective for RcclCollective {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world(&self) -> usize {
        self.comm.world()
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let out = self.run("all_reduce_sum", |dev, comm| {
            let mut buf = dev.upload(data)?;
            comm.all_reduce_sum(dev, &mut buf)?;
            dev.download(&buf)
        })?;
        data.copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&mut self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        if out.len() != local.len() * self.world() {
            return Err(CollectiveError::InvalidArgument {
                op: "all_gather",
                detail: format!("out {} != {} ranks x {}", out.len(), self.world(), local.len()),
            });
        }
        let got = self.run("all_gather", |dev, comm| {
            let l = dev.upload(local)?;
            let mut o = dev.alloc::<f32>(local.len() * comm.world())?;
            comm.all_gather(dev, &l, &mut o)?;
            dev.download(&o)
        })?;
        out.copy_from_slice(&got);
        Ok(())
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), CollectiveError> {
        self.peer_ok("send", to)?;
        self.run("send", |dev, comm| send_buf(dev, comm, to, data))
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.peer_ok("recv", from)?;
        let got = self.run("recv", |dev, comm| recv_buf::<f32>(dev, comm, from, data.len()))?;
        data.copy_from_slice(&got);
        Ok(())
    }

    /// The length goes first as one u32, then the values.
    fn send_u32(&mut self, to: usize, data: &[u32]) -> Result<(), CollectiveError> {
        self.peer_ok("send_u32", to)?;
        let len = u32::try_from(data.len()).map_err(|_| CollectiveError::InvalidArgument {
            op: "send_u32",
            detail: format!("{} values exceed a u32 length", data.len()),
        })?;
        self.run("send_u32", |dev, comm| {
            send_buf(dev, comm, to, &[len])?;
            if len > 0 {
                send_buf(dev, comm, to, data)?;
            }
            Ok(())
        })
    }

    fn recv_u32(&mut self, from: usize, data: &mut Vec<u32>) -> Result<(), CollectiveError> {
        self.peer_ok("recv_u32", from)?;
        *data = self.run("recv_u32", |dev, comm| {
            let len = recv_buf::<u32>(dev, comm, from, 1)?.first().copied().unwrap_or(0) as usize;
            if len == 0 {
                return Ok(Vec::new());
            }
            recv_buf::<u32>(dev, comm, from, len)
        })?;
        Ok(())
    }

    /// A one-element all-reduce: returns on a rank only once every rank has contributed.
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut one = [1.0f32];
        self.all_reduce_sum(&mut one)
    }
}
