//! Collectives: how a worker exchanges activations with its tensor- and pipeline-parallel
//! peers. Row-parallel layers all-reduce their partial outputs, vocab-parallel heads
//! all-gather logits shards, and pipeline stages send hidden states (f32) and token
//! metadata (u32) to the next stage.
//!
//! One trait, several transports: [`TcpCollective`] for CPU workers (multi-process TP/PP in CI,
//! no GPU needed); `RcclCollective` (feature `hip`, rccl.rs) for AMD GPUs. The CUDA forward
//! pass calls NCCL on its device buffers directly (kernels::cuda::NcclComm).
//!
//! Contract shared by every implementation:
//! - Collective calls (`all_reduce_sum`, `all_gather`, `barrier`) are made by every rank of the
//!   group in the same order with the same lengths; `send`/`recv` pairs match in order between
//!   two ranks. A rank that breaks this gets [`CollectiveError::Mismatch`], never a silent
//!   corruption or a hang.
//! - Failure is fail-stop: after an error other than `InvalidArgument`, the collective is
//!   unusable (later calls return [`CollectiveError::Broken`]) and its peers fail too.

#[cfg(feature = "hip")]
pub mod rccl;
pub mod tcp;

use std::time::Duration;

#[cfg(feature = "hip")]
pub use rccl::RcclCollective;
pub use tcp::TcpCollective;

/// The communication a worker needs with the other ranks of its parallel group.
/// Ranks are `0..world()`; lengths are element counts.
pub trait Collective: Send {
    /// This process's rank in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world(&self) -> usize;

    /// Element-wise sum over all ranks, in place. The result is bit-identical on every rank
    /// and independent of timing: partial sums are added in rank order
    /// (((x0 + x1) + x2) ...).
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError>;

    /// `out` (length `local.len() * world()`) = every rank's `local`, concatenated in rank
    /// order; all ranks pass `local`s of the same length.
    fn all_gather(&mut self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError>;

    /// Sends `data` to rank `to`, which must call `recv` with a buffer of the same length.
    /// May return before `to` has received it.
    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), CollectiveError>;

    /// Receives exactly `data.len()` elements sent by rank `from` with `send`.
    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), CollectiveError>;

    /// Sends u32 metadata (token ids, positions) to rank `to`; the length travels with it.
    fn send_u32(&mut self, to: usize, data: &[u32]) -> Result<(), CollectiveError>;

    /// Replaces `data` with the u32s rank `from` sent with `send_u32` (any length).
    fn recv_u32(&mut self, from: usize, data: &mut Vec<u32>) -> Result<(), CollectiveError>;

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CollectiveError>;
}

/// Why a collective operation (or setting one up) failed. `peer` is the rank at the other end
/// of the failing connection; `op` names the call (`"all_reduce_sum"`, `"recv"`, ...).
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("{op} with rank {peer}: {source}")]
    Io {
        peer: usize,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} with rank {peer}: no progress for {after:?}")]
    Timeout { peer: usize, op: &'static str, after: Duration },
    #[error("{op}: rank {peer} closed the connection")]
    PeerClosed { peer: usize, op: &'static str },
    /// The ranks are not making the same call (another op, another length, a skipped op).
    #[error("{op} with rank {peer}: ranks disagree: {detail}")]
    Mismatch { peer: usize, op: &'static str, detail: String },
    /// The peer failed (for a reason other than a mismatch) and told us before closing.
    #[error("{op}: rank {peer} aborted: {reason}")]
    PeerAborted { peer: usize, op: &'static str, reason: String },
    /// The peer sent bytes that are not a valid frame (unknown tag, oversized length).
    #[error("{op} with rank {peer}: malformed message: {detail}")]
    Protocol { peer: usize, op: &'static str, detail: String },
    /// The call itself is wrong (bad rank, wrong output length); nothing was sent and the
    /// collective stays usable.
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
    /// An earlier call failed; the connections are no longer in step.
    #[error("collective unusable after an earlier failure: {0}")]
    Broken(String),
    #[error("collective setup failed: {0}")]
    Setup(String),
    /// A GPU collective (RCCL) or its device staging failed.
    #[error("{op}: device error: {detail}")]
    Device { op: &'static str, detail: String },
}
