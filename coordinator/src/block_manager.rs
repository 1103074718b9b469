//! The paged-KV block pool of one replica, with prefix caching.
//!
//! The coordinator owns block *ids* only; workers hold the memory. A block is in exactly
//! one of three states:
//! - **used**: its reference count (the number of block tables holding it) is > 0;
//! - **free**: count 0 and no cached content;
//! - **evictable**: count 0 but its content is in the prefix cache, kept in an LRU list
//!   in case a later sequence shares the prefix. Evictable blocks are reused (and dropped
//!   from the cache) only when no free block remains, least recently released first.
//!
//! Prefix caching (after vLLM's automatic prefix caching): once a *full* block's KV has
//! been computed, it is registered under the chained hash of its prefix (`prefix_hash`).
//! A new sequence reuses the longest run of registered blocks matching its tokens, taking
//! a reference on each, and computes only the rest; at least one token is always left to
//! compute so the step has logits to sample from. A hash is only an index key: a match
//! also needs equal stored token ids *and* a parent link equal to the entry matched for
//! the previous block. Each registration gets a never-reused entry id, so by induction a
//! match means the whole prefix is equal, and a hash collision can only cost a miss.
//!
//! Shared blocks are never written: matches are whole blocks strictly before the first
//! token to compute, and only blocks whose KV is complete are registered.

use std::collections::HashMap;

use crate::error::BlockError;
use crate::prefix_hash::BuildU64Hasher;
use crate::sequence::PrefixChain;

mod check;

/// "No block" in the LRU links.
const NIL: u32 = u32::MAX;

/// What the prefix cache knows about a registered block.
#[derive(Debug)]
struct CacheEntry {
    /// Chained hash of the prefix through this block (the index key).
    hash: u64,
    /// Unique id of this registration; children link to it.
    id: u64,
    /// Entry id of the previous block of the prefix; `None` for a first block.
    parent: Option<u64>,
    /// The block's token ids, `[block_size]`, compared on every match.
    tokens: Box<[u32]>,
}

#[derive(Debug)]
struct Block {
    ref_count: u32,
    entry: Option<CacheEntry>,
    /// LRU neighbours, meaningful while `in_lru`.
    prev: u32,
    next: u32,
    in_lru: bool,
}

/// Prefix-cache counters since the pool was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Tokens looked up at admissions.
    pub query_tokens: u64,
    /// Of those, tokens served from cached blocks.
    pub hit_tokens: u64,
    /// Cached blocks reused for other content.
    pub evictions: u64,
}

/// The pool of `num_blocks` KV blocks of `block_size` positions.
#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    blocks: Vec<Block>,
    /// Free blocks, popped from the end (block 0 first on a fresh pool).
    free: Vec<u32>,
    /// Evictable blocks: `lru_head` is evicted first, releases append at `lru_tail`.
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    /// Prefix hash -> registered block.
    index: HashMap<u64, u32, BuildU64Hasher>,
    next_entry_id: u64,
    stats: CacheStats,
}

