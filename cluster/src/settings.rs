//! Cluster settings kept in etcd at `/tessera/<cluster>/config`: one JSON object that
//! coordinators read at start. A flag given on the command line (or its environment
//! variable) wins over the document; the document wins over the flag's default. Every key is
//! optional; an unknown key or a wrong type is an error (a typo must not be silently ignored).
//!
//! | key                      | meaning (the coordinator flag it stands for)             |
//! |--------------------------|----------------------------------------------------------|
//! | `model`                  | model path as the workers see it (`--model`)             |
//! | `max_num_seqs`           | most running sequences per replica (`--max-num-seqs`)    |
//! | `max_num_batched_tokens` | token budget of one step (`--max-num-batched-tokens`)    |
//! | `max_waiting`            | most waiting requests per replica (`--max-waiting`)      |
//! | `max_model_len`          | context length to serve (`--max-model-len`)              |
//! | `block_size`             | positions per KV block (`--block-size`)                  |
//! | `kv_memory_mib`          | KV memory per worker, MiB (`--kv-memory-mib`)            |
//! | `tp`, `pp`               | tensor-parallel ranks / pipeline stages per replica      |
//! | `step_timeout_s`         | seconds before a step is declared hung (`--step-timeout-s`) |
//!
//! Example: `etcdctl put /tessera/tessera/config '{"max_num_seqs": 32, "max_waiting": 64}'`.

use etcd_client::Client;
use serde::{Deserialize, Serialize};

use crate::error::ClusterError;
use crate::etcd::{connect, with_timeout};
use crate::keys::ClusterKeys;

/// The settings document; `None` = not set there.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub max_num_seqs: Option<usize>,
    #[serde(default)]
    pub max_num_batched_tokens: Option<usize>,
    #[serde(default)]
    pub max_waiting: Option<usize>,
    #[serde(default)]
    pub max_model_len: Option<usize>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub kv_memory_mib: Option<u64>,
    #[serde(default)]
    pub tp: Option<usize>,
    #[serde(default)]
    pub pp: Option<usize>,
    #[serde(default)]
    pub step_timeout_s: Option<u64>,
}

impl ClusterSettings {
    /// Parses the document stored at `key`.
    pub fn parse(key: &str, value: &[u8]) -> Result<Self, ClusterError> {
        serde_json::from_slice(value)
            .map_err(|e| ClusterError::Malformed { key: key.to_string(), reason: e.to_string() })
    }
}

/// Reads the settings of `cluster` through `client`; an absent document is all defaults.
pub async fn read_settings(client: &Client, cluster: &str) -> Result<ClusterSettings, ClusterError> {
    let key = ClusterKeys::new(cluster)?.config();
    let resp = with_timeout("reading the cluster settings", client.kv_client().get(key.as_str(), None)).await?;
    match resp.kvs().first() {
        Some(kv) => ClusterSettings::parse(&key, kv.value()),
        None => Ok(ClusterSettings::default()),
    }
}

/// Connects to `endpoints` and reads the settings of `cluster`.
pub async fn load_settings(endpoints: &[String], cluster: &str) -> Result<ClusterSettings, ClusterError> {
    read_settings(&connect(endpoints).await?, cluster).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_keys_and_refuses_others() {
        let s = ClusterSettings::parse("k", br#"{"max_num_seqs": 8, "model": "/m.gguf"}"#).unwrap();
        assert_eq!(s.max_num_seqs, Some(8));
        assert_eq!(s.model.as_deref(), Some("/m.gguf"));
        assert_eq!(s.max_waiting, None);
        assert!(ClusterSettings::parse("k", br#"{"max_num_seq": 8}"#).is_err());
        assert!(ClusterSettings::parse("k", br#"{"max_num_seqs": "8"}"#).is_err());
        assert!(ClusterSettings::parse("k", br#"{"max_num_seqs": -1}"#).is_err());
    }
}
