//! The fused decode GEMVs (`kernels/src/cuda/gemv_fused.rs`: norm + GEMV, norm + gate_up +
//! SwiGLU, GEMV + residual add) against an f64 reference written here and against the
//! unfused kernels they replace, on random bf16 inputs with NaN-poisoned outputs; plus a
//! benchmark of one Llama-8B layer's GEMV chain, fused vs unfused, in a CUDA graph.
//!
//! Needs a GPU: tests run only with `TESSERA_GPU_TESTS=1`, the benchmark only with
//! `TESSERA_GPU_BENCH=1` (`bench/gpu/run.sh` runs both on the device machine).
//!
//! What must hold:
//! - residual: bit for bit `bf16(r + bf16(x · Wᵀ))` with the unfused GEMV's output (both
//!   kernels sum in the same order), for every shape;
//! - norm + SwiGLU: bit for bit the norm GEMV (`matmul_rms_norm`) → `silu_mul_packed` pair,
//!   for every shape they take; the norm GEMV itself factors the norm out of its sum
//!   (rounding x * gamma, not the normalised x, to bf16), so against `rms_norm` → `matmul` it
//!   is held to the reference bound below, not to bits;
//! - all of them within the f64 reference's error bound: with `S = sum_k |xn_k w_k|` over
//!   the exactly normalised x, `|gpu - ref| <= S / 128 + |ref| / 128` (x's values are
//!   rounded to bf16, 2^-9 relative each, the row's scale applied in f32, and the output
//!   rounded to bf16); rows up to 14336 values where their m rows fit in shared memory;
//! - norm + qkv + RoPE + K/V write: q and both caches bit for bit what `matmul_rms_norm` then
//!   `qkv_rope_write` write (which cuda_qkv.rs checks against its f64 reference), with and
//!   without bias, partial rotation, a position past the RoPE table and skipped slots; the
//!   shapes it must refuse (Neox RoPE, a q/k norm, head_dim % 16 != 0) are errors.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use tessera_kernels::cpu::attention::PagedKv;
use tessera_kernels::cpu::rope::{RopeParams, RopeStyle};
use tessera_kernels::cuda::{Buf, Device, QkvPrep};

const EPS: f32 = 1e-5;

/// Exactly normalised rows of x (f64): `x * gamma / sqrt(mean(x^2) + eps)`.
fn normalised(x: &[f32], gamma: &[f32], m: usize, cols: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(m * cols);
    for row in x.chunks_exact(cols).take(m) {
        let ms = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / cols as f64;
        let s = 1.0 / (ms + f64::from(EPS)).sqrt();
        out.extend(row.iter().zip(gamma).map(|(&v, &g)| f64::from(v) * s * f64::from(g)));
    }
    out
}

/// `(sum_k x[i, k] w[j, k], sum_k |x[i, k] w[j, k]|)`, `[m, rows]` each.
fn products(x: &[f64], w: &[f32], m: usize, rows: usize, cols: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut mag) = (vec![0.0; m * rows], vec![0.0; m * rows]);
    for i in 0..m {
        let xr = &x[i * cols..(i + 1) * cols];
        for j in 0..rows {
            let (mut s, mut a) = (0f64, 0f64);
            for (&xv, &wv) in xr.iter().zip(&w[j * cols..(j + 1) * cols]) {
                let p = xv * f64::from(wv);
                s += p;
                a += p.abs();
            }
            out[i * rows + j] = s;
            mag[i * rows + j] = a;
        }
    }
    (out, mag)
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

struct Case {
    m: usize,
    rows: usize,
    cols: usize,
    x: Vec<bf16>,
    gamma: Vec<bf16>,
    w: Vec<bf16>,
}

impl Case {
    fn new(r: &mut rand_chacha::ChaCha8Rng, m: usize, rows: usize, cols: usize) -> Self {
        Case {
            m,
            rows,
            cols,
            x: rand_bf16(r, m * cols, -2.0, 2.0),
            gamma: rand_bf16(r, cols, 0.5, 1.5),
            w: rand_bf16(r, rows * cols, -0.1, 0.1),
        }
    }

