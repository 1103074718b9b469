//! A worker's registration: its record at `workers/<id>` under a lease kept alive in the
//! background. When the lease is lost (etcd unreachable for longer than the TTL, or the
//! lease expired) the record is gone, so the keeper grants a new lease and writes the record
//! again until it succeeds. [`Registration::deregister`] revokes the lease on shutdown;
//! dropping a `Registration` only stops the refreshes (the record expires after the TTL).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, PutOptions};
use tokio::task::JoinHandle;

use crate::discovery::WorkerRecord;
use crate::error::ClusterError;
use crate::etcd::{check_ttl, connect, with_timeout};
use crate::keys::ClusterKeys;
use crate::lease::KeptLease;
use crate::record;

/// A live registration of one worker.
pub struct Registration {
    client: Client,
    /// The lease the record hangs on now (it changes after a re-registration).
    lease_id: Arc<Mutex<i64>>,
    task: JoinHandle<()>,
}

/// Registers `record` in `cluster` under a lease of `ttl_s` seconds and keeps it registered.
/// Fails when etcd cannot be reached now or the record is not valid.
pub async fn register_worker(
    endpoints: &[String],
    cluster: &str,
    record: WorkerRecord,
    ttl_s: u64,
) -> Result<Registration, ClusterError> {
    let ttl = check_ttl(ttl_s)?;
    let keys = ClusterKeys::new(cluster)?;
    let key = keys.worker(&record.id);
    let value = record::encode(&record)?;
    let client = connect(endpoints).await?;
    let lease = put_under_new_lease(&client, &key, &value, ttl).await?;
    let lease_id = Arc::new(Mutex::new(lease.id()));
    let task = tokio::spawn(keep_registered(client.clone(), key, value, ttl, lease, lease_id.clone()));
    Ok(Registration { client, lease_id, task })
}

impl Registration {
    /// The lease the record hangs on now.
    pub fn lease_id(&self) -> i64 {
        *self.lease_id.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops refreshing and revokes the lease: the record disappears now.
    pub async fn deregister(self) -> Result<(), ClusterError> {
        self.task.abort();
        let id = self.lease_id();
        with_timeout("revoking the worker's lease", self.client.lease_client().revoke(id)).await.map(|_| ())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn put_under_new_lease(client: &Client, key: &str, value: &str, ttl: i64) -> Result<KeptLease, ClusterError> {
    let lease = KeptLease::grant(client, ttl).await?;
    let opts = PutOptions::new().with_lease(lease.id());
    with_timeout("writing the worker record", client.kv_client().put(key, value, Some(opts))).await?;
    Ok(lease)
}

async fn keep_registered(
    client: Client,
    key: String,
    value: String,
    ttl: i64,
    mut lease: KeptLease,
    lease_id: Arc<Mutex<i64>>,
) {
    loop {
        lease.lost().await;
        tracing::warn!(key, "worker registration lost; registering again");
        lease = loop {
            match put_under_new_lease(&client, &key, &value, ttl).await {
                Ok(l) => break l,
                Err(e) => {
                    tracing::warn!(key, "re-registering failed, retrying in 1 s: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        *lease_id.lock().unwrap_or_else(|e| e.into_inner()) = lease.id();
        tracing::info!(key, lease = format!("{:x}", lease.id()), "worker registered again");
    }
}
