//! The non-matmul CPU ops against straightforward f64 references written here, on
//! random inputs: RMSNorm, RoPE (both pair styles, Llama-3 scaling, frequency factors,
//! ggml-style angles), the pointwise ops (incl. ggml's `e^x` and SwiGLU), softmax, and
//! paged attention against dense causal attention.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::attention::{attention, write_kv, PagedKv, SeqSlice};
use tessera_kernels::cpu::exp_ggml::exp_ggml;
use tessera_kernels::cpu::norm::SumOrder;
use tessera_kernels::cpu::rope::{
    rope, rope_qk_with_table, rope_with_table, Llama3Scaling, RopeAngles, RopeParams, RopeStyle,
};
use tessera_kernels::cpu::{activation, norm, softmax};
use tessera_kernels::quant::q8::ActsQ8;
use tessera_kernels::KernelError;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// A value uniform in `[lo, hi)`.
fn unif(r: &mut ChaCha8Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * ((r.next_u32() >> 8) as f32 / (1u32 << 24) as f32)
}

fn rand_vec(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| unif(r, lo, hi)).collect()
}

/// Asserts `|got - want| <= atol + rtol * |want|` everywhere.
fn assert_close(what: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(err <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w} (err {err:e})");
    }
}

fn is_shape_err<T: std::fmt::Debug>(r: Result<T, KernelError>) -> bool {
    matches!(r, Err(KernelError::Shape { .. }))
}

// ---------------------------------------------------------------- RMSNorm

fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let dim = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(dim) {
        let ms = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / dim as f64;
        let s = 1.0 / (ms + f64::from(eps)).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &wv)| f64::from(v) * s * f64::from(wv)));
    }
    out
}

#[test]
fn rms_norm_matches_reference() {
    let mut r = rng(1);
    // (rows, dim): a decode row, a block-norm batch large enough for the parallel path,
    // and Qwen3's per-head use (rows = tokens * heads, dim = head_dim).
    for (rows, dim, eps) in [(1, 576, 1e-5f32), (64, 576, 1e-5), (5 * 9, 64, 1e-6), (3, 7, 0.5), (4, 579, 1e-5)] {
        let x = rand_vec(&mut r, rows * dim, -3.0, 3.0);
        let w = rand_vec(&mut r, dim, -2.0, 2.0);
        let want = rms_norm_ref(&x, &w, eps);
        let mut ggml = vec![f32::NAN; x.len()];
        for order in [SumOrder::Ggml, SumOrder::Lanes] {
            let mut out = vec![f32::NAN; x.len()];
            norm::rms_norm_with(order, &mut out, &x, &w, rows, eps).unwrap();
            assert_close("rms_norm", &out, &want, 1e-6, 1e-5);
            let mut inplace = x.clone();
            norm::rms_norm_inplace_with(order, &mut inplace, &w, rows, eps).unwrap();
            assert_eq!(inplace, out, "{order:?}: in-place and out-of-place differ");
            if order == SumOrder::Ggml {
                ggml = out;
            } else {
                // The two orders' f64 sums differ by a few units of 2^-53, under the f32
                // scale's rounding step except right at a boundary: at most one ulp.
                for (a, b) in out.iter().zip(&ggml) {
                    assert!((a - b).abs() <= 2.0 * f32::EPSILON * b.abs(), "lanes {a} vs ggml {b}");
                }
            }
        }
    }
}

/// The lanes order is what `SumOrder::Lanes` documents: value `i` into lane `i % 8`, the
/// lanes added pairwise ((0+4)+(2+6))+((1+5)+(3+7)); checked bit for bit through the
/// scale it gives, at widths with and without a tail.
#[test]
fn rms_norm_lanes_sum_in_its_documented_order() {
    let mut r = rng(9);
    for dim in [13usize, 64, 579] {
        let x = rand_vec(&mut r, dim, -3.0, 3.0);
        let w = vec![1.0f32; dim];
        let mut lanes = [0.0f64; 8];
        for (i, &v) in x.iter().enumerate() {
            lanes[i % 8] += f64::from(v * v);
        }
        let sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
        let scale = 1.0 / ((sum / dim as f64) as f32 + 1e-5).sqrt();
        let mut out = vec![0.0f32; dim];
        norm::rms_norm_with(SumOrder::Lanes, &mut out, &x, &w, 1, 1e-5).unwrap();
        for (o, &v) in out.iter().zip(&x) {
            assert_eq!(o.to_bits(), (v * scale).to_bits(), "dim {dim}");
        }
    }
}

#[test]
fn rms_norm_rejects_bad_shapes() {
    let (x, w) = (vec![1.0f32; 12], vec![1.0f32; 4]);
    let mut out = vec![0.0f32; 12];
    assert!(is_shape_err(norm::rms_norm(&mut out, &x, &w, 4, 1e-5)));
    assert!(is_shape_err(norm::rms_norm(&mut out[..8], &x, &w, 3, 1e-5)));
    assert!(is_shape_err(norm::rms_norm(&mut out, &x, &[], 3, 1e-5)));
    assert!(is_shape_err(norm::rms_norm(&mut out, &x, &w, 3, f32::NAN)));
    let mut x2 = x.clone();
    assert!(is_shape_err(norm::rms_norm_inplace(&mut x2, &w[..3], 3, 1e-5)));
    assert!(norm::rms_norm(&mut out, &x, &w, 3, 1e-5).is_ok());
}

