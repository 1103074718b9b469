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

/// The driver results after which a GPU context is unusable: "sticky" errors, which every
/// later call in the process returns again (CUDA's names as cudarc prints them; HIP uses
/// the same numbers, printed by `HipApi::check` as `HIP error N:`).
const CONTEXT_LOST: [(&str, u32); 9] = [
    ("CUDA_ERROR_ECC_UNCORRECTABLE", 214),
    ("CUDA_ERROR_ILLEGAL_ADDRESS", 700),
    ("CUDA_ERROR_ASSERT", 710),
    ("CUDA_ERROR_HARDWARE_STACK_ERROR", 714),
    ("CUDA_ERROR_ILLEGAL_INSTRUCTION", 715),
    ("CUDA_ERROR_MISALIGNED_ADDRESS", 716),
    ("CUDA_ERROR_INVALID_ADDRESS_SPACE", 717),
    ("CUDA_ERROR_INVALID_PC", 718),
    ("CUDA_ERROR_LAUNCH_FAILED", 719),
];

impl KernelError {
    /// Whether this error left the GPU context unusable (a kernel faulted or trapped, e.g.
    /// the one-shot all-reduce giving up on a dead peer): nothing on that device works
    /// again in this process, so a server should restart rather than keep failing.
    pub fn context_lost(&self) -> bool {
        let KernelError::Device { detail, .. } = self else { return false };
        CONTEXT_LOST.iter().any(|(name, code)| {
            let hip = format!("HIP error {code}:");
            detail.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == *name)
                || detail.starts_with(&hip)
        })
    }
}

/// Returns a [`KernelError::Shape`] unless `cond` holds.
pub(crate) fn check(cond: bool, op: &'static str, detail: impl FnOnce() -> String) -> Result<(), KernelError> {
    if cond {
        Ok(())
    } else {
        Err(KernelError::Shape { op, detail: detail() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(detail: &str) -> KernelError {
        KernelError::Device { op: "op", detail: detail.into() }
    }

    #[test]
    fn sticky_driver_errors_mark_the_context_lost() {
        // As cudarc's DriverError prints through `dev_err`, and as HipApi::check words it.
        for lost in [
            r#"DriverError(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure")"#,
            r#"DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered")"#,
            "HIP error 700: an illegal memory access was encountered",
            "HIP error 719: unspecified launch failure",
        ] {
            assert!(device(lost).context_lost(), "{lost}");
        }
        for fine in [
            r#"DriverError(CUDA_ERROR_OUT_OF_MEMORY, "out of memory")"#,
            r#"DriverError(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch")"#,
            "HIP error 2: out of memory",
            "HIP error 7000: not a code",
            "NCCL returned ncclSystemError",
        ] {
            assert!(!device(fine).context_lost(), "{fine}");
        }
        assert!(!KernelError::Shape { op: "op", detail: "CUDA_ERROR_LAUNCH_FAILED".into() }.context_lost());
    }
}
