//! AVX512-VNNI row kernels of the CPU matmul for Q4_0, Q4_1 and Q8_0: the AVX2 kernels
//! (`simd_avx2.rs`, same micro-kernels and tiling) with each block's `maddubs` + `madd`
//! pair replaced by one `vpdpbusd` (u8 × i8, four adjacent products summed into each
//! i32 lane). Both give the same exact i32 lanes (nothing saturates: see `simd_avx2.rs`),
//! and the f32 steps are unchanged, so results are bit-identical to the AVX2 path and
//! keep its batch invariance. The 256-bit (VL) form is used: Zen 4 runs 512-bit ops as
//! two 256-bit halves, and 32-value blocks fill exactly one 256-bit register.
//!
//! Every function here needs AVX2, FMA, F16C, AVX512F/BW/VL and AVX512-VNNI; `matmul.rs`
//! only hands them out through a constructed `Isa`, which checked the CPU.

use std::arch::x86_64::*;

use super::avx2::{check_q8, f16_load, f16_pair, hsum, nibbles, q8_kernel, tiled};
use crate::quant::q8::ActsQ8;

/// Σ over 32 lanes of u8 × i8, as 8 i32 lanes (lane i: bytes 4i..4i+4).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot_u8i8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
}

// Q4_0: unsigned nibbles q in 0..16, value d·(q - 8): the -8 goes to the s_x term.
q8_kernel!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    q4_0_rn,
    18,
    true,
    |blk| {
        let d = f16_load(blk);
        (nibbles(blk.add(2)), d, -8.0 * d)
    },
    |w, x| { dot_u8i8(w, x) }
);

// Q4_1: value d·q + m.
q8_kernel!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    q4_1_rn,
    20,
    true,
    |blk| {
        let (d, m) = f16_pair(blk);
        (nibbles(blk.add(4)), d, m)
    },
    |w, x| { dot_u8i8(w, x) }
);

// Q8_0: both sides signed, so move w's sign onto x: |w| · sign(w)·x (|-128| = 128 as u8).
q8_kernel!(
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    q8_0_rn,
    34,
    false,
    |blk| {
        let d = f16_load(blk);
        (_mm256_loadu_si256(blk.add(2) as *const __m256i), d, 0.0)
    },
    |w, x| { dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)) }
);

tiled!(row_q4_0, q4_0_rn, 18);
tiled!(row_q4_1, q4_1_rn, 20);
tiled!(row_q8_0, q8_0_rn, 34);
