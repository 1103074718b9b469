//! Causal attention over a paged KV cache held in f16 with llama.cpp's rounding: the CPU
//! engine's attention on its exact path (`TESSERA_CPU_PACKED=0`; the fast path takes
//! [`super::attention_tiled`]).
//!
//! Same cache layout, block tables and causal rule as [`super::attention`] (which keeps
//! f32 and is the exact reference), but with the rounding steps of llama.cpp's CPU
//! flash-attention kernel for an f16 cache (llama.cpp's default), so that the engine
//! makes the same near-tie decisions as the reference it is checked against:
//! - K and V are stored rounded to f16 (nearest, ties to even): half the memory of f32.
//! - Each query row is rounded to f16. A score is the f16·f16 dot (every product is
//!   exact in f32) summed in f32 in the lane order of ggml's AVX-512 build (64 lanes, see
//!   [`dot_lanes`]), times `scale`.
//! - Softmax is online over the positions in order: a running max `M` and sum `S` in f32,
//!   and the weighted sum of V rows kept in f16. On a new maximum the accumulator is
//!   scaled by `e^(M_old - M)` and rounded to f16; every position adds `w * v` (one f32
//!   FMA, rounded to f16), with `w = e^(s - M)`.
//! - The output is the accumulator widened to f32, times `1 / S`.
//!
//! The f16 accumulator loses about 11 bits per step against the f32 reference; that is
//! the point (llama.cpp's results carry the same loss), not an accident.
//! Work is parallel over (token, head) rows of the output, as in [`super::attention`].
//! With AVX2/FMA/F16C and `head_dim` a multiple of 64 a row runs in registers
//! (`attention_f16_avx2.rs`, the same bits); otherwise the scalar row below.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::attention::{write_kv_as, PagedKv, SeqSlice};
use super::matmul::Isa;
use super::par::{self, SharedMut};
use crate::error::check;
use crate::KernelError;

#[cfg(target_arch = "x86_64")]
#[path = "attention_f16_avx2.rs"]
mod avx2;

/// Below this many multiply-adds (`tokens * heads * context * head_dim`) a call stays on
/// the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// Lanes of one step of the score dot (ggml AVX-512: four 16-lane f32 registers).
const LANES: usize = 64;

/// Stores the chunk's new keys and values, `k`, `v`: `[n_tokens, n_kv_heads * head_dim]`
/// f32, rounded to f16; token `t` goes to position `first_pos + t`.
pub fn write_kv_f16(
    cache: &PagedKv,
    k_cache: &mut [f16],
    v_cache: &mut [f16],
    k: &[f32],
    v: &[f32],
    seq: &SeqSlice,
) -> Result<(), KernelError> {
    write_kv_as("write_kv_f16", cache, k_cache, v_cache, k, v, seq, |dst, src| dst.convert_from_f32_slice(src))
}

/// The cache offsets of one head's K/V row at positions `0, 1, ..` of a sequence, in
/// order: block by block, with no division per position. The table was checked to cover
/// the positions asked for with valid blocks.
#[derive(Clone, Copy)]
struct Slots<'a> {
    table: &'a [u32],
    block_size: usize,
    /// Values per cache slot (all kv heads).
    stride: usize,
    /// The head's offset within a slot.
    head_off: usize,
    /// Positions left to give.
    left: usize,
    /// Next position's offset, and slots left in its block (0: look up the next block).
    next: usize,
    left_in_block: usize,
    block: usize,
}

impl<'a> Slots<'a> {
    fn new(cache: &PagedKv, table: &'a [u32], head_off: usize, positions: usize) -> Self {
        let (block_size, stride) = (cache.block_size, cache.token_stride());
        Slots { table, block_size, stride, head_off, left: positions, next: 0, left_in_block: 0, block: 0 }
    }
}

impl Iterator for Slots<'_> {
    type Item = usize;

    #[inline]
    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        if self.left_in_block == 0 {
            self.next = self.table[self.block] as usize * self.block_size * self.stride + self.head_off;
            self.block += 1;
            self.left_in_block = self.block_size;
        }
        let off = self.next;
        self.next += self.stride;
        self.left_in_block -= 1;
        self.left -= 1;
        Some(off)
    }
}

/// What one call of a row kernel reads: the query rows `q` (`[rows, head_dim]`, query
/// heads of one kv head and token), both caches, the offsets of the kv head's K/V rows
/// at the positions attended to, and the score scale.
struct RowInputs<'a> {
    q: &'a [f32],
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    slots: Slots<'a>,
    scale: f32,
}

