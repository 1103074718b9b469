//! Where things live in etcd. Everything of one cluster is under `/tessera/<cluster>/`:
//!
//! | key                               | value                                          | written by |
//! |-----------------------------------|------------------------------------------------|------------|
//! | `workers/<id>`                    | a worker record (JSON, `record.rs`), under the worker's lease | worker |
//! | `election/<lease id>`             | a candidate's address (etcd's election API)    | coordinators |
//! | `leader`                          | the leader's address + fencing token (JSON), under its lease | the leader, fenced |
//! | `plan`                            | the replica plan (JSON), fenced                | the leader |
//! | `config`                          | cluster settings (JSON, `settings.rs`)         | the operator |

use crate::error::ClusterError;

/// The key names of one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterKeys {
    /// `/tessera/<cluster>/`
    root: String,
}

impl ClusterKeys {
    /// Keys for the cluster `name`: letters, digits, `.`, `_`, `-` (it becomes one key segment).
    pub fn new(name: &str) -> Result<Self, ClusterError> {
        let ok = !name.is_empty()
            && name.len() <= 128
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(ClusterError::Invalid(format!(
                "cluster name {name:?}: use 1-128 letters, digits, '.', '_' or '-'"
            )));
        }
        Ok(ClusterKeys { root: format!("/tessera/{name}/") })
    }

    /// Prefix of every worker record.
    pub fn workers_prefix(&self) -> String {
        format!("{}workers/", self.root)
    }

    /// The record of worker `id`.
    pub fn worker(&self, id: &str) -> String {
        format!("{}{id}", self.workers_prefix())
    }

    /// The election's name (etcd adds `/<lease id>` per candidate).
    pub fn election(&self) -> String {
        format!("{}election", self.root)
    }

    /// The published leader address.
    pub fn leader(&self) -> String {
        format!("{}leader", self.root)
    }

    /// The replica plan the leader formed.
    pub fn plan(&self) -> String {
        format!("{}plan", self.root)
    }

    /// The cluster settings document.
    pub fn config(&self) -> String {
        format!("{}config", self.root)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_become_one_segment() {
        let k = ClusterKeys::new("prod-1").unwrap();
        assert_eq!(k.worker("w0"), "/tessera/prod-1/workers/w0");
        assert_eq!(k.config(), "/tessera/prod-1/config");
        for bad in ["", "a/b", "x y", "é"] {
            assert!(ClusterKeys::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
