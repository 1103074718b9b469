//! Observability shared by every Tessera role (gateway, coordinator, worker): metrics in
//! Prometheus text format, the small admin HTTP endpoint (`/health`, `/ready`, `/metrics`)
//! of the roles that do not serve HTTP themselves, OpenTelemetry traces and structured logs,
//! and the in-flight count a graceful drain waits on.

pub mod admin;
pub mod drain;
pub mod metrics;
pub mod metrics_buckets;
pub mod prometheus;
pub use admin::{serve_admin, Readiness};
pub use metrics::{Counter, Family, Gauge, Histogram, Registry};
pub mod logs;
pub mod trace;
pub mod trace_capture;