// ---------------------------------------------------------------- RoPE

/// The fused producers of the packed matmul's 8-bit activations give the bits of the op
/// then `ActsQ8::quantize_plain`: `rms_norm_q8` in both sum orders, `silu_mul_ggml_q8`;
/// row counts on one thread and split (from 2,048 values), widths of 2, 18 and 130 blocks
/// (a row wider than a 2,048-value piece: three pieces, the last of 64 values), whole
/// multiples of a piece (2,048 and 4,096), and an all-zero row (scale 0).
#[test]
fn fused_q8_producers_equal_op_then_quantise() {
    let mut r = rng(31);
    let same = |what: &str, a: &ActsQ8, b: &ActsQ8| {
        assert_eq!(a.qs, b.qs, "{what}: quants");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.d), bits(&b.d), "{what}: scales");
        assert_eq!(bits(&a.s), bits(&b.s), "{what}: block sums");
        assert_eq!(a.cols, b.cols, "{what}: cols");
    };
    for cols in [64usize, 576, 2048, 4096, 4160] {
        for n in [1usize, 2, 5, 16, 33] {
            // Rows of different sizes, so each row's scale matters.
            let mut x: Vec<f32> = (0..n)
                .flat_map(|t| rand_vec(&mut r, cols, -1.0, 1.0).into_iter().map(move |v| v * (1 + t) as f32))
                .collect();
            // An all-zero row (scale 0) among the others.
            if n > 2 {
                x[cols..2 * cols].fill(0.0);
            }
            let w = rand_vec(&mut r, cols, 0.5, 1.5);
            for order in [SumOrder::Ggml, SumOrder::Lanes] {
                let mut normed = vec![0.0; n * cols];
                norm::rms_norm_with(order, &mut normed, &x, &w, n, 1e-5).unwrap();
                let fused = norm::rms_norm_q8(order, &x, &w, n, 1e-5).unwrap();
                same(&format!("rms_norm {order:?} {n}x{cols}"), &fused, &ActsQ8::quantize_plain(&normed, cols));
            }
        }
    }
    for cols in [64usize, 1536, 2048, 4096, 4160] {
        for n in [1usize, 3, 16, 40] {
            let gate = rand_vec(&mut r, n * cols, -8.0, 8.0);
            let up = rand_vec(&mut r, n * cols, -2.0, 2.0);
            let mut product = gate.clone();
            activation::silu_mul_ggml_inplace(&mut product, &up).unwrap();
            let fused = activation::silu_mul_ggml_q8(&gate, &up, cols).unwrap();
            same(&format!("silu_mul {n}x{cols}"), &fused, &ActsQ8::quantize_plain(&product, cols));
        }
    }
    let x = rand_vec(&mut r, 2 * 48, -1.0, 1.0);
    assert!(is_shape_err(norm::rms_norm_q8(SumOrder::Lanes, &x, &x[..48], 2, 1e-5)), "rows of 48");
    assert!(is_shape_err(norm::rms_norm_q8(SumOrder::Lanes, &x[..64], &x[..32], 3, 1e-5)), "rows short");
    assert!(is_shape_err(activation::silu_mul_ggml_q8(&x, &x[..64], 32)), "gate and up differ");
    assert!(is_shape_err(activation::silu_mul_ggml_q8(&x, &x, 48)), "rows of 48");
    assert!(is_shape_err(activation::silu_mul_ggml_q8(&x, &x, 64)), "96 values in rows of 64");
    assert!(is_shape_err(activation::silu_mul_ggml_q8(&[], &[], 0)), "rows of 0");
    // No rows: empty activations that still know their width.
    assert_eq!(activation::silu_mul_ggml_q8(&[], &[], 64).unwrap().cols, 64);
    assert_eq!(norm::rms_norm_q8(SumOrder::Lanes, &[], &x[..64], 0, 1e-5).unwrap().cols, 64);
}

/// q and k rotated in one pass give the bits of a `rope_with_table` call each, in both
/// styles, partial rotation included, on one thread and split; bad shapes are errors.
#[test]
fn rope_qk_equals_a_call_each() {
    let mut r = rng(32);
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for (hd, rope_dim) in [(64usize, 64usize), (64, 32)] {
            let params = RopeParams::new(rope_dim, 10000.0, None, None).unwrap();
            for n in [1usize, 3, 16, 40] {
                let positions: Vec<u32> = (0..n).map(|t| (t * 37 % 500) as u32).collect();
                let table = params.table(&positions);
                let q = rand_vec(&mut r, n * 9 * hd, -2.0, 2.0);
                let k = rand_vec(&mut r, n * 3 * hd, -2.0, 2.0);
                let (mut q1, mut k1) = (q.clone(), k.clone());
                rope_with_table(&mut q1, n, 9, hd, &table, style).unwrap();
                rope_with_table(&mut k1, n, 3, hd, &table, style).unwrap();
                let (mut q2, mut k2) = (q, k);
                rope_qk_with_table(&mut q2, &mut k2, n, 9, 3, hd, &table, style).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&q1), bits(&q2), "{style:?} hd {hd} n {n}: q");
                assert_eq!(bits(&k1), bits(&k2), "{style:?} hd {hd} n {n}: k");
            }
        }
    }
    // No tokens: nothing to do, no error.
    let none = RopeParams::new(64, 10000.0, None, None).unwrap().table(&[]);
    rope_qk_with_table(&mut [], &mut [], 0, 9, 3, 64, &none, RopeStyle::Neox).unwrap();
    let table = RopeParams::new(64, 10000.0, None, None).unwrap().table(&[0, 1]);
    let (mut q, mut k) = (vec![0.5f32; 2 * 9 * 64], vec![0.5f32; 2 * 3 * 64]);
    assert!(is_shape_err(rope_qk_with_table(&mut q, &mut k[..100], 2, 9, 3, 64, &table, RopeStyle::Neox)), "short k");
    assert!(is_shape_err(rope_qk_with_table(&mut q, &mut k, 2, 9, 2, 64, &table, RopeStyle::Neox)), "k heads");
    assert!(
        is_shape_err(rope_qk_with_table(&mut q[..9 * 64], &mut k[..3 * 64], 1, 9, 3, 64, &table, RopeStyle::Neox)),
        "table of 2 tokens for 1"
    );
}

