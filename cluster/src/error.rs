//! Errors of the etcd side of the cluster crate. The binary turns them into `anyhow` at
//! its edge; discovery callers see `DiscoveryError` instead (see `discovery.rs`).

/// What went wrong talking to etcd or reading what is stored there.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// etcd could not be reached or refused a request.
    #[error("etcd: {0}")]
    Etcd(String),
    /// A flag or name that cannot be used (cluster name, endpoints, TTL).
    #[error("invalid cluster setting: {0}")]
    Invalid(String),
    /// A fenced write was refused: this process is no longer the leader.
    #[error("fenced write to {key} refused: leadership (token {token}) was lost")]
    Fenced { key: String, token: i64 },
    /// The lease behind a registration or a campaign expired.
    #[error("lease {0:x} expired")]
    LeaseLost(i64),
    /// A stored document did not parse.
    #[error("malformed {key}: {reason}")]
    Malformed { key: String, reason: String },
}

impl From<etcd_client::Error> for ClusterError {
    fn from(e: etcd_client::Error) -> Self {
        ClusterError::Etcd(e.to_string())
    }
}