/// Per-thread scratch of one (token, head) row, each `[head_dim]`.
struct Scratch {
    /// The query rounded to f16, widened back.
    q: Vec<f32>,
    /// The current K or V row, widened.
    kv: Vec<f32>,
    /// The weighted V sum: f16 between steps, widened during one.
    acc16: Vec<f16>,
    acc: Vec<f32>,
}

impl Scratch {
    fn new(hd: usize) -> Self {
        Scratch { q: vec![0.0; hd], kv: vec![0.0; hd], acc16: vec![f16::ZERO; hd], acc: vec![0.0; hd] }
    }

    /// Rounds `acc` to f16 (kept in `acc16`) and widens it back.
    fn round_acc(&mut self) {
        self.acc16.convert_from_f32_slice(&self.acc);
        self.acc16.convert_to_f32_slice(&mut self.acc);
    }
}

/// Causal attention of the chunk's queries over the f16 cache (which must already hold
/// the chunk's own K/V, see [`write_kv_f16`]). `q`, `out`: `[n_tokens, n_heads *
/// head_dim]` f32; scores are `scale * q.k`.
#[allow(clippy::too_many_arguments)]
pub fn attention_f16(
    cache: &PagedKv,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    q: &[f32],
    seq: &SeqSlice,
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    attention_f16_with(Isa::best(), cache, k_cache, v_cache, out, q, seq, n_heads, scale)
}

/// [`attention_f16`] with a chosen instruction set (tests compare the paths bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn attention_f16_with(
    isa: Isa,
    cache: &PagedKv,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    q: &[f32],
    seq: &SeqSlice,
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    const OP: &str = "attention_f16";
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
    // The register kernel's widths: head_dim 64, 128, 256. It takes `g` query heads of
    // one GQA group at a time (they read the same K/V rows): the largest of 4, 3, 2, 1
    // that divides the group.
    let simd = isa.has_avx2() && matches!(hd, 64 | 128 | 256);
    let g = if simd { [4, 3, 2].into_iter().find(|g| group.is_multiple_of(*g)).unwrap_or(1) } else { 1 };
    let work = seq.n_tokens.saturating_mul(n_heads).saturating_mul(ctx).saturating_mul(hd);
    let threads = rayon::current_num_threads();
    let parallel = work >= PAR_MIN_WORK && threads > 1 && !par::in_task();
    // One head per task where whole groups would leave threads idle (a decode token on
    // many cores: SmolLM2 has 3 groups for 16 threads). Every width gives the scalar
    // rows' bits, so this changes only the speed.
    let g = if parallel && seq.n_tokens * n_heads / g < threads { 1 } else { g };

    // Task `i`: output rows `i * g .. (i + 1) * g`, row `t * n_heads + h` for (token,
    // head); `g` divides the group, so the rows share token and kv head.
    let heads = |b: &mut Scratch, (i, o): (usize, &mut [f32])| {
        let row0 = i * g;
        let (t, h0) = (row0 / n_heads, row0 % n_heads);
        let slots = Slots::new(cache, seq.block_table, (h0 / group) * hd, seq.first_pos + t + 1);
        let rows = RowInputs { q: &q[row0 * hd..(row0 + g) * hd], k_cache, v_cache, slots, scale };
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` implies a constructed AVX2 `Isa`, so the CPU has AVX2, FMA
            // and F16C (and AVX-512VL where the `Isa` says so).
            unsafe { avx2::attend(isa.has_avx512vl(), hd, g, rows, o) };
            return;
        }
        let _ = simd;
        scalar_row(b, rows, o);
    };

    if parallel {
        par::for_each_chunk_mut(out, g * hd, |i, o| {
            // Scratch is the portable path's only (the register kernel needs none).
            heads(&mut if simd { Scratch::new(0) } else { Scratch::new(hd) }, (i, o));
        });
    } else {
        let mut scratch = Scratch::new(hd);
        out.chunks_mut(g * hd).enumerate().for_each(|item| heads(&mut scratch, item));
    }
    Ok(())
}

/// [`attention_f16`] over every sequence of a step: `q`, `out` `[rows, n_heads *
/// head_dim]`, `seqs[0]`'s token rows first, then `seqs[1]`'s, and so on (the layout of
/// `attention_tiled`). A prefill chunk splits over its own (token, head) rows, the chunks
/// one after another; the decodes run in one parallel region, a task each (one region
/// per sequence costs more in waking threads than a decode's work).
#[allow(clippy::too_many_arguments)]
pub fn attention_f16_batch(
    cache: &PagedKv,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    q: &[f32],
    seqs: &[SeqSlice],
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    const OP: &str = "attention_f16_batch";
    let num_blocks = cache.check_cache(OP, k_cache.len(), v_cache.len())?;
    let starts = cache.check_batch(OP, seqs, num_blocks, q.len(), out.len(), n_heads)?.starts;
    let row = n_heads * cache.head_dim;
    let base = SharedMut::new(out);
    let run = |i: usize| -> Result<(), KernelError> {
        let (s, at) = (&seqs[i], starts[i] * row);
        let len = s.n_tokens * row;
        // SAFETY: sequence `i`'s rows `starts[i] ..+ n_tokens` are its own.
        let o = unsafe { base.slice(at, at + len) };
        attention_f16(cache, k_cache, v_cache, o, &q[at..at + len], s, n_heads, scale)
    };
    for i in (0..seqs.len()).filter(|&i| seqs[i].n_tokens > 1) {
        run(i)?;
    }
    let decodes: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].n_tokens == 1).collect();
    let failed = std::sync::Mutex::new(None);
    par::for_each_task(decodes.len(), |j| {
        if let Err(e) = run(decodes[j]) {
            failed.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
        }
    });
    failed.into_inner().unwrap_or_else(|e| e.into_inner()).map_or(Ok(()), Err)
}

