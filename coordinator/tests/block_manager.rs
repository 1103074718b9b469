//! Block pool and prefix cache: allocation accounting, prefix matches (and misses), LRU
//! eviction order, hash-collision safety, and a long randomized workload checked against
//! a shadow of what KV each block really holds.

mod common;

use common::Rng;
use tessera_coordinator::prefix_hash::extend_chain;
use tessera_coordinator::{BlockError, BlockManager, PrefixChain};

const BS: usize = 4;

/// A table that has computed all of `tokens` and registered its full blocks.
fn computed(bm: &mut BlockManager, tokens: &[u32]) -> (Vec<u32>, PrefixChain) {
    let mut chain = PrefixChain::default();
    extend_chain(&mut chain.hashes, tokens, BS);
    let mut table = Vec::new();
    let prefix = bm.match_prefix(tokens, &chain.hashes);
    bm.take_prefix(&prefix, &mut table, &mut chain, tokens.len());
    bm.grow(&mut table, tokens.len()).expect("room");
    bm.cache_full_blocks(&table, tokens, &mut chain, tokens.len());
    (table, chain)
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::new();
    extend_chain(&mut h, tokens, BS);
    h
}

#[test]
fn allocation_accounting_and_all_or_nothing_grow() {
    let mut bm = BlockManager::new(10, BS);
    let mut a = Vec::new();
    assert_eq!(bm.grow(&mut a, 9), Ok(3));
    assert_eq!(a, [0, 1, 2]);
    assert_eq!(bm.grow(&mut a, 12), Ok(0), "9..12 fits in the third block");
    assert_eq!(bm.grow(&mut a, 13), Ok(1));
    let mut b = Vec::new();
    let err = bm.grow(&mut b, 7 * BS).unwrap_err();
    assert_eq!(err, BlockError::OutOfBlocks { needed: 7, available: 6 });
    assert!(b.is_empty() && bm.num_free() == 6, "a failed grow changes nothing");
    assert!(bm.can_allocate(6) && !bm.can_allocate(7));
    assert_eq!(bm.grow(&mut b, 6 * BS), Ok(6));
    assert_eq!((bm.num_used(), bm.num_free(), bm.num_evictable()), (10, 0, 0));
    bm.check_invariants(&[&a, &b]).unwrap();
    bm.free(&mut a);
    bm.free(&mut b);
    assert_eq!((bm.num_used(), bm.num_free()), (0, 10));
    bm.check_invariants(&[]).unwrap();
}

#[test]
fn shared_prefix_hits_whole_blocks_and_leaves_a_token() {
    let mut rng = Rng::new(1);
    let mut bm = BlockManager::new(32, BS);
    let shared = rng.tokens(3 * BS, 1000);
    let a_tokens = [shared.clone(), rng.tokens(2, 1000)].concat();
    let (a_table, _) = computed(&mut bm, &a_tokens);
    assert_eq!(bm.num_cached(), 3, "three full blocks registered, the partial one not");

    let b_tokens = [shared.clone(), rng.tokens(5, 1000)].concat();
    let prefix = bm.match_prefix(&b_tokens, &hashes(&b_tokens));
    assert_eq!(prefix, a_table[..3]);

    // A prompt that is exactly the cached blocks still computes its last token.
    let prefix = bm.match_prefix(&shared, &hashes(&shared));
    assert_eq!(prefix, a_table[..2]);

    let mut b_table = Vec::new();
    let mut chain = PrefixChain::default();
    let full = bm.match_prefix(&b_tokens, &hashes(&b_tokens));
    bm.take_prefix(&full, &mut b_table, &mut chain, b_tokens.len());
    assert_eq!(bm.stats().hit_tokens, 3 * BS as u64);
    assert_eq!(bm.stats().query_tokens, (a_tokens.len() + b_tokens.len()) as u64);
    for &blk in &a_table[..3] {
        assert_eq!(bm.ref_count(blk), Some(2));
    }
    bm.check_invariants(&[&a_table, &b_table]).unwrap();
}

#[test]
fn no_hit_when_an_earlier_block_differs() {
    let mut rng = Rng::new(2);
    let mut bm = BlockManager::new(32, BS);
    let (x1, x2, x3) = (rng.tokens(BS, 1000), rng.tokens(BS, 1000), rng.tokens(BS, 1000));
    let y1 = rng.tokens(BS, 1000);
    let a = [x1.clone(), x2.clone(), x3.clone(), vec![7]].concat();
    let (a_table, _) = computed(&mut bm, &a);
    let b = [y1.clone(), x2.clone(), x3.clone(), vec![7]].concat();
    assert!(bm.match_prefix(&b, &hashes(&b)).is_empty(), "same later blocks, different first block");
    let c = [x1.clone(), y1, x3, vec![7]].concat();
    assert_eq!(bm.match_prefix(&c, &hashes(&c)), a_table[..1]);
}

