//! AVX2 row kernels of the CPU matmul for Q4_0, Q4_1, Q8_0 and the float types.
//!
//! Same arithmetic as `matmul_scalar.rs`, bit for bit for Q4_0, Q4_1 and Q8_0 (the same
//! eight i32 lanes per block, FMA chains and final horizontal sum; for the float types
//! only the order of the f32 additions differs). Per 32-value block: unpack the weight quants to
//! 32 bytes, `maddubs` (u8 × i8 → pairs summed in i16, which cannot saturate here:
//! |pair| <= 2·15·127 for nibbles, 2·128·127 for Q8_0), `madd` with ones (→ 8 × i32),
//! convert and FMA with `d_w · d_x`. One token takes `q8_kernel!` a row at a time; several
//! take the token-group kernel of `simd_q8_tile.rs`, which unpacks each weight block once
//! for up to 4 tokens here (8 with AVX-512VL's registers, `simd_vnni.rs`).
//!
//! Every function here needs AVX2, FMA and F16C; `matmul.rs` only hands them out through
//! a constructed `Isa`, which checked the CPU.

use std::arch::x86_64::*;

use super::q8_tile::q8_tile_kernel;
use super::ActsF32;
use crate::quant::q8::{ActsQ8, TOKEN_GROUP};

/// Horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The two f16 at `p[0..4]` (a block's `d` and, for Q4_1, `m`) as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The two f16 at `p[0..4]` as f32 lanes 0 and 1 (lanes 2 and 3 zero).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn f16_lanes(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(p as *const i32)))
}

/// The f16 at `p[0..2]` as f32. Written in asm because with intrinsics the compiler
/// narrows the conversion to one lane and merges the load into a stale register (a
/// `vpinsrw` into, say, an accumulator), which chains every block onto the previous
/// one and halves the kernel's speed; `vmovd` writes the whole register.
#[inline]
pub(crate) unsafe fn f16_load(p: *const u8) -> f32 {
    let bits = u32::from(std::ptr::read_unaligned(p as *const u16));
    let out: f32;
    // SAFETY: register-only instructions; callers hold F16C (checked by `Isa`).
    std::arch::asm!(
        "vmovd {v}, {b:e}",
        "vcvtph2ps {v}, {v}",
        b = in(reg) bits,
        v = out(xmm_reg) out,
        options(pure, nomem, nostack, preserves_flags),
    );
    out
}

/// 16 bytes of nibble pairs at `p` as 32 bytes: values 0-15 (low nibbles) then 16-31.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn nibbles(p: *const u8) -> __m256i {
    // Broadcast-load (no shuffle), then shift only the upper half right by 4.
    let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
    let q = _mm256_srlv_epi32(q, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0));
    _mm256_and_si256(q, _mm256_set1_epi8(0x0F))
}

/// Σ over 32 lanes of u8 × i8, as 8 i32 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_u8i8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
}

/// Σ over 32 lanes of i8 × i8 (Q8_0 weights), as 8 i32 lanes: w's sign moves onto x,
/// |w| · sign(w)·x (|-128| = 128 as u8).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot_i8i8(w: __m256i, x: __m256i) -> __m256i {
    dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
}

/// One kernel body per weight type: one row against one token's activations, one FMA
/// chain per lane over the row's blocks (ggml's order). `$unpack(blk)` gives (32 quant
/// bytes, d, offset coefficient); the block adds `coef · s_x` when `$offset`; `$mul(w, x)`
/// gives the i32 lanes of the block's integer dot; `$feat` the target features it is
/// compiled for. Several tokens take `simd_q8_tile.rs` instead. (Interleaving two rows or
/// two accumulator sets measured slower or no faster at decode; see `tiled!`.)
macro_rules! q8_kernel {
    ($feat:literal, $name:ident, $bytes:expr, $offset:expr, |$blk:ident| $unpack:block, |$wv:ident, $xv:ident| $mul:block) => {
        /// The row at `w` against token `t`; returns its output.
        #[target_feature(enable = $feat)]
        unsafe fn $name(w: *const u8, a: &ActsQ8, t: usize) -> f32 {
            let nb = a.row_blocks();
            let (xq, xd, xs) = (a.qs.as_ptr().add(t * a.cols), a.d.as_ptr().add(t * nb), a.s.as_ptr().add(t * nb));
            let mut acc = _mm256_setzero_ps();
            let mut accm = 0.0f32;
            for b in 0..nb {
                let $blk = w.add(b * $bytes);
                let (wv, wd, wm): (__m256i, f32, f32) = $unpack;
                let $xv = _mm256_loadu_si256(xq.add(b * 32) as *const __m256i);
                let $wv = wv;
                let p: __m256i = $mul;
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd * *xd.add(b)), acc);
                if $offset {
                    accm = wm.mul_add(*xs.add(b), accm);
                }
            }
            hsum(acc) + accm
        }
    };
}
pub(crate) use q8_kernel;

