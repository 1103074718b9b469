//! The L2 prefetch hint a latency-bound kernel carries for the kernel after it. Decode
//! attention at small batches and the one-shot all-reduce leave HBM bandwidth idle for
//! microseconds per layer, while the GEMV that follows each of them streams a weight matrix
//! from HBM; handing them that matrix lets them ask the L2 for its head meanwhile
//! (`l2_prefetch_share` in common.cuh), so the GEMV's first copies hit L2. A hint only: no
//! result depends on it.

use super::{bf16, Buf};

/// The first [`L2Prefetch::bytes`] of a weight buffer, to be prefetched into L2.
#[derive(Clone, Copy)]
pub struct L2Prefetch<'a> {
    // Read by the CUDA launchers only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) buf: &'a Buf<bf16>,
    bytes: usize,
}

impl<'a> L2Prefetch<'a> {
    /// The head of `buf`: at most `max_bytes`, rounded down to the 16-byte pieces bulk
    /// prefetches take. Zero bytes prefetch nothing.
    pub fn head(buf: &'a Buf<bf16>, max_bytes: usize) -> Self {
        let bytes = (buf.len() * 2).min(max_bytes) / 16 * 16;
        Self { buf, bytes }
    }

    /// Bytes the kernel will prefetch: a multiple of 16 within the buffer.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}
