//! Portable row kernels of the CPU matmul: one weight row against a run of tokens.
//!
//! These define the arithmetic the SIMD kernels must reproduce: per block, an exact
//! integer dot of the weight quants with the 8-bit activations, then
//! `acc += (d_w · d_x) · isum` (+ the offset terms below). For Q4_0, Q4_1 and Q8_0 the
//! f32 steps are those of the SIMD kernels and of ggml's x86 `vec_dot` (so the result is
//! bit-identical to both): the block's integer dot stays in eight i32 lanes of four
//! adjacent products each, each lane is FMA'd with `d_w · d_x` into its own f32
//! accumulator over the whole row, the offset terms go into one scalar FMA chain, and
//! the lanes are summed at the end in the order of an AVX `hsum` ([`hsum8`]). The `*_row`
//! functions take exactly one row and write token `t0 + i` to `out[i]`; `per_row!` turns
//! each into a [`Kernel`](super::Kernel).

use super::ActsF32;
use crate::quant::q8::{ActsQ8, ActsQ8K};
use crate::quant::{bf16_to_f32, f16_to_f32, k4_scales_mins};

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// Runs `dot(token)` for every token of the tile.
#[inline]
fn per_token(t0: usize, out: &mut [f32], mut dot: impl FnMut(usize) -> f32) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot(t0 + i);
    }
}

/// The integer dot of a Q4 block (byte j: values j and j+16) with 32 i8 values, as
/// eight lanes: lane `l` sums the products of values `4l..4l + 4`.
#[inline]
fn nibble_lanes(qs: &[u8], x: &[i8]) -> [i32; 8] {
    std::array::from_fn(|l| {
        (4 * l..4 * l + 4)
            .map(|j| {
                let q = if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 };
                q as i32 * x[j] as i32
            })
            .sum()
    })
}

/// The integer dot of a Q8_0 block's signed quants with 32 i8 values, in eight lanes.
#[inline]
fn q8_lanes(qs: &[u8], x: &[i8]) -> [i32; 8] {
    std::array::from_fn(|l| (4 * l..4 * l + 4).map(|j| (qs[j] as i8) as i32 * x[j] as i32).sum())
}

/// Eight f32 lane accumulators and the scalar offset chain of one (row, token) dot.
#[derive(Default)]
struct Lanes {
    acc: [f32; 8],
    offset: f32,
}

impl Lanes {
    /// One block: `acc[l] += lane[l] · scale` (FMA), `offset += coef · s_x` (FMA).
    #[inline]
    fn add(&mut self, lanes: [i32; 8], scale: f32, coef: f32, s_x: f32) {
        for (a, &p) in self.acc.iter_mut().zip(&lanes) {
            *a = (p as f32).mul_add(scale, *a);
        }
        self.offset = coef.mul_add(s_x, self.offset);
    }

    fn total(&self) -> f32 {
        hsum8(&self.acc) + self.offset
    }
}

/// The sum of eight lanes in the order of an AVX horizontal sum: the two 128-bit halves
/// lane-wise, then lanes {0, 2} and {1, 3}, then the two.
#[inline]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Token `t`'s quants, scales and scaled sums from 32-value-block activations.
#[inline]
fn q8_row(a: &ActsQ8, t: usize) -> (&[i8], &[f32], &[f32]) {
    let nb = a.row_blocks();
    (&a.qs[t * a.cols..(t + 1) * a.cols], &a.d[t * nb..(t + 1) * nb], &a.s[t * nb..(t + 1) * nb])
}

/// Q4_0: value = d·(q - 8), so Σ = d·d_x·Σq·x_q - 8·d·s_x.
fn q4_0_row(w: &[u8], a: &ActsQ8, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, xs) = q8_row(a, t);
        let mut acc = Lanes::default();
        for (((b, x), &dx), &sx) in w.chunks_exact(18).zip(xq.chunks_exact(32)).zip(xd).zip(xs) {
            let d = f16_at(b, 0);
            acc.add(nibble_lanes(&b[2..18], x), d * dx, -8.0 * d, sx);
        }
        acc.total()
    })
}

/// Q4_1: value = d·q + m, so Σ = (d·d_x)·Σq·x_q + m·s_x.
fn q4_1_row(w: &[u8], a: &ActsQ8, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, xs) = q8_row(a, t);
        let mut acc = Lanes::default();
        for (((b, x), &dx), &sx) in w.chunks_exact(20).zip(xq.chunks_exact(32)).zip(xd).zip(xs) {
            let (d, m) = (f16_at(b, 0), f16_at(b, 2));
            acc.add(nibble_lanes(&b[4..20], x), d * dx, m, sx);
        }
        acc.total()
    })
}

/// Q8_0: value = d·q.
fn q8_0_row(w: &[u8], a: &ActsQ8, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, _) = q8_row(a, t);
        let mut acc = Lanes::default();
        for ((b, x), &dx) in w.chunks_exact(34).zip(xq.chunks_exact(32)).zip(xd) {
            acc.add(q8_lanes(&b[2..34], x), f16_at(b, 0) * dx, 0.0, 0.0);
        }
        acc.total()
    })
}

/// Token `t`'s quants, super-block scales and 16-value sums.
#[inline]
fn q8k_row(a: &ActsQ8K, t: usize) -> (&[i8], &[f32], &[i16]) {
    let nb = a.row_blocks();
    (&a.qs[t * a.cols..(t + 1) * a.cols], &a.d[t * nb..(t + 1) * nb], &a.bsums[t * nb * 16..(t + 1) * nb * 16])
}

