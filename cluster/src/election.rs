//! Leader election among coordinators, with fencing.
//!
//! Candidates campaign through etcd's election API under `election`, each on its own kept
//! lease; etcd makes the candidate with the oldest key the leader. The leader's key has a
//! create revision that no other leadership will ever have: that revision is the fencing
//! token. Every write the leader makes goes through [`Fence`], a transaction that first
//! compares the leader key's create revision with the token, so once the key is gone (the
//! lease expired or was revoked; a successor may already lead) the write is refused. A deposed
//! leader therefore cannot act on the cluster's shared state even if it has not noticed yet.
//!
//! A [`Leadership`] also tells its holder when it is lost ([`Leadership::lost`]): the lease
//! was lost, or the leader key was deleted. What to do then is the holder's choice; the
//! coordinator stops serving and exits, so a supervisor restarts it and it campaigns again.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, EventType, PutOptions, Txn, TxnOp, WatchOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::ClusterError;
use crate::etcd::{check_ttl, connect, with_timeout};
use crate::keys::ClusterKeys;
use crate::lease::KeptLease;

/// What the leader publishes at `leader`: where to reach it and the term it leads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderInfo {
    /// gRPC address of the leading coordinator (`host:port`).
    pub addr: String,
    /// Its fencing token (the create revision of its election key).
    pub token: i64,
}

/// The replica plan the leader formed, at `plan`: worker addresses, one list per replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaPlan {
    /// Fencing token of the leadership that wrote it.
    pub token: i64,
    pub replicas: Vec<Vec<String>>,
}

/// Writes that succeed only while the leadership that made this fence still holds.
/// Cheap to clone; hand it to whatever writes on the leader's behalf.
#[derive(Clone)]
pub struct Fence {
    client: Client,
    /// The leader's election key (`election/<lease id>`).
    leader_key: Vec<u8>,
    /// Create revision of `leader_key`: the fencing token.
    token: i64,
    lease: i64,
}

impl Fence {
    /// The fencing token: strictly greater for every later leadership.
    pub fn token(&self) -> i64 {
        self.token
    }

    /// Puts `value` at `key` if this leadership still holds; with `with_lease` the key is
    /// deleted when the leader's lease ends. `Err(Fenced)` when it no longer holds.
    pub async fn put(&self, key: &str, value: impl Into<Vec<u8>>, with_lease: bool) -> Result<(), ClusterError> {
        let opts = with_lease.then(|| PutOptions::new().with_lease(self.lease));
        self.txn(key, TxnOp::put(key, value, opts)).await
    }

    /// Deletes `key` if this leadership still holds.
    pub async fn delete(&self, key: &str) -> Result<(), ClusterError> {
        self.txn(key, TxnOp::delete(key, None)).await
    }

    async fn txn(&self, key: &str, op: TxnOp) -> Result<(), ClusterError> {
        let cmp = Compare::create_revision(self.leader_key.clone(), CompareOp::Equal, self.token);
        let txn = Txn::new().when([cmp]).and_then([op]);
        let resp = with_timeout("fenced write", self.client.kv_client().txn(txn)).await?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(ClusterError::Fenced { key: key.to_string(), token: self.token })
        }
    }
}

/// This process leads the cluster's coordinators.
pub struct Leadership {
    keys: ClusterKeys,
    fence: Fence,
    lease: KeptLease,
    /// `true` once the leader key was seen deleted.
    key_gone: watch::Receiver<bool>,
    watch_task: JoinHandle<()>,
}

