//! The fused Q/K/V preparation (`Device::qkv_rope_write`) against a scalar f64 reference
//! written here (bias add, per-head RMSNorm, RoPE from the exact angle, scatter into the
//! paged caches), at the shapes of the model families it serves: SmolLM2-like llama (no
//! bias or norm, interleaved, head dim 64, 9/3 heads), Qwen2 (bias, neox, 128, 28/4),
//! Qwen3 (q/k norm, neox, 128, 32/8), Llama-3 frequency scaling, partial rotary, and head
//! dims that take the other launch shapes (32, 256; the general kernel at 80 and 36).
//!
//! Outputs and caches are poisoned with NaN first: every q value must be written, and a
//! cache slot no token maps to (or that only a padding token, slot `u32::MAX` or one past
//! the cache, names) must still be NaN afterwards. Tokens sit at scattered positions and
//! slots; one position is past the rope table, which must give NaN in exactly its rotated
//! dims. Needs a GPU: runs only with `TESSERA_GPU_TESTS=1`.
//!
//! Tolerance: `|gpu - ref| <= 2^-7 |ref| + 1e-4`: the output's bf16 rounding (at most 2^-9
//! relative) plus f32 arithmetic and the f32-rounded (cos, sin) table; the absolute term
//! covers rotations that cancel to near zero from inputs of magnitude up to ~6.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use rand_chacha::ChaCha8Rng;
use rand_core::Rng;
use tessera_kernels::cpu::attention::PagedKv;
use tessera_kernels::cpu::rope::{Llama3Scaling, RopeParams, RopeStyle};
use tessera_kernels::cuda::{Device, QkvPrep};
use tessera_kernels::KernelError;

const RTOL: f64 = 1.0 / 128.0;
const ATOL: f64 = 1e-4;
const BLOCK_SIZE: usize = 16;
const MAX_POS: usize = 4096;

/// Every element close to the reference; where the reference is NaN (rotated dims of a
/// position past the table, cache slots nobody writes) the result must be NaN too.
fn assert_close(what: &str, got: &[bf16], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0f64);
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = f64::from(g.to_f32());
        if w.is_nan() {
            assert!(g.is_nan(), "{what}[{i}]: got {g}, want NaN");
            continue;
        }
        let err = (g - w).abs();
        assert!(err <= ATOL + RTOL * w.abs(), "{what}[{i}]: got {g}, want {w} (err {err:e})");
        if err > worst.1 {
            worst = (i, err);
        }
    }
    eprintln!("{what}: ok, {} values, max abs err {:.3e} at {}", got.len(), worst.1, worst.0);
}

#[derive(Clone, Copy, PartialEq)]
enum Slots {
    /// Distinct random slots; with 3+ tokens, token 1 is padding (`u32::MAX`) and token 2
    /// names the first slot past the cache. With 4+ tokens, token 0 sits at the last table
    /// position and token 3 one past it.
    Scattered,
    /// Every token is padding: no cache slot may change.
    AllPadding,
}

struct Case {
    name: &'static str,
    n_tokens: usize,
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    rope_dim: usize,
    theta: f32,
    llama3: Option<Llama3Scaling>,
    style: RopeStyle,
    bias: bool,
    norm: bool,
    slots: Slots,
}

/// Host inputs of one case.
struct Inputs {
    qkv: Vec<bf16>,
    bias: Option<Vec<bf16>>,
    norm: Option<(Vec<bf16>, Vec<bf16>)>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    num_blocks: usize,
    eps: f32,
}

impl Case {
    fn heads(&self) -> usize {
        self.n_heads + 2 * self.n_kv
    }