/// Rotates each pair `(a, b)` as the complex number `a + ib` times `e^{i pos inv_freq}`.
fn rope_ref(
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[u32],
    inv_freq: &[f64],
    style: RopeStyle,
) -> Vec<f64> {
    let half = inv_freq.len();
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..n_heads {
            let base = (t * n_heads + h) * head_dim;
            for (i, &f) in inv_freq.iter().enumerate() {
                let (ia, ib) = match style {
                    RopeStyle::Interleaved => (base + 2 * i, base + 2 * i + 1),
                    RopeStyle::Neox => (base + i, base + i + half),
                };
                let (a, b) = (out[ia], out[ib]);
                let ang = f64::from(pos) * f;
                let (re, im) = (ang.cos(), ang.sin());
                out[ia] = a * re - b * im;
                out[ib] = a * im + b * re;
            }
        }
    }
    out
}

fn plain_inv_freq(theta: f64, rope_dim: usize) -> Vec<f64> {
    (0..rope_dim / 2).map(|i| 1.0 / theta.powf((2 * i) as f64 / rope_dim as f64)).collect()
}

#[test]
fn rope_matches_complex_rotation_both_styles() {
    let mut r = rng(2);
    // Non-contiguous, unordered positions, including a large one; then a run of 64 more
    // (72 tokens: enough angles for the parallel table of `RopeParams::table`).
    let mut positions: Vec<u32> = vec![0, 5, 3, 1000, 77_777, 12, 1, 4095, 2, 9, 31_000, 7];
    positions.extend(200..264);
    let n_tokens = positions.len();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        // (heads, head_dim, rope_dim, theta): full rotary, partial rotary, and a size
        // large enough for the parallel path.
        for (n_heads, head_dim, rope_dim, theta) in
            [(9, 64, 64, 10_000.0f32), (4, 64, 32, 1_000_000.0), (32, 128, 128, 500_000.0)]
        {
            let x = rand_vec(&mut r, n_tokens * n_heads * head_dim, -2.0, 2.0);
            let params = RopeParams::new(rope_dim, theta, None, None).unwrap();
            let inv = plain_inv_freq(f64::from(theta), rope_dim);
            assert_close("inv_freq", &params.inv_freq().iter().map(|&v| v as f32).collect::<Vec<_>>(), &inv, 0.0, 1e-6);
            let want = rope_ref(&x, n_heads, head_dim, &positions, &inv, style);
            // Past rope_dim the dims are untouched: the reference above only rotated
            // pairs below rope_dim, so `want` already carries them through.
            let mut got = x.clone();
            rope(&mut got, n_tokens, n_heads, head_dim, &positions, &params, style).unwrap();
            assert_close(&format!("rope {style:?} hd{head_dim} rd{rope_dim}"), &got, &want, 2e-6, 2e-6);
            if rope_dim < head_dim {
                for (row, xr) in got.chunks(head_dim).zip(x.chunks(head_dim)) {
                    assert_eq!(&row[rope_dim..], &xr[rope_dim..], "partial rotary touched the tail");
                }
            }
            // Position 0 is the identity.
            let mut zero = x[..n_heads * head_dim].to_vec();
            rope(&mut zero, 1, n_heads, head_dim, &[0], &params, style).unwrap();
            assert_eq!(zero, &x[..n_heads * head_dim]);
        }
    }
}

#[test]
fn rope_styles_differ_only_by_pair_layout() {
    // Permuting each head's dims from interleaved to half-split layout turns
    // interleaved rope into neox rope (what the GGUF converter's q/k permutation does).
    let mut r = rng(3);
    let (n_heads, hd, positions) = (3, 16, vec![4u32, 17, 250]);
    let params = RopeParams::new(hd, 10_000.0, None, None).unwrap();
    let x = rand_vec(&mut r, positions.len() * n_heads * hd, -1.0, 1.0);
    let to_neox = |v: &[f32]| -> Vec<f32> {
        v.chunks(hd)
            .flat_map(|h| (0..hd / 2).map(|i| h[2 * i]).chain((0..hd / 2).map(|i| h[2 * i + 1])).collect::<Vec<_>>())
            .collect()
    };
    let mut a = x.clone();
    rope(&mut a, 3, n_heads, hd, &positions, &params, RopeStyle::Interleaved).unwrap();
    let mut b = to_neox(&x);
    rope(&mut b, 3, n_heads, hd, &positions, &params, RopeStyle::Neox).unwrap();
    assert_eq!(to_neox(&a), b);
}

