//! Causal attention over the f16 paged cache with an f32 softmax, sixteen positions at a
//! time, for a whole batch of sequences in one parallel region: the CPU engine's fast
//! attention, paired with the packed matmuls (`packed.rs`).
//!
//! Why: [`super::attention_f16`] reproduces llama.cpp's rounding one position at a time
//! (a horizontal dot, a C-library `expf`, an f16 round of the accumulator per position
//! and head), and was the largest op of a 16-sequence decode step on the 16-core Xeon
//! (23%, bench/RESULTS.md). Here each row takes its positions in tiles of [`TILE`]:
//! - the tile's scores, `scale · (q · k)`, the query rounded to f16 as llama.cpp's
//!   kernels round it (products exact in f32, summed in f32), eight dot products
//!   reduced together;
//! - online softmax across tiles, in f32: the tile's maximum, the accumulator and sum
//!   rescaled by `e^(M_old - M)` when it rises, the weights `e^(s - M)` eight at a time
//!   (a polynomial `e^x` within a few ulp of `expf`; arguments below -87 are taken as -87,
//!   whose weight, under 2e-38 of the maximum's, is lost in the sum anyway);
//! - the V rows weighted and summed in f32, eight dimensions at a time over the tile.
//!
//! So it approaches exact attention over the f16 query, keys and values to f32 rounding
//! (tests: against f64), where the f16 path carries llama.cpp's f16 accumulator; the
//! engine takes this one with the packed kernels, which already round differently from
//! llama.cpp (`LlamaModel::set_packed_kernels`). Rounding the query matters: with an f32
//! query the default model agreed with llama.cpp's greedy output on 3 of 12 fixture
//! prompts, with it on 6 (worker/tests/llama_cpp_agreement.rs; bench/RESULTS.md).
//!
//! One call takes every sequence of a step: prefill chunks and decodes, their query rows
//! concatenated. The work is split into (token, query heads sharing a kv head) units
//! over all of them, so sixteen decodes of different lengths balance over the threads
//! instead of one sequence per thread.
//!
//! Bits: a row's output depends only on its query, its positions' K/V and the tile
//! boundaries (fixed, from position 0), never on the batch, the thread count or the
//! split, so the engine stays batch invariant. The AVX2 and AVX-512VL builds (the latter
//! on CPUs with AVX-512 VNNI) run the same instructions (the same bits); without AVX2, or
//! for a head_dim other than 64, 128 and 256, the portable rows take the same steps in
//! scalar f32, in another summation order.

use half::f16;

use super::attention::{BatchRows, PagedKv, SeqSlice};
use super::matmul::Isa;
use super::par;
use crate::error::check;
use crate::KernelError;

#[cfg(target_arch = "x86_64")]
#[path = "attention_tiled_avx2.rs"]
mod avx2;

/// Positions per tile: two 8-lane registers of scores.
const TILE: usize = 16;

/// The smallest argument of the weights' `e^x` (see the module docs): `e^-87` is still a
/// normal f32, so the register kernel builds `2^n` from its exponent bits.
const EXP_MIN: f32 = -87.0;

/// Below this many multiply-adds (`rows * heads * context * head_dim`) a call stays on
/// the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// Tasks per thread the split aims for, where there are enough units (a unit's work
/// grows with its context, which differs between sequences).
const TASKS_PER_THREAD: usize = 8;

/// What one kernel call reads: `g` query rows of one token that share a kv head, both
/// caches, the kv head's offset in a slot, the sequence's block table and how many
/// positions the token attends to, and the score scale.
struct RowInputs<'a> {
    q: &'a [f32],
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    cache: &'a PagedKv,
    table: &'a [u32],
    head_off: usize,
    positions: usize,
    scale: f32,
}

impl RowInputs<'_> {
    /// Fills `offs` with the cache offsets of the kv head's rows at positions `p0 ..`
    /// (as many as fit and exist); returns how many. The table was checked to cover the
    /// positions with valid blocks.
    #[inline]
    fn tile_offsets(&self, p0: usize, offs: &mut [usize; TILE]) -> usize {
        let n = TILE.min(self.positions - p0);
        let (bs, stride) = (self.cache.block_size, self.cache.token_stride());
        // One division per tile, not per position.
        let (mut block, mut slot) = (p0 / bs, p0 % bs);
        for o in offs.iter_mut().take(n) {
            *o = (self.table[block] as usize * bs + slot) * stride + self.head_off;
            slot += 1;
            if slot == bs {
                (block, slot) = (block + 1, 0);
            }
        }
        n
    }
}

/// Causal attention of every sequence's chunk over the f16 cache (which must already
/// hold the chunks' own K/V, see [`super::attention_f16::write_kv_f16`]). `q`, `out`:
/// `[rows, n_heads * head_dim]` f32, the rows of `seqs[0]`'s tokens first, then
/// `seqs[1]`'s, and so on; scores are `scale * q.k`.
#[allow(clippy::too_many_arguments)]
pub fn attention_tiled(
    cache: &PagedKv,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    q: &[f32],
    seqs: &[SeqSlice],
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    attention_tiled_with(Isa::best(), cache, k_cache, v_cache, out, q, seqs, n_heads, scale)
}