#[test]
fn evictable_blocks_are_used_only_when_free_runs_out_oldest_tail_first() {
    let mut rng = Rng::new(3);
    let mut bm = BlockManager::new(6, BS);
    let toks = rng.tokens(3 * BS + 1, 1000);
    let (mut table, _) = computed(&mut bm, &toks);
    assert_eq!(table, [0, 1, 2, 3]);
    bm.free(&mut table);
    assert_eq!((bm.num_free(), bm.num_evictable(), bm.num_cached()), (3, 3, 3));
    bm.check_invariants(&[]).unwrap();

    let mut other = Vec::new();
    bm.grow(&mut other, 3 * BS).unwrap();
    assert_eq!(bm.match_prefix(&toks, &hashes(&toks)).len(), 3, "free blocks go first: cache intact");
    assert_eq!(bm.stats().evictions, 0);

    bm.grow(&mut other, 4 * BS).unwrap();
    assert_eq!(other[3], 2, "the last block of the freed table is evicted first");
    assert_eq!(bm.match_prefix(&toks, &hashes(&toks)).len(), 2);
    bm.grow(&mut other, 5 * BS).unwrap();
    assert_eq!(other[4], 1);
    assert_eq!(bm.match_prefix(&toks, &hashes(&toks)), [0]);
    assert_eq!((bm.stats().evictions, bm.num_cached()), (2, 1));
    bm.check_invariants(&[&other]).unwrap();

    // A hit on an evictable block takes it out of the LRU: it is not evicted under the holder.
    let prefix = bm.match_prefix(&toks, &hashes(&toks));
    assert_eq!(bm.available_after_prefix(&prefix), 0);
    let mut holder = Vec::new();
    let mut chain = PrefixChain::default();
    bm.take_prefix(&prefix, &mut holder, &mut chain, toks.len());
    assert_eq!(bm.grow(&mut holder, 2 * BS), Err(BlockError::OutOfBlocks { needed: 1, available: 0 }));
    bm.check_invariants(&[&other, &holder]).unwrap();
}

#[test]
fn forged_colliding_hashes_never_return_wrong_blocks() {
    let mut rng = Rng::new(4);
    let mut bm = BlockManager::new(32, BS);
    let a = rng.tokens(3 * BS + 1, 1000);
    let forged = vec![11u64, 22, 33];
    let mut chain = PrefixChain { hashes: forged.clone(), ..Default::default() };
    let mut table = Vec::new();
    bm.grow(&mut table, a.len()).unwrap();
    bm.cache_full_blocks(&table, &a, &mut chain, a.len());
    assert_eq!(bm.match_prefix(&a, &forged), table[..3], "the same tokens match");

    // Same hashes, different tokens in block 1: only block 0 is reused.
    let mut b = a.clone();
    b[BS + 2] ^= 1;
    assert_eq!(bm.match_prefix(&b, &forged), table[..1]);
    // Same hashes, blocks 1 and 2 equal but block 0 differs: the parent link stops it.
    let mut c = a.clone();
    c[0] ^= 1;
    assert!(bm.match_prefix(&c, &forged).is_empty());
    // c registered under the same forged hashes replaces a's entries...
    let mut c_chain = PrefixChain { hashes: forged.clone(), ..Default::default() };
    let mut c_table = Vec::new();
    bm.grow(&mut c_table, c.len()).unwrap();
    bm.cache_full_blocks(&c_table, &c, &mut c_chain, c.len());
    assert_eq!(bm.match_prefix(&c, &forged), c_table[..3]);
    // ... and a no longer matches anything, instead of getting c's KV.
    assert!(bm.match_prefix(&a, &forged).is_empty());

    // Block 0 matches d's entry and block 1's key leads to c's block 1: the right tokens,
    // but KV computed after c's first block, not d's. The parent link rejects it.
    let d = rng.tokens(2 * BS + 1, 1000);
    let mut d_chain = PrefixChain { hashes: vec![44, 55], ..Default::default() };
    let mut d_table = Vec::new();
    bm.grow(&mut d_table, d.len()).unwrap();
    bm.cache_full_blocks(&d_table, &d, &mut d_chain, d.len());
    let q = [d[..BS].to_vec(), c[BS..2 * BS].to_vec(), vec![9]].concat();
    assert_eq!(bm.match_prefix(&q, &[44, 22]), d_table[..1]);
    bm.check_invariants(&[&table, &c_table, &d_table]).unwrap();
}

/// One live table in the randomized workload.
struct Live {
    tokens: Vec<u32>,
    table: Vec<u32>,
    chain: PrefixChain,
    computed: usize,
}

fn chain_hashes(tokens: &[u32], weak: bool) -> Vec<u64> {
    let mut h = hashes(tokens);
    if weak {
        h.iter_mut().for_each(|x| *x &= 3); // four possible keys: collisions everywhere
    }
    h
}