    fn inputs(&self, r: &mut ChaCha8Rng) -> Inputs {
        let (n, row) = (self.n_tokens, self.heads() * self.hd);
        let qkv = rand_bf16(r, n * row, -3.0, 3.0);
        let bias = self.bias.then(|| rand_bf16(r, row, -3.0, 3.0));
        let norm = self.norm.then(|| (rand_bf16(r, self.hd, -2.0, 2.0), rand_bf16(r, self.hd, -2.0, 2.0)));
        // About twice the slots the tokens need, so many stay unwritten.
        let num_blocks = (2 * n).div_ceil(BLOCK_SIZE) + 1;
        let n_slots = num_blocks * BLOCK_SIZE;
        let mut all: Vec<u32> = (0..n_slots as u32).collect();
        for i in (1..all.len()).rev() {
            let j = (r.next_u64() % (i as u64 + 1)) as usize;
            all.swap(i, j);
        }
        let mut slots = all[..n].to_vec();
        let mut positions: Vec<u32> = (0..n).map(|_| r.next_u32() % MAX_POS as u32).collect();
        match self.slots {
            Slots::AllPadding => slots.fill(u32::MAX),
            Slots::Scattered => {
                if n >= 3 {
                    slots[1] = u32::MAX;
                    slots[2] = n_slots as u32;
                }
                if n >= 4 {
                    positions[0] = MAX_POS as u32 - 1;
                    positions[3] = MAX_POS as u32;
                }
            }
        }
        Inputs { qkv, bias, norm, positions, slots, num_blocks, eps: 1e-6 }
    }