/// Llama-3.1-8B frequencies (theta 500000, head_dim 128, factor 8, low 1, high 4,
/// original context 8192) printed by this independent numpy computation (numpy 2.4,
/// float64), written from the HF `rope_type: "llama3"` description:
///
/// ```python
/// import numpy as np
/// theta, dim, factor, lo, hi, old = 500000.0, 128, 8.0, 1.0, 4.0, 8192
/// inv = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
/// wl = 2 * np.pi / inv
/// scaled = np.where(wl > old / lo, inv / factor, inv)
/// s = (old / wl - lo) / (hi - lo)
/// smoothed = (1 - s) * scaled / factor + s * scaled
/// medium = ~(wl < old / hi) & ~(wl > old / lo)
/// out = np.where(medium, smoothed, scaled)
/// ```
const LLAMA31_INV_FREQ: [(usize, f64); 11] = [
    (0, 1.0),                   // high frequency: unchanged
    (1, 0.8146172338565447),    // high
    (20, 0.016560440080994446), // high
    (29, 0.002166570763503359), // medium (smoothed) ...
    (30, 0.0013718935677611381),
    (31, 0.0008567514129196324),
    (32, 0.0005248461609929547),
    (33, 0.00031269375038406517),
    (34, 0.00017850781276799638), // ... medium
    (40, 3.428102195952591e-05),  // low frequency: divided by 8
    (63, 3.068925988914511e-07),  // low
];

fn llama31() -> Llama3Scaling {
    Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 }
}

#[test]
fn rope_llama3_scaling_matches_numpy() {
    let p = RopeParams::new(128, 500_000.0, Some(llama31()), None).unwrap();
    assert_eq!(p.inv_freq().len(), 64);
    for (i, want) in LLAMA31_INV_FREQ {
        let got = p.inv_freq()[i];
        assert!((got - want).abs() <= 1e-12 * want, "inv_freq[{i}]: got {got:e}, want {want:e}");
    }
}

#[test]
fn rope_freq_factors_divide_inv_freq_and_match_llama3() {
    // llama.cpp's converter stores Llama-3 scaling as per-pair factors
    // `1 / scale`; those must give the same frequencies as the config-side scaling.
    let (theta, dim) = (500_000.0f64, 128usize);
    let s = llama31();
    let factors: Vec<f32> = plain_inv_freq(theta, dim)
        .iter()
        .map(|&f| {
            let wl = 2.0 * std::f64::consts::PI / f;
            let (old, lo, hi, fac) = (8192.0, 1.0, 4.0, 8.0);
            if wl < old / hi {
                1.0
            } else if wl > old / lo {
                fac as f32
            } else {
                let sm = (old / wl - lo) / (hi - lo);
                (1.0 / ((1.0 - sm) / fac + sm)) as f32
            }
        })
        .collect();
    let from_factors = RopeParams::new(dim, theta as f32, None, Some(factors.clone())).unwrap();
    let from_config = RopeParams::new(dim, theta as f32, Some(s), None).unwrap();
    for (i, (a, b)) in from_factors.inv_freq().iter().zip(from_config.inv_freq()).enumerate() {
        // The factors were rounded to f32.
        assert!((a - b).abs() <= 1e-7 * b, "pair {i}: factors {a:e} vs llama3 {b:e}");
    }

    // Arbitrary factors: inv_freq = theta^(-2i/d) / factor[i], and rope uses them.
    let mut r = rng(4);
    let ff = rand_vec(&mut r, 32, 0.5, 4.0);
    let p = RopeParams::new(64, 10_000.0, None, Some(ff.clone())).unwrap();
    let want: Vec<f64> = plain_inv_freq(10_000.0, 64).iter().zip(&ff).map(|(f, &d)| f / f64::from(d)).collect();
    for (g, w) in p.inv_freq().iter().zip(&want) {
        assert!((g - w).abs() <= 1e-12 * w);
    }
    let positions = [3u32, 900, 17];
    let x = rand_vec(&mut r, 3 * 2 * 64, -1.0, 1.0);
    let mut got = x.clone();
    rope(&mut got, 3, 2, 64, &positions, &p, RopeStyle::Neox).unwrap();
    assert_close("rope with factors", &got, &rope_ref(&x, 2, 64, &positions, &want, RopeStyle::Neox), 2e-6, 2e-6);
}