/// Campaigns in `cluster` with `addr` as this candidate's value and a lease of `ttl_s`
/// seconds; returns once this candidate leads. While another leads it waits (for as long
/// as that takes). Errors when etcd fails or this candidate's lease is lost meanwhile.
pub async fn campaign(endpoints: &[String], cluster: &str, addr: &str, ttl_s: u64) -> Result<Leadership, ClusterError> {
    let ttl = check_ttl(ttl_s)?;
    let keys = ClusterKeys::new(cluster)?;
    let client = connect(endpoints).await?;
    let lease = KeptLease::grant(&client, ttl).await?;
    let mut election = client.election_client();
    let resp = tokio::select! {
        r = election.campaign(keys.election(), addr, lease.id()) => r,
        _ = lease.lost() => return Err(ClusterError::LeaseLost(lease.id())),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            // Withdraw this candidacy now rather than leave a key that could win later
            // with no one behind it.
            let _ = lease.revoke(&client).await;
            return Err(e.into());
        }
    };
    let leader = resp.leader().ok_or_else(|| ClusterError::Etcd("campaign answered without a leader key".into()))?;
    let fence =
        Fence { client: client.clone(), leader_key: leader.key().to_vec(), token: leader.rev(), lease: lease.id() };
    let (tx, key_gone) = watch::channel(false);
    let watch_task = tokio::spawn(watch_key_deleted(client, fence.leader_key.clone(), fence.token, tx));
    tracing::info!(token = fence.token, "won the coordinator election");
    Ok(Leadership { keys, fence, lease, key_gone, watch_task })
}

impl Leadership {
    /// The fencing token of this leadership.
    pub fn token(&self) -> i64 {
        self.fence.token
    }

    /// A handle for fenced writes.
    pub fn fence(&self) -> Fence {
        self.fence.clone()
    }

    /// Publishes `addr` as the leader's address at `leader` (fenced, under the leader's
    /// lease, so it disappears with the leadership).
    pub async fn publish_address(&self, addr: &str) -> Result<(), ClusterError> {
        let info = LeaderInfo { addr: addr.to_string(), token: self.fence.token };
        let value = serde_json::to_vec(&info).map_err(|e| ClusterError::Invalid(e.to_string()))?;
        self.fence.put(&self.keys.leader(), value, true).await
    }

    /// Writes the replica plan (fenced).
    pub async fn write_plan(&self, replicas: Vec<Vec<String>>) -> Result<(), ClusterError> {
        let plan = ReplicaPlan { token: self.fence.token, replicas };
        let value = serde_json::to_vec(&plan).map_err(|e| ClusterError::Invalid(e.to_string()))?;
        self.fence.put(&self.keys.plan(), value, false).await
    }

    /// Resolves once this leadership is lost.
    pub async fn lost(&self) {
        let mut gone = self.key_gone.clone();
        tokio::select! {
            _ = self.lease.lost() => {}
            _ = gone.wait_for(|g| *g) => {}
        }
    }

    /// Whether the leadership is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.lease.is_lost() || *self.key_gone.borrow()
    }

    /// Steps down now: revokes the lease, deleting the election key and the published
    /// address, so another candidate leads at once.
    pub async fn resign(&self) -> Result<(), ClusterError> {
        self.watch_task.abort();
        self.lease.revoke(&self.fence.client).await
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.watch_task.abort();
    }
}

/// Sets `gone` once `key` (created at revision `token`) is deleted. Watches from the revision
/// after its creation, so a deletion that happened before the watch started is still seen;
/// after a broken watch it checks the key directly and watches again.
async fn watch_key_deleted(client: Client, key: Vec<u8>, token: i64, gone: watch::Sender<bool>) {
    let mut from = token + 1;
    loop {
        let opts = WatchOptions::new().with_start_revision(from);
        if let Ok(mut stream) = client.watch_client().watch(key.clone(), Some(opts)).await {
            while let Ok(Some(resp)) = stream.message().await {
                if resp.canceled() {
                    break; // compacted past `from`: check the key below
                }
                for ev in resp.events() {
                    if ev.event_type() == EventType::Delete {
                        let _ = gone.send(true);
                        return;
                    }
                }
                if let Some(h) = resp.header() {
                    from = from.max(h.revision() + 1);
                }
            }
        }
        match with_timeout("checking the leader key", client.kv_client().get(key.clone(), None)).await {
            Ok(resp) => {
                if resp.kvs().first().map(|kv| kv.create_revision()) != Some(token) {
                    let _ = gone.send(true);
                    return;
                }
                if let Some(h) = resp.header() {
                    from = from.max(h.revision() + 1);
                }
            }
            Err(e) => tracing::warn!("watching the leader key: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
