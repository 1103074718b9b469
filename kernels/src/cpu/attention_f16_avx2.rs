//! AVX2 (+FMA, F16C) body of one (token, head) row of [`super::attention_f16`]: the same
//! steps as the scalar row, bit for bit, with the query and the f16 accumulator held in
//! registers (`head_dim / 8` lanes of 8) instead of going through slices.
//!
//! Why it is bit-identical:
//! - f16 -> f32 (`vcvtph2ps`) is exact; f32 -> f16 (`vcvtps2ph`, immediate 0) rounds to
//!   nearest, ties to even, overflowing to infinity and rounding into f16 subnormals,
//!   as `half`'s conversion does (tests compare the two on every kind of f32).
//! - The score dot keeps the 64 lane sums of the scalar `dot_lanes` as eight 8-lane
//!   registers (register `j` holds lanes `8j..8j+8`) and reduces them in its order:
//!   lanes `l, 32+l, 16+l, 48+l` of the 16-lane halves are registers 0, 4, 2, 6 (low
//!   eight) and 1, 5, 3, 7 (high eight), then high + low eight, four, two, one.
//! - Everything after the score (the running maximum, `e^x` from the C library, the
//!   scale-and-round on a new maximum, the FMA-and-round per position, the final
//!   `1 / S`) is the scalar code's f32 operation per lane.
//!
//! Needs `head_dim % 64 == 0` (the dot has no tail here); callers check that and the
//! CPU features (see `Isa`).

use std::arch::x86_64::*;

use super::RowInputs;
use crate::cpu::attention_x86::{by_head_dim_and_rows, hsum, round_f16, widen8};

/// The kernels for one set of target features: AVX2 + FMA + F16C, and the same code with
/// AVX-512VL enabled, where the compiler has 32 vector registers instead of 16 (the
/// group's accumulators then stay in registers). Same instructions' arithmetic, so the
/// same bits.
macro_rules! kernels {
    ($feat:literal, $attend:ident) => {
        /// `G` output rows that read the same kv head at the same positions (query heads
        /// of one GQA group, consecutive): `rows.q`, `out` `[G, 8 * NV]`. Each row's steps
        /// are those of the scalar row; the rows share the K/V loads and interleave their
        /// dependency chains.
        ///
        /// # Safety
        /// The CPU must have the features of `$feat`.
        #[target_feature(enable = $feat)]
        unsafe fn $attend<const NV: usize, const G: usize>(rows: RowInputs, out: &mut [f32]) {
            let RowInputs { q, k_cache, v_cache, slots, scale } = rows;
            let hd = 8 * NV;
            assert!(NV % 8 == 0 && q.len() == G * hd && out.len() == G * hd);
            let mut qv = [[_mm256_setzero_ps(); NV]; G];
            for (g, qg) in qv.iter_mut().enumerate() {
                for (j, r) in qg.iter_mut().enumerate() {
                    *r = round_f16(_mm256_loadu_ps(q.as_ptr().add(g * hd + 8 * j)));
                }
            }
            let mut acc = [[_mm256_setzero_ps(); NV]; G];
            let (mut m, mut sum) = ([f32::NEG_INFINITY; G], [0.0f32; G]);
            let mut kv = [_mm256_setzero_ps(); NV];
            for off in slots {
                assert!(off + hd <= k_cache.len() && off + hd <= v_cache.len());
                let (kp, vp) = (k_cache.as_ptr().add(off), v_cache.as_ptr().add(off));
                for (j, r) in kv.iter_mut().enumerate() {
                    *r = widen8(kp.add(8 * j));
                }
                let mut wv = [_mm256_setzero_ps(); G];
                for g in 0..G {
                    let s = dot(&qv[g], &kv) * scale;
                    let (mut ms, mut w) = (1.0f32, 1.0f32);
                    if s > m[g] {
                        ms = (m[g] - s).exp();
                        m[g] = s;
                        let msv = _mm256_set1_ps(ms);
                        for a in acc[g].iter_mut() {
                            *a = round_f16(_mm256_mul_ps(*a, msv));
                        }
                    } else {
                        w = (s - m[g]).exp();
                    }
                    wv[g] = _mm256_set1_ps(w);
                    sum[g] = sum[g].mul_add(ms, w);
                }
                for (j, r) in kv.iter_mut().enumerate() {
                    *r = widen8(vp.add(8 * j));
                }
                for g in 0..G {
                    for (a, &v) in acc[g].iter_mut().zip(&kv) {
                        *a = round_f16(_mm256_fmadd_ps(v, wv[g], *a));
                    }
                }
            }
            for g in 0..G {
                let inv = _mm256_set1_ps(if sum[g] == 0.0 { 0.0 } else { 1.0 / sum[g] });
                for (j, a) in acc[g].iter().enumerate() {
                    _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + 8 * j), _mm256_mul_ps(*a, inv));
                }
            }
        }
    };
}

kernels!("avx2,fma,f16c", attend_avx2);
kernels!("avx2,fma,f16c,avx512f,avx512vl", attend_avx512vl);

/// Runs the kernel for `head_dim` `hd` (64, 128 or 256) and `g` (1 to 4) rows, compiled
/// with AVX-512VL if `avx512vl`. Panics on other sizes (the caller picks from these).
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, and AVX-512F/VL if `avx512vl`.
pub(super) unsafe fn attend(avx512vl: bool, hd: usize, g: usize, rows: RowInputs, out: &mut [f32]) {
    if avx512vl {
        by_head_dim_and_rows!("attention_f16", attend_avx512vl, hd, g, (rows, out))
    } else {
        by_head_dim_and_rows!("attention_f16", attend_avx2, hd, g, (rows, out))
    }
}

/// `Σ q[i]·k[i]` over `8 * NV` values (`NV % 8 == 0`) in `dot_lanes`'s order; both hold
/// f16 values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot<const NV: usize>(q: &[__m256; NV], k: &[__m256; NV]) -> f32 {
    let mut l = [_mm256_setzero_ps(); 8];
    for j in 0..NV {
        l[j % 8] = _mm256_fmadd_ps(q[j], k[j], l[j % 8]);
    }
    let lo = _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7]));
    hsum(_mm256_add_ps(hi, lo))
}