impl BlockManager {
    /// A pool with every block free. `num_blocks` must be below `u32::MAX` (the config
    /// checks it).
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        let blocks =
            (0..num_blocks).map(|_| Block { ref_count: 0, entry: None, prev: NIL, next: NIL, in_lru: false }).collect();
        BlockManager {
            block_size,
            blocks,
            free: (0..num_blocks as u32).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            index: HashMap::default(),
            next_entry_id: 0,
            stats: CacheStats::default(),
        }
    }

    /// Positions per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks held by at least one table.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.free.len() - self.lru_len
    }

    /// Blocks with no references and no cached content.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Unreferenced blocks kept for their cached content.
    pub fn num_evictable(&self) -> usize {
        self.lru_len
    }

    /// Blocks registered in the prefix cache (used or evictable).
    pub fn num_cached(&self) -> usize {
        self.index.len()
    }

    /// Blocks an allocation can take now: free plus evictable.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    /// Whether `n` more blocks can be allocated.
    pub fn can_allocate(&self, n: usize) -> bool {
        n <= self.num_available()
    }

    /// Reference count of `block`, `None` when out of range.
    pub fn ref_count(&self, block: u32) -> Option<u32> {
        self.blocks.get(block as usize).map(|b| b.ref_count)
    }

    /// Prefix-cache counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// The longest run of cached blocks holding the KV of a prefix of `tokens`, leaving at
    /// least one token uncovered. `hashes` is the chain of `tokens`' full blocks (it may be
    /// shorter: the match stops where it ends). Changes nothing; pass the result to
    /// [`take_prefix`](Self::take_prefix) before any other call.
    pub fn match_prefix(&self, tokens: &[u32], hashes: &[u64]) -> Vec<u32> {
        let bs = self.block_size;
        let max_blocks = (tokens.len().saturating_sub(1) / bs).min(hashes.len());
        let mut out = Vec::new();
        let mut parent = None;
        for (i, hash) in hashes.iter().enumerate().take(max_blocks) {
            let Some(&b) = self.index.get(hash) else { break };
            let Some(e) = self.blocks.get(b as usize).and_then(|blk| blk.entry.as_ref()) else { break };
            if e.parent != parent || *e.tokens != tokens[i * bs..(i + 1) * bs] {
                break;
            }
            out.push(b);
            parent = Some(e.id);
        }
        out
    }

    /// Blocks still allocatable after taking `prefix` (its evictable blocks stop being
    /// evictable once referenced).
    pub fn available_after_prefix(&self, prefix: &[u32]) -> usize {
        let idle = prefix.iter().filter(|&&b| self.blocks[b as usize].ref_count == 0).count();
        self.num_available() - idle
    }

    /// Starts an empty `table` with the matched `prefix` (a reference on each block) and
    /// records the lookup of `query_tokens` tokens in the stats.
    pub fn take_prefix(&mut self, prefix: &[u32], table: &mut Vec<u32>, chain: &mut PrefixChain, query_tokens: usize) {
        debug_assert!(table.is_empty(), "take_prefix starts a table");
        chain.reset();
        for &b in prefix {
            if self.blocks[b as usize].ref_count == 0 {
                self.lru_remove(b);
            }
            let blk = &mut self.blocks[b as usize];
            blk.ref_count += 1;
            chain.tail = blk.entry.as_ref().map(|e| e.id);
            table.push(b);
        }
        chain.registered = prefix.len();
        self.stats.query_tokens += query_tokens as u64;
        self.stats.hit_tokens += (prefix.len() * self.block_size) as u64;
    }

    /// Appends blocks to `table` until it holds `num_tokens` positions. All or nothing:
    /// on error the table and the pool are unchanged. Returns how many were appended.
    pub fn grow(&mut self, table: &mut Vec<u32>, num_tokens: usize) -> Result<usize, BlockError> {
        let needed = self.blocks_for(num_tokens).saturating_sub(table.len());
        if needed > self.num_available() {
            return Err(BlockError::OutOfBlocks { needed, available: self.num_available() });
        }
        for _ in 0..needed {
            let b = match self.free.pop() {
                Some(b) => b,
                None => self.evict_oldest().ok_or(BlockError::OutOfBlocks { needed, available: 0 })?,
            };
            self.blocks[b as usize].ref_count = 1;
            table.push(b);
        }
        Ok(needed)
    }

    /// Drops `table`'s references and empties it. Blocks reaching zero become evictable
    /// if cached (tail blocks first in eviction order, the shared roots last), else free.
    pub fn free(&mut self, table: &mut Vec<u32>) {
        for &b in table.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.ref_count > 0, "freeing unreferenced block {b}");
            blk.ref_count = blk.ref_count.saturating_sub(1);
            if blk.ref_count == 0 {
                if blk.entry.is_some() {
                    self.lru_push_tail(b);
                } else {
                    self.free.push(b);
                }
            }
        }
        table.clear();
    }

    /// Registers the full blocks of `table` whose KV is complete (the first
    /// `num_computed` positions of `tokens`) and not yet offered, continuing `chain`.
    /// `chain.hashes` must cover them (blocks past its end wait for a later call).
    pub fn cache_full_blocks(&mut self, table: &[u32], tokens: &[u32], chain: &mut PrefixChain, num_computed: usize) {
        let bs = self.block_size;
        let full = (num_computed.min(tokens.len()) / bs).min(table.len()).min(chain.hashes.len());
        while chain.registered < full {
            let i = chain.registered;
            let id = self.register(table[i], chain.hashes[i], chain.tail, &tokens[i * bs..(i + 1) * bs]);
            chain.tail = Some(id);
            chain.registered += 1;
        }
    }

    /// Registers block `b` (held by the caller) and returns the entry id standing for its
    /// prefix: its own, or that of an identical entry already cached elsewhere.
    fn register(&mut self, b: u32, hash: u64, parent: Option<u64>, tokens: &[u32]) -> u64 {
        if let Some(e) = &self.blocks[b as usize].entry {
            return e.id; // a block this table got from the cache
        }
        if let Some(&o) = self.index.get(&hash) {
            if let Some(e) = &self.blocks[o as usize].entry {
                if e.parent == parent && *e.tokens == *tokens {
                    return e.id; // computed twice (admitted before the first copy was cached)
                }
            }
            // A collision, or a stale child of an evicted parent: the newest entry wins.
            self.uncache(o);
        }
        let id = self.next_entry_id;
        self.next_entry_id += 1;
        self.blocks[b as usize].entry = Some(CacheEntry { hash, id, parent, tokens: tokens.into() });
        self.index.insert(hash, b);
        id
    }

    /// Drops block `b`'s cache entry; an evictable block becomes free.
    fn uncache(&mut self, b: u32) {
        if let Some(e) = self.blocks[b as usize].entry.take() {
            if self.index.get(&e.hash) == Some(&b) {
                self.index.remove(&e.hash);
            }
        }
        if self.blocks[b as usize].in_lru {
            self.lru_remove(b);
            self.free.push(b);
        }
    }

    /// Takes the least recently released evictable block out of the cache for reuse.
    fn evict_oldest(&mut self) -> Option<u32> {
        let b = self.lru_head;
        if b == NIL {
            return None;
        }
        self.lru_remove(b);
        if let Some(e) = self.blocks[b as usize].entry.take() {
            if self.index.get(&e.hash) == Some(&b) {
                self.index.remove(&e.hash);
            }
        }
        self.stats.evictions += 1;
        Some(b)
    }

    fn lru_push_tail(&mut self, b: u32) {
        let tail = self.lru_tail;
        let blk = &mut self.blocks[b as usize];
        blk.prev = tail;
        blk.next = NIL;
        blk.in_lru = true;
        if tail == NIL {
            self.lru_head = b;
        } else {
            self.blocks[tail as usize].next = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, b: u32) {
        let (prev, next) = {
            let blk = &mut self.blocks[b as usize];
            debug_assert!(blk.in_lru, "block {b} is not in the LRU");
            blk.in_lru = false;
            (std::mem::replace(&mut blk.prev, NIL), std::mem::replace(&mut blk.next, NIL))
        };
        match prev {
            NIL => self.lru_head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.lru_tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        self.lru_len -= 1;
    }
}
