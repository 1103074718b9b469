//! A lease kept alive in the background: [`KeptLease`]. Registrations and election
//! campaigns hang their keys on one. The keeper refreshes every TTL/3; when its stream
//! breaks it reopens one, and it declares the lease lost when etcd says it expired or when
//! the last confirmed TTL runs out with no refresh (then its keys are gone, or soon will be).

use std::time::Duration;

use etcd_client::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::ClusterError;
use crate::etcd::with_timeout;

/// A granted lease and the task refreshing it. Dropping it stops the refreshes (the lease
/// then expires after its TTL, as if the process had died); [`KeptLease::revoke`] ends it now.
#[derive(Debug)]
pub struct KeptLease {
    id: i64,
    lost: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl KeptLease {
    /// Grants a lease of `ttl_s` seconds and starts refreshing it.
    pub async fn grant(client: &Client, ttl_s: i64) -> Result<Self, ClusterError> {
        let resp = with_timeout("granting a lease", client.lease_client().grant(ttl_s, None)).await?;
        let id = resp.id();
        let ttl = Duration::from_secs(resp.ttl().max(1) as u64);
        let (tx, lost) = watch::channel(false);
        let task = tokio::spawn(keep_alive(client.clone(), id, ttl, tx));
        Ok(KeptLease { id, lost, task })
    }

    pub fn id(&self) -> i64 {
        self.id
    }

    /// Whether the lease is known to be gone.
    pub fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    /// Resolves once the lease is lost (at once if it already is).
    pub async fn lost(&self) {
        let mut rx = self.lost.clone();
        // An error means the keeper ended, which it only does after sending `true`.
        let _ = rx.wait_for(|lost| *lost).await;
    }

    /// Stops refreshing and revokes the lease, deleting its keys now.
    pub async fn revoke(&self, client: &Client) -> Result<(), ClusterError> {
        self.task.abort();
        with_timeout("revoking a lease", client.lease_client().revoke(self.id)).await.map(|_| ())
    }
}

impl Drop for KeptLease {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn keep_alive(client: Client, id: i64, ttl: Duration, lost: watch::Sender<bool>) {
    let period = ttl / 3;
    let mut deadline = Instant::now() + ttl;
    loop {
        match client.lease_client().keep_alive(id).await {
            Ok((mut keeper, mut stream)) => {
                // Opening the stream refreshed the lease once already.
                deadline = Instant::now() + ttl;
                loop {
                    tokio::time::sleep(period).await;
                    if keeper.keep_alive().await.is_err() {
                        break;
                    }
                    match tokio::time::timeout(period, stream.message()).await {
                        Ok(Ok(Some(r))) if r.ttl() > 0 => {
                            deadline = Instant::now() + Duration::from_secs(r.ttl() as u64)
                        }
                        Ok(Ok(Some(_))) => {
                            tracing::warn!(lease = format!("{id:x}"), "etcd lease expired");
                            let _ = lost.send(true);
                            return;
                        }
                        _ => break, // stream broken or slow: reopen it
                    }
                }
            }
            Err(etcd_client::Error::LeaseKeepAliveError(e)) => {
                tracing::warn!(lease = format!("{id:x}"), "etcd lease gone: {e}");
                let _ = lost.send(true);
                return;
            }
            Err(etcd_client::Error::GRpcStatus(s)) if s.code() == tonic::Code::NotFound => {
                tracing::warn!(lease = format!("{id:x}"), "etcd lease gone: {}", s.message());
                let _ = lost.send(true);
                return;
            }
            Err(e) => tracing::warn!(lease = format!("{id:x}"), "etcd lease keep-alive failed, retrying: {e}"),
        }
        if Instant::now() >= deadline {
            tracing::warn!(lease = format!("{id:x}"), "etcd lease not refreshed within its TTL; treating it as lost");
            let _ = lost.send(true);
            return;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