#[test]
fn rope_rejects_bad_params_and_shapes() {
    assert!(is_shape_err(RopeParams::new(63, 10_000.0, None, None)));
    assert!(is_shape_err(RopeParams::new(0, 10_000.0, None, None)));
    assert!(is_shape_err(RopeParams::new(64, 0.0, None, None)));
    assert!(is_shape_err(RopeParams::new(64, 10_000.0, Some(llama31()), Some(vec![1.0; 32]))));
    assert!(is_shape_err(RopeParams::new(64, 10_000.0, None, Some(vec![1.0; 31]))));
    assert!(is_shape_err(RopeParams::new(64, 10_000.0, None, Some(vec![0.0; 32]))));
    let bad = Llama3Scaling { high_freq_factor: 1.0, ..llama31() };
    assert!(is_shape_err(RopeParams::new(64, 10_000.0, Some(bad), None)));

    let p = RopeParams::new(64, 10_000.0, None, None).unwrap();
    let mut x = vec![0.5f32; 2 * 2 * 64];
    assert!(is_shape_err(rope(&mut x, 2, 2, 64, &[1], &p, RopeStyle::Neox)));
    assert!(is_shape_err(rope(&mut x, 2, 2, 63, &[1, 2], &p, RopeStyle::Neox)));
    assert!(is_shape_err(rope(&mut x, 3, 2, 64, &[1, 2, 3], &p, RopeStyle::Neox)));
    assert!(is_shape_err(rope(&mut x[..128], 1, 4, 32, &[1], &p, RopeStyle::Neox)));
    assert!(rope(&mut x, 2, 2, 64, &[1, 2], &p, RopeStyle::Neox).is_ok());
    // An angle table for other tokens than x's.
    let table = p.table(&[1, 2, 3]);
    assert!(is_shape_err(rope_with_table(&mut x, 2, 2, 64, &table, RopeStyle::Neox)));
}

// ---------------------------------------------------------------- pointwise, softmax

