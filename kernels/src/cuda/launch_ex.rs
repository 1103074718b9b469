//! Kernel launch with programmatic dependent launch (PDL): cudarc's launch builder takes
//! no launch attributes, so kernels that may start before the kernel ahead of them finishes
//! (the decode GEMVs, the one-shot all-reduce, decode attention) go through
//! `cuLaunchKernelEx` here. With `pdl` the kernel may launch once every CTA of the previous
//! kernel in the stream has executed `griddepcontrol.launch_dependents` (or exited); it must
//! execute `griddepcontrol.wait` before touching anything that kernel writes. That kernel
//! may itself have started before the one ahead of it finished, so what is read before the
//! wait must have been complete before the previous kernel started (a plain launch further
//! back guarantees it for everything ahead of that launch). Without `pdl` this is a plain
//! launch (the kernel's griddepcontrol instructions are then no-ops).

use std::ffi::c_void;

use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig};

use super::device::dev_err;
use crate::KernelError;

/// Launches `func` on `stream` with `params` (pointers to each argument's value, in the
/// kernel's order), as a programmatic dependent launch when `pdl`.
///
/// # Safety
/// `params` must point at live values whose types, order and count match the kernel's
/// parameters, and the kernel must stay within its buffers for this configuration; with
/// `pdl` it must wait (`griddepcontrol.wait`) before reading or writing memory that the
/// previous kernel in the stream, or any kernel still running ahead of it, may write.
pub(crate) unsafe fn launch_ex(
    op: &'static str,
    stream: &CudaStream,
    func: &CudaFunction,
    cfg: LaunchConfig,
    pdl: bool,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    // SAFETY: a zeroed attribute is valid plain data; id and value are set together.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
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
        attrs: &mut attr,
        numAttrs: u32::from(pdl),
    };
    stream.context().bind_to_thread().map_err(dev_err(op))?;
    // SAFETY: the caller vouches for `params` and the kernel (see above); `ex` and `attr`
    // live through the call.
    unsafe { sys::cuLaunchKernelEx(&ex, func.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
        .result()
        .map_err(dev_err(op))
}