/// The Q4_0, Q4_1 and Q8_0 micro-kernels for one instruction set: `$features` is its
/// target-feature list, `$dot` its u8 × i8 block dot product (32 bytes to 8 i32 lanes)
/// and `$dot_i8` / `$dot_i8_tile` its i8 × i8 ones (Q8_0) for one token and for tiles.
/// The AVX2 and AVX512-VNNI paths differ only in those two.
macro_rules! q8_family {
    ($features:literal, $dot:ident, $dot_i8:ident, $dot_i8_tile:ident, $tile_tokens:literal) => {
        // Q4_0: unsigned nibbles q in 0..16, value d·(q - 8): the -8 goes to the s_x term.
        q8_kernel!(
            $features,
            q4_0_rn,
            18,
            true,
            |blk| {
                let d = f16_load(blk);
                (nibbles(blk.add(2)), d, -8.0 * d)
            },
            |w, x| { $dot(w, x) }
        );
        // Q4_1: value d·q + m.
        q8_kernel!(
            $features,
            q4_1_rn,
            20,
            true,
            |blk| {
                let (d, m) = f16_pair(blk);
                (nibbles(blk.add(4)), d, m)
            },
            |w, x| { $dot(w, x) }
        );
        // Q8_0: both sides signed, so move w's sign onto x: |w| · sign(w)·x
        // (|-128| = 128 as u8).
        q8_kernel!(
            $features,
            q8_0_rn,
            34,
            false,
            |blk| {
                let d = f16_load(blk);
                (_mm256_loadu_si256(blk.add(2) as *const __m256i), d, 0.0)
            },
            |w, x| { $dot_i8(w, x) }
        );
        q8_tile_kernel!(
            $features,
            q4_0_tile,
            18,
            true,
            |blk| { (nibbles(blk.add(2)), f16_lanes(blk)) },
            |dm| { _mm_mul_ps(_mm_set1_ps(-8.0), _mm_broadcastss_ps(dm)) },
            |w, x| { $dot(w, x) }
        );
        q8_tile_kernel!(
            $features,
            q4_1_tile,
            20,
            true,
            |blk| { (nibbles(blk.add(4)), f16_lanes(blk)) },
            |dm| { _mm_permute_ps(dm, 0b0101_0101) },
            |w, x| { $dot(w, x) }
        );
        q8_tile_kernel!(
            $features,
            q8_0_tile,
            34,
            false,
            |blk| { (_mm256_loadu_si256(blk.add(2) as *const __m256i), f16_lanes(blk)) },
            |dm| { dm },
            |w, x| { $dot_i8_tile(w, x) }
        );
        tiled!(row_q4_0, q4_0_rn, q4_0_tile, 18, $tile_tokens);
        tiled!(row_q4_1, q4_1_rn, q4_1_tile, 20, $tile_tokens);
        tiled!(row_q8_0, q8_0_rn, q8_0_tile, 34, $tile_tokens);
    };
}
pub(crate) use q8_family;

/// Checks the lengths the raw-pointer micro-kernels rely on; returns the row count.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_q8(
    w: &[u8],
    row_bytes: usize,
    block_bytes: usize,
    a: &ActsQ8,
    t0: usize,
    tn: usize,
    out: &[f32],
    stride: usize,
) -> usize {
    let nb = a.row_blocks();
    let rows = w.len() / row_bytes.max(1);
    assert!(
        row_bytes == nb * block_bytes
            && w.len() == rows * row_bytes
            && a.qs.len() >= (t0 + tn) * a.cols
            && a.d.len() >= (t0 + tn) * nb
            && a.s.len() >= (t0 + tn) * nb
            && (rows == 0 || tn == 0 || out.len() >= (rows - 1) * stride + tn)
            && (tn <= 1
                || (t0.is_multiple_of(TOKEN_GROUP)
                    && a.d4.len() >= (t0 + tn).div_ceil(TOKEN_GROUP) * nb * TOKEN_GROUP
                    && a.s4.len() == a.d4.len()))
    );
    rows
}