    /// (q_out, k_cache, v_cache) in f64, NaN where nothing is written.
    fn reference(&self, x: &Inputs, params: &RopeParams) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (hd, nh, nkv) = (self.hd, self.n_heads, self.n_kv);
        let row = self.heads() * hd;
        let n_slots = x.num_blocks * BLOCK_SIZE;
        let mut q = vec![f64::NAN; self.n_tokens * nh * hd];
        let mut kc = vec![f64::NAN; n_slots * nkv * hd];
        let mut vc = kc.clone();
        let f = |v: bf16| f64::from(v.to_f32());
        let half = params.rope_dim() / 2;
        for t in 0..self.n_tokens {
            let (pos, slot) = (x.positions[t] as usize, x.slots[t] as usize);
            for h in 0..self.heads() {
                let base = h * hd;
                let mut v: Vec<f64> = (0..hd).map(|d| f(x.qkv[t * row + base + d])).collect();
                if let Some(b) = &x.bias {
                    for (d, val) in v.iter_mut().enumerate() {
                        *val += f(b[base + d]);
                    }
                }
                let is_q = h < nh;
                let is_v = h >= nh + nkv;
                if !is_v {
                    if let Some((wq, wk)) = &x.norm {
                        let w = if is_q { wq } else { wk };
                        let ms = v.iter().map(|a| a * a).sum::<f64>() / hd as f64;
                        let s = 1.0 / (ms + f64::from(x.eps)).sqrt();
                        for (d, val) in v.iter_mut().enumerate() {
                            *val *= s * f(w[d]);
                        }
                    }
                    for i in 0..half {
                        let (ia, ib) = match self.style {
                            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                            RopeStyle::Neox => (i, i + half),
                        };
                        if pos >= MAX_POS {
                            v[ia] = f64::NAN;
                            v[ib] = f64::NAN;
                            continue;
                        }
                        let (s, c) = (pos as f64 * params.inv_freq()[i]).sin_cos();
                        let (a, b) = (v[ia], v[ib]);
                        v[ia] = a * c - b * s;
                        v[ib] = a * s + b * c;
                    }
                }
                if is_q {
                    q[(t * nh + h) * hd..][..hd].copy_from_slice(&v);
                } else if slot < n_slots {
                    let (kvh, dst) = if is_v { (h - nh - nkv, &mut vc) } else { (h - nh, &mut kc) };
                    dst[(slot * nkv + kvh) * hd..][..hd].copy_from_slice(&v);
                }
            }
        }
        (q, kc, vc)
    }

    fn run(&self, dev: &Device, r: &mut ChaCha8Rng) {
        let params = RopeParams::new(self.rope_dim, self.theta, self.llama3, None).unwrap();
        let rope = dev.rope_cache(&params, MAX_POS).unwrap();
        let x = self.inputs(r);
        let (want_q, want_k, want_v) = self.reference(&x, &params);

        let qkv = dev.upload(&x.qkv).unwrap();
        let bias = x.bias.as_ref().map(|b| dev.upload(b).unwrap());
        let norm = x.norm.as_ref().map(|(a, b)| (dev.upload(a).unwrap(), dev.upload(b).unwrap()));
        let (positions, slots) = (dev.upload(&x.positions).unwrap(), dev.upload(&x.slots).unwrap());
        let cache = PagedKv { block_size: BLOCK_SIZE, n_kv_heads: self.n_kv, head_dim: self.hd };
        let mut q_out = poisoned(dev, want_q.len());
        let mut k_cache = poisoned(dev, want_k.len());
        let mut v_cache = poisoned(dev, want_v.len());
        let p = QkvPrep {
            qkv: &qkv,
            n_tokens: self.n_tokens,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv,
            head_dim: self.hd,
            bias: bias.as_ref(),
            qk_norm: norm.as_ref().map(|(a, b)| (a, b)),
            eps: x.eps,
            positions: &positions,
            rope: &rope,
            style: self.style,
            slots: &slots,
        };
        dev.qkv_rope_write(&mut q_out, &mut k_cache, &mut v_cache, &cache, &p).unwrap();

        let what = format!("{} ({} tokens)", self.name, self.n_tokens);
        let got_q = dev.download(&q_out).unwrap();
        assert_close(&format!("{what} q"), &got_q, &want_q);
        assert_close(&format!("{what} k cache"), &dev.download(&k_cache).unwrap(), &want_k);
        assert_close(&format!("{what} v cache"), &dev.download(&v_cache).unwrap(), &want_v);
        // The reference marks what it expects: NaN q values only for the token past the table,
        // and only in its rotated dims (the pass-through tail stays finite).
        if self.slots == Slots::Scattered && self.n_tokens >= 4 {
            let head = &got_q[3 * self.n_heads * self.hd..][..self.hd];
            assert!(head[..self.rope_dim].iter().all(|v| v.is_nan()), "{what}: position past the table");
            assert!(head[self.rope_dim..].iter().all(|v| v.is_finite()), "{what}: pass-through dims");
        }
        let stored = x.slots.iter().filter(|&&s| (s as usize) < x.num_blocks * BLOCK_SIZE).count();
        eprintln!("{what}: {stored} tokens stored, {} slots must still be NaN", x.num_blocks * BLOCK_SIZE - stored);
    }
}

fn llama3() -> Option<Llama3Scaling> {
    Some(Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 })
}

