//! Forming replicas from the workers a [`Discovery`] lists, and re-forming a failed one.
//!
//! `form` sets a replica up on given addresses (Info, Load of every shard, step streams)
//! and builds its scheduler from what the workers report. `supervise` runs per replica
//! for the coordinator's lifetime: when the replica's engine reports it unhealthy, it
//! looks the workers up again every `period`, picks the ones for this replica
//! (`choose_workers`: its previous addresses first, never a worker another healthy replica
//! uses), checks each answers Info within a few seconds (readiness), forms the replica on
//! them and attaches it to the engine, which then serves again. While the replica is
//! healthy it watches the listing too: a worker of the replica that is no longer listed (its
//! etcd lease expired: the process is hung, stopped or cut off, even if its step stream
//! has not broken) fails the replica at once (`EngineHandle::evict`) rather than after the
//! per-step deadline. `scale_out` forms new replicas from workers registered after the
//! start (enough unused ones for a whole replica, while every replica is healthy), so an
//! operator adds capacity by starting workers.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_cluster::{Discovery, WorkerRecord};
use tessera_proto::worker as pb;

use crate::config::SchedulerConfig;
use crate::engine::EngineHandle;
use crate::error::ConfigError;
use crate::placement::Placement;
use crate::replica_link::{LoadSpec, ReplicaLink};
use crate::replica_set::ReplicaSet;
use crate::scheduler::Scheduler;
use crate::worker_link::{LinkError, WorkerLink};

/// How every replica is formed.
#[derive(Debug, Clone)]
pub struct FormSpec {
    /// Workers per replica and their ranks.
    pub placement: Placement,
    /// What each shard loads; `group` is the base that formation numbers are added to.
    pub load: LoadSpec,
    /// Scheduler limits; block size, block count, context length and batches in flight
    /// are filled in from the workers and the placement.
    pub sched: SchedulerConfig,
    /// Context length to serve at most (the model's when `None`).
    pub max_model_len: Option<usize>,
    /// Per-step deadline of the replica's link; `None`: by the workers' device kind
    /// (`replica_link::default_step_timeout`).
    pub step_timeout: Option<Duration>,
    /// Mutual TLS on the links to the workers (forming, re-forming and readiness checks);
    /// plain gRPC when `None`.
    pub tls: Option<tonic::transport::ClientTlsConfig>,
}

/// A replica set up on its workers.
pub struct Formed {
    pub link: ReplicaLink,
    pub sched: Scheduler,
    /// The leader's info, with the smallest block count of any rank.
    pub info: pb::WorkerInfo,
}

#[derive(Debug, thiserror::Error)]
pub enum FormError {
    #[error(transparent)]
    Link(#[from] LinkError),
    #[error("scheduler for the replica: {0}")]
    Config(#[from] ConfigError),
    #[error("worker {addr} did not answer Info within {after:?}")]
    NotReady { addr: String, after: Duration },
    #[error("forming the replica took longer than {0:?}")]
    Timeout(Duration),
    #[error("waiting for workers: {need} needed, {free} listed and free")]
    TooFewWorkers { need: usize, free: usize },
}

/// Sets a replica up on `addrs` (rank `i` at `addrs[i]`) with collective group `group`,
/// waiting up to `wait` for the workers to accept connections.
pub async fn form(addrs: &[String], spec: &FormSpec, group: u64, wait: Duration) -> Result<Formed, FormError> {
    let load = LoadSpec { group, ..spec.load.clone() };
    let (link, info) = ReplicaLink::connect(addrs, &spec.placement, &load, wait, spec.tls.as_ref()).await?;
    // Lookahead decodes need the workers that sample to be the ones that run the next
    // step: no pipeline (its first stage never sees the token). Every tensor rank samples
    // the same token from the same gathered logits, when its workers say so
    // (`ranks_sample_alike`; `ReplicaLink::recv` then checks every step that they agree).
    // The second batch in flight is the lookahead; a pipeline keeps one per stage.
    let (tp, pp) = (spec.placement.tp, spec.placement.pp);
    let lookahead = spec.sched.lookahead && pp == 1 && (tp == 1 || info.ranks_sample_alike);
    let link = match spec.step_timeout {
        Some(t) => link.with_step_timeout(t),
        None => link,
    };
    let link = link.with_rank_check(lookahead && tp > 1);
    let model_len = info.max_model_len as usize;
    let cfg = SchedulerConfig {
        block_size: info.block_size as usize,
        num_blocks: info.num_blocks as usize,
        max_model_len: spec.max_model_len.map_or(model_len, |m| m.min(model_len)),
        max_in_flight: if lookahead { 2 } else { pp },
        lookahead,
        ..spec.sched.clone()
    };
    Ok(Formed { link, sched: Scheduler::new(cfg)?, info })
}

/// Whether the worker at `addr` answers Info within `after` (it is up and serving), over
/// mutual TLS when `tls` is set.
pub async fn ready_check(
    addr: &str,
    after: Duration,
    tls: Option<&tonic::transport::ClientTlsConfig>,
) -> Result<pb::WorkerInfo, FormError> {
    let check = async {
        let mut client = WorkerLink::dial(addr, after, tls).await?;
        WorkerLink::info_of(&mut client, addr).await
    };
    match tokio::time::timeout(after, check).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(FormError::NotReady { addr: addr.to_string(), after }),
    }
}

/// The `n` workers to form a replica on, from those listed now (`records`, in id order):
/// the replica's `previous` addresses that are still listed, then other listed workers,
/// none that is `busy` (serving another replica). `None` when fewer than `n` are free.
/// A replica whose every previous worker is back keeps its rank order.
pub fn choose_workers(
    records: &[WorkerRecord],
    busy: &HashSet<String>,
    previous: &[String],
    n: usize,
) -> Option<Vec<String>> {
    let free = |a: &String| !busy.contains(a);
    let listed: Vec<&String> = records.iter().map(|r| &r.addr).filter(|a| free(a)).collect();
    let mut chosen: Vec<String> = previous.iter().filter(|a| listed.contains(a)).cloned().collect();
    for a in listed {
        if chosen.len() >= n {
            break;
        }
        if !chosen.contains(a) {
            chosen.push(a.clone());
        }
    }
    chosen.truncate(n);
    (chosen.len() == n).then_some(chosen)
}

/// The first of `members` that `records` no longer lists.
pub fn unlisted_member<'a>(records: &[WorkerRecord], members: &'a [String]) -> Option<&'a String> {
    members.iter().find(|m| !records.iter().any(|r| &r.addr == *m))
}

