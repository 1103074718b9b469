//! The backend-independent part of paged attention on the GPU: the batch description the
//! kernels read ([`PagedBatch`]), the split-KV plan of a decode call ([`DecodePlan`]) and
//! the pure rules that choose it and size the CTAs' shared memory. Always built,
//! so the rules are tested on machines without CUDA.
// Without the `cuda` feature only the types are used; the rules serve the launchers.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use super::Buf;
use crate::cpu::attention::PagedKv;
use half::bf16;

/// Head dims with compiled attention kernels.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Decode CTA geometry (must match DEC_WARPS, DEC_TILE, DEC_STAGES in the .cu): warps, the
/// positions of one warp's tile, and the tiles of each warp's cp.async ring.
pub(crate) const DECODE_WARPS: usize = 4;
pub(crate) const DECODE_TILE: usize = 16;
pub(crate) const DECODE_STAGES: usize = 3;
/// Ring depth of the lean decode kernels (DEC_LEAN_STAGES in the .cu).
pub(crate) const DECODE_LEAN_STAGES: usize = 2;
/// Fewest positions a split gets from the heuristic (one tile per warp of a CTA): below
/// this the partial results and the CTA's start-up cost more than the parallelism gives.
pub(crate) const MIN_SPLIT_TOKENS: usize = DECODE_WARPS * DECODE_TILE;
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
    /// Splits per sequence (the grid's depth); 1 means no partial results.
    pub n_splits: usize,
    /// Positions per split (the last split of a sequence runs to its end). With the
    /// automatic plan every sequence derives its own length from its context
    /// ([`auto_split_len`]); this is the one of `max_context`.
    pub split_len: usize,
}

/// Splits per sequence for `ctas` CTAs of one split, on a GPU that holds `slots` decode
/// CTAs at once (SMs x CTAs per SM): as many as fit in one wave (at least 1), no split
/// under [`MIN_SPLIT_TOKENS`] positions, at most `capacity` (what the workspace holds) and
/// the grid's 65535. Whole waves: a second, partial wave would leave most SMs idle at the
/// end. A forced `split_len` is honoured unless the workspace cannot hold its splits; then
/// fewer, longer splits.
pub(crate) fn plan_splits(
    ctas: usize,
    max_context: usize,
    split_len: Option<usize>,
    capacity: usize,
    slots: usize,
) -> DecodePlan {
    let ctx = max_context.max(1);
    let cap = capacity.clamp(1, 65535);
    match split_len {
        Some(t) => {
            let t = t.max(1);
            let n = ctx.div_ceil(t).clamp(1, cap);
            let len = if ctx.div_ceil(t) <= cap { t } else { ctx.div_ceil(n) };
            DecodePlan { n_splits: ctx.div_ceil(len).max(1), split_len: len }
        }
        None => {
            let n = (slots / ctas.max(1)).min(ctx.div_ceil(MIN_SPLIT_TOKENS)).clamp(1, cap);
            let len = auto_split_len(ctx, n);
            DecodePlan { n_splits: ctx.div_ceil(len), split_len: len }
        }
    }
}

/// Positions per split of a sequence of `ctx > 0` positions over `n_splits` automatic splits
/// (the kernel's rule, dec_split_len): an even share, at least [`MIN_SPLIT_TOKENS`], rounded
/// up to whole tiles. Never more than `n_splits` splits start before `ctx`.
pub(crate) fn auto_split_len(ctx: usize, n_splits: usize) -> usize {
    ctx.div_ceil(n_splits.max(1)).max(MIN_SPLIT_TOKENS).next_multiple_of(DECODE_TILE)
}

/// Dynamic shared memory of a decode CTA: each warp's ring of [`DECODE_STAGES`] tiles of K
/// and V, [`DECODE_TILE`] rows of `head_dim` bf16 each (the warps' partial results reuse it).
pub(crate) fn decode_smem_bytes(head_dim: usize) -> usize {
    decode_ring_bytes(head_dim, DECODE_STAGES)
}

/// The same for the lean decode kernels' ring of [`DECODE_LEAN_STAGES`] tiles.
pub(crate) fn decode_lean_smem_bytes(head_dim: usize) -> usize {
    decode_ring_bytes(head_dim, DECODE_LEAN_STAGES)
}