/// Tiles rows × tokens into micro-kernel calls: one row at a time for a single token
/// (decode: reading several rows at once defeats the hardware prefetcher and halves
/// the speed of streaming weights from DRAM), one row × `$tile_tokens` tokens otherwise
/// (`simd_q8_tile.rs`; a second row per tile measured slower on Zen 4).
// Every variant keeps one FMA chain per lane and (row, token), so a token's result is
// bit-identical whatever tile it lands in: batch invariance (a sequence's tokens do not
// depend on what else is in the batch) rests on this. It is also the order of the scalar
// kernels and of ggml's x86 `vec_dot`, which the CPU engine reproduces bit for bit.
macro_rules! tiled {
    ($pub_name:ident, $rn:ident, $tile:ident, $bytes:expr, $tile_tokens:literal) => {
        pub(crate) unsafe fn $pub_name(
            w: &[u8],
            row_bytes: usize,
            a: &ActsQ8,
            t0: usize,
            tn: usize,
            out: &mut [f32],
            stride: usize,
        ) {
            let rows = check_q8(w, row_bytes, $bytes, a, t0, tn, out, stride);
            let (wp, op) = (w.as_ptr(), out.as_mut_ptr());
            if tn == 1 {
                for r in 0..rows {
                    *op.add(r * stride) = $rn(wp.add(r * row_bytes), a, t0);
                }
                return;
            }
            let mut t = 0;
            while t < tn {
                let nt = (tn - t).min($tile_tokens);
                macro_rules! rows_of {
                    ($n:literal) => {
                        for r in 0..rows {
                            $tile::<$n>(wp.add(r * row_bytes), a, t0 + t, op.add(r * stride + t));
                        }
                    };
                }
                match nt {
                    1 => rows_of!(1),
                    2 => rows_of!(2),
                    3 => rows_of!(3),
                    4 => rows_of!(4),
                    5 => rows_of!(5),
                    6 => rows_of!(6),
                    7 => rows_of!(7),
                    _ => rows_of!(8),
                }
                t += nt;
            }
        }
    };
}

pub(crate) use tiled;

// Tiles of one row × 4 tokens: AVX2's 16 registers hold the four accumulators and the
// four tokens' activations (two rows × 4 spilled: 107 vs 193 GFLOP/s, Q4_1 n = 64).
q8_family!("avx2,fma,f16c", dot_u8i8, dot_i8i8, dot_i8i8, 4);

/// Expands a one-row kernel generic over the token count (1..=4) into a one-row function
/// over any number of tokens.
macro_rules! grouped {
    ($name:ident, $n_fn:ident, $acts:ty) => {
        /// See the module docs; `out[i]` gets token `t0 + i`.
        unsafe fn $name(w: &[u8], a: &$acts, t0: usize, out: &mut [f32]) {
            let mut t = t0;
            for o in out.chunks_mut(4) {
                match o.len() {
                    4 => $n_fn::<4>(w, a, t, o),
                    3 => $n_fn::<3>(w, a, t, o),
                    2 => $n_fn::<2>(w, a, t, o),
                    _ => $n_fn::<1>(w, a, t, o),
                }
                t += o.len();
            }
        }
    };
}
pub(crate) use grouped;

/// f32 dot of one float-typed weight row with each token: `$load(p)` gives the 8
/// weights at pointer `p` as f32 lanes, `$one(q)` the single weight at `q` (the tail).
macro_rules! float_kernel {
    ($name:ident, $elem:expr, |$p:ident| $load:block, |$q:ident| $one:block) => {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name(w: &[u8], a: &ActsF32<'_>, t0: usize, out: &mut [f32]) {
            let cols = a.cols;
            assert!(w.len() == cols * $elem && a.x.len() >= (t0 + out.len()) * cols);
            let wp = w.as_ptr();
            for (j, o) in out.iter_mut().enumerate() {
                let x = a.x.as_ptr().add((t0 + j) * cols);
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut c = 0;
                while c + 32 <= cols {
                    for k in 0..4 {
                        let $p = wp.add((c + 8 * k) * $elem);
                        let wv: __m256 = $load;
                        acc[k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(c + 8 * k)), acc[k]);
                    }
                    c += 32;
                }
                while c + 8 <= cols {
                    let $p = wp.add(c * $elem);
                    let wv: __m256 = $load;
                    acc[0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(c)), acc[0]);
                    c += 8;
                }
                let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
                while c < cols {
                    let $q = wp.add(c * $elem);
                    let wi: f32 = $one;
                    sum += wi * *x.add(c);
                    c += 1;
                }
                *o = sum;
            }
        }
    };
}

float_kernel!(f32_row, 4, |p| { _mm256_loadu_ps(p as *const f32) }, |q| { std::ptr::read_unaligned(q as *const f32) });

float_kernel!(f16_row, 2, |p| { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }, |q| { f16_load(q) });

float_kernel!(
    bf16_row,
    2,
    |p| {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    },
    |q| { crate::quant::bf16_to_f32(std::ptr::read_unaligned(q as *const u16)) }
);

per_row!(row_f32, f32_row, ActsF32<'_>);
per_row!(row_f16, f16_row, ActsF32<'_>);
per_row!(row_bf16, bf16_row, ActsF32<'_>);
