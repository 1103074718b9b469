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

use half::f16;

use super::Slots;

/// The 8 f16 at `p` as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen8(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Each lane rounded to f16 (nearest, ties to even) and widened back.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn round_f16(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// `Σ q[i]·k[i]` over `8 * NV` values (`NV % 8 == 0`) in `dot_lanes`'s order; `q` holds
/// f16 values, `k` points at f16.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot<const NV: usize>(q: &[__m256; NV], k: *const f16) -> f32 {
    let mut l = [_mm256_setzero_ps(); 8];
    for j in 0..NV {
        l[j % 8] = _mm256_fmadd_ps(q[j], widen8(k.add(8 * j)), l[j % 8]);
    }
    let lo = _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7]));
    let r8 = _mm256_add_ps(hi, lo);
    let r4 = _mm_add_ps(_mm256_extractf128_ps::<1>(r8), _mm256_castps256_ps128(r8));
    // [r0 + r2, r1 + r3, ..], then lane 0 + lane 1.
    let r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
    _mm_cvtss_f32(_mm_add_ss(r2, _mm_movehdup_ps(r2)))
}

/// One output row: `q`, `out` `[8 * NV]`; `slots` gives the cache offset of this head's
/// K/V row at each position of the context, in order.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_row<const NV: usize>(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    slots: Slots,
    scale: f32,
    out: &mut [f32],
) {
    let hd = 8 * NV;
    assert!(NV % 8 == 0 && q.len() == hd && out.len() == hd);
    let mut qv = [_mm256_setzero_ps(); NV];
    for (j, r) in qv.iter_mut().enumerate() {
        *r = round_f16(_mm256_loadu_ps(q.as_ptr().add(8 * j)));
    }
    let mut acc = [_mm256_setzero_ps(); NV];
    let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
    for off in slots {
        assert!(off + hd <= k_cache.len() && off + hd <= v_cache.len());
        let s = dot(&qv, k_cache.as_ptr().add(off)) * scale;
        let (mut ms, mut w) = (1.0f32, 1.0f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            let msv = _mm256_set1_ps(ms);
            for a in acc.iter_mut() {
                *a = round_f16(_mm256_mul_ps(*a, msv));
            }
        } else {
            w = (s - m).exp();
        }
        let (wv, vp) = (_mm256_set1_ps(w), v_cache.as_ptr().add(off));
        for (j, a) in acc.iter_mut().enumerate() {
            *a = round_f16(_mm256_fmadd_ps(widen8(vp.add(8 * j)), wv, *a));
        }
        sum = sum.mul_add(ms, w);
    }
    let inv = _mm256_set1_ps(if sum == 0.0 { 0.0 } else { 1.0 / sum });
    for (j, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), _mm256_mul_ps(*a, inv));
    }
}

#[cfg(test)]
mod tests {
    use std::arch::x86_64::*;

    use half::f16;

    use super::round_f16;

    /// f32 -> f16 -> f32 with nearest-even rounding, from the f16 format's definition:
    /// the value's f16 quantum is `2^(e - 10)` for exponent `e >= -14`, `2^-24` below
    /// (subnormals); a magnitude that rounds to `2^16` or more is infinity.
    fn reference(x: f32) -> f32 {
        if x.is_nan() {
            return f32::NAN;
        }
        let a = f64::from(x.abs());
        let e = ((x.to_bits() >> 23) & 0xff) as i32 - 127;
        let quantum = 2f64.powi(if a < 2f64.powi(-14) { -24 } else { e - 10 });
        let r = (a / quantum).round_ties_even() * quantum;
        let r = if r >= 65536.0 { f64::INFINITY } else { r };
        (r as f32).copysign(x)
    }

    fn check(bits: impl Iterator<Item = u32>) -> usize {
        let mut n = 0;
        let mut lanes = [0f32; 8];
        let mut batch = Vec::with_capacity(8);
        let mut flush = |batch: &mut Vec<f32>, n: &mut usize| {
            let mut x = [0f32; 8];
            x[..batch.len()].copy_from_slice(batch);
            // SAFETY: the caller checked the CPU features.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), round_f16(_mm256_loadu_ps(x.as_ptr()))) };
            for (&v, &got) in batch.iter().zip(&lanes) {
                let (want, by_half) = (reference(v), f16::from_f32(v).to_f32());
                let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
                assert!(same(got, want), "{v:e} ({:#x}): simd {got:e}, reference {want:e}", v.to_bits());
                assert!(same(by_half, want), "{v:e}: half {by_half:e}, reference {want:e}");
                *n += 1;
            }
            batch.clear();
        };
        for b in bits {
            batch.push(f32::from_bits(b));
            if batch.len() == 8 {
                flush(&mut batch, &mut n);
            }
        }
        if !batch.is_empty() {
            flush(&mut batch, &mut n);
        }
        n
    }

    #[test]
    fn round_f16_matches_the_f16_format_and_half() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            return;
        }
        // A sparse sweep of every f32 (both signs, NaN and infinity included), then every
        // f32 of the binades where f16 overflows (2^15), turns subnormal (2^-15, 2^-14)
        // and underflows to zero (2^-25, 2^-24), each sign.
        let mut n = check((0..=u32::MAX).step_by(9973));
        for e in [15i32, -14, -15, -24, -25] {
            let base = ((e + 127) as u32) << 23;
            n += check((base..base + (1 << 23)).step_by(3).flat_map(|b| [b, b | 0x8000_0000]));
        }
        assert!(n > 10_000_000);
    }
}