#[test]
fn qkv_rope_write_matches_reference() {
    let Some(dev) = gpu("qkv_rope_write_matches_reference") else { return };
    let mut r = rng(71);
    use RopeStyle::{Interleaved, Neox};
    let case = |name, n_tokens, (n_heads, n_kv, hd, rope_dim), theta, style, bias, norm| Case {
        name,
        n_tokens,
        n_heads,
        n_kv,
        hd,
        rope_dim,
        theta,
        llama3: None,
        style,
        bias,
        norm,
        slots: Slots::Scattered,
    };
    let cases = [
        case("llama smollm2", 300, (9, 3, 64, 64), 10_000.0, Interleaved, false, false),
        case("llama smollm2", 1, (9, 3, 64, 64), 10_000.0, Interleaved, false, false),
        case("qwen2", 300, (28, 4, 128, 128), 1_000_000.0, Neox, true, false),
        case("qwen2", 1, (28, 4, 128, 128), 1_000_000.0, Neox, true, false),
        case("qwen3", 300, (32, 8, 128, 128), 1_000_000.0, Neox, false, true),
        case("qwen3", 1, (32, 8, 128, 128), 1_000_000.0, Neox, false, true),
        Case { llama3: llama3(), ..case("llama3 scaled", 37, (32, 8, 128, 128), 500_000.0, Interleaved, false, false) },
        Case { llama3: llama3(), ..case("llama3 scaled neox", 9, (32, 8, 128, 128), 500_000.0, Neox, true, true) },
        case("partial rotary neox", 5, (6, 2, 64, 32), 10_000.0, Neox, true, true),
        case("partial rotary interleaved", 6, (4, 4, 64, 48), 10_000.0, Interleaved, true, true),
        // Other head dims: the vec8 kernel at its 4- and 32-lanes-per-head extremes, the
        // general kernel where head_dim / 8 is not a power of two (80) or not whole (36).
        case("vec8 hd 256", 5, (8, 2, 256, 256), 10_000.0, Neox, true, true),
        case("vec8 hd 32 partial", 5, (6, 3, 32, 16), 10_000.0, Interleaved, false, true),
        case("general hd 80", 6, (7, 1, 80, 80), 10_000.0, Neox, true, true),
        case("general hd 36 partial", 5, (3, 3, 36, 20), 10_000.0, Interleaved, true, false),
        Case {
            slots: Slots::AllPadding,
            ..case("padding only", 1, (9, 3, 64, 64), 10_000.0, Interleaved, false, false)
        },
        Case { slots: Slots::AllPadding, ..case("padding only", 4, (32, 8, 128, 128), 1e6, Neox, false, true) },
    ];
    for c in &cases {
        c.run(&dev, &mut r);
    }
}

#[test]
fn qkv_rope_write_rejects_bad_shapes() {
    let Some(dev) = gpu("qkv_rope_write_rejects_bad_shapes") else { return };
    let (n, nh, nkv, hd) = (3usize, 4usize, 2usize, 64usize);
    let params = RopeParams::new(hd, 10_000.0, None, None).unwrap();
    let rope = dev.rope_cache(&params, 64).unwrap();
    let qkv = dev.upload(&vec![bf16::ONE; n * (nh + 2 * nkv) * hd]).unwrap();
    let short_qkv = dev.upload(&vec![bf16::ONE; n * (nh + 2 * nkv) * hd - 2]).unwrap();
    let bias_bad = dev.upload(&vec![bf16::ONE; (nh + 2 * nkv) * hd - 1]).unwrap();
    let w = dev.upload(&vec![bf16::ONE; hd]).unwrap();
    let w_short = dev.upload(&vec![bf16::ONE; hd - 2]).unwrap();
    let positions = dev.upload(&[0u32, 1, 2]).unwrap();
    let slots = dev.upload(&[0u32, 1, 2]).unwrap();
    let slots_short = dev.upload(&[0u32, 1]).unwrap();
    let cache = PagedKv { block_size: 4, n_kv_heads: nkv, head_dim: hd };
    let mut q_out = poisoned(&dev, n * nh * hd);
    let mut kc = poisoned(&dev, 2 * 4 * nkv * hd);
    let mut vc = poisoned(&dev, 2 * 4 * nkv * hd);
    let good = QkvPrep {
        qkv: &qkv,
        n_tokens: n,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
        bias: None,
        qk_norm: None,
        eps: 1e-6,
        positions: &positions,
        rope: &rope,
        style: RopeStyle::Neox,
        slots: &slots,
    };
    dev.qkv_rope_write(&mut q_out, &mut kc, &mut vc, &cache, &good).unwrap();
    let bad = [
        ("short qkv", QkvPrep { qkv: &short_qkv, ..good }),
        ("bias length", QkvPrep { bias: Some(&bias_bad), ..good }),
        ("norm length", QkvPrep { qk_norm: Some((&w, &w_short)), ..good }),
        ("slots length", QkvPrep { slots: &slots_short, ..good }),
        ("odd head_dim", QkvPrep { head_dim: 63, ..good }),
        ("rope_dim > head_dim", QkvPrep { head_dim: 32, n_heads: 8, n_kv_heads: 4, ..good }),
        ("no heads", QkvPrep { n_heads: 0, n_kv_heads: 4, ..good }),
        ("eps", QkvPrep { eps: f32::NAN, ..good }),
    ];
    for (what, p) in &bad {
        let res = dev.qkv_rope_write(&mut q_out, &mut kc, &mut vc, &cache, p);
        assert!(matches!(res, Err(KernelError::Shape { .. })), "{what}: {:?}", res.err());
    }
    // Output and cache shapes.
    let mut q_short = poisoned(&dev, n * nh * hd - 1);
    assert!(matches!(
        dev.qkv_rope_write(&mut q_short, &mut kc, &mut vc, &cache, &good),
        Err(KernelError::Shape { .. })
    ));
    let mut vc_odd = poisoned(&dev, 2 * 4 * nkv * hd + hd);
    assert!(matches!(
        dev.qkv_rope_write(&mut q_out, &mut kc, &mut vc_odd, &cache, &good),
        Err(KernelError::Shape { .. })
    ));
    let cache_hd = PagedKv { head_dim: 128, ..cache };
    assert!(matches!(
        dev.qkv_rope_write(&mut q_out, &mut kc, &mut vc, &cache_hd, &good),
        Err(KernelError::Shape { .. })
    ));
}

