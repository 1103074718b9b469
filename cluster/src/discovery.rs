//! The [`Discovery`] trait and its static implementation.
//!
//! A coordinator asks a `Discovery` for the workers that exist now and waits for the set
//! to change; it forms replicas from them and re-forms a failed replica when its workers
//! (or replacements) are listed again and pass a readiness check.

use std::time::Duration;

/// One registered worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// Stable identity (e.g. host + GPU index); records are ordered by it.
    pub id: String,
    /// gRPC address the worker serves on (`host:port`).
    pub addr: String,
    /// `cpu`, `cuda:N`, ...
    pub device: String,
    /// Free device memory at registration, bytes (0 when unknown).
    pub free_memory_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("discovery backend unavailable: {0}")]
    Unavailable(String),
    #[error("malformed membership record {key}: {reason}")]
    Malformed { key: String, reason: String },
}

/// Where workers are found.
#[async_trait::async_trait]
pub trait Discovery: Send + Sync {
    /// The workers registered now, ordered by id.
    async fn workers(&self) -> Result<Vec<WorkerRecord>, DiscoveryError>;
    /// Waits until membership may have changed, at most `timeout`; callers then call
    /// `workers` again. (A backend without notifications just sleeps.)
    async fn wait_change(&self, timeout: Duration);
}

/// A fixed list of worker addresses (the `--workers` flag); ids are the list positions.
#[derive(Debug, Clone)]
pub struct StaticDiscovery {
    records: Vec<WorkerRecord>,
}

impl StaticDiscovery {
    pub fn new(addrs: &[String]) -> Self {
        let records = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| WorkerRecord {
                id: format!("{i:04}"),
                addr: a.clone(),
                device: String::new(),
                free_memory_bytes: 0,
            })
            .collect();
        StaticDiscovery { records }
    }
}

#[async_trait::async_trait]
impl Discovery for StaticDiscovery {
    async fn workers(&self) -> Result<Vec<WorkerRecord>, DiscoveryError> {
        Ok(self.records.clone())
    }

    async fn wait_change(&self, timeout: Duration) {
        // The list never changes: waiting is just the timeout.
        tokio::time::sleep(timeout).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn static_lists_addresses_in_order() {
        let d = StaticDiscovery::new(&["a:1".into(), "b:2".into()]);
        let w = d.workers().await.unwrap();
        assert_eq!(w.iter().map(|r| r.addr.as_str()).collect::<Vec<_>>(), ["a:1", "b:2"]);
        assert!(w[0].id < w[1].id);
    }
}
