//! 8-bit quantisation of activations for the integer dot products of the CPU matmul.
//!
//! As in llama.cpp, a matmul against quantised weights first quantises its input rows
//! once per call, symmetrically, to i8 with one f32 scale per block (on the CPU engine's
//! fast path the op before the matmul writes them so straight away:
//! `ActsQ8::quantize_rows_plain`); the weight-by-activation products are then sums of
//! i8*u8/i8 products, exact in i32.
//! - [`ActsQ8`]: 32-value blocks (for Q4_0, Q4_1, Q8_0 weights), with `s = d * sum(q)` per
//!   block, which folds the offset of Q4_0/Q4_1 (`m * sum(x)`) into one multiply.
//! - [`ActsQ8K`]: 256-value blocks (for the K types), with the integer sum of every 16
//!   values (`bsums`), which folds the K-quant mins and Q6_K's `- 32` offset.
//!
//! The scale is `max|x| / 127` and values round to nearest, ties to even. ggml stores
//! the `d` and `s` of its `block_q8_0`/`block_q8_1` as f16 (the quants themselves come
//! from the f32 scale); [`Q8_SCALES_F16`] says whether [`ActsQ8`] does the same (ggml's
//! `block_q8_K` keeps an f32 `d`, and so does [`ActsQ8K`]). The body is
//! written so the compiler vectorises it; the AVX2 copy is the same code compiled with
//! AVX2 enabled, so both give identical bytes. Large inputs are split by token rows (the
//! fused producers' by pieces of rows) over the CPU threads (`cpu::par`).

use crate::cpu::par::{self, SharedMut};

/// Activations in 32-value blocks; `n` rows of `cols` values.
#[derive(Debug, Clone, Default)]
pub struct ActsQ8 {
    pub cols: usize,
    /// Quantised values, (n, cols).
    pub qs: Vec<i8>,
    /// Block scales, (n, cols / 32); rounded to f16 if [`Q8_SCALES_F16`].
    pub d: Vec<f32>,
    /// `d * sum(q)` per block, with the f32 `d`, (n, cols / 32); rounded to f16 if
    /// [`Q8_SCALES_F16`].
    pub s: Vec<f32>,
    /// `d` and `s` again, block-major for groups of [`TOKEN_GROUP`] tokens:
    /// `(n / 4 rounded up, cols / 32, 4)`, entry `[g][b][l]` = token `4 g + l`'s value of
    /// block `b` (0 past the last token). The multi-token matmul kernels load a block's
    /// four scales as one vector. Empty for one token.
    pub d4: Vec<f32>,
    pub s4: Vec<f32>,
}

/// Tokens per group of [`ActsQ8::d4`] / [`ActsQ8::s4`].
pub const TOKEN_GROUP: usize = 4;

/// Activations in 256-value super-blocks; `n` rows of `cols` values.
#[derive(Debug, Clone, Default)]
pub struct ActsQ8K {
    pub cols: usize,
    /// Quantised values, (n, cols).
    pub qs: Vec<i8>,
    /// Super-block scales, (n, cols / 256).
    pub d: Vec<f32>,
    /// Integer sum of each run of 16 values, (n, cols / 16).
    pub bsums: Vec<i16>,
}

/// Largest |v| of a block; compares bit patterns so the loop vectorises (non-negative
/// floats order like their bits). NaN sorts above infinity, so it propagates.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7FFF_FFFF)))
}

/// Quantises one block: returns its scale `max|x| / 127` and writes `q` with the
/// multiplier `id`: `1 / d` for 256-value blocks, `127 / max|x|` for 32-value ones (the
/// two differ in the last bit now and then; the latter is what ggml's x86 Q8_0/Q8_1
/// quantisation uses, and a one-bit difference can move a value across a rounding tie).
#[inline(always)]
fn quant_block(x: &[f32], q: &mut [i8], ggml_multiplier: bool) -> f32 {
    let max = abs_max(x);
    let d = max / 127.0;
    let id = match (d > 0.0, ggml_multiplier) {
        (false, _) => 0.0,
        (true, true) => 127.0 / max,
        (true, false) => 1.0 / d,
    };
    for (qv, &v) in q.iter_mut().zip(x) {
        // max/min drop NaN (clamp would keep it), so the value is finite and in range.
        #[allow(clippy::manual_clamp)]
        let r = (v * id).round_ties_even().max(-127.0).min(127.0);
        // SAFETY: `r` is an integer-valued float in [-127, 127] (a plain `as` would be
        // scalarised for its saturation rules).
        *qv = unsafe { r.to_int_unchecked::<i32>() } as i8;
    }
    d
}

/// Whether [`ActsQ8`] rounds its block scale `d` and sum `s` to f16, as ggml's Q8_0 and
/// Q8_1 activation blocks do. On: the CPU engine is checked against llama.cpp's greedy
/// output, and the f16 scales (a relative error of up to 2^-12 per block) are one of the
/// roundings that decide its near-ties (tests read this flag).
pub const Q8_SCALES_F16: bool = true;

