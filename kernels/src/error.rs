//! The one error type of the kernel API. Shapes are checked at the op boundary so a
//! caller bug is an error that names the op, never an out-of-bounds write.

/// What can go wrong inside a kernel call.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The platform asked for was not compiled into this binary.
    #[error("the {0} backend is not compiled into this build")]
    NotCompiled(&'static str),
    /// Buffer lengths disagree with the shape the op was given.
    #[error("{op}: shape mismatch: {detail}")]
    Shape { op: &'static str, detail: String },
    /// A tensor type the op has no implementation for.
    #[error("{op}: unsupported tensor type {ty}")]
    Unsupported { op: &'static str, ty: String },
    /// A GPU driver, runtime library or BLAS call failed.
    #[error("{op}: device error: {detail}")]
    Device { op: &'static str, detail: String },
    /// Run-time compilation of a kernel source failed; `log` is the compiler's output.
    #[error("compiling kernel module {module} for {arch} failed: {log}")]
    Compile { module: String, arch: String, log: String },
}

/// Returns a [`KernelError::Shape`] unless `cond` holds.
pub(crate) fn check(cond: bool, op: &'static str, detail: impl FnOnce() -> String) -> Result<(), KernelError> {
    if cond {
        Ok(())
    } else {
        Err(KernelError::Shape { op, detail: detail() })
    }
}