    fn name(&self) -> String {
        format!("m={} {}x{}", self.m, self.rows, self.cols)
    }
}

/// Asserts `got` within the bound of the module comment; `what` names the case.
fn within(what: &str, got: &[bf16], want: &[f64], mag: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((g, &w), &a)) in got.iter().zip(want).zip(mag).enumerate() {
        let g = f64::from(g.to_f32());
        let bound = a / 128.0 + w.abs() / 128.0 + 1e-6;
        assert!((g - w).abs() <= bound, "{what}[{i}]: got {g}, want {w} (bound {bound:e})");
    }
}

/// Equal bit for bit: the fused kernels round where the unfused pairs they replace round.
fn agree(what: &str, fused: &[bf16], unfused: &[bf16]) {
    for (i, (a, b)) in fused.iter().zip(unfused).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}[{i}]: fused {a} != unfused {b}");
    }
}

fn norm_case(dev: &Device, c: &Case) {
    let (m, rows, cols) = (c.m, c.rows, c.cols);
    let (x, gamma, w) = (dev.upload(&c.x).unwrap(), dev.upload(&c.gamma).unwrap(), dev.upload(&c.w).unwrap());
    let mut fused = poisoned(dev, m * rows);
    dev.matmul_rms_norm(&mut fused, &x, &gamma, EPS, m, &w, rows, cols).unwrap();
    let fused = dev.download(&fused).unwrap();
    let xr = normalised(&to_f32(&c.x), &to_f32(&c.gamma), m, cols);
    let (want, mag) = products(&xr, &to_f32(&c.w), m, rows, cols);
    within(&format!("norm {}", c.name()), &fused, &want, &mag);
}

fn swiglu_case(dev: &Device, c: &Case) {
    let (m, cols) = (c.m, c.cols);
    let ffn = c.rows / 2;
    let (x, gamma, w) = (dev.upload(&c.x).unwrap(), dev.upload(&c.gamma).unwrap(), dev.upload(&c.w).unwrap());
    let mut fused = poisoned(dev, m * ffn);
    dev.matmul_rms_norm_swiglu(&mut fused, &x, &gamma, EPS, m, &w, ffn, cols).unwrap();
    let mut gu = poisoned(dev, m * 2 * ffn);
    let mut unfused = poisoned(dev, m * ffn);
    dev.matmul_rms_norm(&mut gu, &x, &gamma, EPS, m, &w, 2 * ffn, cols).unwrap();
    dev.silu_mul_packed(&mut unfused, &gu, m).unwrap();
    let (fused, unfused) = (dev.download(&fused).unwrap(), dev.download(&unfused).unwrap());
    // Reference: silu(g) * u from the exact products; g's and u's errors (bounded as in
    // `within`) pass through silu (slope <= 1.1) and the product.
    let xr = normalised(&to_f32(&c.x), &to_f32(&c.gamma), m, cols);
    let (gu_ref, mag) = products(&xr, &to_f32(&c.w), m, 2 * ffn, cols);
    let what = format!("swiglu m={m} ffn={ffn} cols={cols}");
    for i in 0..m {
        for j in 0..ffn {
            let (gi, ui) = (i * 2 * ffn + j, i * 2 * ffn + ffn + j);
            let (g, u) = (gu_ref[gi], gu_ref[ui]);
            let (eg, eu) = (mag[gi] / 128.0 + g.abs() / 128.0, mag[ui] / 128.0 + u.abs() / 128.0);
            let want = silu(g) * u;
            let bound = 1.1 * eg * (u.abs() + eu) + silu(g).abs() * eu + want.abs() / 128.0 + 1e-6;
            let got = f64::from(fused[i * ffn + j].to_f32());
            assert!((got - want).abs() <= bound, "{what}[{i}, {j}]: got {got}, want {want} (bound {bound:e})");
        }
    }
    agree(&what, &fused, &unfused);
}

