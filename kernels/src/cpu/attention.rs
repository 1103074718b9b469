//! Causal attention over a paged KV cache, and the write of new K/V into it.
//!
//! The serving design keeps each layer's K and V in fixed-size blocks,
//! `[num_blocks, block_size, n_kv_heads, head_dim]` f32, and gives every sequence a
//! block table: position `p` lives in block `block_table[p / block_size]`, slot
//! `p % block_size`. One call handles one sequence's chunk of `n_tokens` new tokens at
//! positions `first_pos..first_pos + n_tokens` (a decode step is a chunk of one; a
//! prefill chunk may start mid-context). Query token `t` attends to positions
//! `0..=first_pos + t`; query head `h` reads kv head `h / (n_heads / n_kv_heads)` (GQA).
//!
//! Softmax is two-pass per (token, head): scores into an O(context) f32 buffer, max,
//! `exp(s - max)` weights summed in f32, then the weighted sum of V rows normalised once.
//! Work is parallel over (token, head) rows of the output.
//!
//! This f32 version is the exact reference (the GPU kernels are tested against it); the
//! CPU engine keeps its cache in f16 and takes llama.cpp's rounding steps, see
//! [`super::attention_f16`].

use rayon::prelude::*;

use crate::error::check;
use crate::KernelError;

/// Below this many multiply-adds (`tokens * heads * context * head_dim`) a call stays on
/// the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// Geometry of one layer's paged K (or V) cache, `[num_blocks, block_size, n_kv_heads,
/// head_dim]`; `num_blocks` comes from the buffer length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKv {
    pub block_size: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// The chunk of one sequence a call works on.
#[derive(Debug, Clone, Copy)]
pub struct SeqSlice<'a> {
    /// Physical block ids of the sequence, in position order; must cover
    /// `first_pos + n_tokens` positions. Ids within one table must be distinct.
    pub block_table: &'a [u32],
    /// Position of the chunk's first token; positions before it are already cached.
    pub first_pos: usize,
    pub n_tokens: usize,
}

/// A checked step of sequences ([`PagedKv::check_batch`]).
pub(crate) struct BatchRows {
    /// Each sequence's first row in the stacked q / out.
    pub starts: Vec<usize>,
    /// Rows in all.
    pub rows: usize,
    /// Query rows times the positions each attends to (saturating).
    pub work: usize,
}

