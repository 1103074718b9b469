//! The x86 kernels of `packed.rs`: AVX-512 VNNI (sixteen rows per register, one
//! `vpdpbusd` per four columns) and AVX2 (eight rows per register, `vpmaddubsw` pairs
//! summed in i16 and widened once per block). Both compute the exact integer block sums
//! and then the f32 steps of `packed.rs`'s scalar kernel in the same order, so every lane
//! is bit for bit the scalar value.
//!
//! AVX2's i16 sums cannot overflow: a nibble (<= 15) times an activation (|q| <= 127, the
//! quantiser clamps) twice is at most 3,810 per `vpmaddubsw` lane, and eight chunks sum to
//! at most 30,480 < 32,767. Q8_0 (255 · 127 · 2 would saturate) takes the sign form below.

use std::arch::x86_64::*;

use super::{quant_bytes, Acts, GROUP, TILE};
use crate::quant::GgmlType;

/// How a type's offset term `m_w · s_x` is formed: none (Q8_0), `m` from the record
/// (Q4_1), `-8 d` (Q4_0).
const OFF_NONE: u8 = 0;
const OFF_M: u8 = 1;
const OFF_D8: u8 = 2;

/// Checks what the kernels read: `nb` records, tokens `t0 .. t0 + tn` of the activations.
fn check(ty: GgmlType, recs: &[u8], rec: usize, a: &Acts, t0: usize, tn: usize) {
    let end = t0 + tn;
    assert!(tn <= TILE && rec >= quant_bytes(ty) + 64 && recs.len() >= a.nb * rec);
    assert!(a.cols == a.nb * 32 && a.qs.len() >= end * a.cols && a.d.len() >= end * a.nb && a.s.len() >= end * a.nb);
    assert!(ty != GgmlType::Q8_0 || a.qsum.len() >= end * a.nb);
}

/// Calls `$f::<tn, ..>` for a run-time `tn` in `1..=8`.
macro_rules! by_width {
    ($tn:expr, $f:ident, [$($c:expr),*], $args:tt) => {
        match $tn {
            1 => $f::<1, $($c),*> $args,
            2 => $f::<2, $($c),*> $args,
            3 => $f::<3, $($c),*> $args,
            4 => $f::<4, $($c),*> $args,
            5 => $f::<5, $($c),*> $args,
            6 => $f::<6, $($c),*> $args,
            7 => $f::<7, $($c),*> $args,
            8 => $f::<8, $($c),*> $args,
            _ => {}
        }
    };
}

/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX512F/BW/VL and AVX512-VNNI.
pub(super) unsafe fn avx512_tile(
    ty: GgmlType,
    recs: &[u8],
    rec: usize,
    a: &Acts,
    t0: usize,
    tn: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    check(ty, recs, rec, a, t0, tn);
    let p = recs.as_ptr();
    // SAFETY (all three): features by the caller's contract, lengths checked above.
    unsafe {
        match ty {
            GgmlType::Q8_0 => by_width!(tn, k512, [true, OFF_NONE], (p, rec, a, t0, tile)),
            GgmlType::Q4_1 => by_width!(tn, k512, [false, OFF_M], (p, rec, a, t0, tile)),
            _ => by_width!(tn, k512, [false, OFF_D8], (p, rec, a, t0, tile)),
        }
    }
}

/// Tokens per AVX2 pass (sixteen registers, eight of which hold the weights; 2, 4 and 8 measured
/// within noise of each other on the 2-core VM).
const SUB: usize = 4;

/// # Safety
/// The CPU has AVX2, FMA and F16C.
pub(super) unsafe fn avx2_tile(
    ty: GgmlType,
    recs: &[u8],
    rec: usize,
    a: &Acts,
    t0: usize,
    tn: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    check(ty, recs, rec, a, t0, tn);
    // Four tokens per pass: AVX2 has sixteen registers, eight of which hold the weights.
    for s0 in (0..tn).step_by(SUB) {
        let w = SUB.min(tn - s0);
        let sub = &mut tile[s0..s0 + w];
        let (p, t) = (recs.as_ptr(), t0 + s0);
        // SAFETY: features by the caller's contract, lengths checked above.
        unsafe {
            match ty {
                GgmlType::Q8_0 => by_width!(w, k256_q8, [], (p, rec, a, t, sub)),
                GgmlType::Q4_1 => by_width!(w, k256, [OFF_M], (p, rec, a, t, sub)),
                _ => by_width!(w, k256, [OFF_D8], (p, rec, a, t, sub)),
            }
        }
    }
}