fn residual_case(dev: &Device, c: &Case) {
    let (m, rows, cols) = (c.m, c.rows, c.cols);
    let (x, w) = (dev.upload(&c.x).unwrap(), dev.upload(&c.w).unwrap());
    // The residual stream: values of the size a layer's output adds to.
    let mut r = rng((m * rows + cols) as u64);
    let before = rand_bf16(&mut r, m * rows, -4.0, 4.0);
    let mut res = dev.upload(&before).unwrap();
    dev.matmul_add_residual(&mut res, &x, m, &w, rows, cols).unwrap();
    let mut plain = poisoned(dev, m * rows);
    dev.matmul(&mut plain, &x, m, &w, rows, cols).unwrap();
    let (got, plain) = (dev.download(&res).unwrap(), dev.download(&plain).unwrap());
    let unfused: Vec<bf16> = before.iter().zip(&plain).map(|(r, p)| bf16::from_f32(r.to_f32() + p.to_f32())).collect();
    let xr: Vec<f64> = c.x.iter().map(|v| f64::from(v.to_f32())).collect();
    let (prod, mag) = products(&xr, &to_f32(&c.w), m, rows, cols);
    let want: Vec<f64> = prod.iter().zip(&before).map(|(p, r)| p + f64::from(r.to_f32())).collect();
    let what = format!("residual {}", c.name());
    let mag: Vec<f64> = mag.iter().zip(&before).map(|(a, r)| a + f64::from(r.to_f32().abs())).collect();
    within(&what, &got, &want, &mag);
    agree(&what, &got, &unfused);
}

/// Shapes: SmolLM2 (576 wide, FFN 1536), Llama-8B widths (4096; 14336 as the input of
/// down), rows not a multiple of the 16-row tile (and FFN widths not a multiple of the
/// 8-feature SwiGLU tile), column counts ending in a partial 64-column chunk, tiny ones;
/// rows whose 64-column chunks do not split evenly over the warps (Qwen2-7B's 3584, 1032)
/// and long ones (8192).
const SHAPES: &[(usize, usize)] = &[
    (576, 576),
    (3072, 576),
    (1000, 4096),
    (206, 1000),
    (77, 14336),
    (40, 24),
    (18, 8),
    (1, 4096),
    (40, 3584),
    (24, 8192),
    (16, 1032),
];

#[test]
fn fused_gemvs_match_reference_and_unfused() {
    let Some(dev) = gpu("fused_gemvs_match_reference_and_unfused") else { return };
    let mut r = rng(71);
    for m in [1usize, 2, 5, 8] {
        for &(rows, cols) in SHAPES {
            assert!(dev.fused_gemv_applies(m, rows, cols), "m={m} {rows}x{cols} should take the fused GEMV");
            let c = Case::new(&mut r, m, rows, cols);
            residual_case(&dev, &c);
            // The norm GEMVs take as many rows of x as fit a CTA's shared memory next to the
            // ring (227 KB on Hopper): 8 rows of 8192 values, but not 8 of 14336.
            let fits = dev.fused_norm_gemv_applies(m, rows, cols);
            assert!(fits || cols > 8192, "m={m} {rows}x{cols}: the fused norm GEMVs should apply");
            assert!(!(m == 8 && cols == 14336 && fits), "8 rows of 14336 values cannot fit");
            if fits {
                norm_case(&dev, &c);
                if rows % 2 == 0 {
                    swiglu_case(&dev, &c);
                }
            }
        }
    }
}

/// One fused Q/K/V case: heads, head_dim, rotated dims, hidden width, tokens, bias.
struct RopeCase {
    nh: usize,
    nkv: usize,
    hd: usize,
    rope_dim: usize,
    cols: usize,
    m: usize,
    bias: bool,
    style: RopeStyle,
    qk_norm: bool,
}

const ROPE_MAX_POS: usize = 512;
const ROPE_BLOCK: usize = 16;