/// Σ of the eight sub-block mins times the sums of their 32 activations.
#[inline]
fn mins_dot(mn: &[u8; 8], bsums: &[i16]) -> i32 {
    (0..8).map(|i| mn[i] as i32 * (bsums[2 * i] as i32 + bsums[2 * i + 1] as i32)).sum()
}

/// Q4_K / Q5_K share everything but the fifth bit; `qh` is empty for Q4_K.
#[inline]
fn k4_k5_block(b_scales: &[u8], qh: &[u8], qs: &[u8], x: &[i8]) -> (i32, [u8; 8]) {
    let (sc, mn) = k4_scales_mins(b_scales);
    let mut isum = 0i32;
    for i in 0..8 {
        let bytes = &qs[32 * (i / 2)..32 * (i / 2) + 32];
        let shift = 4 * (i % 2);
        let xs = &x[32 * i..32 * i + 32];
        let mut s = 0i32;
        for l in 0..32 {
            let hi = if qh.is_empty() { 0 } else { ((qh[l] >> i) & 1) << 4 };
            s += (((bytes[l] >> shift) & 0x0F) | hi) as i32 * xs[l] as i32;
        }
        isum += sc[i] as i32 * s;
    }
    (isum, mn)
}

/// Q4_K: Σ = d_x·(d·Σ sc_i·Σq·x_q - dmin·Σ m_i·Σx_q).
fn q4_k_row(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, bs) = q8k_row(a, t);
        let mut acc = 0.0f32;
        for (((b, x), &dx), bsums) in w.chunks_exact(144).zip(xq.chunks_exact(256)).zip(xd).zip(bs.chunks_exact(16)) {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (isum, mn) = k4_k5_block(&b[4..16], &[], &b[16..144], x);
            acc += dx * (d * isum as f32 - dmin * mins_dot(&mn, bsums) as f32);
        }
        acc
    })
}

/// Q5_K: as Q4_K with 5-bit quants.
fn q5_k_row(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, bs) = q8k_row(a, t);
        let mut acc = 0.0f32;
        for (((b, x), &dx), bsums) in w.chunks_exact(176).zip(xq.chunks_exact(256)).zip(xd).zip(bs.chunks_exact(16)) {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let (isum, mn) = k4_k5_block(&b[4..16], &b[16..48], &b[48..176], x);
            acc += dx * (d * isum as f32 - dmin * mins_dot(&mn, bsums) as f32);
        }
        acc
    })
}

/// Q6_K: Σ = d·d_x·(Σ_g sc_g·Σq·x_q - 32·Σ_g sc_g·bsum_g) over the 16-value groups g.
fn q6_k_row(w: &[u8], a: &ActsQ8K, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        let (xq, xd, bs) = q8k_row(a, t);
        let mut acc = 0.0f32;
        for (((b, x), &dx), bsums) in w.chunks_exact(210).zip(xq.chunks_exact(256)).zip(xd).zip(bs.chunks_exact(16)) {
            let d = f16_at(b, 208);
            let scales = &b[192..208];
            let mut isum = 0i32;
            for h in 0..2 {
                let ql = &b[64 * h..64 * h + 64];
                let qh = &b[128 + 32 * h..160 + 32 * h];
                for g in 0..4 {
                    let lo = &ql[32 * (g & 1)..32 * (g & 1) + 32];
                    let shift = 4 * (g >> 1);
                    let xs = &x[128 * h + 32 * g..128 * h + 32 * g + 32];
                    for half in 0..2 {
                        let mut s = 0i32;
                        for l in 16 * half..16 * half + 16 {
                            let q = ((lo[l] >> shift) & 0x0F) | (((qh[l] >> (2 * g)) & 3) << 4);
                            s += q as i32 * xs[l] as i32;
                        }
                        isum += (scales[8 * h + 2 * g + half] as i8) as i32 * s;
                    }
                }
            }
            let offset: i32 = scales.iter().zip(bsums).map(|(&sc, &bsum)| (sc as i8) as i32 * bsum as i32).sum();
            acc += (d * dx) * (isum - 32 * offset) as f32;
        }
        acc
    })
}

/// f32 dot with four partial sums (for the compiler's sake, not precision).
#[inline]
fn float_dot(x: &[f32], wv: impl Iterator<Item = f32>) -> f32 {
    let mut acc = [0.0f32; 4];
    for (i, (w, &v)) in wv.zip(x).enumerate() {
        acc[i % 4] += w * v;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3])
}

#[inline]
fn x_row<'a>(a: &ActsF32<'a>, t: usize) -> &'a [f32] {
    &a.x[t * a.cols..(t + 1) * a.cols]
}

fn f32_row(w: &[u8], a: &ActsF32<'_>, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        float_dot(x_row(a, t), w.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
    })
}

fn f16_row(w: &[u8], a: &ActsF32<'_>, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        float_dot(x_row(a, t), w.chunks_exact(2).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))))
    })
}

fn bf16_row(w: &[u8], a: &ActsF32<'_>, t0: usize, out: &mut [f32]) {
    per_token(t0, out, |t| {
        float_dot(x_row(a, t), w.chunks_exact(2).map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))))
    })
}

per_row!(row_q4_0, q4_0_row, ActsQ8);
per_row!(row_q4_1, q4_1_row, ActsQ8);
per_row!(row_q8_0, q8_0_row, ActsQ8);
per_row!(row_q4_k, q4_k_row, ActsQ8K);
per_row!(row_q5_k, q5_k_row, ActsQ8K);
per_row!(row_q6_k, q6_k_row, ActsQ8K);
per_row!(row_f32, f32_row, ActsF32<'_>);
per_row!(row_f16, f16_row, ActsF32<'_>);
per_row!(row_bf16, bf16_row, ActsF32<'_>);