fn decode_ring_bytes(head_dim: usize, stages: usize) -> usize {
    DECODE_WARPS * stages * 2 * DECODE_TILE * head_dim * 2
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

    /// An H200: 132 SMs x 2 head-dim-128 decode CTAs.
    const SLOTS: usize = 264;

    #[test]
    fn plan_fills_one_wave_without_tiny_splits() {
        // Llama-8B shapes (8 kv heads): batch 1 at 32k splits 33 ways (264 CTAs, one wave).
        let p = plan_splits(8, 32768, None, BIG, SLOTS);
        assert_eq!(p, DecodePlan { n_splits: 33, split_len: 1008 });
        assert!(p.split_len * p.n_splits >= 32768 && p.split_len * (p.n_splits - 1) < 32768);
        // Batch 4: 8 splits (256 CTAs), not 9 (288: a second wave of 24).
        assert_eq!(plan_splits(32, 32768, None, BIG, SLOTS).n_splits, 8);
        // Batch 64 (512 CTAs) and 256 fill the GPU without splitting.
        assert_eq!(plan_splits(64 * 8, 8192, None, BIG, SLOTS), DecodePlan { n_splits: 1, split_len: 8192 });
        assert_eq!(plan_splits(256 * 8, 4096, None, BIG, SLOTS).n_splits, 1);
        // Short contexts never split below MIN_SPLIT_TOKENS; lengths are whole tiles.
        assert_eq!(plan_splits(8, 512, None, BIG, SLOTS), DecodePlan { n_splits: 8, split_len: 64 });
        assert_eq!(plan_splits(8, 300, None, BIG, SLOTS), DecodePlan { n_splits: 5, split_len: 64 });
        assert_eq!(plan_splits(8, 17, None, BIG, SLOTS), DecodePlan { n_splits: 1, split_len: 64 });
        // Rounding up to tiles can leave fewer splits than asked for: the plan reports them.
        assert_eq!(plan_splits(8, 4096, None, BIG, SLOTS), DecodePlan { n_splits: 32, split_len: 128 });
        // The workspace caps the splits.
        assert_eq!(plan_splits(8, 32768, None, 4, SLOTS), DecodePlan { n_splits: 4, split_len: 8192 });
    }

    #[test]
    fn auto_split_len_covers_every_context_in_at_most_n_splits() {
        for n in [1usize, 2, 3, 8, 33, 66] {
            for ctx in (1..3000).step_by(7).chain([4095, 4096, 4097, 32768, 100_000]) {
                let len = auto_split_len(ctx, n);
                assert!(len.is_multiple_of(DECODE_TILE) && len >= MIN_SPLIT_TOKENS, "ctx {ctx} n {n}: len {len}");
                assert!(ctx.div_ceil(len) <= n, "ctx {ctx} n {n}: {} splits of {len}", ctx.div_ceil(len));
                // Rounding adds less than a tile to the even share.
                assert!(len < ctx.div_ceil(n).max(MIN_SPLIT_TOKENS) + DECODE_TILE, "ctx {ctx} n {n}: len {len}");
            }
        }
        // A sequence far shorter than the planned max_context (a graph's) gets splits of its own.
        assert_eq!(auto_split_len(600, 33), 64);
        assert_eq!(auto_split_len(600, 2), 304);
    }

    #[test]
    fn plan_respects_forced_length_and_capacity() {
        assert_eq!(plan_splits(1, 500, Some(64), 100, SLOTS), DecodePlan { n_splits: 8, split_len: 64 });
        // Too small a workspace: fewer, longer splits that still cover the context.
        assert_eq!(plan_splits(1, 500, Some(64), 3, SLOTS), DecodePlan { n_splits: 3, split_len: 167 });
        assert_eq!(plan_splits(1, 500, Some(64), 0, SLOTS).n_splits, 1);
        assert_eq!(plan_splits(1, 0, None, 8, SLOTS), DecodePlan { n_splits: 1, split_len: 64 });
        // The grid's z limit caps the splits.
        assert_eq!(plan_splits(1, 1 << 20, Some(1), BIG, SLOTS).n_splits, 65535.min((1usize << 20).div_ceil(17)));
    }

    #[test]
    fn decode_smem_fits_two_ctas_per_sm() {
        // Hopper: 228 KB per SM, 1 KB of it reserved per CTA; 227 KB at most per CTA.
        assert_eq!(decode_smem_bytes(128), 96 * 1024);
        assert_eq!(decode_smem_bytes(64), 48 * 1024);
        assert!(2 * (decode_smem_bytes(128) + 1024) <= 228 * 1024);
        assert!(4 * (decode_smem_bytes(64) + 1024) <= 228 * 1024);
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
