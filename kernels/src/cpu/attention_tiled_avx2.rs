//! AVX2 (+FMA, F16C) kernel of [`super::attention_tiled`]: `G` query rows of one token
//! that share a kv head, the query and the tile's state in registers, `head_dim / 8`
//! registers of eight lanes per row.
//!
//! Per tile of sixteen positions: each position's K row is widened once and dotted with
//! all `G` queries (two FMA chains per row); eight positions' dot vectors are reduced
//! together (`hadd` tree, one register of eight scores, then times the scale); the next
//! tile's K and V rows are prefetched; the weights are `e^(s - M)`
//! eight lanes at a time; the V pass goes over the dimensions eight at a time, and for
//! each over the tile's positions, so only `G` accumulators are live.
//!
//! `e^x` for `x` in [-87, 0]: `n = round(x · log2 e)`, `b = x - n · ln 2` (two parts),
//! a degree-5 polynomial in `b` (the coefficients of `exp_ggml.rs`), times `2^n` built
//! from its exponent bits (`n >= -126`: a normal f32).

use std::arch::x86_64::*;

use super::{RowInputs, EXP_MIN, TILE};
use crate::cpu::attention_x86::{by_head_dim_and_rows, hsum, round_f16, widen8};
use crate::cpu::exp_ggml::{C0, C1, C2, C3, C4, LN2_HI, LN2_LO, LOG2E, SHIFT};

/// The kernels for one set of target features: AVX2 + FMA + F16C, and the same code with
/// AVX-512VL enabled, where the compiler has 32 vector registers (the queries stay in
/// registers). The same instructions' arithmetic, so the same bits.
macro_rules! kernels {
    ($feat:literal, $attend:ident, $vj:literal) => {
        /// `G` rows: `rows.q`, `out` `[G, 8 * NV]`.
        ///
        /// # Safety
        /// The CPU must have the features of `$feat`.
        #[target_feature(enable = $feat)]
        unsafe fn $attend<const NV: usize, const G: usize>(rows: RowInputs, out: &mut [f32]) {
            const VJ: usize = $vj;
            let hd = 8 * NV;
            assert!(NV % 2 == 0 && rows.q.len() == G * hd && out.len() == G * hd);
            let (kc, vc) = (rows.k_cache, rows.v_cache);
            let sc = _mm256_set1_ps(rows.scale);
            // The queries rounded to f16 (nearest, ties to even) and widened back.
            let mut qv = [[_mm256_setzero_ps(); NV]; G];
            for (g, qg) in qv.iter_mut().enumerate() {
                for (j, r) in qg.iter_mut().enumerate() {
                    *r = round_f16(_mm256_loadu_ps(rows.q.as_ptr().add(g * hd + 8 * j)));
                }
            }
            let mut acc = [[_mm256_setzero_ps(); NV]; G];
            let (mut m, mut l) = ([f32::NEG_INFINITY; G], [0.0f32; G]);
            let (mut offs, mut next) = ([0usize; TILE], [0usize; TILE]);
            let mut w = [[0.0f32; TILE]; G];
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let mut n = rows.tile_offsets(0, &mut offs);
            for p0 in (0..rows.positions).step_by(TILE) {
                for &o in &offs[..n] {
                    assert!(o + hd <= kc.len() && o + hd <= vc.len());
                }
                // The next tile's K and V rows are fetched while this one is computed (a
                // step's caches do not fit in the CPU's: without this the loads wait).
                let n_next = if p0 + TILE < rows.positions { rows.tile_offsets(p0 + TILE, &mut next) } else { 0 };
                for &o in &next[..n_next] {
                    for line in (0..hd).step_by(32) {
                        _mm_prefetch::<_MM_HINT_T0>(kc.as_ptr().add(o + line) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(vc.as_ptr().add(o + line) as *const i8);
                    }
                }
                // Scores, eight positions per register; lanes past `n` are -inf (and
                // weigh nothing below).
                let mut s = [[_mm256_setzero_ps(); 2]; G];
                let mut live = [_mm256_setzero_ps(); 2];
                for h in 0..2 {
                    let mut d = [[_mm256_setzero_ps(); 8]; G];
                    for i in 0..8.min(n.saturating_sub(8 * h)) {
                        let kp = kc.as_ptr().add(offs[8 * h + i]);
                        let (mut a0, mut a1) = ([_mm256_setzero_ps(); G], [_mm256_setzero_ps(); G]);
                        for j in (0..NV).step_by(2) {
                            let (k0, k1) = (widen8(kp.add(8 * j)), widen8(kp.add(8 * j + 8)));
                            for g in 0..G {
                                a0[g] = _mm256_fmadd_ps(qv[g][j], k0, a0[g]);
                                a1[g] = _mm256_fmadd_ps(qv[g][j + 1], k1, a1[g]);
                            }
                        }
                        for g in 0..G {
                            d[g][i] = _mm256_add_ps(a0[g], a1[g]);
                        }
                    }
                    // Lane `i` holds position `8h + i`: live below `n`.
                    let left = _mm256_set1_epi32(n.saturating_sub(8 * h) as i32);
                    live[h] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(left, lane));
                    for g in 0..G {
                        s[g][h] = _mm256_blendv_ps(
                            _mm256_set1_ps(f32::NEG_INFINITY),
                            _mm256_mul_ps(sum8x8(&d[g]), sc),
                            live[h],
                        );
                    }
                }
                for g in 0..G {
                    // The maximum skips NaN scores, as `f32::max` in the scalar rows does.
                    let tmax = hmax(_mm256_max_ps(no_nan(s[g][0]), no_nan(s[g][1])));
                    if tmax > m[g] {
                        let corr = (m[g] - tmax).exp();
                        m[g] = tmax;
                        l[g] *= corr;
                        let cv = _mm256_set1_ps(corr);
                        for a in acc[g].iter_mut() {
                            *a = _mm256_mul_ps(*a, cv);
                        }
                    }
                    if m[g] == f32::NEG_INFINITY {
                        w[g] = [0.0; TILE];
                        continue;
                    }
                    let mv = _mm256_set1_ps(m[g]);
                    let mut sum = _mm256_setzero_ps();
                    for h in 0..2 {
                        // Lanes past `n` weigh nothing (not `e^-87`); a NaN score's weight
                        // is NaN.
                        let e = _mm256_and_ps(exp_nonpos(_mm256_sub_ps(s[g][h], mv)), live[h]);
                        _mm256_storeu_ps(w[g].as_mut_ptr().add(8 * h), e);
                        sum = _mm256_add_ps(sum, e);
                    }
                    l[g] += hsum(sum);
                }
                // `VJ` registers of each row's accumulator at a time (each weight is
                // broadcast once per `VJ`); every lane still adds the positions in order.
                for j0 in (0..NV).step_by(VJ) {
                    let mut a: [[__m256; VJ]; G] = std::array::from_fn(|g| std::array::from_fn(|j| acc[g][j0 + j]));
                    for (p, &o) in offs[..n].iter().enumerate() {
                        let v: [__m256; VJ] = std::array::from_fn(|j| widen8(vc.as_ptr().add(o + 8 * (j0 + j))));
                        for g in 0..G {
                            let wv = _mm256_set1_ps(w[g][p]);
                            for j in 0..VJ {
                                a[g][j] = _mm256_fmadd_ps(wv, v[j], a[g][j]);
                            }
                        }
                    }
                    for g in 0..G {
                        for j in 0..VJ {
                            acc[g][j0 + j] = a[g][j];
                        }
                    }
                }
                // A row with no finite score yet has summed nothing (the scalar rows skip
                // its V pass): zero weights times a non-finite V must not count.
                for g in 0..G {
                    if m[g] == f32::NEG_INFINITY {
                        acc[g] = [_mm256_setzero_ps(); NV];
                    }
                }
                (offs, n) = (next, n_next);
            }
            for g in 0..G {
                let inv = _mm256_set1_ps(if l[g] == 0.0 { 0.0 } else { 1.0 / l[g] });
                for (j, a) in acc[g].iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + 8 * j), _mm256_mul_ps(*a, inv));
                }
            }
        }
    };
}

