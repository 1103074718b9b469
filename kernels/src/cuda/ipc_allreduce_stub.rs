//! The one-shot all-reduce API (`ipc_allreduce.rs`) when the `cuda` feature is not
//! compiled in: the same names and signatures, so callers need no `#[cfg]`. No
//! [`IpcAllReduce`] can exist; setup reports `NotCompiled("cuda")`.

use std::convert::Infallible;

use half::bf16;

use super::{Buf, Device, NcclComm};
use crate::KernelError;

/// Blocks of the kernel's grid (see the `cuda` build's documentation).
pub const ONESHOT_BLOCKS: u32 = 16;
/// Largest message sent one-shot by default (see the `cuda` build's documentation).
pub const ONESHOT_DEFAULT_MAX_BYTES: usize = 1 << 20;
/// Dead-peer timeout of the kernel's waits.
pub const ONESHOT_TIMEOUT_NS: u64 = 30_000_000_000;

/// One rank's one-shot all-reduce state (never constructed without the `cuda` feature).
pub struct IpcAllReduce {
    never: Infallible,
}

#[allow(unused_variables)]
impl IpcAllReduce {
    pub fn rank(&self) -> usize {
        match self.never {}
    }
    pub fn world(&self) -> usize {
        match self.never {}
    }
    pub fn capacity_bytes(&self) -> usize {
        match self.never {}
    }
    pub fn max_bytes(&self) -> usize {
        match self.never {}
    }
    pub fn set_max_bytes(&mut self, bytes: usize) {
        match self.never {}
    }
    pub fn set_timeout_ns(&mut self, ns: u64) {
        match self.never {}
    }
    pub fn set_early_dependents(&mut self, on: bool) {
        match self.never {}
    }
    pub fn route(&self) -> &str {
        match self.never {}
    }
    pub fn fits(&self, len: usize) -> bool {
        match self.never {}
    }
}

#[allow(unused_variables)]
impl Device {
    pub fn ipc_all_reduce_setup(&self, comm: &NcclComm, max_bytes: usize) -> Result<IpcAllReduce, KernelError> {
        Err(KernelError::NotCompiled("cuda"))
    }
    pub fn all_reduce_sum_small(&self, ar: &IpcAllReduce, buf: &mut Buf<bf16>) -> Result<(), KernelError> {
        match ar.never {}
    }
    pub fn all_reduce_sum_small_add(
        &self,
        ar: &IpcAllReduce,
        buf: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        match ar.never {}
    }
    pub fn tp_all_reduce_add(
        &self,
        comm: &NcclComm,
        ar: Option<&IpcAllReduce>,
        buf: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        Err(KernelError::NotCompiled("cuda"))
    }
    pub fn tp_all_reduce(
        &self,
        comm: &NcclComm,
        ar: Option<&IpcAllReduce>,
        buf: &mut Buf<bf16>,
    ) -> Result<(), KernelError> {
        Err(KernelError::NotCompiled("cuda"))
    }
}
