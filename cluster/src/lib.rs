//! Cluster membership behind one trait, [`Discovery`]: which workers exist and where.
//! `static` is the embedded default (`tessera serve` and fixed `--workers` lists);
//! `etcd` registers workers under leases and watches them ([`EtcdDiscovery`],
//! [`register_worker`]), elects a coordinator leader whose writes are fenced by revision
//! ([`campaign`], [`Fence`]), lets gateways follow the leader ([`follow_leader`]) and keeps
//! cluster settings ([`ClusterSettings`]). `keys.rs` lists every key.

pub mod discovery;
pub mod election;
pub mod error;
pub mod etcd;
pub mod etcd_discovery;
pub mod keys;
pub mod leader_watch;
pub mod lease;
pub mod record;
pub mod registration;
pub mod settings;

pub use discovery::{Discovery, DiscoveryError, StaticDiscovery, WorkerRecord};
pub use election::{campaign, Fence, LeaderInfo, Leadership, ReplicaPlan};
pub use error::ClusterError;
pub use etcd::parse_endpoints;
pub use etcd_discovery::EtcdDiscovery;
pub use keys::ClusterKeys;
pub use leader_watch::{follow_leader, LeaderWatch};
pub use registration::{register_worker, Registration};
pub use settings::{load_settings, ClusterSettings};