/// The first `n` listed workers that no replica uses, when there are that many.
pub fn unused_workers(records: &[WorkerRecord], members: &[Vec<String>], n: usize) -> Option<Vec<String>> {
    let used: HashSet<&String> = members.iter().flatten().collect();
    let free: Vec<String> = records.iter().map(|r| &r.addr).filter(|a| !used.contains(a)).take(n).cloned().collect();
    (n > 0 && free.len() == n).then_some(free)
}

/// Starts the engine of a replica formed at `index` and returns its handle.
pub type SpawnEngine = Box<dyn Fn(usize, Formed) -> EngineHandle + Send + Sync>;

/// For the coordinator's lifetime: whenever the listing holds enough unused workers for a
/// whole replica and every replica is healthy (so this never races a re-formation for the
/// same workers), forms a new replica on them (readiness check, Load) and supervises it.
pub async fn scale_out(sup: Arc<Supervision>, spawn_engine: SpawnEngine) {
    let n = sup.spec.placement.workers();
    loop {
        sup.discovery.wait_change(sup.period).await;
        if sup.set.handles().iter().any(|h| !h.healthy()) {
            continue;
        }
        let Ok(records) = sup.discovery.workers().await else { continue };
        let members = sup.members.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(addrs) = unused_workers(&records, &members, n) else { continue };
        if let Err(e) = sup.add_replica(&addrs, &spawn_engine).await {
            tracing::warn!("tessera coordinator: a new replica on {} not formed yet: {e}", addrs.join(","));
        }
    }
}

/// Shared by the supervisors of one coordinator.
pub struct Supervision {
    pub set: Arc<ReplicaSet>,
    pub discovery: Arc<dyn Discovery>,
    pub spec: FormSpec,
    /// Each replica's worker addresses (the last formation's).
    pub members: Mutex<Vec<Vec<String>>>,
    /// How often a failed replica looks for workers.
    pub period: Duration,
    /// Readiness check deadline per worker.
    pub ready_timeout: Duration,
    /// Longest a re-formation (connect + load) may take.
    pub form_timeout: Duration,
}

impl Supervision {
    /// Runs `supervise` for every replica of the set.
    pub fn spawn_all(self: &Arc<Self>) {
        for i in 0..self.set.len() {
            tokio::spawn(supervise(self.clone(), i));
        }
    }

    fn busy_except(&self, index: usize) -> HashSet<String> {
        let members = self.members.lock().unwrap_or_else(|e| e.into_inner());
        let healthy = |i: usize| self.set.get(i).is_some_and(|h| h.healthy());
        members.iter().enumerate().filter(|&(i, _)| i != index && healthy(i)).flat_map(|(_, m)| m.clone()).collect()
    }

    /// Forms a new replica on `addrs` and starts supervising it.
    async fn add_replica(self: &Arc<Self>, addrs: &[String], spawn_engine: &SpawnEngine) -> Result<(), FormError> {
        for a in addrs {
            ready_check(a, self.ready_timeout, self.spec.tls.as_ref()).await?;
        }
        let index = self.set.len();
        let group = self.spec.load.group | (index as u64 & 0xff);
        let formed = tokio::time::timeout(self.form_timeout, form(addrs, &self.spec, group, self.ready_timeout))
            .await
            .map_err(|_| FormError::Timeout(self.form_timeout))??;
        let deadline = formed.link.step_timeout();
        let handle = spawn_engine(index, formed);
        let pushed = self.set.push(handle);
        self.members.lock().unwrap_or_else(|e| e.into_inner()).push(addrs.to_vec());
        debug_assert_eq!(pushed, index, "only scale_out adds replicas");
        tracing::info!(
            "tessera coordinator: replica {pushed} added on {} (step deadline {} s)",
            addrs.join(","),
            deadline.as_secs()
        );
        tokio::spawn(supervise(self.clone(), pushed));
        Ok(())
    }

