//! The backend-independent part of paged attention on the GPU: the batch description the
//! kernels read ([`PagedBatch`]), the split-KV plan of a decode call ([`DecodePlan`]) and
//! the pure rules that choose it and size the prefill CTA's shared memory. Always built,
//! so the rules are tested on machines without CUDA.
// Without the `cuda` feature only the types are used; the rules serve the launchers.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::Buf;
use crate::cpu::attention::PagedKv;
use half::bf16;

/// Head dims with compiled attention kernels.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Decode CTAs resident per SM at the decode kernels' register use (about 128 registers x
/// 128 threads): the split heuristic aims at this many CTAs per SM.
pub(crate) const DECODE_CTAS_PER_SM: usize = 4;
/// Fewest positions a split gets from the heuristic (two steps of a head-dim-128 CTA):
/// below this the reduction and the CTA's start-up cost more than the parallelism gives.
pub(crate) const MIN_SPLIT_TOKENS: usize = 64;
/// Prefill CTA geometry (must match PF_R, PF_BK in the .cu): rows of (query token, head)
/// and KV positions per tile, and the K/V tiles in flight (tile j + 1 loads while tile j
/// computes).
pub(crate) const PF_ROWS: usize = 64;
pub(crate) const PF_KEYS: usize = 64;
pub(crate) const PF_STAGES: usize = 2;

/// A batch of sequences over one layer's paged K/V cache, as both attention kernels read
/// it.
pub struct PagedBatch<'a> {
    pub cache: PagedKv,
    /// `[num_blocks, block_size, n_kv_heads, head_dim]` bf16.
    pub k_cache: &'a Buf<bf16>,
    pub v_cache: &'a Buf<bf16>,
    /// `[num_seqs, max_blocks]`: physical block ids of each sequence in position order.
    /// Rows may be partly filled; only the blocks covering the context are read.
    pub block_tables: &'a Buf<u32>,
    pub max_blocks: usize,
    /// `[num_seqs]`: positions cached per sequence, this step's tokens included (their K/V
    /// written first, `Device::write_kv`). 0 marks a padding row: its decode output is zeros.
    pub context_lens: &'a Buf<u32>,
}

/// How a decode call divided each sequence's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    /// Splits per sequence; 1 means no reduction kernel ran.
    pub n_splits: usize,
    /// Positions per split (the last split of a sequence runs to its end).
    pub split_len: usize,
}

/// Splits per sequence for `ctas` CTAs of one split: enough to give every SM
/// [`DECODE_CTAS_PER_SM`] CTAs, no split under [`MIN_SPLIT_TOKENS`] positions, at most
/// `capacity` (what the workspace holds) and the grid's 65535. A forced `split_len` is
/// honoured unless the workspace cannot hold its splits; then fewer, longer splits.
pub(crate) fn plan_splits(
    ctas: usize,
    max_context: usize,
    split_len: Option<usize>,
    capacity: usize,
    sm_count: usize,
) -> DecodePlan {
    let ctx = max_context.max(1);
    let cap = capacity.clamp(1, 65535);
    let n = match split_len {
        Some(t) => ctx.div_ceil(t.max(1)),
        None => (DECODE_CTAS_PER_SM * sm_count.max(1)).div_ceil(ctas.max(1)).min(ctx.div_ceil(MIN_SPLIT_TOKENS)),
    }
    .clamp(1, cap);
    let len = match split_len {
        Some(t) if ctx.div_ceil(t.max(1)) <= cap => t.max(1),
        _ => ctx.div_ceil(n),
    };
    DecodePlan { n_splits: ctx.div_ceil(len).max(1), split_len: len }
}

/// Dynamic shared memory of a prefill CTA: two stages of a K and a V tile, `PF_KEYS` rows
/// of `head_dim` bf16 each (unpadded: the kernel permutes 16-byte chunks instead). Q is
/// staged through one of the K buffers, so it needs no room of its own.
pub(crate) fn prefill_smem_bytes(head_dim: usize) -> usize {
    PF_STAGES * 2 * PF_KEYS * head_dim * 2
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIG: usize = 1 << 20;

    #[test]
    fn plan_fills_the_gpu_without_tiny_splits() {
        // Llama-8B shapes (8 kv heads) on 132 SMs: batch 1 at 32k splits 66 ways (528 CTAs).
        let p = plan_splits(8, 32768, None, BIG, 132);
        assert_eq!(p.n_splits, 66);
        assert!(p.split_len * p.n_splits >= 32768 && p.split_len * (p.n_splits - 1) < 32768);
        assert!(p.split_len >= MIN_SPLIT_TOKENS);
        // Batch 256 fills the GPU without splitting.
        assert_eq!(plan_splits(256 * 8, 4096, None, BIG, 132).n_splits, 1);
        // Short contexts never split below MIN_SPLIT_TOKENS.
        assert_eq!(plan_splits(8, 300, None, BIG, 132), DecodePlan { n_splits: 5, split_len: 60 });
        assert_eq!(plan_splits(8, 17, None, BIG, 132).n_splits, 1);
    }

    #[test]
    fn plan_respects_forced_length_and_capacity() {
        assert_eq!(plan_splits(1, 500, Some(64), 100, 132), DecodePlan { n_splits: 8, split_len: 64 });
        // Too small a workspace: fewer, longer splits that still cover the context.
        assert_eq!(plan_splits(1, 500, Some(64), 3, 132), DecodePlan { n_splits: 3, split_len: 167 });
        assert_eq!(plan_splits(1, 500, Some(64), 0, 132).n_splits, 1);
        assert_eq!(plan_splits(1, 0, None, 8, 132), DecodePlan { n_splits: 1, split_len: 1 });
        // The grid's z limit caps the splits.
        assert_eq!(plan_splits(1, 1 << 20, Some(1), BIG, 132).n_splits, 65535.min((1usize << 20).div_ceil(17)));
    }

    #[test]
    fn prefill_smem_fits_hopper_opt_in() {
        // 227 KB is Hopper's opt-in limit per SM: head dim 128 fits two CTAs, 64 three
        // (the register budgets of the kernels' launch bounds).
        assert_eq!(prefill_smem_bytes(128), 64 * 1024);
        assert_eq!(prefill_smem_bytes(64), 32 * 1024);
        assert!(2 * prefill_smem_bytes(128) <= 227 * 1024 && 3 * prefill_smem_bytes(64) <= 227 * 1024);
        // Rows are whole 16-byte chunks (cp.async, ldmatrix) in pairs (two loader lanes a row).
        assert!(HEAD_DIMS.iter().all(|&d| d * 2 % 32 == 0));
    }
}
