//! The block pool's consistency check, for tests and debug builds: reference counts
//! against the tables that hold blocks, the free / evictable / used partition, the LRU
//! links and the prefix index.

use std::collections::HashSet;

use super::{BlockManager, NIL};

impl BlockManager {
    /// Checks the pool against the `tables` that hold its blocks: every reference count
    /// equals the number of tables holding the block; free, evictable and used partition
    /// the pool; evictable blocks are exactly the unreferenced cached ones, in a well-linked
    /// LRU; the index and the entries agree. For tests and debug checks.
    pub fn check_invariants(&self, tables: &[&[u32]]) -> Result<(), String> {
        let n = self.blocks.len();
        let mut refs = vec![0u32; n];
        for (t, table) in tables.iter().enumerate() {
            let mut seen = HashSet::new();
            for &b in *table {
                if b as usize >= n || !seen.insert(b) {
                    return Err(format!("table {t} holds block {b} twice or out of range"));
                }
                refs[b as usize] += 1;
            }
        }
        let mut in_free = vec![false; n];
        for &b in &self.free {
            if b as usize >= n || std::mem::replace(&mut in_free[b as usize], true) {
                return Err(format!("free list holds block {b} twice or out of range"));
            }
        }
        let mut lru = Vec::new();
        let (mut prev, mut cur) = (NIL, self.lru_head);
        while cur != NIL {
            let blk = self.blocks.get(cur as usize).ok_or(format!("LRU links to missing block {cur}"))?;
            if blk.prev != prev || lru.len() >= n {
                return Err(format!("LRU links broken at block {cur}"));
            }
            lru.push(cur);
            (prev, cur) = (cur, blk.next);
        }
        if prev != self.lru_tail || lru.len() != self.lru_len {
            return Err(format!(
                "LRU has {} blocks ending at {prev}; counted {} ending at {}",
                lru.len(),
                self.lru_len,
                self.lru_tail
            ));
        }
        let mut entries = 0;
        for (b, blk) in self.blocks.iter().enumerate() {
            if blk.ref_count != refs[b] {
                return Err(format!("block {b}: ref count {} but held by {} tables", blk.ref_count, refs[b]));
            }
            let idle = blk.ref_count == 0;
            if in_free[b] != (idle && blk.entry.is_none()) || blk.in_lru != (idle && blk.entry.is_some()) {
                return Err(format!(
                    "block {b}: ref {} cached {} in free list {} in LRU {}",
                    blk.ref_count,
                    blk.entry.is_some(),
                    in_free[b],
                    blk.in_lru
                ));
            }
            if let Some(e) = &blk.entry {
                entries += 1;
                if self.index.get(&e.hash) != Some(&(b as u32)) || e.tokens.len() != self.block_size {
                    return Err(format!("block {b}: cache entry not indexed under its hash"));
                }
            }
        }
        if lru.iter().any(|&b| !self.blocks[b as usize].in_lru) || entries != self.index.len() {
            return Err(format!("{} index keys but {entries} cached blocks, or LRU flags wrong", self.index.len()));
        }
        if self.num_used() != refs.iter().filter(|&&r| r > 0).count() {
            return Err("used + free + evictable != total".into());
        }
        Ok(())
    }
}