/// [`attention_tiled`] with a chosen instruction set (tests compare the paths).
#[allow(clippy::too_many_arguments)]
pub fn attention_tiled_with(
    isa: Isa,
    cache: &PagedKv,
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
    q: &[f32],
    seqs: &[SeqSlice],
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    const OP: &str = "attention_tiled";
    let num_blocks = cache.check_cache(OP, k_cache.len(), v_cache.len())?;
    let (hd, n_kv) = (cache.head_dim, cache.n_kv_heads);
    check(n_heads > 0 && n_heads.is_multiple_of(n_kv), OP, || {
        format!("n_heads {n_heads} is not a positive multiple of n_kv_heads {n_kv}")
    })?;
    check(scale.is_finite(), OP, || format!("scale {scale} is not finite"))?;
    // Each sequence's first row, and the work (multiply-adds) of the whole call.
    let BatchRows { starts, rows, work } = cache.check_batch(OP, seqs, num_blocks, q.len(), out.len(), n_heads)?;
    let row_len = n_heads * hd;
    if rows == 0 {
        return Ok(());
    }
    let work = work.saturating_mul(row_len);
    let group = n_heads / n_kv;
    let threads = rayon::current_num_threads();
    let parallel = work >= PAR_MIN_WORK && threads > 1 && !par::in_task();
    // The register kernel's widths: head_dim 64, 128, 256, and `g` query heads of a group
    // at a time (they read the same K/V rows; one head at a time costs 1.8x (SmolLM2) to
    // 3x (Llama 3 8B) per head on the 2-core AVX2 VM, bench/RESULTS.md): the largest of
    // 4, 3, 2 dividing the group, cut to one only where whole groups would leave threads
    // idle (a lone decode).
    let simd = isa.has_avx2() && matches!(hd, 64 | 128 | 256);
    let mut g = [4, 3, 2].into_iter().find(|g| group.is_multiple_of(*g)).unwrap_or(1);
    if parallel && rows * n_heads / g < threads {
        g = 1;
    }
    let unit = g * hd;
    let units_per_row = n_heads / g;

    // Unit `u`: output values `u * unit ..`: row `u / units_per_row`, heads from
    // `(u % units_per_row) * g`.
    let attend = |u: usize, o: &mut [f32], scratch: &mut Scratch| {
        let (row, h0) = (u / units_per_row, (u % units_per_row) * g);
        let si = starts.partition_point(|&s| s <= row) - 1;
        let seq = &seqs[si];
        let t = row - starts[si];
        let at = row * row_len + h0 * hd;
        let rows = RowInputs {
            q: &q[at..at + unit],
            k_cache,
            v_cache,
            cache,
            table: seq.block_table,
            head_off: (h0 / group) * hd,
            positions: seq.first_pos + t + 1,
            scale,
        };
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` implies a constructed AVX2 `Isa`, so the CPU has AVX2, FMA
            // and F16C (and AVX-512VL where the `Isa` says so).
            unsafe { avx2::attend(isa.has_avx512vl(), hd, g, rows, o) };
            return;
        }
        let _ = simd;
        scalar_rows(&rows, hd, o, scratch);
    };
    let units = rows * units_per_row;
    if parallel {
        let per = (units / (TASKS_PER_THREAD * threads)).max(1);
        par::for_each_chunk_mut(out, per * unit, |i, o| {
            let mut scratch = Scratch::default();
            for (j, o) in o.chunks_mut(unit).enumerate() {
                attend(i * per + j, o, &mut scratch);
            }
        });
    } else {
        let mut scratch = Scratch::default();
        out.chunks_mut(unit).enumerate().for_each(|(u, o)| attend(u, o, &mut scratch));
    }
    Ok(())
}

/// The portable path's per-task buffers (empty until it runs; the register kernel needs
/// none): the accumulator and the f16-rounded query, `[head_dim]` each.
#[derive(Default)]
struct Scratch {
    acc: Vec<f32>,
    q16: Vec<f32>,
}

/// The portable path: the kernel's steps for each of the unit's rows in scalar f32
/// (`o`: `[rows, head_dim]`).
fn scalar_rows(r: &RowInputs, hd: usize, o: &mut [f32], scratch: &mut Scratch) {
    let mut offs = [0usize; TILE];
    let Scratch { acc, q16 } = scratch;
    acc.resize(hd, 0.0);
    q16.resize(hd, 0.0);
    for (q, o) in r.q.chunks_exact(hd).zip(o.chunks_exact_mut(hd)) {
        for (d, &x) in q16.iter_mut().zip(q) {
            *d = f16::from_f32(x).to_f32();
        }
        acc.fill(0.0);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
        for p0 in (0..r.positions).step_by(TILE) {
            let n = r.tile_offsets(p0, &mut offs);
            let mut s = [f32::NEG_INFINITY; TILE];
            for (s, &off) in s.iter_mut().zip(&offs[..n]) {
                let k = &r.k_cache[off..off + hd];
                *s = q16.iter().zip(k).map(|(&a, &b)| a * b.to_f32()).sum::<f32>() * r.scale;
            }
            let tmax = s[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if tmax > m {
                let corr = (m - tmax).exp();
                m = tmax;
                l *= corr;
                acc.iter_mut().for_each(|a| *a *= corr);
            }
            if m == f32::NEG_INFINITY {
                continue;
            }
            for (&s, &off) in s.iter().zip(&offs[..n]) {
                // The clamp as the register kernel's (a NaN score stays NaN).
                let x = s - m;
                let w = if x < EXP_MIN { EXP_MIN } else { x }.exp();
                l += w;
                for (a, v) in acc.iter_mut().zip(&r.v_cache[off..off + hd]) {
                    *a = v.to_f32().mul_add(w, *a);
                }
            }
        }
        let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
        for (o, &a) in o.iter_mut().zip(acc.iter()) {
            *o = a * inv;
        }
    }
}