/// Runs `c` fused and unfused on the same random inputs; `Some((fused, unfused))` outputs
/// (q, k cache, v cache each), or `None` when the fused kernel refused the case.
fn rope_case(dev: &Device, c: &RopeCase, seed: u64) -> Option<[(Vec<bf16>, Vec<bf16>); 3]> {
    let mut r = rng(seed);
    let (m, cols, hd) = (c.m, c.cols, c.hd);
    let rows = (c.nh + 2 * c.nkv) * hd;
    let x = dev.upload(&rand_bf16(&mut r, m * cols, -2.0, 2.0)).unwrap();
    let gamma = dev.upload(&rand_bf16(&mut r, cols, 0.5, 1.5)).unwrap();
    let w = dev.upload(&rand_bf16(&mut r, rows * cols, -0.1, 0.1)).unwrap();
    let bias = c.bias.then(|| dev.upload(&rand_bf16(&mut r, rows, -0.5, 0.5)).unwrap());
    let qn = c.qk_norm.then(|| dev.upload(&rand_bf16(&mut r, hd, 0.5, 1.5)).unwrap());
    let params = RopeParams::new(c.rope_dim, 10000.0, None, None).unwrap();
    let rope = dev.rope_cache(&params, ROPE_MAX_POS).unwrap();
    // Token 1 sits past the RoPE table (NaN rows), token 2 (if any) in a slot past the cache
    // (its K/V are skipped); the others at scattered positions and slots.
    let num_blocks = 4;
    let positions: Vec<u32> = (0..m).map(|t| if t == 1 { ROPE_MAX_POS as u32 } else { (37 * t + 5) as u32 }).collect();
    let slots: Vec<u32> =
        (0..m).map(|t| if t == 2 { (num_blocks * ROPE_BLOCK) as u32 } else { (13 * t + 3) as u32 }).collect();
    let (positions, slots) = (dev.upload(&positions).unwrap(), dev.upload(&slots).unwrap());
    let cache = PagedKv { block_size: ROPE_BLOCK, n_kv_heads: c.nkv, head_dim: hd };
    let cache_len = num_blocks * ROPE_BLOCK * c.nkv * hd;
    let mut qkv = poisoned(dev, m * rows);
    let prep = |qkv| QkvPrep {
        qkv,
        n_tokens: m,
        n_heads: c.nh,
        n_kv_heads: c.nkv,
        head_dim: hd,
        bias: bias.as_ref(),
        qk_norm: qn.as_ref().map(|q| (q, q)),
        eps: EPS,
        positions: &positions,
        rope: &rope,
        style: c.style,
        slots: &slots,
    };
    let outs = || (poisoned(dev, m * c.nh * hd), poisoned(dev, cache_len), poisoned(dev, cache_len));
    // The fused kernel never reads `qkv` (only its length): a separate, poisoned one.
    let unread = poisoned(dev, m * rows);
    let (mut fq, mut fk, mut fv) = outs();
    let fused = dev.matmul_rms_norm_rope(&mut fq, &mut fk, &mut fv, &cache, &prep(&unread), &x, &gamma, EPS, &w, cols);
    assert_eq!(fused.is_ok(), dev.fused_rope_gemv_applies(&prep(&unread), cols), "applies <=> launches");
    fused.ok()?;
    let (mut uq, mut uk, mut uv) = outs();
    dev.matmul_rms_norm(&mut qkv, &x, &gamma, EPS, m, &w, rows, cols).unwrap();
    dev.qkv_rope_write(&mut uq, &mut uk, &mut uv, &cache, &prep(&qkv)).unwrap();
    let d = |b: &Buf<bf16>| dev.download(b).unwrap();
    Some([(d(&fq), d(&uq)), (d(&fk), d(&uk)), (d(&fv), d(&uv))])
}

