//! Helpers shared by the kernel test files.

pub mod gpu;
