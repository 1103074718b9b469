//! Which replica a request goes to: by prefix-cache affinity when the replica that last
//! served the same prefix is not overloaded, else the least loaded healthy one.
//!
//! Plain data and pure functions (no I/O), so `#[test]`s drive the decision directly.
//! The affinity key is the chained hash of a prompt's full KV blocks (`prefix_hash`): the
//! hash of block `i` stands for the whole prefix through block `i`, so the longest prefix a
//! replica has served is found by looking the chain up from its end. The map is bounded
//! (oldest entries go first); a stale entry costs at most a cache miss, never a wrong
//! answer, because each replica's block manager checks its own cache.

use std::collections::{HashMap, VecDeque};

use crate::prefix_hash::{extend_chain, BuildU64Hasher};

/// Most leading blocks of a prompt that take part in routing (longer prompts route by
/// their first `MAX_ROUTING_BLOCKS` blocks).
pub const MAX_ROUTING_BLOCKS: usize = 64;

/// Routing settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingConfig {
    /// How many more sequences (running + waiting) the affine replica may hold than the
    /// least loaded one and still be chosen.
    pub affinity_margin: usize,
    /// Prefix hashes remembered.
    pub capacity: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig { affinity_margin: 8, capacity: 1 << 16 }
    }
}

/// The chained hashes of the first full blocks of `prompt` (at most `MAX_ROUTING_BLOCKS`).
pub fn prompt_block_hashes(prompt: &[u32], block_size: usize) -> Vec<u64> {
    let mut hashes = Vec::new();
    if block_size > 0 {
        let len = prompt.len().min(block_size.saturating_mul(MAX_ROUTING_BLOCKS));
        extend_chain(&mut hashes, &prompt[..len], block_size);
    }
    hashes
}

/// A bounded map from block-prefix hash to the replica that last served that prefix.
#[derive(Debug)]
pub struct AffinityMap {
    /// hash -> (replica, stamp of the insertion that set it).
    map: HashMap<u64, (usize, u64), BuildU64Hasher>,
    /// Insertions, oldest first: (hash, stamp). An entry whose stamp no longer matches the
    /// map's was overwritten later and is skipped at eviction.
    order: VecDeque<(u64, u64)>,
    capacity: usize,
    next_stamp: u64,
}

impl AffinityMap {
    /// An empty map holding at most `capacity` hashes (at least 1).
    pub fn new(capacity: usize) -> Self {
        AffinityMap { map: HashMap::default(), order: VecDeque::new(), capacity: capacity.max(1), next_stamp: 0 }
    }

    /// The replica that served the longest known prefix of `hashes` (a prompt's chain).
    pub fn lookup(&self, hashes: &[u64]) -> Option<usize> {
        hashes.iter().rev().find_map(|h| self.map.get(h).map(|&(r, _)| r))
    }

    /// Records that `replica` now holds every prefix of `hashes`.
    pub fn record(&mut self, hashes: &[u64], replica: usize) {
        for &h in hashes {
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            self.map.insert(h, (replica, stamp));
            self.order.push_back((h, stamp));
        }
        while self.map.len() > self.capacity || self.order.len() > 2 * self.capacity {
            let Some((h, stamp)) = self.order.pop_front() else { break };
            if self.map.get(&h).is_some_and(|&(_, s)| s == stamp) {
                self.map.remove(&h);
            }
        }
    }

    /// Forgets every prefix of `replica` (its cache was lost with its workers).
    pub fn forget_replica(&mut self, replica: usize) {
        self.map.retain(|_, (r, _)| *r != replica);
    }

    /// Hashes held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// The replica to use. `loads[i]` is replica `i`'s running + waiting sequences, `None`
/// when it cannot take work. The affine replica (`preferred`) wins unless it is unhealthy
/// or holds more than `margin` sequences beyond the least loaded; otherwise the least
/// loaded healthy replica wins (the lowest index among equals).
pub fn choose(loads: &[Option<usize>], preferred: Option<usize>, margin: usize) -> Option<usize> {
    let (least, least_load) =
        loads.iter().enumerate().filter_map(|(i, l)| l.map(|l| (i, l))).min_by_key(|&(i, l)| (l, i))?;
    match preferred.and_then(|p| loads.get(p).copied().flatten().map(|l| (p, l))) {
        Some((p, load)) if load <= least_load.saturating_add(margin) => Some(p),
        _ => Some(least),
    }
}

/// Where to move the unfinished sequences of failed replica `from`: the least loaded
/// healthy replica other than it.
pub fn migration_target(loads: &[Option<usize>], from: usize) -> Option<usize> {
    let others: Vec<Option<usize>> = loads.iter().enumerate().map(|(i, l)| if i == from { None } else { *l }).collect();
    choose(&others, None, 0)
}
