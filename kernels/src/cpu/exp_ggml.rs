//! `e^x` as ggml's AVX-512 build approximates it inside SiLU / SwiGLU, one value at a
//! time, so the CPU engine's SwiGLU gives llama.cpp's values bit for bit.
//!
//! Why: ggml's vectorised SwiGLU does not call the C library's `expf`; it uses a
//! polynomial approximation (within a couple of ulp of `expf`, and different from it in
//! about a quarter of the outputs). A one-ulp difference in a SwiGLU output is usually
//! absorbed by the 8-bit quantisation of the next matmul's input, but over a few tokens
//! one is not, and from there the engine drifts away from llama.cpp as fast as if it
//! were computing something else (measured: the last source of disagreement with the
//! llama.cpp fixture; see worker/tests/llama_cpp_agreement.rs).
//!
//! The arithmetic (every step f32, `fma` fused): with `n = round(x · log2 e)` (by the
//! add-and-subtract of `1.5 · 2^23`), `b = x - n·ln2` in two parts (`ln2_hi`, `ln2_lo`),
//! `u = b²`, `p = ((c4·b + c3)·u + (c2·b + c1))·u + (c0·b + 1)` and the result
//! `p · 2^n`, except `|n| > 192`: `+inf` for `n > 0`, `0` otherwise. ggml's AVX2 build
//! uses a variant of the same scheme that rounds differently; this is the AVX-512 one
//! (the reference fixture's machine).

/// `1.5 · 2^23`: adding and subtracting it rounds an f32 of magnitude < 2^22 to an
/// integer (nearest, ties to even).
pub(crate) const SHIFT: f32 = 12_582_912.0;
/// `log2 e` rounded to f32.
pub(crate) const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
/// `ln 2` split so that `n · LN2_HI` is exact for the `n` that occur.
pub(crate) const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
pub(crate) const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// The polynomial's coefficients of `b` (`C0`) to `b^5` (`C4`).
pub(crate) const C0: f32 = f32::from_bits(0x3f7f_fff6);
pub(crate) const C1: f32 = f32::from_bits(0x3eff_fedb);
pub(crate) const C2: f32 = f32::from_bits(0x3e2a_af33);
pub(crate) const C3: f32 = f32::from_bits(0x3d2b_9f17);
pub(crate) const C4: f32 = f32::from_bits(0x3c07_2010);

/// ggml's AVX-512 `e^x` (see the module docs).
#[inline]
pub fn exp_ggml(x: f32) -> f32 {
    let z = x.mul_add(LOG2E, SHIFT);
    let n = z - SHIFT;
    let b = (-n).mul_add(LN2_LO, (-n).mul_add(LN2_HI, x));
    let u = b * b;
    let p = C4.mul_add(b, C3).mul_add(u, C2.mul_add(b, C1)).mul_add(u, C0.mul_add(b, 1.0));
    // Also catches NaN: `n` is NaN, the comparison false, and NaN flows through below.
    if n.abs() > 192.0 {
        return if n > 0.0 { f32::INFINITY } else { 0.0 };
    }
    scale_pow2(p, n as i32)
}

/// `p · 2^n`, rounded once (as AVX-512 `scalef`): `p` is in about [0.7, 1.5] and
/// `|n| <= 192`, so the product may leave f32's normal range; f64 holds it exactly.
#[inline]
fn scale_pow2(p: f32, n: i32) -> f32 {
    if (-126..=127).contains(&n) {
        p * f32::from_bits(((n + 127) as u32) << 23)
    } else {
        (f64::from(p) * f64::from_bits(((n + 1023) as u64) << 52)) as f32
    }
}