#[test]
fn fused_rope_matches_unfused() {
    let Some(dev) = gpu("fused_rope_matches_unfused") else { return };
    let base = RopeCase {
        nh: 9,
        nkv: 3,
        hd: 64,
        rope_dim: 64,
        cols: 576,
        m: 1,
        bias: false,
        style: RopeStyle::Interleaved,
        qk_norm: false,
    };
    let llama = RopeCase { nh: 32, nkv: 8, hd: 128, rope_dim: 128, cols: 4096, ..base };
    let mut seed = 5;
    for m in [1usize, 2, 3, 4, 8] {
        for c in [
            RopeCase { m, ..base },
            RopeCase { m, bias: true, ..base },
            RopeCase { m, rope_dim: 32, ..base },
            RopeCase { m, ..llama },
            RopeCase { m, nh: 4, nkv: 4, hd: 16, rope_dim: 16, cols: 200, bias: true, ..base },
        ] {
            seed += 1;
            let what = format!("rope m={m} heads {}/{} x {} rot {} bias {}", c.nh, c.nkv, c.hd, c.rope_dim, c.bias);
            let outs = rope_case(&dev, &c, seed).unwrap_or_else(|| panic!("{what}: refused"));
            for ((fused, unfused), part) in outs.iter().zip(["q", "k cache", "v cache"]) {
                agree(&format!("{what} {part}"), fused, unfused);
            }
            // The token past the table has NaN in its rotated q dims only.
            if m >= 2 {
                let (q, _) = &outs[0];
                let head = &q[c.nh * c.hd..][..c.hd];
                assert!(head[..c.rope_dim].iter().all(|v| v.is_nan()), "{what}: position past the table");
                assert!(head[c.rope_dim..].iter().all(|v| v.is_finite()), "{what}: pass-through dims");
            }
        }
    }
    // One warp per CTA: 32 threads for the 40 or 64 row pairs of 5 or 8 tokens' tiles, so
    // the epilogue's threads take a second pass.
    dev.set_gemv_tuning(6, 1, true, 2).unwrap();
    for c in [RopeCase { m: 8, ..base }, RopeCase { m: 8, ..llama }, RopeCase { m: 5, bias: true, ..base }] {
        seed += 1;
        let what = format!("rope, one warp, m={} heads {}/{}", c.m, c.nh, c.nkv);
        let outs = rope_case(&dev, &c, seed).unwrap_or_else(|| panic!("{what}: refused"));
        for ((fused, unfused), part) in outs.iter().zip(["q", "k cache", "v cache"]) {
            agree(&format!("{what} {part}"), fused, unfused);
        }
    }
    // What it must refuse (the caller then takes the unfused path).
    for c in [
        RopeCase { style: RopeStyle::Neox, ..base },
        RopeCase { qk_norm: true, ..base },
        RopeCase { nh: 4, nkv: 2, hd: 24, rope_dim: 24, cols: 96, ..base },
    ] {
        assert!(
            rope_case(&dev, &c, 99).is_none(),
            "style {:?} qk_norm {} hd {}: should refuse",
            c.style,
            c.qk_norm,
            c.hd
        );
    }
}

/// Shapes the fused GEMV refuses are errors, not launches: 9 rows of x, columns not a
/// multiple of 8, mismatched lengths, an odd gate|up row count.
#[test]
fn fused_gemvs_reject_bad_shapes() {
    let Some(dev) = gpu("fused_gemvs_reject_bad_shapes") else { return };
    assert!(!dev.fused_gemv_applies(9, 64, 64));
    assert!(!dev.fused_gemv_applies(1, 64, 60));
    let (x, g, w) =
        (dev.alloc::<bf16>(9 * 64).unwrap(), dev.alloc::<bf16>(64).unwrap(), dev.alloc::<bf16>(64 * 64).unwrap());
    let mut out = dev.alloc::<bf16>(9 * 64).unwrap();
    assert!(dev.matmul_rms_norm(&mut out, &x, &g, EPS, 9, &w, 64, 64).is_err());
    let (x1, mut o1) = (dev.alloc::<bf16>(64).unwrap(), dev.alloc::<bf16>(63).unwrap());
    assert!(dev.matmul_add_residual(&mut o1, &x1, 1, &w, 64, 64).is_err());
    let w63 = dev.alloc::<bf16>(63 * 64).unwrap();
    let mut act = dev.alloc::<bf16>(32).unwrap();
    assert!(dev.matmul_rms_norm_swiglu(&mut act, &x1, &g, EPS, 1, &w63, 32, 64).is_err());
    assert!(dev.matmul_rms_norm(&mut o1, &x1, &g, f32::NAN, 1, &w, 63, 64).is_err());
}

/// Enough copies of a weight that a timing loop reads well over the 60 MB L2 from HBM.
fn copies(dev: &Device, len: usize, n: usize, seed: u64) -> Vec<Buf<bf16>> {
    (0..n)
        .map(|c| {
            let mut b = dev.alloc::<bf16>(len).unwrap();
            dev.fill_uniform(&mut b, seed + c as u64, -0.02, 0.02).unwrap();
            b
        })
        .collect()
}