/// `v` as stored in an [`ActsQ8`] scale field.
#[inline(always)]
fn scale_round(v: f32) -> f32 {
    if Q8_SCALES_F16 {
        half::f16::from_f32(v).to_f32()
    } else {
        v
    }
}

#[inline(always)]
fn isum(q: &[i8]) -> i32 {
    q.iter().map(|&v| v as i32).sum()
}

/// `x`, `qs`: whole blocks; `d`, `s`: one per block.
#[inline(always)]
fn quantize_q8_body(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    let blocks = x.chunks_exact(32).zip(qs.chunks_exact_mut(32));
    for ((xb, qb), (d, s)) in blocks.zip(d.iter_mut().zip(s.iter_mut())) {
        let full = quant_block(xb, qb, true);
        *d = scale_round(full);
        *s = scale_round(full * isum(qb) as f32);
    }
}

/// `x`, `qs`: whole super-blocks; `d`: one per super-block; `bsums`: 16 per super-block.
#[inline(always)]
fn quantize_q8k_body(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    let blocks = x.chunks_exact(256).zip(qs.chunks_exact_mut(256));
    for ((xb, qb), (d, bs)) in blocks.zip(d.iter_mut().zip(bsums.chunks_exact_mut(16))) {
        *d = quant_block(xb, qb, false);
        for (b, q16) in bs.iter_mut().zip(qb.chunks_exact(16)) {
            *b = isum(q16) as i16; // |sum| <= 16 * 127
        }
    }
}

