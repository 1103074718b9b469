//! x86 pieces shared by the register kernels of the two f16-cache attentions
//! (`attention_f16_avx2.rs`, `attention_tiled_avx2.rs`): f16 loads and rounding, a lane
//! sum, and the dispatch from run-time sizes to their const-generic variants.

use std::arch::x86_64::*;

use half::f16;

/// Calls `$f::<head_dim / 8, g>$args` for `$hd` (head_dim) 64, 128 or 256 and `$g` (query
/// rows per call) 1 to 4; panics on other sizes (callers pick from these).
macro_rules! by_head_dim_and_rows {
    ($op:literal, $f:ident, $hd:expr, $g:expr, $args:tt) => {
        match ($hd, $g) {
            (64, 1) => $f::<8, 1> $args,
            (64, 2) => $f::<8, 2> $args,
            (64, 3) => $f::<8, 3> $args,
            (64, 4) => $f::<8, 4> $args,
            (128, 1) => $f::<16, 1> $args,
            (128, 2) => $f::<16, 2> $args,
            (128, 3) => $f::<16, 3> $args,
            (128, 4) => $f::<16, 4> $args,
            (256, 1) => $f::<32, 1> $args,
            (256, 2) => $f::<32, 2> $args,
            (256, 3) => $f::<32, 3> $args,
            (256, 4) => $f::<32, 4> $args,
            (hd, g) => panic!("{} register kernel: no variant for head_dim {hd} x {g} rows", $op),
        }
    };
}
pub(crate) use by_head_dim_and_rows;

/// The 8 f16 at `p` as f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn widen8(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Each lane rounded to f16 (nearest, ties to even) and widened back.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn round_f16(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// The sum of the eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) fn hsum(v: __m256) -> f32 {
    let r4 = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
    let r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
    _mm_cvtss_f32(_mm_add_ss(r2, _mm_movehdup_ps(r2)))
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