/// One Llama-8B layer's decode chain without attention, in a CUDA graph over 8 layers'
/// worth of distinct weights (so every layer streams from HBM): unfused (add_rms_norm, qkv,
/// o, add_rms_norm, gate_up, silu_mul, down) vs fused (norm+qkv, o+residual,
/// norm+gate_up+SwiGLU, down+residual), at m = 1 and 8. Prints µs per layer and GB/s.
#[test]
fn bench_fused_layer() {
    let Some(dev) = bench_enabled("bench_fused_layer") else { return };
    let (h, qkv, ffn) = (4096usize, 6144usize, 14336usize);
    const LAYERS: usize = 8;
    let wq = copies(&dev, qkv * h, LAYERS, 300);
    let wo = copies(&dev, h * h, LAYERS, 400);
    let wgu = copies(&dev, 2 * ffn * h, LAYERS, 500);
    let wd = copies(&dev, h * ffn, LAYERS, 600);
    let bytes = (qkv * h + h * h + 2 * ffn * h + h * ffn) * 2;
    let mut gamma = dev.alloc::<bf16>(h).unwrap();
    dev.fill_uniform(&mut gamma, 7, 0.9, 1.1).unwrap();
    dev.set_gemv_tuning(6, 8, true, 2).unwrap();
    for m in [1usize, 8] {
        let mut x = dev.alloc::<bf16>(m * h).unwrap();
        dev.fill_uniform(&mut x, 8, -1.0, 1.0).unwrap();
        let mut xn = dev.alloc::<bf16>(m * h).unwrap();
        let mut out = dev.alloc::<bf16>(m * h).unwrap();
        dev.fill_uniform(&mut out, 9, -0.01, 0.01).unwrap();
        let mut q = dev.alloc::<bf16>(m * qkv).unwrap();
        let mut attn = dev.alloc::<bf16>(m * h).unwrap();
        dev.fill_uniform(&mut attn, 10, -1.0, 1.0).unwrap();
        let mut gu = dev.alloc::<bf16>(m * 2 * ffn).unwrap();
        let mut act = dev.alloc::<bf16>(m * ffn).unwrap();
        let unfused = dev
            .capture(|| {
                for l in 0..LAYERS {
                    dev.add_rms_norm(&mut xn, &mut x, &out, &gamma, m, EPS)?;
                    dev.matmul(&mut q, &xn, m, &wq[l], qkv, h)?;
                    dev.matmul(&mut out, &attn, m, &wo[l], h, h)?;
                    dev.add_rms_norm(&mut xn, &mut x, &out, &gamma, m, EPS)?;
                    dev.matmul(&mut gu, &xn, m, &wgu[l], 2 * ffn, h)?;
                    dev.silu_mul_packed(&mut act, &gu, m)?;
                    dev.matmul(&mut out, &act, m, &wd[l], h, ffn)?;
                }
                Ok(())
            })
            .unwrap();
        let fused = dev
            .capture(|| {
                for l in 0..LAYERS {
                    dev.matmul_rms_norm(&mut q, &x, &gamma, EPS, m, &wq[l], qkv, h)?;
                    dev.matmul_add_residual(&mut x, &attn, m, &wo[l], h, h)?;
                    dev.matmul_rms_norm_swiglu(&mut act, &x, &gamma, EPS, m, &wgu[l], ffn, h)?;
                    dev.matmul_add_residual(&mut x, &act, m, &wd[l], h, ffn)?;
                }
                Ok(())
            })
            .unwrap();
        for (name, g) in [("unfused", &unfused), ("fused", &fused)] {
            // The residual grows with every replay; keep it bounded between timings.
            dev.fill_uniform(&mut x, 8, -1.0, 1.0).unwrap();
            let ms = median_ms(&dev, 7, 5, |_| dev.launch_graph(g)) / LAYERS as f64;
            println!(
                "BENCH | llama-8b layer GEMV chain {name} | M={m} | {:.1} us/layer | {:.0} GB/s",
                ms * 1e3,
                bytes as f64 / (ms * 1e-3) / 1e9
            );
        }
    }
}
