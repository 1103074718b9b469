//! Cluster membership behind one trait, [`Discovery`]: which workers exist and where.
//! `static` is the embedded default (`tessera serve` and fixed `--workers` lists);
//! `etcd` registers workers under leases and watches them.

pub mod discovery;

pub use discovery::{Discovery, DiscoveryError, StaticDiscovery, WorkerRecord};
