//! Content hashes of full KV blocks, the keys of the prefix cache.
//!
//! The hash of block `i` chains the hash of block `i - 1` with block `i`'s token ids, so
//! equal hashes mean "same whole prefix up to here" (with high probability), not only "same
//! block". Blocks whose last tokens agree but whose earlier context differs get unrelated
//! hashes, because their KV differs.
//!
//! The function is our own, fixed and platform independent (no `RandomState`, no pointer
//! sizes): the SplitMix64 finaliser applied as a sponge over the parent hash, then each
//! token id, then the token count. A 64-bit hash can still collide; the block manager never
//! trusts a hash alone (it compares the stored tokens and the parent link before reusing
//! a block), so a collision can cost a cache miss but never return wrong KV.

use std::hash::{BuildHasherDefault, Hasher};

/// Start of the chain: the hash a first block is chained to.
const ROOT: u64 = 0x243f_6a88_85a3_08d3;
/// Added before mixing each word, so a run of zero ids still moves the state.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 finaliser: a bijection on u64 with full avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of one full block of `tokens` following a block whose hash is `parent`
/// (`None` for the first block of a sequence).
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = mix64(parent.map_or(ROOT, |p| p ^ GAMMA.rotate_left(17)));
    for &t in tokens {
        h = mix64(h.wrapping_add(GAMMA).wrapping_add(u64::from(t)));
    }
    mix64(h.wrapping_add(GAMMA) ^ tokens.len() as u64)
}

/// Extends `hashes` (the chain of the first `hashes.len()` blocks of `tokens`) to every
/// full block of `tokens`: afterwards `hashes.len() == tokens.len() / block_size`.
/// A `block_size` of 0 leaves `hashes` as it is.
pub fn extend_chain(hashes: &mut Vec<u64>, tokens: &[u32], block_size: usize) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = hashes.last().copied();
        hashes.push(block_hash(parent, &tokens[i * block_size..(i + 1) * block_size]));
    }
}

/// A `Hasher` for maps with u64 keys (block hashes, sequence ids): one [`mix64`] instead
/// of SipHash. Sequence ids are assigned by the engine, but block hashes come from prompt
/// tokens through a fixed, public function, so a client could precompute blocks whose keys
/// crowd one region of a map. Accepted: such a client mostly slows its own lookups (the
/// maps hold at most the cache's blocks), and a keyed hash would cost every step.
#[derive(Default, Clone, Copy)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only reached for keys other than u64; fold them in so the map still works.
        for &b in bytes {
            self.0 = mix64(self.0 ^ u64::from(b));
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = mix64(self.0 ^ v);
    }
}

/// `BuildHasher` for `HashMap<u64, _, BuildU64Hasher>`.
pub type BuildU64Hasher = BuildHasherDefault<U64Hasher>;
