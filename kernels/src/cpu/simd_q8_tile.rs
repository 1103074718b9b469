//! The multi-token micro-kernel of the CPU matmul for Q4_0, Q4_1 and Q8_0 (prefill and
//! batched decode): one weight row × `N <= 8` tokens of one or two token groups.
//!
//! Same arithmetic as the one-row kernel (`q8_kernel!` in `simd_avx2.rs`) and the scalar
//! kernels, bit for bit: each (row, token) keeps its eight f32 lanes with one FMA chain
//! per lane over the blocks (`acc += f32(isum) · (d_w · d_x)`), its offset term as one
//! scalar FMA chain (`accm += m_w · s_x`), and ends as `hsum(acc) + accm`. What changes
//! is how the per-block scalars get there: the four tokens' `d_x` and `s_x` of a block
//! are one vector (`ActsQ8::d4` / `s4`), so a row's four scale products `d_w · d_x` are
//! one multiply and its four offset terms one FMA (lane `t` is token `t`'s chain), where
//! the scalar form spent a multiply, a broadcast and an FMA per token and a load of each
//! scale. Lanes are independent, so every value is the one the scalar steps give.
//!
//! Used through `q8_family!`, which instantiates it with each instruction set's block
//! dot product.

/// Defines `$name::<N>(w, acts, t0, out)`: the row at `w` × tokens `t0 + t` (`t < N <= 8`,
/// `t0` a multiple of 4), written to `out[t]`. `$unpack(blk)` gives (32 quant bytes, `[d, m, ..]` as f32 lanes
/// 0 and 1); `$offset` whether the block adds `coef · s_x` with `coef = $coef(dm)`;
/// `$mul(w, x)` the block's integer dot as eight i32 lanes.
macro_rules! q8_tile_kernel {
    ($feat:literal, $name:ident, $bytes:expr, $offset:expr,
     |$blk:ident| $unpack:block, |$dm:ident| $coef:block, |$wv:ident, $xv:ident| $mul:block) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name<const N: usize>(w: *const u8, a: &ActsQ8, t0: usize, out: *mut f32) {
            let nb = a.row_blocks();
            let cols = a.cols;
            let g = t0 / TOKEN_GROUP;
            let xq = a.qs.as_ptr().add(t0 * cols);
            // Group j's scales of block b: d4[j * nb * 4 + b * 4 ..][..4].
            let (d4, s4) = (a.d4.as_ptr().add(g * nb * TOKEN_GROUP), a.s4.as_ptr().add(g * nb * TOKEN_GROUP));
            let groups = N.div_ceil(TOKEN_GROUP);
            let mut acc = [_mm256_setzero_ps(); N];
            let mut accm = [_mm_setzero_ps(); 2];
            for b in 0..nb {
                let mut xs = [_mm256_setzero_si256(); N];
                for t in 0..N {
                    xs[t] = _mm256_loadu_si256(xq.add(t * cols + b * 32) as *const __m256i);
                }
                let $blk = w.add(b * $bytes);
                let (wv, $dm): (__m256i, __m128) = $unpack;
                let dw = _mm_broadcastss_ps($dm);
                let mut sc = [0.0f32; 8];
                for j in 0..groups {
                    let at = (j * nb + b) * TOKEN_GROUP;
                    // Lane l: d_w · d_x of token 4 j + l.
                    _mm_storeu_ps(sc.as_mut_ptr().add(4 * j), _mm_mul_ps(dw, _mm_loadu_ps(d4.add(at))));
                    if $offset {
                        let coef: __m128 = $coef;
                        accm[j] = _mm_fmadd_ps(coef, _mm_loadu_ps(s4.add(at)), accm[j]);
                    }
                }
                for t in 0..N {
                    let $wv = wv;
                    let $xv = xs[t];
                    let p: __m256i = $mul;
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(sc[t]), acc[t]);
                }
            }
            let mut m = [0.0f32; 8];
            _mm_storeu_ps(m.as_mut_ptr(), accm[0]);
            _mm_storeu_ps(m.as_mut_ptr().add(4), accm[1]);
            for t in 0..N {
                *out.add(t) = hsum(acc[t]) + m[t];
            }
        }
    };
}
pub(crate) use q8_tile_kernel;
