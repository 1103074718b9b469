//! AVX2 row kernels of the CPU matmul for the K types (Q4_K, Q5_K, Q6_K) against
//! [`ActsQ8K`] activations.
//!
//! Per 256-value super-block and token: the quants of each 32-value sub-block are
//! unpacked to bytes, `maddubs` with the activations (|pair| <= 2·63·127, no i16
//! saturation), `madd` with the sub-block scale (i32), summed over the block, then one
//! FMA with `d · d_x`. The min / offset terms use the activation's 16-value sums
//! (`bsums`) with another `madd`. Same arithmetic as `matmul_scalar.rs`.
//! Up to four tokens share each unpacked block. Needs AVX2, FMA and F16C.

// Loops over tokens index several per-token arrays at once.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::avx2::{f16_load, f16_pair, grouped, hsum};
use crate::quant::k4_scales_mins;
use crate::quant::q8::ActsQ8K;

/// Checks the lengths the raw-pointer loops rely on (the driver's contract), once per row.
#[inline]
fn check_q8k(w: &[u8], block_bytes: usize, a: &ActsQ8K, t0: usize, n_tok: usize) -> usize {
    let nb = a.row_blocks();
    assert!(
        w.len() == nb * block_bytes
            && a.qs.len() >= (t0 + n_tok) * a.cols
            && a.d.len() >= (t0 + n_tok) * nb
            && a.bsums.len() >= (t0 + n_tok) * nb * 16
    );
    nb
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// Σ_i m_i · (bsums[2i] + bsums[2i+1]) as 8 i32 lanes, for the 8 sub-block mins `mn`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn mins_dot(mn: &[u8; 8], bsums: *const i16) -> __m256i {
    let m = _mm_cvtsi64_si128(i64::from_le_bytes(*mn));
    let m2 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m, m)); // m0 m0 m1 m1 ... m7 m7
    _mm256_madd_epi16(_mm256_loadu_si256(bsums as *const __m256i), m2)
}

/// Q4_K (`HIGH = false`) and Q5_K (`HIGH = true`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q45_k_n<const N: usize, const HIGH: bool>(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    let bytes = if HIGH { 176 } else { 144 };
    let nb = check_q8k(w, bytes, a, t0, N);
    let (cols, xq, xd, xb) =
        (a.cols, a.qs.as_ptr().add(t0 * a.cols), a.d.as_ptr().add(t0 * nb), a.bsums.as_ptr().add(t0 * nb * 16));
    let m4 = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut accm = [_mm256_setzero_ps(); N];
    for bi in 0..nb {
        let blk = w.as_ptr().add(bi * bytes);
        let (d, dmin) = f16_pair(blk);
        let (sc, mn) = k4_scales_mins(std::slice::from_raw_parts(blk.add(4), 12));
        let qs = blk.add(if HIGH { 48 } else { 16 });
        let mut qh = if HIGH { load(blk.add(16)) } else { _mm256_setzero_si256() };
        let mut isum = [_mm256_setzero_si256(); N];
        for p in 0..4 {
            let q = load(qs.add(32 * p));
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if HIGH {
                // Bits 0 and 1 of each (shifted) qh byte are the fifth bits of sub-blocks 2p, 2p+1.
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
                qh = _mm256_srli_epi16(qh, 2);
            }
            let s_lo = _mm256_set1_epi16(sc[2 * p] as i16);
            let s_hi = _mm256_set1_epi16(sc[2 * p + 1] as i16);
            for i in 0..N {
                let x = xq.add(i * cols + bi * 256 + 64 * p) as *const u8;
                let p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load(x)), s_lo);
                let p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load(x.add(32))), s_hi);
                isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for i in 0..N {
            let dx = *xd.add(i * nb + bi);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * dx), acc[i]);
            let m = mins_dot(&mn, xb.add((i * nb + bi) * 16));
            accm[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(dmin * dx), accm[i]);
        }
    }
    for i in 0..N {
        out[i] = hsum(_mm256_sub_ps(acc[i], accm[i]));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_n<const N: usize>(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    q45_k_n::<N, false>(w, a, t0, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_n<const N: usize>(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    q45_k_n::<N, true>(w, a, t0, out)
}

/// Q6_K: quants 0..64 (the -32 is folded in through `bsums`), one i8 scale per 16 values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_n<const N: usize>(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    let nb = check_q8k(w, 210, a, t0, N);
    let (cols, xq, xd, xb) =
        (a.cols, a.qs.as_ptr().add(t0 * a.cols), a.d.as_ptr().add(t0 * nb), a.bsums.as_ptr().add(t0 * nb * 16));
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x30);
    let mut acc = [_mm256_setzero_ps(); N];
    for bi in 0..nb {
        let blk = w.as_ptr().add(bi * 210);
        let d = f16_load(blk.add(208));
        let scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i)); // 16 x i16
        let mut isum = [_mm256_setzero_si256(); N];
        for h in 0..2 {
            let qa = load(blk.add(64 * h));
            let qb = load(blk.add(64 * h + 32));
            let hh = load(blk.add(128 + 32 * h));
            // Group g (32 values): low nibble source and bits 2g..2g+2 of qh moved to 4..6.
            let q = [
                _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 4), m2)),
                _mm256_or_si256(_mm256_and_si256(qb, m4), _mm256_and_si256(_mm256_slli_epi16(hh, 2), m2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(hh, m2)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(hh, 2), m2),
                ),
            ];
            for (g, qg) in q.iter().enumerate() {
                let s0 = *blk.add(192 + 8 * h + 2 * g) as i8 as i16;
                let s1 = *blk.add(193 + 8 * h + 2 * g) as i8 as i16;
                let sv = _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0));
                for i in 0..N {
                    let x = xq.add(i * cols + bi * 256 + 128 * h + 32 * g) as *const u8;
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qg, load(x)), sv);
                    isum[i] = _mm256_add_epi32(isum[i], p);
                }
            }
        }
        for i in 0..N {
            let bs = _mm256_loadu_si256(xb.add((i * nb + bi) * 16) as *const __m256i);
            let offset = _mm256_slli_epi32(_mm256_madd_epi16(bs, scales), 5); // 32 · Σ sc_g · bsum_g
            let dx = *xd.add(i * nb + bi);
            acc[i] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[i], offset)), _mm256_set1_ps(d * dx), acc[i]);
        }
    }
    for i in 0..N {
        out[i] = hsum(acc[i]);
    }
}

grouped!(q4_k_row, q4_k_n, ActsQ8K);
grouped!(q5_k_row, q5_k_n, ActsQ8K);
grouped!(q6_k_row, q6_k_n, ActsQ8K);
per_row!(row_q4_k, q4_k_row, ActsQ8K);
per_row!(row_q5_k, q5_k_row, ActsQ8K);
per_row!(row_q6_k, q6_k_row, ActsQ8K);
