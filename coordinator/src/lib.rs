//! The coordinator's pure core: sequence state, the paged-KV block manager with prefix
//! caching, and the continuous-batching scheduler. Plain synchronous Rust (no I/O, no
//! async) so `#[test]`s drive it directly; the async engine loop and the gRPC fan-out to
//! workers are built on top.
//!
//! Flow per step: `Scheduler::schedule` -> `ScheduledBatch` (deltas for the `Step`
//! stream, or `Scheduler::chunks` for full tables) -> workers run it and sample ->
//! `Scheduler::postprocess(&[StepOutput])` -> `SeqUpdate`s to stream to clients.

pub mod batch;
pub mod block_manager;
pub mod config;
pub mod drain;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod migration;
pub mod placement;
pub mod prefix_hash;
pub mod replica_link;
pub mod replica_set;
pub mod routing;
pub mod scheduler;
pub mod seq_trace;
pub mod sequence;
pub mod service;
pub mod supervisor;
pub mod validate;
pub mod worker_link;

pub use batch::{BlockAppend, ChunkView, NewSeq, ScheduledBatch, SeqRun, TableMirror};
pub use block_manager::{BlockManager, CacheStats};
pub use config::SchedulerConfig;
pub use error::{AdmissionError, BlockError, ConfigError, DeltaError};
pub use scheduler::{Scheduler, SchedulerStats, SeqUpdate, StepOutput};
pub use sequence::{FinishReason, PrefixChain, SeqStatus, Sequence, StopCriteria};