/// Thousands of random admit / compute / grow / finish operations; after each, the pool's
/// invariants hold, and every prefix hit is checked against a shadow of the KV each block
/// holds (block position in its table and the tokens it was computed from).
fn random_workload(seed: u64, weak: bool, vocab: u32) {
    let mut rng = Rng::new(seed);
    let num_blocks = 48;
    let mut bm = BlockManager::new(num_blocks, BS);
    let mut shadow: Vec<Option<(usize, Vec<u32>)>> = vec![None; num_blocks];
    let bases: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            let n = rng.range(BS, 4 * BS);
            rng.tokens(n, vocab)
        })
        .collect();
    let mut live: Vec<Live> = Vec::new();
    for _ in 0..6000 {
        match rng.below(10) {
            0..=2 if live.len() < 12 => {
                let base = &bases[rng.below(bases.len())];
                let n = rng.range(1, 3 * BS);
                let tokens = [base.clone(), rng.tokens(n, vocab)].concat();
                let mut chain = PrefixChain { hashes: chain_hashes(&tokens, weak), ..Default::default() };
                let prefix = bm.match_prefix(&tokens, &chain.hashes);
                assert!(prefix.len() * BS < tokens.len(), "a token is left to compute");
                for (i, &b) in prefix.iter().enumerate() {
                    let expect = (i, tokens[..(i + 1) * BS].to_vec());
                    assert_eq!(shadow[b as usize].as_ref(), Some(&expect), "hit block {b} holds other KV");
                }
                let first = prefix.len() * BS + rng.range(1, tokens.len() - prefix.len() * BS + 1);
                let needed = bm.blocks_for(first) - prefix.len();
                if needed > bm.available_after_prefix(&prefix) {
                    continue;
                }
                let mut table = Vec::new();
                bm.take_prefix(&prefix, &mut table, &mut chain, tokens.len());
                bm.grow(&mut table, first).expect("checked room");
                let computed = prefix.len() * BS;
                live.push(Live { tokens, table, chain, computed });
                let idx = live.len() - 1;
                compute(&mut bm, &mut shadow, &mut live[idx], first, weak);
            }
            3..=6 if !live.is_empty() => {
                let l = rng.below(live.len());
                let s = &mut live[l];
                if s.computed == s.tokens.len() {
                    s.tokens.push(rng.tokens(1, vocab)[0]); // a sampled token
                }
                let upto = rng.range(s.computed + 1, s.tokens.len() + 1);
                let before = (s.table.clone(), bm.num_free(), bm.num_evictable());
                match bm.grow(&mut s.table, upto) {
                    Ok(_) => compute(&mut bm, &mut shadow, s, upto, weak),
                    Err(_) => assert_eq!(before, (s.table.clone(), bm.num_free(), bm.num_evictable())),
                }
            }
            7..=9 if !live.is_empty() => {
                let mut s = live.swap_remove(rng.below(live.len()));
                bm.free(&mut s.table);
            }
            _ => {}
        }
        let tables: Vec<&[u32]> = live.iter().map(|s| &s.table[..]).collect();
        bm.check_invariants(&tables).unwrap();
        assert_eq!(bm.num_used() + bm.num_free() + bm.num_evictable(), num_blocks);
    }
    let stats = bm.stats();
    // With four hash values at most four blocks are cached at once, so evictions need the
    // real hash; hits happen with both.
    let exercised = if weak { stats.hit_tokens > 500 } else { stats.hit_tokens > 1000 && stats.evictions > 100 };
    assert!(exercised, "workload exercised hits and evictions: {stats:?}");
    for mut s in live.drain(..) {
        bm.free(&mut s.table);
    }
    bm.check_invariants(&[]).unwrap();
    assert_eq!((bm.num_used(), bm.num_free() + bm.num_evictable()), (0, num_blocks));
    let mut all = Vec::new();
    bm.grow(&mut all, num_blocks * BS).expect("every block comes back");
    bm.free(&mut all);
    assert_eq!((bm.num_used(), bm.num_free(), bm.num_cached()), (0, num_blocks, 0));
}

/// Marks positions `s.computed..upto` computed: writes the shadow (only ever into blocks
/// held by this table alone) and registers full blocks.
fn compute(bm: &mut BlockManager, shadow: &mut [Option<(usize, Vec<u32>)>], s: &mut Live, upto: usize, weak: bool) {
    for p in s.computed..upto {
        let b = s.table[p / BS];
        assert_eq!(bm.ref_count(b), Some(1), "write into shared block {b}");
        shadow[b as usize] = Some((p / BS, s.tokens[..p + 1].to_vec()));
    }
    s.computed = upto;
    s.chain.hashes = chain_hashes(&s.tokens, weak);
    bm.cache_full_blocks(&s.table, &s.tokens, &mut s.chain, s.computed);
}

#[test]
fn random_workload_keeps_invariants_and_never_reuses_wrong_kv() {
    random_workload(0x5eed, false, 6);
}

#[test]
fn random_workload_with_a_four_valued_hash_stays_correct() {
    // Two token values: equal blocks after different prefixes are common.
    random_workload(0xc0111de, true, 3);
}
