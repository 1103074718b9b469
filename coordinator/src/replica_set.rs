//! The replicas of one model behind one coordinator: their engine handles, the prefix
//! affinity map, and the two decisions that span replicas: where a new request goes
//! (`pick`, see `routing`) and where the unfinished sequences of a failed replica go
//! (`hand_off`).
//!
//! Engines are built before the set is complete (each needs the set to hand work off),
//! so the first handles are installed after every engine exists; replicas formed later
//! (workers registered after the start, `supervisor::scale_out`) are pushed at the end.

use std::sync::{Mutex, RwLock};

use crate::engine::EngineHandle;
use crate::migration::Migrant;
use crate::routing::{self, AffinityMap, RoutingConfig};

/// Every replica of the served model.
pub struct ReplicaSet {
    handles: RwLock<Vec<EngineHandle>>,
    affinity: Mutex<AffinityMap>,
    cfg: RoutingConfig,
}

impl ReplicaSet {
    pub fn new(cfg: RoutingConfig) -> Self {
        ReplicaSet { handles: RwLock::new(Vec::new()), affinity: Mutex::new(AffinityMap::new(cfg.capacity)), cfg }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<EngineHandle>> {
        self.handles.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Installs the first handles, replica `i` at index `i` (once; later calls are ignored).
    pub fn install(&self, handles: Vec<EngineHandle>) {
        let mut h = self.handles.write().unwrap_or_else(|e| e.into_inner());
        if h.is_empty() {
            *h = handles;
        }
    }

    /// Adds a replica formed later; returns its index.
    pub fn push(&self, handle: EngineHandle) -> usize {
        let mut h = self.handles.write().unwrap_or_else(|e| e.into_inner());
        h.push(handle);
        h.len() - 1
    }

    /// Replicas now.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Replica `i`'s handle.
    pub fn get(&self, i: usize) -> Option<EngineHandle> {
        self.read().get(i).cloned()
    }

    /// The replicas, by index (a snapshot; empty before `install`).
    pub fn handles(&self) -> Vec<EngineHandle> {
        self.read().clone()
    }

    /// Positions per KV block (the replicas share it).
    pub fn block_size(&self) -> usize {
        self.read().first().map_or(0, EngineHandle::block_size)
    }

    /// Sequences held (or about to be) by each replica that can take work now.
    fn loads(&self) -> Vec<Option<usize>> {
        self.read().iter().map(|h| h.healthy().then(|| h.sequences())).collect()
    }

    /// The replica for a prompt whose block chain is `hashes`
    /// (`routing::prompt_block_hashes`).
    pub fn pick(&self, hashes: &[u64]) -> Option<(usize, EngineHandle)> {
        let preferred = self.affinity.lock().unwrap_or_else(|e| e.into_inner()).lookup(hashes);
        let i = routing::choose(&self.loads(), preferred, self.cfg.affinity_margin)?;
        Some((i, self.get(i)?))
    }

    /// Replica `i` took a prompt whose block chain is `hashes`.
    pub fn record(&self, hashes: &[u64], i: usize) {
        self.affinity.lock().unwrap_or_else(|e| e.into_inner()).record(hashes, i);
    }

    /// Replica `i` lost its workers and with them its prefix cache.
    pub fn replica_failed(&self, i: usize) {
        self.affinity.lock().unwrap_or_else(|e| e.into_inner()).forget_replica(i);
    }

    /// Whether a healthy replica other than `from` exists.
    pub fn can_hand_off(&self, from: usize) -> bool {
        routing::migration_target(&self.loads(), from).is_some()
    }

    /// Moves a sequence of failed replica `from` to the least loaded healthy other
    /// replica; when there is none (or it has moved through every replica already), its
    /// client gets an error event.
    pub fn hand_off(&self, from: usize, mut m: Migrant) {
        m.hops += 1;
        if m.hops > self.len() {
            return m.fail();
        }
        match routing::migration_target(&self.loads(), from).and_then(|t| self.get(t)) {
            Some(target) => {
                if let Err(m) = target.adopt(m) {
                    m.fail();
                }
            }
            None => m.fail(),
        }
    }
}
