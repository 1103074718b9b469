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
