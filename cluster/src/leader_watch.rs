//! Following the coordinator leader from a gateway: [`LeaderWatch`] keeps the address
//! published at `leader` (see `election.rs`) in a `tokio::sync::watch` channel. A
//! background task reads the key, then watches it; after a broken watch, or when the holder
//! asks for it ([`LeaderWatch::refresh`], e.g. after a failed connection to the leader), it
//! reads the key again. While etcd cannot be reached the last known address is kept, since
//! the coordinator itself may well be fine; when the key is deleted (the leader's lease
//! ended) the address becomes `None` until a new leader publishes.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, WatchOptions};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::election::LeaderInfo;
use crate::error::ClusterError;
use crate::etcd::{connect, with_timeout};
use crate::keys::ClusterKeys;

/// The current leader's address, kept up to date from etcd.
#[derive(Debug)]
pub struct LeaderWatch {
    rx: watch::Receiver<Option<String>>,
    refresh: Arc<Notify>,
    task: JoinHandle<()>,
}

/// Starts following the leader of `cluster`. The first read happens before this returns
/// (an unreachable etcd at start is an error; later outages are ridden out).
pub async fn follow_leader(endpoints: &[String], cluster: &str) -> Result<LeaderWatch, ClusterError> {
    let key = ClusterKeys::new(cluster)?.leader();
    let client = connect(endpoints).await?;
    let (first, rev) = read_leader(&client, &key).await?;
    let (tx, rx) = watch::channel(first);
    let refresh = Arc::new(Notify::new());
    let task = tokio::spawn(follow(client, key, rev, tx, refresh.clone()));
    Ok(LeaderWatch { rx, refresh, task })
}

impl LeaderWatch {
    /// The leader's address now, if one is published.
    pub fn current(&self) -> Option<String> {
        self.rx.borrow().clone()
    }

    /// A receiver that sees every change of the address.
    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.rx.clone()
    }

    /// A handle that makes the watcher read the key again when notified.
    pub fn refresher(&self) -> Arc<Notify> {
        self.refresh.clone()
    }

    /// Reads the key again now (e.g. the leader could not be reached).
    pub fn refresh(&self) {
        self.refresh.notify_one();
    }
}

impl Drop for LeaderWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Parses the published leader document; a malformed one counts as no leader (logged).
pub fn parse_leader(key: &str, value: &[u8]) -> Option<String> {
    match serde_json::from_slice::<LeaderInfo>(value) {
        Ok(info) if !info.addr.is_empty() => Some(info.addr),
        Ok(_) => {
            tracing::error!(key, "the published leader has an empty address");
            None
        }
        Err(e) => {
            tracing::error!(key, "malformed leader record: {e}");
            None
        }
    }
}

/// The published address (if any) and the store revision it was read at.
async fn read_leader(client: &Client, key: &str) -> Result<(Option<String>, i64), ClusterError> {
    let resp = with_timeout("reading the leader", client.kv_client().get(key, None)).await?;
    let rev = resp.header().map_or(0, |h| h.revision());
    Ok((resp.kvs().first().and_then(|kv| parse_leader(key, kv.value())), rev))
}

fn set(tx: &watch::Sender<Option<String>>, addr: Option<String>) {
    tx.send_if_modified(|cur| {
        if *cur == addr {
            return false;
        }
        tracing::info!(leader = addr.as_deref().unwrap_or("none"), "coordinator leader changed");
        *cur = addr;
        true
    });
}

async fn follow(client: Client, key: String, mut rev: i64, tx: watch::Sender<Option<String>>, refresh: Arc<Notify>) {
    loop {
        let opts = WatchOptions::new().with_start_revision(rev + 1);
        match client.watch_client().watch(key.as_str(), Some(opts)).await {
            Ok(mut stream) => loop {
                tokio::select! {
                    msg = stream.message() => match msg {
                        Ok(Some(resp)) if !resp.canceled() => {
                            for ev in resp.events() {
                                let addr = match (ev.event_type(), ev.kv()) {
                                    (EventType::Put, Some(kv)) => parse_leader(&key, kv.value()),
                                    _ => None,
                                };
                                set(&tx, addr);
                            }
                        }
                        _ => break,
                    },
                    _ = refresh.notified() => break,
                }
            },
            Err(e) => tracing::warn!("watching the coordinator leader: {e}"),
        }
        // Read the key again: changes may have been missed, or the holder asked. (The pause
        // keeps a watch that fails at once from spinning.)
        tokio::time::sleep(Duration::from_millis(200)).await;
        loop {
            match read_leader(&client, &key).await {
                Ok((addr, r)) => {
                    set(&tx, addr);
                    rev = r;
                    break;
                }
                Err(e) => {
                    tracing::warn!("reading the coordinator leader: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
        if tx.is_closed() {
            return;
        }
    }
}
