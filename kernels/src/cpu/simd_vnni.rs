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
q8_family!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", dot_u8i8, 8);