impl PagedKv {
    /// Values per token in the cache: all kv heads of one slot.
    pub(crate) fn token_stride(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Checks the geometry and both cache buffers; returns `num_blocks`.
    pub(crate) fn check_cache(&self, op: &'static str, k_len: usize, v_len: usize) -> Result<usize, KernelError> {
        check(self.block_size > 0 && self.n_kv_heads > 0 && self.head_dim > 0, op, || {
            format!("block_size, n_kv_heads, head_dim must be > 0, got {self:?}")
        })?;
        let block = self
            .block_size
            .checked_mul(self.token_stride())
            .ok_or_else(|| KernelError::Shape { op, detail: format!("block size overflows: {self:?}") })?;
        check(k_len == v_len && k_len.is_multiple_of(block), op, || {
            format!("k cache {k_len} / v cache {v_len} values: not equal whole numbers of {block}-value blocks")
        })?;
        Ok(k_len / block)
    }

    /// Checks `seq`'s table covers its context with valid block ids; returns the context
    /// length `first_pos + n_tokens`.
    pub(crate) fn check_seq(&self, op: &'static str, seq: &SeqSlice, num_blocks: usize) -> Result<usize, KernelError> {
        let ctx = seq.first_pos.checked_add(seq.n_tokens).ok_or_else(|| KernelError::Shape {
            op,
            detail: format!("first_pos {} + n_tokens {} overflows", seq.first_pos, seq.n_tokens),
        })?;
        let needed = ctx.div_ceil(self.block_size);
        check(seq.block_table.len() >= needed, op, || {
            format!(
                "block table has {} blocks, {needed} needed for {ctx} positions of block size {}",
                seq.block_table.len(),
                self.block_size
            )
        })?;
        if let Some(&b) = seq.block_table[..needed].iter().find(|&&b| b as usize >= num_blocks) {
            return Err(KernelError::Shape { op, detail: format!("block id {b} >= num_blocks {num_blocks}") });
        }
        Ok(ctx)
    }

    /// Checks every sequence of a step (as [`PagedKv::check_seq`]) and `q` / `out` as
    /// their stacked rows of `n_heads` heads; returns where each sequence's rows start.
    /// The entry points that take a whole step (`attention_tiled`, `attention_f16_batch`)
    /// share it.
    pub(crate) fn check_batch(
        &self,
        op: &'static str,
        seqs: &[SeqSlice],
        num_blocks: usize,
        q_len: usize,
        out_len: usize,
        n_heads: usize,
    ) -> Result<BatchRows, KernelError> {
        let mut b = BatchRows { starts: Vec::with_capacity(seqs.len()), rows: 0, work: 0 };
        for seq in seqs {
            let ctx = self.check_seq(op, seq, num_blocks)?;
            b.starts.push(b.rows);
            b.rows = b.rows.checked_add(seq.n_tokens).ok_or_else(|| KernelError::Shape {
                op,
                detail: format!("the sequences' {} tokens overflow", seq.n_tokens),
            })?;
            b.work = b.work.saturating_add(seq.n_tokens.saturating_mul(ctx));
        }
        let row = n_heads.checked_mul(self.head_dim);
        check(row.and_then(|r| r.checked_mul(b.rows)) == Some(q_len) && out_len == q_len, op, || {
            format!(
                "q {q_len} / out {out_len} values, expected {} tokens x {n_heads} heads x {}",
                b.rows, self.head_dim
            )
        })?;
        Ok(b)
    }

    /// Offset in the cache of `position`'s slot (all kv heads) for a checked table.
    pub(crate) fn slot_offset(&self, block_table: &[u32], position: usize) -> usize {
        let block = block_table[position / self.block_size] as usize;
        (block * self.block_size + position % self.block_size) * self.token_stride()
    }
}

/// Stores the chunk's new keys and values, `k`, `v`: `[n_tokens, n_kv_heads * head_dim]`,
/// token `t` at position `first_pos + t`.
pub fn write_kv(
    cache: &PagedKv,
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    k: &[f32],
    v: &[f32],
    seq: &SeqSlice,
) -> Result<(), KernelError> {
    write_kv_as("write_kv", cache, k_cache, v_cache, k, v, seq, |dst, src| dst.copy_from_slice(src))
}

/// [`write_kv`] into a cache of any element type, `store` converting one token's row
/// (the f16 cache rounds there). Checks the operands as `op`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_kv_as<T>(
    op: &'static str,
    cache: &PagedKv,
    k_cache: &mut [T],
    v_cache: &mut [T],
    k: &[f32],
    v: &[f32],
    seq: &SeqSlice,
    store: impl Fn(&mut [T], &[f32]),
) -> Result<(), KernelError> {
    let num_blocks = cache.check_cache(op, k_cache.len(), v_cache.len())?;
    cache.check_seq(op, seq, num_blocks)?;
    let stride = cache.token_stride();
    check(k.len() == v.len() && seq.n_tokens.checked_mul(stride) == Some(k.len()), op, || {
        format!("k {} / v {} values, expected {} tokens x {stride}", k.len(), v.len(), seq.n_tokens)
    })?;
    // A copy per token: bandwidth-bound and small next to the matmuls, so serial.
    for (t, (kt, vt)) in k.chunks_exact(stride).zip(v.chunks_exact(stride)).enumerate() {
        let off = cache.slot_offset(seq.block_table, seq.first_pos + t);
        store(&mut k_cache[off..off + stride], kt);
        store(&mut v_cache[off..off + stride], vt);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    cache: &PagedKv,
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
    q: &[f32],
    seq: &SeqSlice,
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    const OP: &str = "attention";
    let num_blocks = cache.check_cache(OP, k_cache.len(), v_cache.len())?;
    let ctx = cache.check_seq(OP, seq, num_blocks)?;
    let (hd, n_kv) = (cache.head_dim, cache.n_kv_heads);
    check(n_heads > 0 && n_heads.is_multiple_of(n_kv), OP, || {
        format!("n_heads {n_heads} is not a positive multiple of n_kv_heads {n_kv}")
    })?;
    let q_len = seq.n_tokens.checked_mul(n_heads * hd);
    check(q_len == Some(q.len()) && out.len() == q.len(), OP, || {
        format!("q {} / out {} values, expected {} tokens x {n_heads} heads x {hd}", q.len(), out.len(), seq.n_tokens)
    })?;
    check(scale.is_finite(), OP, || format!("scale {scale} is not finite"))?;
    let group = n_heads / n_kv;

    // One output row per (token, head): `row = t * n_heads + h`.
    let head = |scores: &mut Vec<f32>, (row, o): (usize, &mut [f32])| {
        let (t, h) = (row / n_heads, row % n_heads);
        let kv_off = (h / group) * hd;
        let qh = &q[row * hd..(row + 1) * hd];
        let n_ctx = seq.first_pos + t + 1;

        scores.clear();
        scores.extend((0..n_ctx).map(|p| {
            let off = cache.slot_offset(seq.block_table, p) + kv_off;
            scale * dot(qh, &k_cache[off..off + hd])
        }));
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        o.fill(0.0);
        for (p, s) in scores.iter().enumerate() {
            let w = (s - m).exp();
            sum += w;
            let off = cache.slot_offset(seq.block_table, p) + kv_off;
            for (acc, &vv) in o.iter_mut().zip(&v_cache[off..off + hd]) {
                *acc += w * vv;
            }
        }
        // sum >= 1 (the max contributes e^0) unless a score was NaN.
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|v| *v *= inv);
    };

    let work = seq.n_tokens.saturating_mul(n_heads).saturating_mul(ctx).saturating_mul(hd);
    if work >= PAR_MIN_WORK {
        out.par_chunks_mut(hd).enumerate().for_each_init(|| Vec::with_capacity(ctx), head);
    } else {
        let mut scores = Vec::with_capacity(ctx);
        out.chunks_mut(hd).enumerate().for_each(|item| head(&mut scores, item));
    }
    Ok(())
}

/// f32 dot product with eight independent partial sums, so the compiler can vectorise
/// it (a single running sum has to stay in order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