/// One output row on the portable path: `q`, `o` `[head_dim]`.
fn scalar_row(b: &mut Scratch, rows: RowInputs, o: &mut [f32]) {
    let RowInputs { q, k_cache, v_cache, slots, scale } = rows;
    let hd = q.len();
    for (d, &x) in b.q.iter_mut().zip(q) {
        *d = f16::from_f32(x).to_f32();
    }
    b.acc.fill(0.0);
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    for off in slots {
        k_cache[off..off + hd].convert_to_f32_slice(&mut b.kv);
        let s = dot_lanes(&b.q, &b.kv) * scale;
        // `ms` rescales what was summed under the old maximum, `w` weighs this row.
        let (mut ms, mut w) = (1.0f32, 1.0f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            b.acc.iter_mut().for_each(|a| *a *= ms);
            b.round_acc();
        } else {
            w = (s - m).exp();
        }
        v_cache[off..off + hd].convert_to_f32_slice(&mut b.kv);
        for (a, &vv) in b.acc.iter_mut().zip(&b.kv) {
            *a = vv.mul_add(w, *a);
        }
        b.round_acc();
        sum = sum.mul_add(ms, w);
    }
    // sum >= 1 (the maximum contributes e^0) unless a score was NaN.
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (o, &a) in o.iter_mut().zip(&b.acc) {
        *o = a * inv;
    }
}

/// `Σ a[i]·b[i]` in f32, summed as ggml's AVX-512 `ggml_vec_dot_f16` does: each run of
/// 64 values adds into 64 lane sums by FMA; the lanes (four registers of 16) are reduced
/// by adding registers 0+2 and 1+3, then those two, then the 16 lanes pairwise down to
/// one (8+8, 4+4, then lanes {0,2} and {1,3}, then the two). A tail shorter than 64 is
/// added in f64. The inputs are f16 values, so the products are exact and only the
/// order of the additions is being reproduced.
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    let whole = a.len() - a.len() % LANES;
    let mut sum = if whole > 0 {
        let mut lanes = [0.0f32; LANES];
        for (ac, bc) in a[..whole].chunks_exact(LANES).zip(b[..whole].chunks_exact(LANES)) {
            for i in 0..LANES {
                lanes[i] = ac[i].mul_add(bc[i], lanes[i]);
            }
        }
        let mut r16 = [0.0f32; 16];
        for (l, r) in r16.iter_mut().enumerate() {
            *r = (lanes[l] + lanes[32 + l]) + (lanes[16 + l] + lanes[48 + l]);
        }
        let r8: [f32; 8] = std::array::from_fn(|l| r16[8 + l] + r16[l]);
        let r4: [f32; 4] = std::array::from_fn(|l| r8[4 + l] + r8[l]);
        f64::from((r4[0] + r4[2]) + (r4[1] + r4[3]))
    } else {
        0.0
    };
    for (&x, &y) in a[whole..].iter().zip(&b[whole..]) {
        sum += f64::from(x * y);
    }
    sum as f32
}
