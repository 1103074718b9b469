//! The routing decisions as pure code: prefix affinity within a load margin, least loaded
//! otherwise, never an unhealthy replica; the bounded affinity map; migration targets; and
//! which workers a failed replica is re-formed on.

use std::collections::HashSet;

use tessera_cluster::WorkerRecord;
use tessera_coordinator::routing::{choose, migration_target, prompt_block_hashes, AffinityMap, MAX_ROUTING_BLOCKS};
use tessera_coordinator::supervisor::choose_workers;

#[test]
fn least_loaded_healthy_replica_without_affinity() {
    assert_eq!(choose(&[Some(3), Some(1), Some(2)], None, 8), Some(1));
    assert_eq!(choose(&[Some(3), None, Some(2)], None, 8), Some(2), "an unhealthy replica is never chosen");
    assert_eq!(choose(&[Some(2), Some(2)], None, 8), Some(0), "ties go to the lowest index");
    assert_eq!(choose(&[None, None], None, 8), None);
    assert_eq!(choose(&[], None, 8), None);
}

#[test]
fn affinity_wins_within_the_margin_only() {
    let loads = [Some(10), Some(4)];
    assert_eq!(choose(&loads, Some(0), 6), Some(0), "10 <= 4 + 6");
    assert_eq!(choose(&loads, Some(0), 5), Some(1), "10 > 4 + 5: overloaded, least loaded instead");
    assert_eq!(choose(&[None, Some(4)], Some(0), 100), Some(1), "an unhealthy affine replica is skipped");
    assert_eq!(choose(&loads, Some(7), 6), Some(1), "an unknown replica index is ignored");
}

#[test]
fn the_longest_known_prefix_decides() {
    let bs = 4;
    let shared: Vec<u32> = (1..=8).collect(); // two full blocks every prompt below starts with
    let a: Vec<u32> = shared.iter().copied().chain([50, 51, 52, 53, 54]).collect();
    let b: Vec<u32> = shared.iter().copied().chain([60, 61, 62, 63]).collect();
    let (ha, hb) = (prompt_block_hashes(&a, bs), prompt_block_hashes(&b, bs));
    assert_eq!((ha.len(), hb.len()), (3, 3), "full blocks only");
    assert_eq!(ha[..2], hb[..2], "same prefix, same chain");
    let mut m = AffinityMap::new(100);
    assert_eq!(m.lookup(&ha), None);
    m.record(&ha, 0);
    m.record(&hb, 1);
    assert_eq!(m.lookup(&ha), Some(0), "a's third block is only on replica 0");
    assert_eq!(m.lookup(&hb), Some(1));
    let c: Vec<u32> = shared.iter().copied().chain([70, 71, 72, 73]).collect();
    assert_eq!(m.lookup(&prompt_block_hashes(&c, bs)), Some(1), "the shared prefix was last served by 1");
    assert_eq!(m.lookup(&prompt_block_hashes(&[9, 9, 9, 9], bs)), None);
    assert!(prompt_block_hashes(&[1, 2, 3], bs).is_empty(), "no full block, no affinity");
    let long: Vec<u32> = (0..10_000).collect();
    assert_eq!(prompt_block_hashes(&long, bs).len(), MAX_ROUTING_BLOCKS);
    m.forget_replica(1);
    assert_eq!(m.lookup(&hb), None, "replica 1's entries are gone, the shared prefix's included");
    assert_eq!(m.lookup(&prompt_block_hashes(&c, bs)), None);
    assert_eq!(m.lookup(&ha), Some(0), "replica 0's own block stays");
}

#[test]
fn the_affinity_map_is_bounded_and_evicts_oldest_first() {
    let mut m = AffinityMap::new(3);
    for h in 0..10u64 {
        m.record(&[h], (h % 2) as usize);
        assert!(m.len() <= 3);
    }
    assert_eq!(m.lookup(&[9]), Some(1));
    assert_eq!(m.lookup(&[7]), Some(1));
    assert_eq!(m.lookup(&[6]), None, "evicted");
    // Re-recording an old hash refreshes it rather than letting its stale insertion evict it.
    let mut m = AffinityMap::new(2);
    m.record(&[1], 0);
    m.record(&[2], 0);
    m.record(&[1], 1);
    m.record(&[3], 0);
    assert_eq!(m.lookup(&[1]), Some(1), "refreshed entry survives");
    assert_eq!(m.lookup(&[2]), None);
}

#[test]
fn migration_goes_to_another_healthy_replica() {
    assert_eq!(migration_target(&[None, Some(5), Some(2)], 0), Some(2));
    assert_eq!(migration_target(&[Some(0), Some(5)], 0), Some(1), "never back to the failed replica");
    assert_eq!(migration_target(&[None], 0), None, "a lone replica has nowhere to go");
    assert_eq!(migration_target(&[None, None], 0), None);
}

fn records(addrs: &[&str]) -> Vec<WorkerRecord> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| WorkerRecord {
            id: format!("{i:04}"),
            addr: a.to_string(),
            device: String::new(),
            free_memory_bytes: 0,
        })
        .collect()
}

#[test]
fn a_failed_replica_reforms_on_its_own_workers_first() {
    let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let all = records(&["a", "b", "c", "d"]);
    let none = HashSet::new();
    assert_eq!(choose_workers(&all, &none, &s(&["c", "d"]), 2), Some(s(&["c", "d"])), "same ranks as before");
    let busy: HashSet<String> = s(&["a", "b"]).into_iter().collect();
    assert_eq!(choose_workers(&records(&["a", "b", "d"]), &busy, &s(&["c", "d"]), 2), None, "c is not back yet");
    assert_eq!(
        choose_workers(&records(&["a", "b", "d", "e"]), &busy, &s(&["c", "d"]), 2),
        Some(s(&["d", "e"])),
        "a replacement worker fills the missing rank; busy workers are never taken"
    );
    assert_eq!(choose_workers(&all, &none, &[], 3), Some(s(&["a", "b", "c"])));
}
