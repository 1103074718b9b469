//! The HIP API without the `hip` feature: opening a device says the backend is not compiled
//! in, so callers need no `#[cfg]` to ask.

use crate::KernelError;

/// Stands in for the real device; cannot be constructed.
pub struct Device {
    _never: std::convert::Infallible,
}

impl Device {
    pub fn new(_ordinal: usize) -> Result<Self, KernelError> {
        Err(KernelError::NotCompiled("hip"))
    }
}

/// Without the feature there is no runtime to ask.
pub fn device_count() -> Result<usize, KernelError> {
    Err(KernelError::NotCompiled("hip"))
}
