//! AVX512-VNNI row kernels of the CPU matmul for Q4_0, Q4_1 and Q8_0: the AVX2 kernels
//! (`simd_avx2.rs`, same micro-kernels; token groups of 8 instead of 4, as the 32
//! registers hold a row's eight accumulators and the eight tokens' activations) with each block's `maddubs` + `madd`
//! pair replaced by one `vpdpbusd` (u8 × i8, four adjacent products summed into each
//! i32 lane). Both give the same exact i32 lanes (nothing saturates: see `simd_avx2.rs`),
//! and the f32 steps are unchanged, so results are bit-identical to the AVX2 path and
//! keep its batch invariance. The 256-bit (VL) form is used: Zen 4 runs 512-bit ops as
//! two 256-bit halves, and 32-value blocks fill exactly one 256-bit register.
//!
//! Every function here needs AVX2, FMA, F16C, AVX512F/BW/VL and AVX512-VNNI; `matmul.rs`
//! only hands them out through a constructed `Isa`, which checked the CPU.

use std::arch::x86_64::*;

use super::avx2::{check_q8, f16_lanes, f16_load, f16_pair, hsum, nibbles, q8_family, q8_kernel, tiled};
use super::q8_tile::q8_tile_kernel;
use crate::quant::q8::{ActsQ8, TOKEN_GROUP};

/// Σ over 32 lanes of u8 × i8, as 8 i32 lanes (lane i: bytes 4i..4i+4).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot_u8i8(w: __m256i, x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
}

// One row × 8 tokens per tile (`matmul_bench --vnni` on Zen 4, 2 threads, Q4_1 n = 64:
// 1 × 8 236 / 217 GFLOP/s for SmolLM2's two FFN shapes, 1 × 4 227 / 200, 2 × 4 199 / 185).
/// Σ over 32 lanes of i8 × i8 (Q8_0 weights) for one token: w's sign moved onto x.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot_i8i8(w: __m256i, x: __m256i) -> __m256i {
    dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
}

/// Σ over 32 lanes of i8 × i8 (Q8_0 weights), as 8 i32 lanes, in one `vpdpbusd` per
/// token of a tile: x + 128 is a u8 (x in [-127, 127]), and the lanes start from -128·Σw (of their
/// four w), so each ends as Σ x·w, exact in i32 as the AVX2 form. The start depends only
/// on w, so the compiler computes it once per block for all the tile's tokens (for one
/// token the sign form's three operations are fewer: 570 vs 514 µs, LM head, 2 threads).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn dot_i8i8_tile(w: __m256i, x: __m256i) -> __m256i {
    let bias = _mm256_set1_epi8(-128);
    let start = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), bias, w));
    _mm256_dpbusd_epi32(start, _mm256_xor_si256(x, bias), w)
}

q8_family!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", dot_u8i8, dot_i8i8, dot_i8i8_tile, 8);
