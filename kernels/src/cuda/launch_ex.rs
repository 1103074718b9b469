//! Kernel launch with launch attributes: cudarc's launch builder takes none, so kernels that
//! may start before the kernel ahead of them finishes (programmatic dependent launch, PDL:
//! the decode GEMVs, the one-shot all-reduce, decode attention) or that run in thread-block
//! clusters (the lean cluster decode attention) go through `cuLaunchKernelEx` here.
//!
//! With `pdl` the kernel may launch once every CTA of the previous kernel in the stream has
//! executed `griddepcontrol.launch_dependents` (or exited); it must execute
//! `griddepcontrol.wait` before touching anything that kernel writes. That kernel may itself
//! have started before the one ahead of it finished, so what is read before the wait must
//! have been complete before the previous kernel started (a plain launch further back
//! guarantees it for everything ahead of that launch). Without `pdl` this is a plain launch
//! (the kernel's griddepcontrol instructions are then no-ops).
//!
//! With a cluster shape the grid is divided into clusters of that many CTAs per dimension,
//! co-scheduled on one GPC, which can synchronise (`barrier.cluster`) and read each other's
//! shared memory (`mapa`, `ld.shared::cluster`).

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

use super::device::dev_err;
use crate::KernelError;

/// [`launch_ex_cluster`] without a cluster shape: `func` on `stream` with `params`, as a
/// programmatic dependent launch when `pdl`.
///
/// # Safety
/// As for [`launch_ex_cluster`].
pub(crate) unsafe fn launch_ex(
    op: &'static str,
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { launch_ex_cluster(op, stream, func, cfg, pdl, None, params) }
}

/// Launches `func` on `stream` with `params` (pointers to each argument's value, in the
/// kernel's order), as a programmatic dependent launch when `pdl`, in thread-block clusters
/// of `cluster` = (x, y, z) CTAs when given.
///
/// # Safety
/// `params` must point at live values whose types, order and count match the kernel's
/// parameters, and the kernel must stay within its buffers for this configuration; with
/// `pdl` it must wait (`griddepcontrol.wait`) before reading or writing memory that the
/// previous kernel in the stream, or any kernel still running ahead of it, may write. With
/// `cluster` the grid must be a whole number of clusters in each dimension (the driver
/// refuses others), and every CTA of a cluster must pass the same cluster barriers, or none,
/// and keep its shared memory alive while others of its cluster may read it.
pub(crate) unsafe fn launch_ex_cluster(
    op: &'static str,
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    cluster: Option<(u32, u32, u32)>,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    // SAFETY: a zeroed attribute is valid plain data; each one used gets its id and value set
    // together below.
    let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
    let mut n = 0;
    if pdl {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attrs[n].value.programmaticStreamSerializationAllowed = 1;
        n += 1;
    }
    if let Some((x, y, z)) = cluster {
        attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
        attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
        n += 1;
    }
    let (g, b) = (cfg.grid_dim, cfg.block_dim);
    let ex = sys::CUlaunchConfig {
        gridDimX: g.0,
        gridDimY: g.1,
        gridDimZ: g.2,
        blockDimX: b.0,
        blockDimY: b.1,
        blockDimZ: b.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: attrs.as_mut_ptr(),
        numAttrs: n as u32,
    };
    stream.context().bind_to_thread().map_err(dev_err(op))?;
    // SAFETY: the caller vouches for `params` and the kernel (see above); `ex` and `attrs`
    // live through the call.
    unsafe { sys::cuLaunchKernelEx(&ex, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(dev_err(op))
}
