//! The f16-cache attention (`cpu::attention_f16`) on random inputs, against two
//! references written here:
//! - exact: causal softmax attention in f64 over the f16-rounded q, k, v, which the
//!   kernel must approach within what its f16 accumulator can lose (a bound that grows
//!   with the context);
//! - stepwise: the rounding steps the kernel promises (llama.cpp's CPU flash attention
//!   for an f16 cache), written out one scalar at a time with an f64 dot product. Only
//!   the order of the score dot's additions differs from the kernel, so the two agree
//!   to within an f16 rounding step.
//!
//! Also: what `write_kv_f16` stores, batch invariance (a chunk equals the same tokens fed
//! one at a time, bit for bit), and shape errors.

use half::f16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::attention::{PagedKv, SeqSlice};
use tessera_kernels::cpu::attention_f16::{attention_f16, attention_f16_with, write_kv_f16};
use tessera_kernels::cpu::matmul::Isa;
use tessera_kernels::KernelError;

fn unif(r: &mut ChaCha8Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * ((r.next_u32() >> 8) as f32 / (1u32 << 24) as f32)
}

fn rand_vec(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| unif(r, lo, hi)).collect()
}

fn r16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

/// A random permutation of `0..n`.
fn shuffled(r: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (r.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// Dense inputs of one case: `k`, `v` `[ctx, n_kv * hd]`, `q` `[n_tokens, n_heads * hd]`.
struct Case {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    first_pos: usize,
    n_tokens: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Case {
    fn new(r: &mut ChaCha8Rng, n_heads: usize, n_kv: usize, hd: usize, first_pos: usize, n_tokens: usize) -> Self {
        let ctx = first_pos + n_tokens;
        // Keys spread enough that the running maximum changes often along the context.
        Case {
            n_heads,
            n_kv,
            hd,
            first_pos,
            n_tokens,
            q: rand_vec(r, n_tokens * n_heads * hd, -2.0, 2.0),
            k: rand_vec(r, ctx * n_kv * hd, -2.0, 2.0),
            v: rand_vec(r, ctx * n_kv * hd, -1.0, 1.0),
        }
    }

    fn q_row(&self, t: usize, h: usize) -> &[f32] {
        &self.q[(t * self.n_heads + h) * self.hd..][..self.hd]
    }

    fn kv_row<'a>(&self, x: &'a [f32], p: usize, kvh: usize) -> &'a [f32] {
        &x[(p * self.n_kv + kvh) * self.hd..][..self.hd]
    }

    /// Exact attention (f64) over the f16-rounded inputs.
    fn exact(&self, scale: f32) -> Vec<f64> {
        let (hd, group) = (self.hd, self.n_heads / self.n_kv);
        let mut out = Vec::new();
        for t in 0..self.n_tokens {
            for h in 0..self.n_heads {
                let q = self.q_row(t, h);
                let n_ctx = self.first_pos + t + 1;
                let s: Vec<f64> = (0..n_ctx)
                    .map(|p| {
                        let k = self.kv_row(&self.k, p, h / group);
                        let d: f64 = q.iter().zip(k).map(|(&a, &b)| f64::from(r16(a)) * f64::from(r16(b))).sum();
                        d * f64::from(scale)
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let num: f64 =
                        (0..n_ctx).map(|p| w[p] * f64::from(r16(self.kv_row(&self.v, p, h / group)[d]))).sum();
                    out.push(num / z);
                }
            }
        }
        out
    }

    /// The kernel's promised steps, one scalar at a time (the dot in f64).
    fn stepwise(&self, scale: f32) -> Vec<f32> {
        let (hd, group) = (self.hd, self.n_heads / self.n_kv);
        let mut out = Vec::new();
        for t in 0..self.n_tokens {
            for h in 0..self.n_heads {
                let q = self.q_row(t, h);
                let mut acc = vec![0.0f32; hd]; // always f16 values
                let (mut m, mut sum) = (f32::NEG_INFINITY, 0.0f32);
                for p in 0..=self.first_pos + t {
                    let (k, v) = (self.kv_row(&self.k, p, h / group), self.kv_row(&self.v, p, h / group));
                    let dot: f64 = q.iter().zip(k).map(|(&a, &b)| f64::from(r16(a)) * f64::from(r16(b))).sum();
                    let s = dot as f32 * scale;
                    let (ms, w) = if s > m { ((m - s).exp(), 1.0) } else { (1.0, (s - m).exp()) };
                    m = m.max(s);
                    for (a, &vv) in acc.iter_mut().zip(v) {
                        let scaled = r16(*a * ms);
                        *a = r16(r16(vv).mul_add(w, scaled));
                    }
                    sum = sum.mul_add(ms, w);
                }
                out.extend(acc.iter().map(|a| a * (1.0 / sum)));
            }
        }
        out
    }
}

/// Writes the case into a NaN-poisoned paged cache (the context before the chunk in
/// an earlier write) and runs the chunk's attention.
fn run(case: &Case, block_size: usize, table: &[u32], num_blocks: usize, scale: f32) -> Vec<f32> {
    let (hd, n_kv) = (case.hd, case.n_kv);
    let stride = n_kv * hd;
    let cache = PagedKv { block_size, n_kv_heads: n_kv, head_dim: hd };
    let mut kc = vec![f16::NAN; num_blocks * block_size * stride];
    let mut vc = kc.clone();
    let fp = case.first_pos;
    if fp > 0 {
        let prior = SeqSlice { block_table: table, first_pos: 0, n_tokens: fp };
        write_kv_f16(&cache, &mut kc, &mut vc, &case.k[..fp * stride], &case.v[..fp * stride], &prior).unwrap();
    }
    let seq = SeqSlice { block_table: table, first_pos: fp, n_tokens: case.n_tokens };
    write_kv_f16(&cache, &mut kc, &mut vc, &case.k[fp * stride..], &case.v[fp * stride..], &seq).unwrap();
    // Each position landed, rounded to f16, in its block and slot.
    for p in 0..fp + case.n_tokens {
        let off = (table[p / block_size] as usize * block_size + p % block_size) * stride;
        for (i, (kv, vv)) in kc[off..off + stride].iter().zip(&vc[off..off + stride]).enumerate() {
            assert_eq!(kv.to_bits(), f16::from_f32(case.k[p * stride + i]).to_bits(), "k at position {p}");
            assert_eq!(vv.to_bits(), f16::from_f32(case.v[p * stride + i]).to_bits(), "v at position {p}");
        }
    }
    let mut out = vec![f32::NAN; case.q.len()];
    attention_f16(&cache, &kc, &vc, &mut out, &case.q, &seq, case.n_heads, scale).unwrap();
    out
}

#[test]
fn f16_attention_follows_its_rounding_steps_and_approaches_exact() {
    let mut r = ChaCha8Rng::seed_from_u64(21);
    // head_dim 64 (one lane step), 128 (two), 80 (one step and an f64 tail), 40 (tail only).
    for (n_heads, n_kv, hd) in [(9, 3, 64), (4, 4, 128), (8, 2, 80), (2, 1, 40)] {
        for block_size in [16, 3] {
            // A whole prompt, a prefill chunk starting mid-context, a decode step far in.
            for (first_pos, n_tokens) in [(0, 19), (37, 11), (90, 1)] {
                let case = Case::new(&mut r, n_heads, n_kv, hd, first_pos, n_tokens);
                let scale = 1.0 / (hd as f32).sqrt();
                let ctx = first_pos + n_tokens;
                let needed = ctx.div_ceil(block_size);
                let num_blocks = needed + 4;
                let table = shuffled(&mut r, num_blocks)[..needed + 1].to_vec();
                let got = run(&case, block_size, &table, num_blocks, scale);
                let what = format!("h{n_heads}/kv{n_kv} hd{hd} bs{block_size} pos{first_pos}+{n_tokens}");

                // Against the stepwise reference: |v| < 1, so one f16 step is <= 2^-11.
                let want = case.stepwise(scale);
                let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0f32, f32::max);
                assert!(worst <= 2.0 * 2f32.powi(-11), "{what}: stepwise reference off by {worst:e}");
                // Mostly the f16 accumulators agree exactly and only the f32 sum `S` (one
                // ulp here and there from the dot's order) differs: far below an f16 step.
                let near = got.iter().zip(&want).filter(|(g, w)| (*g - *w).abs() <= 1e-6 * w.abs() + 1e-9).count();
                assert!(near * 10 >= got.len() * 9, "{what}: only {near}/{} values within 1e-6 of stepwise", got.len());

                // Against exact attention: each of the <= ctx accumulator roundings loses at
                // most 2^-12 of |acc| <= Σw; relative to the output (acc / Σw) that is
                // ctx · 2^-12, plus the f32 steps.
                let exact = case.exact(scale);
                let bound = ctx as f64 * 2f64.powi(-12) + 1e-5;
                let mut worst = 0.0f64;
                for (g, e) in got.iter().zip(&exact) {
                    worst = worst.max((f64::from(*g) - e).abs());
                }
                assert!(worst <= bound, "{what}: exact reference off by {worst:e} > {bound:e}");
            }
        }
    }
}

#[test]
fn f16_attention_chunk_equals_token_by_token() {
    let mut r = ChaCha8Rng::seed_from_u64(22);
    let (n_heads, n_kv, hd, bs) = (9, 3, 64, 16);
    // 70 tokens: enough work for the parallel path in the chunk.
    let case = Case::new(&mut r, n_heads, n_kv, hd, 0, 70);
    let table: Vec<u32> = shuffled(&mut r, 5);
    let stride = n_kv * hd;
    let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
    let batched = run(&case, bs, &table, 5, 0.125);
    let mut kc = vec![f16::ZERO; 5 * bs * stride];
    let mut vc = kc.clone();
    let row = n_heads * hd;
    for t in 0..70 {
        let seq = SeqSlice { block_table: &table, first_pos: t, n_tokens: 1 };
        let (k, v) = (&case.k[t * stride..(t + 1) * stride], &case.v[t * stride..(t + 1) * stride]);
        write_kv_f16(&cache, &mut kc, &mut vc, k, v, &seq).unwrap();
        let mut out = vec![f32::NAN; row];
        attention_f16(&cache, &kc, &vc, &mut out, &case.q[t * row..(t + 1) * row], &seq, n_heads, 0.125).unwrap();
        let want = &batched[t * row..(t + 1) * row];
        assert!(out.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t}: alone differs from chunk");
    }
}

#[test]
fn f16_attention_rejects_bad_inputs() {
    let is_shape_err = |r: Result<(), KernelError>| matches!(r, Err(KernelError::Shape { .. }));
    let (hd, n_kv, bs) = (8, 2, 4);
    let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
    let mut kc = vec![f16::from_f32(0.1); 3 * bs * n_kv * hd];
    let mut vc = kc.clone();
    let kv = vec![0.2f32; 2 * n_kv * hd];
    let q = vec![0.3f32; 2 * 4 * hd];
    let mut out = vec![0.0f32; q.len()];
    let table = [2u32, 0];
    let ok = SeqSlice { block_table: &table, first_pos: 5, n_tokens: 2 };
    assert!(write_kv_f16(&cache, &mut kc, &mut vc, &kv, &kv, &ok).is_ok());
    assert!(attention_f16(&cache, &kc, &vc, &mut out, &q, &ok, 4, 0.3).is_ok());
    let short = SeqSlice { block_table: &table, first_pos: 7, n_tokens: 2 };
    assert!(is_shape_err(write_kv_f16(&cache, &mut kc, &mut vc, &kv, &kv, &short)));
    assert!(is_shape_err(attention_f16(&cache, &kc, &vc, &mut out, &q, &short, 4, 0.3)));
    let bad_table = [1u32, 3];
    let bad = SeqSlice { block_table: &bad_table, first_pos: 5, n_tokens: 2 };
    assert!(is_shape_err(attention_f16(&cache, &kc, &vc, &mut out, &q, &bad, 4, 0.3)));
    assert!(is_shape_err(attention_f16(&cache, &kc, &vc, &mut out[..2 * 3 * hd], &q[..2 * 3 * hd], &ok, 3, 0.3)));
    assert!(is_shape_err(attention_f16(&cache, &kc, &vc, &mut out, &q, &ok, 4, f32::NAN)));
    assert!(is_shape_err(attention_f16(&cache, &kc[1..], &vc[1..], &mut out, &q, &ok, 4, 0.3)));
    assert!(is_shape_err(write_kv_f16(&cache, &mut kc, &mut vc, &kv[1..], &kv[1..], &ok)));
}

/// The register kernels (AVX2/F16C, and the AVX-512VL build of the same code) against
/// the scalar rows, bit for bit, on random inputs with values that overflow f16 (q, and
/// accumulators of large V rows), that round into f16 subnormals or to zero; head dims
/// the register kernel takes (64, 128, 256) and one it leaves to the scalar rows (80);
/// GQA groups it takes 1, 2, 3 or 4 heads of at a time (groups 5 and 7: one at a time; the
/// width is also cut to one head where whole groups would leave threads idle).
#[test]
fn f16_attention_simd_equals_scalar_bit_for_bit() {
    for (name, simd) in [("AVX2", Isa::avx2()), ("AVX-512VL", Isa::vnni())] {
        match simd {
            Some(isa) => {
                simd_equals_scalar(isa);
                eprintln!("{name} attention kernel: bit-equal to the scalar rows");
            }
            None => eprintln!("skipped the {name} attention kernel: this CPU lacks it"),
        }
    }
}

fn simd_equals_scalar(simd: Isa) {
    let mut r = ChaCha8Rng::seed_from_u64(23);
    let same =
        |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
    for (n_heads, n_kv, hd) in [(9, 3, 64), (8, 2, 64), (5, 1, 64), (4, 2, 128), (14, 2, 128), (2, 1, 256), (4, 2, 80)]
    {
        // (q range, k range, v range): ordinary; V large enough that Σ w·v overflows f16;
        // tiny V (f16 subnormals and underflow); q beyond f16's range in places.
        for (qr, kr, vr) in [(2.0, 2.0, 1.0), (1.0, 1.0, 6.0e4), (1.0, 1.0, 3.0e-6), (1.0e5, 1.0e-3, 1.0)] {
            let mut case = Case::new(&mut r, n_heads, n_kv, hd, 29, 13);
            case.q.iter_mut().for_each(|x| *x *= qr / 2.0);
            case.k.iter_mut().for_each(|x| *x *= kr / 2.0);
            case.v.iter_mut().for_each(|x| *x *= vr);
            let what = format!("h{n_heads}/kv{n_kv} hd{hd} ranges {qr:e}/{kr:e}/{vr:e}");
            let (bs, ctx): (usize, usize) = (16, 29 + 13);
            let table = shuffled(&mut r, ctx.div_ceil(bs) + 1);
            let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
            let stride = n_kv * hd;
            let mut kc = vec![f16::ZERO; table.len() * bs * stride];
            let mut vc = kc.clone();
            let all = SeqSlice { block_table: &table, first_pos: 0, n_tokens: ctx };
            write_kv_f16(&cache, &mut kc, &mut vc, &case.k, &case.v, &all).unwrap();
            let seq = SeqSlice { block_table: &table, first_pos: 29, n_tokens: 13 };
            let run = |isa| {
                let mut out = vec![f32::NAN; case.q.len()];
                attention_f16_with(isa, &cache, &kc, &vc, &mut out, &case.q, &seq, n_heads, 0.125).unwrap();
                out
            };
            let (fast, slow) = (run(simd), run(Isa::scalar()));
            assert!(same(&fast, &slow), "{what}: {} kernel differs from the scalar rows", simd.name());
            // The regimes were reached: infinities where V is large, nothing else
            // non-finite unless q overflowed.
            let non_finite = slow.iter().filter(|x| !x.is_finite()).count();
            assert_eq!(non_finite > 0, vr > 1.0e4 || qr > 1.0e4, "{what}: {non_finite} non-finite outputs");
        }
    }
}
