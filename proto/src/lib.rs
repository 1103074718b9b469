//! Tessera's gRPC contracts, generated from `worker.proto` (coordinator <-> worker) and
//! `coordinator.proto` (gateway -> coordinator). The `.proto` files are the documentation.
//! Modules mirror the proto packages (the generated code refers across them by path).

pub mod tessera {
    /// `tessera.worker.v1`.
    pub mod worker {
        pub mod v1 {
            tonic::include_proto!("tessera.worker.v1");
        }
    }
    /// `tessera.coordinator.v1`.
    pub mod coordinator {
        pub mod v1 {
            tonic::include_proto!("tessera.coordinator.v1");
        }
    }
}

/// The coordinator service the gateway calls.
pub use tessera::coordinator::v1 as coordinator;
/// The worker service and its step stream.
pub use tessera::worker::v1 as worker;

/// The largest message Tessera's gRPC servers (coordinator, worker) and the coordinator's
/// worker links decode (tonic's default is 4 MiB; the gateway's client keeps it, as the
/// coordinator's token events are small). A step admitting many sequences, each with its
/// prompt, sampling parameters and constraint (at most 1 MiB, checked by the gateway), can
/// pass 4 MiB.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Tokens a step run computes: its `tokens`, or for a lookahead decode (`from_previous`,
/// sent with no tokens) the one token the worker sampled for it in the step before. The
/// wire run and the coordinator's and worker's own run types all count this way.
pub fn run_tokens(tokens: usize, from_previous: bool) -> usize {
    if from_previous {
        1
    } else {
        tokens
    }
}

impl worker::SeqRun {
    /// Tokens this run computes ([`run_tokens`]).
    pub fn num_tokens(&self) -> usize {
        run_tokens(self.tokens.len(), self.from_previous)
    }
}