/// Sixteen rows × `N` tokens `t0 ..`: see `packed.rs`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k512<const N: usize, const Q8: bool, const OFF: u8>(
    recs: *const u8,
    rec: usize,
    a: &Acts,
    t0: usize,
    tile: &mut [[f32; GROUP]; TILE],
) {
    let (nb, cols) = (a.nb, a.cols);
    let qb = if Q8 { 512 } else { 256 };
    // SAFETY (the whole body): `check` bounded every read below.
    unsafe {
        let qs = a.qs.as_ptr().add(t0 * cols);
        let (d, s) = (a.d.as_ptr().add(t0 * nb), a.s.as_ptr().add(t0 * nb));
        let low = _mm512_set1_epi8(0x0F);
        let mut facc = [_mm512_setzero_ps(); N];
        for b in 0..nb {
            let r = recs.add(b * rec);
            let mut w = [_mm512_setzero_si512(); 8];
            if Q8 {
                for (k, wk) in w.iter_mut().enumerate() {
                    *wk = _mm512_loadu_si512(r.add(64 * k) as *const _);
                }
            } else {
                for k in 0..4 {
                    let p = _mm512_loadu_si512(r.add(64 * k) as *const _);
                    w[k] = _mm512_and_si512(p, low);
                    w[k + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(p), low);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(r.add(qb) as *const __m256i));
            let mw = match OFF {
                OFF_M => _mm512_cvtph_ps(_mm256_loadu_si256(r.add(qb + 32) as *const __m256i)),
                OFF_D8 => _mm512_mul_ps(dw, _mm512_set1_ps(-8.0)),
                _ => _mm512_setzero_ps(),
            };
            for (t, f) in facc.iter_mut().enumerate() {
                let xp = qs.add(t * cols + b * 32) as *const i32;
                let mut acc = if Q8 {
                    _mm512_set1_epi32(-128 * *a.qsum.as_ptr().add((t0 + t) * nb + b))
                } else {
                    _mm512_setzero_si512()
                };
                for (k, &wk) in w.iter().enumerate() {
                    acc = _mm512_dpbusd_epi32(acc, wk, _mm512_set1_epi32(xp.add(k).read_unaligned()));
                }
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(*d.add(t * nb + b)));
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), sc, *f);
                if OFF != OFF_NONE {
                    *f = _mm512_fmadd_ps(mw, _mm512_set1_ps(*s.add(t * nb + b)), *f);
                }
            }
        }
        for (t, f) in facc.iter().enumerate() {
            _mm512_storeu_ps(tile[t].as_mut_ptr(), *f);
        }
    }
}

/// Sixteen rows (two halves of eight) × `N <= 4` tokens `t0 ..` of a Q4_0 / Q4_1 weight.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k256<const N: usize, const OFF: u8>(
    recs: *const u8,
    rec: usize,
    a: &Acts,
    t0: usize,
    tile: &mut [[f32; GROUP]],
) {
    let (nb, cols) = (a.nb, a.cols);
    // SAFETY (the whole body): `check` bounded every read below; `tile` has `N` rows.
    unsafe {
        let qs = a.qs.as_ptr().add(t0 * cols);
        let (d, s) = (a.d.as_ptr().add(t0 * nb), a.s.as_ptr().add(t0 * nb));
        let low = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for h in 0..2 {
            let mut facc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let r = recs.add(b * rec);
                let mut w = [_mm256_setzero_si256(); 8];
                for k in 0..4 {
                    let p = _mm256_loadu_si256(r.add(64 * k + 32 * h) as *const __m256i);
                    w[k] = _mm256_and_si256(p, low);
                    w[k + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(p), low);
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(256 + 16 * h) as *const __m128i));
                let mw = if OFF == OFF_M {
                    _mm256_cvtph_ps(_mm_loadu_si128(r.add(288 + 16 * h) as *const __m128i))
                } else {
                    _mm256_mul_ps(dw, _mm256_set1_ps(-8.0))
                };
                for (t, f) in facc.iter_mut().enumerate() {
                    let xp = qs.add(t * cols + b * 32) as *const i32;
                    let mut s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xp.read_unaligned()));
                    for (k, &wk) in w.iter().enumerate().skip(1) {
                        s16 = _mm256_add_epi16(
                            s16,
                            _mm256_maddubs_epi16(wk, _mm256_set1_epi32(xp.add(k).read_unaligned())),
                        );
                    }
                    let acc = _mm256_madd_epi16(s16, ones);
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(t * nb + b)));
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), sc, *f);
                    *f = _mm256_fmadd_ps(mw, _mm256_set1_ps(*s.add(t * nb + b)), *f);
                }
            }
            for (t, f) in facc.iter().enumerate() {
                _mm256_storeu_ps(tile[t].as_mut_ptr().add(8 * h), *f);
            }
        }
    }
}

/// Sixteen rows (two halves of eight) × `N <= 4` tokens `t0 ..` of a Q8_0 weight: the
/// stored `w + 128` turned back into `w` in the register, and each product formed as
/// `|w| · (x with w's sign)` (`vpmaddubsw` wants one unsigned side); a lane pair is at
/// most 128 · 127 · 2 = 32,512, so no i16 saturates, and each chunk widens to i32 at once.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k256_q8<const N: usize>(recs: *const u8, rec: usize, a: &Acts, t0: usize, tile: &mut [[f32; GROUP]]) {
    let (nb, cols) = (a.nb, a.cols);
    // SAFETY (the whole body): `check` bounded every read below; `tile` has `N` rows.
    unsafe {
        let qs = a.qs.as_ptr().add(t0 * cols);
        let d = a.d.as_ptr().add(t0 * nb);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        for h in 0..2 {
            let mut facc = [_mm256_setzero_ps(); N];
            for b in 0..nb {
                let r = recs.add(b * rec);
                let mut ws = [_mm256_setzero_si256(); 8];
                for (k, wk) in ws.iter_mut().enumerate() {
                    *wk = _mm256_xor_si256(_mm256_loadu_si256(r.add(64 * k + 32 * h) as *const __m256i), flip);
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(r.add(512 + 16 * h) as *const __m128i));
                for (t, f) in facc.iter_mut().enumerate() {
                    let xp = qs.add(t * cols + b * 32) as *const i32;
                    let mut acc = _mm256_setzero_si256();
                    for (k, &wk) in ws.iter().enumerate() {
                        let x = _mm256_sign_epi8(_mm256_set1_epi32(xp.add(k).read_unaligned()), wk);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wk), x), ones);
                        acc = _mm256_add_epi32(acc, p);
                    }
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(t * nb + b)));
                    *f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), sc, *f);
                }
            }
            for (t, f) in facc.iter().enumerate() {
                _mm256_storeu_ps(tile[t].as_mut_ptr().add(8 * h), *f);
            }
        }
    }
}
