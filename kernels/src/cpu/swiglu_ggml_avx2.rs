//! [`super::activation::silu_mul_ggml_inplace`] eight values at a time (AVX2 + FMA):
//! `exp_ggml`'s steps lane by lane, so every output equals the scalar
//! `silu_ggml(g) * u` bit for bit.
//!
//! The scalar `p · 2^n` (see `exp_ggml.rs`) multiplies by an exact power of two for
//! `-126 <= n <= 127`; here that power is built from `n`'s bits. `|n| > 192` gives
//! `+inf` / `0` by a blend. The few vectors with a lane in between (`|x|` roughly
//! 88 to 133, where `2^n` is not a normal f32) take the scalar function for all eight.

use std::arch::x86_64::*;

use crate::cpu::exp_ggml::{exp_ggml, C0, C1, C2, C3, C4, LN2_HI, LN2_LO, LOG2E, SHIFT};

/// `exp_ggml` of each lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp8(x: __m256) -> __m256 {
    let n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(LOG2E), _mm256_set1_ps(SHIFT)), _mm256_set1_ps(SHIFT));
    // `fma(-n, c, x)` is `-(n·c) + x` rounded once, as `fnmadd` computes it.
    let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), b);
    let u = _mm256_mul_ps(b, b);
    let f = |c: f32| _mm256_set1_ps(c);
    let p = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(f(C4), b, f(C3)), u, _mm256_fmadd_ps(f(C2), b, f(C1))),
        u,
        _mm256_fmadd_ps(f(C0), b, f(1.0)),
    );
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let out_of_range = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    let not_normal = _mm256_or_ps(
        _mm256_cmp_ps::<_CMP_LT_OQ>(n, _mm256_set1_ps(-126.0)),
        _mm256_cmp_ps::<_CMP_GT_OQ>(n, _mm256_set1_ps(127.0)),
    );
    if _mm256_movemask_ps(_mm256_andnot_ps(out_of_range, not_normal)) != 0 {
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), x);
        lanes.iter_mut().for_each(|v| *v = exp_ggml(*v));
        return _mm256_loadu_ps(lanes.as_ptr());
    }
    // NaN lanes: `n` converts to i32::MIN, whose shifted bits are harmless: `p` is NaN.
    let pow2 =
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127))));
    let scaled = _mm256_mul_ps(p, pow2);
    let big =
        _mm256_blendv_ps(_mm256_setzero_ps(), _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(n, f(0.0)));
    _mm256_blendv_ps(scaled, big, out_of_range)
}

/// `g[i] = silu_ggml(g[i]) * u[i]`; equal lengths.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn silu_mul_inplace(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len());
    let whole = g.len() - g.len() % 8;
    for i in (0..whole).step_by(8) {
        let x = _mm256_loadu_ps(g.as_ptr().add(i));
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        let s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
        _mm256_storeu_ps(g.as_mut_ptr().add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i))));
    }
    for (g, &u) in g[whole..].iter_mut().zip(&u[whole..]) {
        *g = super::silu_ggml(*g) * u;
    }
}