/// GB/s of the fused preparation at Llama-3.1-8B's shape (32/8 heads of 128, neox, with the
/// q/k norm to include its cost): a prefill of 8192 tokens, and a decode step of 64 tokens.
#[test]
fn bench_qkv_rope_write_llama8b() {
    let Some(dev) = bench_enabled("bench_qkv_rope_write_llama8b") else { return };
    let mut r = rng(72);
    let (nh, nkv, hd) = (32usize, 8usize, 128usize);
    let params = RopeParams::new(hd, 500_000.0, llama3(), None).unwrap();
    let rope = dev.rope_cache(&params, 8192).unwrap();
    let cache = PagedKv { block_size: BLOCK_SIZE, n_kv_heads: nkv, head_dim: hd };
    let w =
        (dev.upload(&rand_bf16(&mut r, hd, 0.5, 1.5)).unwrap(), dev.upload(&rand_bf16(&mut r, hd, 0.5, 1.5)).unwrap());
    let n_slots = 8192;
    let mut kc = dev.alloc::<bf16>(n_slots * nkv * hd).unwrap();
    let mut vc = dev.alloc::<bf16>(n_slots * nkv * hd).unwrap();
    for tok in [8192usize, 64] {
        let qkv = dev.upload(&rand_bf16(&mut r, tok * (nh + 2 * nkv) * hd, -2.0, 2.0)).unwrap();
        let pos = dev.upload(&(0..tok as u32).collect::<Vec<_>>()).unwrap();
        let slots = dev.upload(&(0..tok as u32).map(|i| (i * 7919) % n_slots as u32).collect::<Vec<_>>()).unwrap();
        let mut q = dev.alloc::<bf16>(tok * nh * hd).unwrap();
        let p = QkvPrep {
            qkv: &qkv,
            n_tokens: tok,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            bias: None,
            qk_norm: Some((&w.0, &w.1)),
            eps: 1e-6,
            positions: &pos,
            rope: &rope,
            style: RopeStyle::Neox,
            slots: &slots,
        };
        let ms = median_ms(&dev, 7, 20, |_| dev.qkv_rope_write(&mut q, &mut kc, &mut vc, &cache, &p));
        let bytes = 2 * 2 * tok * (nh + 2 * nkv) * hd;
        println!(
            "BENCH | qkv_rope_write | {tok}x({nh}+2x{nkv})x{hd} bf16 | {:.1} us | - | {:.0} GB/s",
            ms * 1e3,
            bytes as f64 / (ms * 1e-3) / 1e9
        );
    }
}
