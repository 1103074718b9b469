//! The prefix hash: fixed values (so it is the same across runs and machines), chaining,
//! and no collisions among many random blocks.

mod common;

use std::collections::HashSet;

use common::Rng;
use tessera_coordinator::prefix_hash::{block_hash, extend_chain, mix64};

#[test]
fn mixer_is_splitmix64() {
    // SplitMix64 seeded with 0: the state advances by the golden gamma, outputs are the
    // finaliser of the state (Steele, Lea, Flood 2014; the reference outputs of seed 0).
    let gamma = 0x9e37_79b9_7f4a_7c15u64;
    let want = [0xe220_a839_7b1d_cdafu64, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f];
    for (k, w) in want.iter().enumerate() {
        assert_eq!(mix64(gamma.wrapping_mul(k as u64 + 1)), *w);
    }
}

#[test]
fn block_hash_values_are_fixed() {
    // From this independent Python transcription of the definition in `prefix_hash.rs`:
    //   M = 2**64 - 1; G = 0x9e3779b97f4a7c15; ROOT = 0x243f6a8885a308d3
    //   def mix(z): z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M
    //               z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M; return z ^ (z >> 31)
    //   def bh(parent, toks):
    //       h = mix(ROOT if parent is None else parent ^ rotl(G, 17))
    //       for t in toks: h = mix((h + G + t) & M)
    //       return mix(((h + G) & M) ^ len(toks))
    let a = block_hash(None, &[1, 2, 3, 4]);
    assert_eq!(a, 0x7d1e_b790_c7b5_1c55);
    assert_eq!(block_hash(Some(a), &[5, 6, 7, 8]), 0x367c_7284_3235_5d10);
    assert_eq!(block_hash(None, &[]), 0x74d2_8e02_5cea_ac29);
    assert_eq!(block_hash(None, &[0, 0, 0, 0]), 0xea16_a2e2_0c48_61cb);
}

#[test]
fn chain_depends_on_everything_before() {
    let mut rng = Rng::new(21);
    let blk = rng.tokens(16, 50_000);
    let p1 = block_hash(None, &rng.tokens(16, 50_000));
    let p2 = block_hash(None, &rng.tokens(16, 50_000));
    assert_ne!(block_hash(Some(p1), &blk), block_hash(Some(p2), &blk), "same block, other prefix");
    assert_ne!(block_hash(None, &blk), block_hash(Some(block_hash(None, &[])), &blk), "root is not an empty parent");
    let mut swapped = blk.clone();
    swapped.swap(3, 4);
    if swapped != blk {
        assert_ne!(block_hash(Some(p1), &blk), block_hash(Some(p1), &swapped), "order matters");
    }
    assert_eq!(block_hash(Some(p1), &blk), block_hash(Some(p1), &blk.clone()));
}

#[test]
fn extend_chain_hashes_full_blocks_incrementally() {
    let mut rng = Rng::new(22);
    let tokens = rng.tokens(37, 50_000);
    let mut whole = Vec::new();
    extend_chain(&mut whole, &tokens, 8);
    assert_eq!(whole.len(), 4, "the partial fifth block is not hashed");
    let mut parent = None;
    for (i, h) in whole.iter().enumerate() {
        let want = block_hash(parent, &tokens[i * 8..(i + 1) * 8]);
        assert_eq!(*h, want);
        parent = Some(want);
    }
    let mut grown = Vec::new();
    for n in 0..=tokens.len() {
        extend_chain(&mut grown, &tokens[..n], 8);
    }
    assert_eq!(grown, whole);
}

#[test]
fn no_collisions_among_many_random_blocks() {
    let mut rng = Rng::new(23);
    let mut seen = HashSet::new();
    let mut blocks = HashSet::new();
    for _ in 0..200_000 {
        let blk = rng.tokens(4, 16); // small alphabet: near-identical blocks, parents differ
        let parent = if rng.chance(1, 2) { None } else { Some(rng.next_u64() % 64) };
        if blocks.insert((parent, blk.clone())) {
            assert!(seen.insert(block_hash(parent, &blk)), "collision for {parent:?} {blk:?}");
        }
    }
    assert!(blocks.len() > 120_000);
}