fn silu_ref(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

#[test]
fn pointwise_ops_match_reference() {
    let mut r = rng(5);
    // A short buffer (serial path) and a long one (parallel chunks with a tail).
    for n in [1536, 5 * 1536 * 7 + 3] {
        let gate = rand_vec(&mut r, n, -12.0, 12.0);
        let up = rand_vec(&mut r, n, -3.0, 3.0);
        let want: Vec<f64> = gate.iter().zip(&up).map(|(&g, &u)| silu_ref(g.into()) * f64::from(u)).collect();
        let mut out = vec![f32::NAN; n];
        activation::silu_mul(&mut out, &gate, &up).unwrap();
        assert_close("silu_mul", &out, &want, 1e-6, 1e-5);
        let mut g2 = gate.clone();
        activation::silu_mul_inplace(&mut g2, &up).unwrap();
        assert_eq!(g2, out);

        let mut a = gate.clone();
        activation::add_inplace(&mut a, &up).unwrap();
        let want: Vec<f64> = gate.iter().zip(&up).map(|(&x, &y)| f64::from(x) + f64::from(y)).collect();
        assert_close("add_inplace", &a, &want, 1e-6, 1e-6);

        let mut s = gate.clone();
        activation::scale_inplace(&mut s, 0.37).unwrap();
        let want: Vec<f64> = gate.iter().map(|&x| f64::from(x) * f64::from(0.37f32)).collect();
        assert_close("scale_inplace", &s, &want, 0.0, 1e-6);
    }
    // Extreme gate values stay finite: silu(-1000) = -0, silu(1000) = 1000.
    let mut out = [0.0f32; 2];
    activation::silu_mul(&mut out, &[-1000.0, 1000.0], &[2.0, 2.0]).unwrap();
    assert_eq!(out, [0.0, 2000.0]);

    let (rows, dim) = (40, 896);
    let x = rand_vec(&mut r, rows * dim, -1.0, 1.0);
    let bias = rand_vec(&mut r, dim, -1.0, 1.0);
    let mut y = x.clone();
    activation::add_row_bias(&mut y, &bias).unwrap();
    let want: Vec<f64> = x.iter().enumerate().map(|(i, &v)| f64::from(v) + f64::from(bias[i % dim])).collect();
    assert_close("add_row_bias", &y, &want, 1e-6, 1e-6);

    let mut short = vec![0.0f32; 3];
    assert!(is_shape_err(activation::silu_mul(&mut short, &[1.0; 3], &[1.0; 4])));
    assert!(is_shape_err(activation::silu_mul_inplace(&mut short, &[1.0; 2])));
    assert!(is_shape_err(activation::add_inplace(&mut short, &[1.0; 2])));
    assert!(is_shape_err(activation::add_row_bias(&mut short, &[1.0; 2])));
    assert!(is_shape_err(activation::scale_inplace(&mut short, f32::INFINITY)));
}

#[test]
fn softmax_is_stable_and_matches_reference() {
    let mut r = rng(6);
    let mut x = rand_vec(&mut r, 1000, -30.0, 30.0);
    x[7] += 1e4; // would overflow exp without the max shift
    x[11] = f32::NEG_INFINITY;
    let m = x.iter().copied().fold(f64::NEG_INFINITY, |a, b| a.max(b.into()));
    let z: f64 = x.iter().map(|&v| (f64::from(v) - m).exp()).sum();
    let want: Vec<f64> = x.iter().map(|&v| (f64::from(v) - m).exp() / z).collect();
    softmax::softmax_inplace(&mut x).unwrap();
    assert_close("softmax", &x, &want, 1e-9, 1e-5);
    assert_eq!(x[11], 0.0);

    let mut rows = rand_vec(&mut r, 3 * 50, -5.0, 5.0);
    softmax::softmax_rows_inplace(&mut rows, 50).unwrap();
    for row in rows.chunks(50) {
        assert!((row.iter().map(|&v| f64::from(v)).sum::<f64>() - 1.0).abs() < 1e-6);
    }
    assert!(is_shape_err(softmax::softmax_inplace(&mut [f32::NEG_INFINITY; 4])));
    assert!(is_shape_err(softmax::softmax_inplace(&mut [1.0, f32::NAN])));
    assert!(is_shape_err(softmax::softmax_inplace(&mut [])));
    assert!(is_shape_err(softmax::softmax_rows_inplace(&mut [1.0; 5], 2)));
}

// ---------------------------------------------------------------- paged attention

/// Dense causal attention: `k`, `v` `[ctx, n_kv, hd]` for every position; queries
/// `[n_tokens, n_heads, hd]` at positions `first_pos..`.
#[allow(clippy::too_many_arguments)]
fn attention_ref(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n_tokens: usize,
    first_pos: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    scale: f32,
) -> Vec<f64> {
    let mut out = vec![0.0f64; n_tokens * n_heads * hd];
    let group = n_heads / n_kv;
    for t in 0..n_tokens {
        for h in 0..n_heads {
            let qh = &q[(t * n_heads + h) * hd..][..hd];
            let kvh = h / group;
            let n_ctx = first_pos + t + 1;
            let scores: Vec<f64> = (0..n_ctx)
                .map(|p| {
                    let kp = &k[(p * n_kv + kvh) * hd..][..hd];
                    f64::from(scale) * qh.iter().zip(kp).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>()
                })
                .collect();
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = w.iter().sum();
            let o = &mut out[(t * n_heads + h) * hd..][..hd];
            for (p, wp) in w.iter().enumerate() {
                let vp = &v[(p * n_kv + kvh) * hd..][..hd];
                for (od, &vd) in o.iter_mut().zip(vp) {
                    *od += wp / z * f64::from(vd);
                }
            }
        }
    }
    out
}

/// A random permutation of `0..n` (Fisher-Yates).
fn shuffled(r: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = (r.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

#[test]
fn paged_attention_matches_dense_causal() {
    let mut r = rng(7);
    let hd = 64;
    // (n_heads, n_kv_heads): GQA ratios 1, 3, 4.
    for (n_heads, n_kv) in [(4, 4), (9, 3), (8, 2)] {
        for block_size in [16, 1] {
            // (first_pos, n_tokens): a whole prompt, a prefill chunk starting
            // mid-context (and mid-block), a decode step.
            for (first_pos, n_tokens) in [(0, 21), (37, 11), (60, 1)] {
                let ctx = first_pos + n_tokens;
                let stride = n_kv * hd;
                let k = rand_vec(&mut r, ctx * stride, -1.0, 1.0);
                let v = rand_vec(&mut r, ctx * stride, -1.0, 1.0);
                let q = rand_vec(&mut r, n_tokens * n_heads * hd, -1.5, 1.5);
                let scale = 1.0 / (hd as f32).sqrt();

                // A pool bigger than needed, NaN everywhere: reading any slot that was
                // not written (another block, a future slot) poisons the output.
                let needed = ctx.div_ceil(block_size);
                let num_blocks = needed + 5;
                let table: Vec<u32> = shuffled(&mut r, num_blocks)[..needed + 2].to_vec();
                let cache = PagedKv { block_size, n_kv_heads: n_kv, head_dim: hd };
                let mut k_cache = vec![f32::NAN; num_blocks * block_size * stride];
                let mut v_cache = k_cache.clone();

                // The context before the chunk arrives in an earlier write, the chunk's own
                // K/V in this step's write.
                if first_pos > 0 {
                    let prior = SeqSlice { block_table: &table, first_pos: 0, n_tokens: first_pos };
                    let (kp, vp) = (&k[..first_pos * stride], &v[..first_pos * stride]);
                    write_kv(&cache, &mut k_cache, &mut v_cache, kp, vp, &prior).unwrap();
                }
                let seq = SeqSlice { block_table: &table, first_pos, n_tokens };
                let (kc, vc) = (&k[first_pos * stride..], &v[first_pos * stride..]);
                write_kv(&cache, &mut k_cache, &mut v_cache, kc, vc, &seq).unwrap();

                // Each position landed in its block/slot.
                for p in 0..ctx {
                    let off = (table[p / block_size] as usize * block_size + p % block_size) * stride;
                    assert_eq!(&k_cache[off..off + stride], &k[p * stride..(p + 1) * stride]);
                    assert_eq!(&v_cache[off..off + stride], &v[p * stride..(p + 1) * stride]);
                }

                let mut out = vec![f32::NAN; q.len()];
                attention(&cache, &k_cache, &v_cache, &mut out, &q, &seq, n_heads, scale).unwrap();
                let want = attention_ref(&q, &k, &v, n_tokens, first_pos, n_heads, n_kv, hd, scale);
                let what = format!("attention h{n_heads}/kv{n_kv} bs{block_size} pos{first_pos}+{n_tokens}");
                assert_close(&what, &out, &want, 2e-6, 1e-5);
            }
        }
    }
}

#[test]
fn paged_attention_large_prefill_uses_threads_and_matches() {
    // Enough work for the parallel path: 128 tokens x 8 heads over a 128-long context.
    let mut r = rng(8);
    let (n_heads, n_kv, hd, bs, n) = (8, 2, 64, 16, 128);
    let stride = n_kv * hd;
    let k = rand_vec(&mut r, n * stride, -1.0, 1.0);
    let v = rand_vec(&mut r, n * stride, -1.0, 1.0);
    let q = rand_vec(&mut r, n * n_heads * hd, -3.0, 3.0);
    let table = shuffled(&mut r, n / bs);
    let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
    let mut kc = vec![f32::NAN; n * stride];
    let mut vc = kc.clone();
    let seq = SeqSlice { block_table: &table, first_pos: 0, n_tokens: n };
    write_kv(&cache, &mut kc, &mut vc, &k, &v, &seq).unwrap();
    let mut out = vec![f32::NAN; q.len()];
    attention(&cache, &kc, &vc, &mut out, &q, &seq, n_heads, 0.125).unwrap();
    assert_close("attention large", &out, &attention_ref(&q, &k, &v, n, 0, n_heads, n_kv, hd, 0.125), 2e-6, 1e-5);
}

#[test]
fn paged_attention_rejects_bad_inputs() {
    let (hd, n_kv, bs) = (8, 2, 4);
    let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
    let num_blocks = 3;
    let mut kc = vec![0.1f32; num_blocks * bs * n_kv * hd];
    let mut vc = kc.clone();
    let kv = vec![0.2f32; 2 * n_kv * hd];
    let q = vec![0.3f32; 2 * 4 * hd];
    let mut out = vec![0.0f32; q.len()];
    let table = [2u32, 0];
    let ok = SeqSlice { block_table: &table, first_pos: 5, n_tokens: 2 };
    assert!(write_kv(&cache, &mut kc, &mut vc, &kv, &kv, &ok).is_ok());
    assert!(attention(&cache, &kc, &vc, &mut out, &q, &ok, 4, 0.3).is_ok());

    // Table covers 8 positions, 9 needed.
    let short = SeqSlice { block_table: &table, first_pos: 7, n_tokens: 2 };
    assert!(is_shape_err(write_kv(&cache, &mut kc, &mut vc, &kv, &kv, &short)));
    assert!(is_shape_err(attention(&cache, &kc, &vc, &mut out, &q, &short, 4, 0.3)));
    // Block id outside the pool.
    let bad_table = [1u32, 3];
    let bad = SeqSlice { block_table: &bad_table, first_pos: 5, n_tokens: 2 };
    assert!(is_shape_err(write_kv(&cache, &mut kc, &mut vc, &kv, &kv, &bad)));
    assert!(is_shape_err(attention(&cache, &kc, &vc, &mut out, &q, &bad, 4, 0.3)));
    // Heads not a multiple of kv heads; q of the wrong length; NaN scale.
    assert!(is_shape_err(attention(&cache, &kc, &vc, &mut out[..2 * 3 * hd], &q[..2 * 3 * hd], &ok, 3, 0.3)));
    assert!(is_shape_err(attention(&cache, &kc, &vc, &mut out, &q[..hd], &ok, 4, 0.3)));
    assert!(is_shape_err(attention(&cache, &kc, &vc, &mut out, &q, &ok, 4, f32::NAN)));
    // Cache not a whole number of blocks, k/v caches of different sizes, new K of the
    // wrong length, zero geometry.
    assert!(is_shape_err(attention(&cache, &kc[1..], &vc[1..], &mut out, &q, &ok, 4, 0.3)));
    let mut vc_small = vec![0.0f32; 2 * bs * n_kv * hd];
    assert!(is_shape_err(write_kv(&cache, &mut kc, &mut vc_small, &kv, &kv, &ok)));
    assert!(is_shape_err(write_kv(&cache, &mut kc, &mut vc, &kv[1..], &kv[1..], &ok)));
    let zero = PagedKv { block_size: 0, ..cache };
    assert!(is_shape_err(attention(&zero, &kc, &vc, &mut out, &q, &ok, 4, 0.3)));
}

// ---------------------------------------------------------------- llama.cpp-style steps

/// The ggml-style rope against its definition, written out here: `theta_scale =
/// theta^(-2/d)` in f32, pair `i`'s angle is the position multiplied by it `i` times in
/// f32 (then divided by frequency factor `i`), and the rotation is evaluated in f64 from
/// the f32 `cos`/`sin` of that angle.
#[test]
fn rope_ggml_angles_follow_the_f32_recurrence() {
    let mut r = rng(40);
    let positions: Vec<u32> = vec![0, 1, 7, 300, 4095, 31_000];
    let (n_heads, hd) = (3, 64);
    let theta = 100_000.0f32;
    let ff: Vec<f32> = (0..hd / 2).map(|i| 1.0 + (i % 5) as f32 * 0.75).collect();
    for factors in [None, Some(ff)] {
        let params = RopeParams::new(hd, theta, None, factors.clone()).unwrap().with_angles(RopeAngles::Ggml).unwrap();
        assert_eq!(params.angles(), RopeAngles::Ggml);
        let x = rand_vec(&mut r, positions.len() * n_heads * hd, -2.0, 2.0);
        let mut got = x.clone();
        rope(&mut got, positions.len(), n_heads, hd, &positions, &params, RopeStyle::Interleaved).unwrap();
        let scale = theta.powf(-2.0 / hd as f32);
        let mut want = Vec::new();
        for (t, &p) in positions.iter().enumerate() {
            let mut angles = Vec::new();
            let mut a = p as f32;
            for i in 0..hd / 2 {
                angles.push(match &factors {
                    Some(f) => a / f[i],
                    None => a,
                });
                a *= scale;
            }
            for h in 0..n_heads {
                let base = (t * n_heads + h) * hd;
                for (i, &ang) in angles.iter().enumerate() {
                    let (c, s) = (f64::from(ang.cos()), f64::from(ang.sin()));
                    let (x0, x1) = (f64::from(x[base + 2 * i]), f64::from(x[base + 2 * i + 1]));
                    want.push(x0 * c - x1 * s);
                    want.push(x0 * s + x1 * c);
                }
            }
        }
        assert_close("rope ggml angles", &got, &want, 1e-6, 1e-6);
        // The f32 recurrence drifts from the exact angle at large positions: the two
        // modes are different computations, and both stay close to the rotation.
        let mut exact = x.clone();
        let p_exact = RopeParams::new(hd, theta, None, factors.clone()).unwrap();
        rope(&mut exact, positions.len(), n_heads, hd, &positions, &p_exact, RopeStyle::Interleaved).unwrap();
        assert_ne!(exact, got, "ggml and exact angles gave identical rows");
        let worst = exact.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 0.05, "ggml-style angles far from the exact rotation: {worst}");
    }
    // llama.cpp has no ggml arithmetic for Llama-3 scaling given as a config.
    let l3 = RopeParams::new(128, 500_000.0, Some(llama31()), None).unwrap();
    assert!(is_shape_err(l3.with_angles(RopeAngles::Ggml)));
}

#[test]
fn exp_ggml_is_within_a_few_ulp_of_exp() {
    let mut r = rng(41);
    let mut worst_ulp = 0.0f64;
    for _ in 0..200_000 {
        let x = unif(&mut r, -87.0, 88.0);
        let got = f64::from(exp_ggml(x));
        let want = f64::from(x).exp();
        // Error in units of the last place of the f32 result.
        let ulp = (want.abs() as f32).next_up() as f64 - want.abs() as f32 as f64;
        worst_ulp = worst_ulp.max((got - want).abs() / ulp);
    }
    assert!(worst_ulp <= 4.0, "exp_ggml off by {worst_ulp:.2} ulp");
    // Edges: exact at 0, overflow to +inf, underflow through subnormals to 0, NaN.
    assert_eq!(exp_ggml(0.0), 1.0);
    assert_eq!(exp_ggml(100.0), f32::INFINITY);
    assert_eq!(exp_ggml(f32::INFINITY), f32::INFINITY);
    let tiny = exp_ggml(-100.0);
    assert!(tiny > 0.0 && !tiny.is_normal(), "e^-100 should be an f32 subnormal, got {tiny:e}");
    assert!((f64::from(tiny) - (-100f64).exp()).abs() <= f64::from(f32::from_bits(1)));
    assert_eq!(exp_ggml(-200.0), 0.0);
    assert_eq!(exp_ggml(f32::NEG_INFINITY), 0.0);
    assert!(exp_ggml(f32::NAN).is_nan());
}

#[test]
fn silu_mul_ggml_matches_reference() {
    let mut r = rng(42);
    // A decode row and a batch large enough for the parallel path.
    for n in [1536, 64 * 1536 + 16] {
        let gate = rand_vec(&mut r, n, -12.0, 12.0);
        let up = rand_vec(&mut r, n, -3.0, 3.0);
        let mut got = gate.clone();
        activation::silu_mul_ggml_inplace(&mut got, &up).unwrap();
        let want: Vec<f64> =
            gate.iter().zip(&up).map(|(&g, &u)| f64::from(g) / (1.0 + (-f64::from(g)).exp()) * f64::from(u)).collect();
        assert_close("silu_mul_ggml", &got, &want, 1e-6, 2e-6);
    }
    let mut g = vec![1.0f32; 4];
    assert!(is_shape_err(activation::silu_mul_ggml_inplace(&mut g, &[1.0; 3])));
}

/// The slice op (eight lanes at a time where the CPU has AVX2) gives exactly the scalar
/// `silu_ggml(g) * u` of every element: ordinary gates, gates where `e^-g` leaves f32's
/// normal range or its exponent range (|g| ~ 87 to 200), and special values, in a
/// length with a tail and one long enough for the parallel path.
#[test]
fn silu_mul_ggml_slice_equals_scalar_bit_for_bit() {
    let mut r = rng(43);
    let special = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 87.3, -88.7, 103.0, -103.0, 133.5, -134.0];
    for n in [1541, 20 * 1536 + 5] {
        let mut gate = rand_vec(&mut r, n, -12.0, 12.0);
        for (i, g) in gate.iter_mut().enumerate() {
            match i % 7 {
                0 => *g *= 17.0, // up to ±204
                1 => *g = special[(i / 7) % special.len()],
                _ => {}
            }
        }
        let up = rand_vec(&mut r, n, -3.0, 3.0);
        let mut got = gate.clone();
        activation::silu_mul_ggml_inplace(&mut got, &up).unwrap();
        for (i, ((&g, &u), &o)) in gate.iter().zip(&up).zip(&got).enumerate() {
            let want = activation::silu_ggml(g) * u;
            let same = o.to_bits() == want.to_bits() || (o.is_nan() && want.is_nan());
            assert!(same, "n={n} [{i}]: silu_ggml({g:e}) * {u:e}: slice {o:e}, scalar {want:e}");
        }
    }
}
