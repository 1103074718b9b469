//! [`EtcdDiscovery`]: the workers registered under `workers/` in etcd. `workers` reads the
//! prefix; a background watch on the prefix wakes `wait_change`. After a broken watch it is
//! re-created and waiters are woken too, since changes may have been missed meanwhile.
//! Malformed records are skipped with a logged error; they never fail the listing.
//!
//! `wait_change` returns once a change arrived after the last `workers` call (or at its
//! timeout). "Seen" is tracked per discovery object, which is exact for one consumer (a
//! coordinator's replica loop); with several, one may wake early, and then reads again.

use std::time::Duration;

use etcd_client::{Client, GetOptions, WatchOptions};
use std::sync::Mutex;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::discovery::{Discovery, DiscoveryError, WorkerRecord};
use crate::error::ClusterError;
use crate::etcd::{connect, with_timeout};
use crate::keys::ClusterKeys;
use crate::record;

/// Workers found through etcd.
pub struct EtcdDiscovery {
    client: Client,
    prefix: String,
    /// Bumped on every change event (and after every re-created watch).
    changes: watch::Receiver<u64>,
    /// The value of `changes` when `workers` last read.
    seen: Mutex<u64>,
    task: JoinHandle<()>,
}

impl EtcdDiscovery {
    /// Connects and starts watching the workers of `cluster`.
    pub async fn connect(endpoints: &[String], cluster: &str) -> Result<Self, ClusterError> {
        let prefix = ClusterKeys::new(cluster)?.workers_prefix();
        let client = connect(endpoints).await?;
        let (tx, rx) = watch::channel(0u64);
        // The first watch is in place before `connect` returns, so no change after it is missed.
        let stream = open_watch(&client, &prefix).await?;
        let task = tokio::spawn(watch_prefix(client.clone(), prefix.clone(), stream, tx));
        Ok(EtcdDiscovery { client, prefix, changes: rx, seen: Mutex::new(0), task })
    }
}

impl Drop for EtcdDiscovery {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Parses the listing, skipping (and logging) what does not parse; ordered by id.
pub fn parse_workers<'a>(kvs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Vec<WorkerRecord> {
    let mut out: Vec<WorkerRecord> = kvs
        .into_iter()
        .filter_map(|(key, value)| match record::decode(key, value) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::error!("skipping worker record: {e}");
                None
            }
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    out
}

#[async_trait::async_trait]
impl Discovery for EtcdDiscovery {
    async fn workers(&self) -> Result<Vec<WorkerRecord>, DiscoveryError> {
        // Mark changes seen before reading, so one that lands during the read wakes the next wait.
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = *self.changes.borrow();
        let resp = with_timeout(
            "listing workers",
            self.client.kv_client().get(self.prefix.as_str(), Some(GetOptions::new().with_prefix())),
        )
        .await
        .map_err(|e| DiscoveryError::Unavailable(e.to_string()))?;
        let mut kvs = Vec::with_capacity(resp.kvs().len());
        for kv in resp.kvs() {
            match kv.key_str() {
                Ok(k) => kvs.push((k, kv.value())),
                Err(_) => tracing::error!("skipping a worker record whose key is not UTF-8"),
            }
        }
        Ok(parse_workers(kvs))
    }

    async fn wait_change(&self, timeout: Duration) {
        let seen = *self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let mut rx = self.changes.clone();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|n| *n != seen)).await;
    }
}

async fn open_watch(client: &Client, prefix: &str) -> Result<etcd_client::WatchStream, ClusterError> {
    let opts = WatchOptions::new().with_prefix();
    with_timeout("watching workers", client.watch_client().watch(prefix, Some(opts))).await
}

async fn watch_prefix(client: Client, prefix: String, mut stream: etcd_client::WatchStream, tx: watch::Sender<u64>) {
    loop {
        let why = loop {
            match stream.message().await {
                Ok(Some(resp)) if !resp.events().is_empty() => tx.send_modify(|n| *n += 1),
                Ok(Some(resp)) if resp.canceled() => break format!("canceled: {}", resp.cancel_reason()),
                Ok(Some(_)) => {}
                Ok(None) => break "closed".to_string(),
                Err(e) => break e.to_string(),
            }
        };
        tracing::warn!(prefix, "the etcd watch on workers broke ({why}); watching again");
        stream = loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            match open_watch(&client, &prefix).await {
                Ok(s) => break s,
                Err(e) => tracing::warn!("re-watching workers: {e}"),
            }
        };
        tx.send_modify(|n| *n += 1);
    }
}