    /// One attempt to re-form replica `index`; `epoch` numbers the attempt. On success, the
    /// new members and the new link's step deadline (the operator's, else by their device
    /// kinds).
    async fn reform(&self, index: usize, epoch: u64) -> Result<Option<(Vec<String>, Duration)>, FormError> {
        let records = match self.discovery.workers().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("tessera coordinator: replica {index}: looking up workers: {e}");
                return Ok(None);
            }
        };
        let previous = self.members.lock().unwrap_or_else(|e| e.into_inner()).get(index).cloned().unwrap_or_default();
        let n = self.spec.placement.workers();
        let busy = self.busy_except(index);
        let Some(addrs) = choose_workers(&records, &busy, &previous, n) else {
            let free = records.iter().filter(|r| !busy.contains(&r.addr)).count();
            return Err(FormError::TooFewWorkers { need: n, free });
        };
        for a in &addrs {
            ready_check(a, self.ready_timeout, self.spec.tls.as_ref()).await?;
        }
        let group = self.spec.load.group | ((epoch & 0xff) << 8) | (index as u64 & 0xff);
        let formed = tokio::time::timeout(self.form_timeout, form(&addrs, &self.spec, group, self.ready_timeout))
            .await
            .map_err(|_| FormError::Timeout(self.form_timeout))??;
        let deadline = formed.link.step_timeout();
        let Some(handle) = self.set.get(index) else { return Ok(None) };
        if !handle.attach(formed.link, formed.sched) {
            return Ok(None);
        }
        Ok(Some((addrs, deadline)))
    }
}

/// Watches replica `index` for the coordinator's lifetime and re-forms it after each
/// failure.
pub async fn supervise(sup: Arc<Supervision>, index: usize) {
    let Some(handle) = sup.set.get(index) else { return };
    let mut health = handle.health();
    let mut epoch = 0u64;
    loop {
        // Healthy: until the engine reports a failure, check that its workers are listed.
        loop {
            tokio::select! {
                alive = async { health.wait_for(|&h| !h).await.is_ok() } => {
                    if !alive {
                        return; // the engine is gone
                    }
                    break;
                }
                _ = sup.discovery.wait_change(sup.period) => {
                    let Ok(records) = sup.discovery.workers().await else { continue };
                    let members = sup.members.lock().unwrap_or_else(|e| e.into_inner()).get(index).cloned();
                    if let Some(gone) = members.as_deref().and_then(|m| unlisted_member(&records, m)) {
                        handle.evict(format!("worker {gone} is no longer registered (its lease expired)"));
                    }
                }
            }
        }
        tracing::warn!("tessera coordinator: replica {index} failed; looking for its workers");
        let mut last_error = String::new();
        loop {
            epoch += 1;
            match sup.reform(index, epoch).await {
                Ok(Some((addrs, deadline))) => {
                    tracing::info!(
                        "tessera coordinator: replica {index} re-formed on {} (step deadline {} s)",
                        addrs.join(","),
                        deadline.as_secs()
                    );
                    if let Some(m) = sup.members.lock().unwrap_or_else(|e| e.into_inner()).get_mut(index) {
                        *m = addrs;
                    }
                    break;
                }
                Ok(None) => {}
                Err(e) => {
                    let msg = e.to_string();
                    if msg != last_error {
                        tracing::warn!("tessera coordinator: replica {index}: not re-formed yet: {msg}");
                        last_error = msg;
                    }
                }
            }
            sup.discovery.wait_change(sup.period).await;
        }
        // Wait for the engine to report the attachment before watching for the next failure.
        if health.wait_for(|&h| h).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(addr: &str) -> WorkerRecord {
        WorkerRecord { id: addr.into(), addr: addr.into(), device: String::new(), free_memory_bytes: 0 }
    }

    #[test]
    fn a_member_missing_from_the_listing_is_found() {
        let members = vec!["a:1".to_string(), "b:2".to_string()];
        assert_eq!(unlisted_member(&[rec("a:1"), rec("b:2"), rec("c:3")], &members), None);
        assert_eq!(unlisted_member(&[rec("a:1"), rec("c:3")], &members), Some(&members[1]));
        assert_eq!(unlisted_member(&[], &members), Some(&members[0]));
        assert_eq!(unlisted_member(&[rec("a:1")], &[]), None, "a replica with no members yet");
    }

    #[test]
    fn a_new_replica_takes_only_unused_workers() {
        let listed = [rec("a:1"), rec("b:2"), rec("c:3"), rec("d:4")];
        let members = vec![vec!["a:1".to_string()], vec!["c:3".to_string()]];
        assert_eq!(unused_workers(&listed, &members, 2), Some(vec!["b:2".to_string(), "d:4".to_string()]));
        assert_eq!(unused_workers(&listed, &members, 3), None, "not enough for a whole replica");
        assert_eq!(unused_workers(&listed[..1], &members, 1), None);
        assert_eq!(unused_workers(&listed, &members, 0), None);
    }
}