/// [`quantize_q8_body`] in its AVX2 build where the CPU has AVX2 and FMA (the detection
/// is a cached load): the entry both [`ActsQ8`] quantisers take.
fn quantize_q8_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected on this CPU.
        return unsafe { quantize_q8_avx2(x, qs, d, s) };
    }
    quantize_q8_body(x, qs, d, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    quantize_q8_body(x, qs, d, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_q8k_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], bsums: &mut [i16]) {
    quantize_q8k_body(x, qs, d, bsums)
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Below this many values quantisation stays on the calling thread: a batched decode's
/// activations (16 tokens of 576 values) are worth splitting on many cores, where each
/// matmul's threads would otherwise wait on one of them (`TASK_VALUES` each, at least a
/// row).
const PAR_MIN_VALUES: usize = 8192;
const TASK_VALUES: usize = 2048;

/// Runs `f` over the (x, qs, per-block a, per-block b) slices of groups of whole token
/// rows, in parallel when there is enough work. `per_a`, `per_b`: entries per row.
fn split_rows<A: Send, B: Send>(
    x: &[f32],
    cols: usize,
    qs: &mut [i8],
    (a, per_a): (&mut [A], usize),
    (b, per_b): (&mut [B], usize),
    f: impl Fn(&[f32], &mut [i8], &mut [A], &mut [B]) + Sync,
) {
    if x.len() < PAR_MIN_VALUES || cols == 0 || x.len() <= cols {
        return f(x, qs, a, b);
    }
    let rows_per = TASK_VALUES.div_ceil(cols);
    let rows = x.len() / cols;
    let (qs_base, a_base, b_base) = (SharedMut::new(qs), SharedMut::new(a), SharedMut::new(b));
    par::for_each_task(rows.div_ceil(rows_per), |i| {
        let (r0, r1) = (i * rows_per, ((i + 1) * rows_per).min(rows));
        // SAFETY: `qs`, `a` and `b` hold `rows` rows of `cols`, `per_a` and `per_b` entries
        // (the callers size them so); task `i` alone takes rows `r0..r1` of each.
        let (qs, a, b) = unsafe {
            (
                qs_base.slice(r0 * cols, r1 * cols),
                a_base.slice(r0 * per_a, r1 * per_a),
                b_base.slice(r0 * per_b, r1 * per_b),
            )
        };
        f(&x[r0 * cols..r1 * cols], qs, a, b);
    });
}

/// `v` = `(n, nb)` as `(n / TOKEN_GROUP rounded up, nb, TOKEN_GROUP)`, zero-padded.
fn group_major(v: &[f32], nb: usize) -> Vec<f32> {
    if nb == 0 {
        return Vec::new();
    }
    let n = v.len() / nb;
    let groups = n.div_ceil(TOKEN_GROUP);
    let mut out = vec![0.0; groups * nb * TOKEN_GROUP];
    for (t, row) in v.chunks_exact(nb).enumerate() {
        let (g, l) = (t / TOKEN_GROUP, t % TOKEN_GROUP);
        for (b, &x) in row.iter().enumerate() {
            out[(g * nb + b) * TOKEN_GROUP + l] = x;
        }
    }
    out
}

impl ActsQ8 {
    /// Quantises `x` = (n, cols); `cols` must be a multiple of 32 and `x.len()` of `cols`
    /// (the matmul checks both before calling).
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let mut acts = Self::quantize_plain(x, cols);
        // One token takes the one-row kernel, which reads `d` and `s`.
        if x.len() > cols {
            acts.d4 = group_major(&acts.d, cols / 32);
            acts.s4 = group_major(&acts.s, cols / 32);
        }
        acts
    }

    /// [`ActsQ8::quantize`] without the group-major `d4` / `s4` (left empty), for kernels
    /// that read `d` and `s` only (`cpu::packed`).
    pub fn quantize_plain(x: &[f32], cols: usize) -> Self {
        let nb = x.len() / 32;
        let mut acts =
            ActsQ8 { cols, qs: vec![0; nb * 32], d: vec![0.0; nb], s: vec![0.0; nb], d4: Vec::new(), s4: Vec::new() };
        split_rows(x, cols, &mut acts.qs, (&mut acts.d, cols / 32), (&mut acts.s, cols / 32), quantize_q8_blocks);
        acts
    }

    /// [`ActsQ8::quantize_plain`] of `n` rows of `cols` values that a producer writes
    /// piece by piece: `piece(r, c0, buf)` fills `buf` with values `c0 ..+ buf.len()` of
    /// row `r`. An op whose output only a matmul reads (a norm, SwiGLU) and the
    /// quantisation then run as one parallel pass, with no `[n, cols]` f32 buffer in
    /// between, the same bits as the op then `quantize_plain` (each 32-value block is
    /// quantised on its own). Pieces are whole rows up to [`PIECE_VALUES`], so one wide
    /// row (a decode's 14,336 SwiGLU values) still spreads over the threads.
    /// The callers check: `cols` a multiple of 32, `n * cols` without overflow.
    pub(crate) fn quantize_rows_plain(n: usize, cols: usize, piece: impl Fn(usize, usize, &mut [f32]) + Sync) -> Self {
        let (nb, len) = (cols / 32, n * cols);
        let mut acts = ActsQ8 {
            cols,
            qs: vec![0; len],
            d: vec![0.0; n * nb],
            s: vec![0.0; n * nb],
            d4: Vec::new(),
            s4: Vec::new(),
        };
        if len == 0 {
            return acts;
        }
        let width = cols.min(PIECE_VALUES);
        let per_row = cols.div_ceil(width);
        // Narrow rows go several to a task; a wide row's pieces one to a task.
        let per_task = if per_row == 1 { par::rows_per_task(cols) } else { 1 };
        let pieces = n * per_row;
        let (qs, d, s) = (SharedMut::new(&mut acts.qs), SharedMut::new(&mut acts.d), SharedMut::new(&mut acts.s));
        let task = |i: usize| {
            let mut buf = [0.0f32; PIECE_VALUES];
            for p in i * per_task..((i + 1) * per_task).min(pieces) {
                let (r, c0) = (p / per_row, (p % per_row) * width);
                let w = width.min(cols - c0);
                let (at, b0) = (r * cols + c0, (r * cols + c0) / 32);
                let buf = &mut buf[..w];
                piece(r, c0, buf);
                // SAFETY: values `at ..+ w` and their blocks (`w` and `c0` are multiples of
                // 32) lie inside the buffers sized above and belong to piece `p` alone.
                let (qs, d, s) = unsafe { (qs.slice(at, at + w), d.slice(b0, b0 + w / 32), s.slice(b0, b0 + w / 32)) };
                quantize_q8_blocks(buf, qs, d, s);
            }
        };
        let tasks = pieces.div_ceil(per_task);
        if len >= ROWS_PAR_MIN_VALUES {
            par::for_each_task(tasks, task);
        } else {
            (0..tasks).for_each(task);
        }
        acts
    }

    /// Blocks per row.
    pub fn row_blocks(&self) -> usize {
        self.cols / 32
    }
}

/// From this many values [`ActsQ8::quantize_rows_plain`] splits its pieces over the
/// threads (a norm's own threshold: the producers cost more per value than quantising).
const ROWS_PAR_MIN_VALUES: usize = 2048;

/// The widest piece of a row [`ActsQ8::quantize_rows_plain`] gives a task (SwiGLU's
/// chunk; a multiple of 32).
const PIECE_VALUES: usize = 2048;

impl ActsQ8K {
    /// Quantises `x` = (n, cols); `cols` must be a multiple of 256 and `x.len()` of `cols`.
    pub fn quantize(x: &[f32], cols: usize) -> Self {
        let nb = x.len() / 256;
        let mut acts = ActsQ8K { cols, qs: vec![0; nb * 256], d: vec![0.0; nb], bsums: vec![0; nb * 16] };
        let avx2 = has_avx2();
        split_rows(x, cols, &mut acts.qs, (&mut acts.d, cols / 256), (&mut acts.bsums, cols / 16), |x, qs, d, bs| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2 and FMA were detected on this CPU.
                return unsafe { quantize_q8k_avx2(x, qs, d, bs) };
            }
            let _ = avx2;
            quantize_q8k_body(x, qs, d, bs)
        });
        acts
    }

    /// Super-blocks per row.
    pub fn row_blocks(&self) -> usize {
        self.cols / 256
    }
}