kernels!("avx2,fma,f16c", attend_avx2, 2);
kernels!("avx2,fma,f16c,avx512f,avx512vl", attend_avx512vl, 4);

/// Runs the kernel for `head_dim` `hd` (64, 128 or 256) and `g` (1 to 4) rows, compiled
/// with AVX-512VL if `avx512vl`. Panics on other sizes (the caller picks from these).
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, and AVX-512F/VL if `avx512vl`.
pub(super) unsafe fn attend(avx512vl: bool, hd: usize, g: usize, rows: RowInputs, out: &mut [f32]) {
    // SAFETY: the features by the caller's contract.
    unsafe {
        if avx512vl {
            by_head_dim_and_rows!("attention_tiled", attend_avx512vl, hd, g, (rows, out))
        } else {
            by_head_dim_and_rows!("attention_tiled", attend_avx2, hd, g, (rows, out))
        }
    }
}

/// Lane `i` of the result: the sum of `v[i]`'s eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn sum8x8(v: &[__m256; 8]) -> __m256 {
    // Pairwise: [v0 01, v0 23, v1 01, v1 23 | v0 45, v0 67, v1 45, v1 67], ...
    let a0 = _mm256_hadd_ps(v[0], v[1]);
    let a1 = _mm256_hadd_ps(v[2], v[3]);
    let a2 = _mm256_hadd_ps(v[4], v[5]);
    let a3 = _mm256_hadd_ps(v[6], v[7]);
    // [v0 0..4, v1 0..4, v2 0..4, v3 0..4 | the same of lanes 4..8], and v4..v7.
    let b0 = _mm256_hadd_ps(a0, a1);
    let b1 = _mm256_hadd_ps(a2, a3);
    let lo = _mm256_permute2f128_ps::<0x20>(b0, b1);
    let hi = _mm256_permute2f128_ps::<0x31>(b0, b1);
    _mm256_add_ps(lo, hi)
}

/// `v` with its NaN lanes replaced by -inf.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn no_nan(v: __m256) -> __m256 {
    _mm256_blendv_ps(v, _mm256_set1_ps(f32::NEG_INFINITY), _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v))
}

/// The largest of the eight lanes (of NaN-free lanes: `max_ps` is not symmetric in NaN).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hmax(v: __m256) -> f32 {
    let r4 = _mm_max_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r2 = _mm_max_ps(r4, _mm_movehl_ps(r4, r4));
    _mm_cvtss_f32(_mm_max_ss(r2, _mm_movehdup_ps(r2)))
}

/// `e^x` of each lane for `x <= 0` (see the module docs); below [`EXP_MIN`] as at it, a
/// NaN stays NaN.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn exp_nonpos(x: __m256) -> __m256 {
    // `max_ps` returns its second operand when either is NaN.
    let x = _mm256_max_ps(_mm256_set1_ps(EXP_MIN), x);
    let n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(SHIFT)), _mm256_set1_ps(SHIFT));
    let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), b);
    let u = _mm256_mul_ps(b, b);
    let f = _mm256_set1_ps;
    let p = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(f(C4), b, f(C3)), u, _mm256_fmadd_ps(f(C2), b, f(C1))),
        u,
        _mm256_fmadd_ps(f(C0), b, f(1.0)),
    );
    // 2^n for n in [-126, 0]: the exponent field n + 127.
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(pow2))
}
