//! The HIP launchers of the forward pass's remaining ops against the CPU reference
//! (kernels::cpu) on random inputs: the fused residual add + RMSNorm, the embedding gather
//! (an id past the vocabulary gives a NaN row), SwiGLU on a packed gate|up buffer (the
//! 16-byte and the scalar kernel), the fused Q/K/V preparation (bias, q/k norm, RoPE with
//! Llama-3 scaling, both rope styles, paged K/V writes, padding slots, a position past the
//! table), the rocBLAS GEMM with f32 output (the LM head) and device row copies.
//!
//! Every test needs an AMD GPU: they run only with `TESSERA_HIP_TESTS=1` and have not run yet
//! (no AMD GPU was available when they were written). Outputs start as NaN so an element a
//! kernel misses fails. Tolerances: bf16 outputs `|gpu - ref| <= 2^-7 |ref| + atol` (atol
//! 1e-5 for rows, 1e-3 for the rotated heads, whose f32 arithmetic runs in another order
//! than the CPU's); the f32 GEMM `|gpu - ref| <= 2^-16 |ref| + 2^-20 sum_k |x_k w_k|`.
#![cfg(feature = "hip")]

mod hip_common;

use half::bf16;
use hip_common::{assert_close, enabled, gemm_reference, gpu, poisoned, random_bf16, to_f32};
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::activation::{add_row_bias, silu_mul};
use tessera_kernels::cpu::attention::{write_kv, PagedKv, SeqSlice};
use tessera_kernels::cpu::norm::{rms_norm, rms_norm_inplace};
use tessera_kernels::cpu::rope::{rope, Llama3Scaling, RopeParams, RopeStyle};
use tessera_kernels::hip::{self, Blas, QkvInputs, RopeTable};

const HIP: &str = "TESSERA_HIP_TESTS";

#[test]
fn add_rms_norm_matches_cpu() {
    if !enabled(HIP, "add_rms_norm_matches_cpu") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for (rows, dim) in [(29, 576), (3, 90), (2, 4096)] {
        let (res, x) = (random_bf16(&mut rng, rows * dim, 2.0), random_bf16(&mut rng, rows * dim, 2.0));
        let w = random_bf16(&mut rng, dim, 1.5);
        // The residual sum rounds to bf16 before the norm reads it.
        let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32()).to_f32()).collect();
        let mut want = vec![0f32; rows * dim];
        rms_norm(&mut want, &sum, &to_f32(&w), rows, 1e-5).unwrap();
        let (mut rd, xd, wd) = (dev.upload(&res).unwrap(), dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = poisoned(&dev, rows * dim);
        hip::ops::add_rms_norm(&dev, &mut out, &mut rd, &xd, &wd, rows, 1e-5).unwrap();
        assert_close("add_rms_norm out", &dev.download(&out).unwrap(), &want, 1.0 / 128.0, 1e-5);
        assert_close("add_rms_norm residual", &dev.download(&rd).unwrap(), &sum, 0.0, 0.0);
    }
}

#[test]
fn embedding_gathers_rows_and_poisons_bad_ids() {
    if !enabled(HIP, "embedding_gathers_rows_and_poisons_bad_ids") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (vocab, dim) in [(1000, 576), (77, 90)] {
        let table = random_bf16(&mut rng, vocab * dim, 1.0);
        let mut ids: Vec<u32> = (0..41).map(|_| rng.next_u32() % vocab as u32).collect();
        ids[7] = vocab as u32;
        let mut want = Vec::with_capacity(ids.len() * dim);
        for &id in &ids {
            match table.get(id as usize * dim..(id as usize + 1) * dim) {
                Some(row) => want.extend(to_f32(row)),
                None => want.extend(std::iter::repeat_n(f32::NAN, dim)),
            }
        }
        let (td, idd) = (dev.upload(&table).unwrap(), dev.upload(&ids).unwrap());
        let mut out = dev.alloc::<bf16>(ids.len() * dim).unwrap();
        hip::ops::embedding(&dev, &mut out, &td, &idd, dim).unwrap();
        assert_close("embedding", &dev.download(&out).unwrap(), &want, 0.0, 0.0);
    }
}

#[test]
fn silu_mul_packed_matches_cpu() {
    if !enabled(HIP, "silu_mul_packed_matches_cpu") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    // 1536: the 16-byte kernel; 100: the scalar one.
    for (rows, ffn) in [(9, 1536), (5, 100)] {
        let gate_up = random_bf16(&mut rng, rows * 2 * ffn, 4.0);
        let mut want = vec![0f32; rows * ffn];
        for r in 0..rows {
            let row = to_f32(&gate_up[r * 2 * ffn..(r + 1) * 2 * ffn]);
            silu_mul(&mut want[r * ffn..(r + 1) * ffn], &row[..ffn], &row[ffn..]).unwrap();
        }
        let gd = dev.upload(&gate_up).unwrap();
        let mut out = poisoned(&dev, rows * ffn);
        hip::ops::silu_mul_packed(&dev, &mut out, &gd, rows).unwrap();
        assert_close("silu_mul_packed", &dev.download(&out).unwrap(), &want, 1.0 / 128.0, 1e-5);
    }
}

/// One Q/K/V case: a model family's head layout and options.
struct QkvCase {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    style: RopeStyle,
    bias: bool,
    norm: bool,
    llama3: bool,
}

/// q, k cache and v cache from the CPU ops: bias add, per-head norm of q and k, rope,
/// write_kv at each token's slot; NaN where nothing is written (and in the rotated dims of
/// a position past the table).
#[allow(clippy::type_complexity)]
#[allow(clippy::too_many_arguments)]
fn qkv_reference(
    c: &QkvCase,
    qkv: &[f32],
    bias: Option<&[f32]>,
    norm: Option<(&[f32], &[f32])>,
    positions: &[u32],
    slots: &[u32],
    params: &RopeParams,
    max_pos: usize,
    cache: &PagedKv,
    n_slots: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (nh, nkv, hd, n) = (c.n_heads, c.n_kv, c.hd, positions.len());
    let row = (nh + 2 * nkv) * hd;
    let mut x = qkv.to_vec();
    if let Some(b) = bias {
        add_row_bias(&mut x, b).unwrap();
    }
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for t in x.chunks_exact(row) {
        q.extend_from_slice(&t[..nh * hd]);
        k.extend_from_slice(&t[nh * hd..(nh + nkv) * hd]);
        v.extend_from_slice(&t[(nh + nkv) * hd..]);
    }
    if let Some((qn, kn)) = norm {
        rms_norm_inplace(&mut q, qn, n * nh, 1e-6).unwrap();
        rms_norm_inplace(&mut k, kn, n * nkv, 1e-6).unwrap();
    }
    let clamped: Vec<u32> = positions.iter().map(|&p| p.min(max_pos as u32 - 1)).collect();
    rope(&mut q, n, nh, hd, &clamped, params, c.style).unwrap();
    rope(&mut k, n, nkv, hd, &clamped, params, c.style).unwrap();
    // A position past the table: the kernel's rotated dims are NaN.
    let half = params.rope_dim() / 2;
    for (t, &p) in positions.iter().enumerate() {
        if p as usize >= max_pos {
            for (buf, heads) in [(&mut q, nh), (&mut k, nkv)] {
                for h in 0..heads {
                    let head = &mut buf[(t * heads + h) * hd..][..hd];
                    let dims: Vec<usize> = match c.style {
                        RopeStyle::Interleaved => (0..2 * half).collect(),
                        RopeStyle::Neox => (0..2 * half).collect(),
                    };
                    for d in dims {
                        head[d] = f32::NAN;
                    }
                }
            }
        }
    }
    let kv_len = n_slots * nkv * hd;
    let (mut kc, mut vc) = (vec![f32::NAN; kv_len], vec![f32::NAN; kv_len]);
    for (t, &slot) in slots.iter().enumerate() {
        if (slot as usize) < n_slots {
            // One token at a time: a one-entry block table naming the slot's block.
            let (block, off) = (slot as usize / cache.block_size, slot as usize % cache.block_size);
            let table = [block as u32];
            let seq = SeqSlice { block_table: &table, first_pos: off, n_tokens: 1 };
            let kv = |b: &[f32]| b[t * nkv * hd..(t + 1) * nkv * hd].to_vec();
            write_kv(cache, &mut kc, &mut vc, &kv(&k), &kv(&v), &seq).unwrap();
        }
    }
    (q, kc, vc)
}

#[test]
fn qkv_rope_write_matches_cpu() {
    if !enabled(HIP, "qkv_rope_write_matches_cpu") {
        return;
    }
    let dev = gpu();
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let llama3 =
        Llama3Scaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: 8192 };
    let cases = [
        // SmolLM2 / Llama (GGUF: interleaved), Llama-3 scaling, Qwen2 (bias), Qwen3 (q/k norm).
        QkvCase { n_heads: 9, n_kv: 3, hd: 64, style: RopeStyle::Interleaved, bias: false, norm: false, llama3: false },
        QkvCase { n_heads: 8, n_kv: 2, hd: 128, style: RopeStyle::Interleaved, bias: false, norm: false, llama3: true },
        QkvCase { n_heads: 7, n_kv: 1, hd: 128, style: RopeStyle::Neox, bias: true, norm: false, llama3: false },
        QkvCase { n_heads: 8, n_kv: 4, hd: 128, style: RopeStyle::Neox, bias: false, norm: true, llama3: false },
        QkvCase { n_heads: 3, n_kv: 1, hd: 80, style: RopeStyle::Neox, bias: true, norm: true, llama3: false },
    ];
    let (block_size, max_pos, n) = (16usize, 2048usize, 13usize);
    for c in &cases {
        let params =
            RopeParams::new(c.hd, 500000.0, c.llama3.then_some(llama3), None).unwrap_or_else(|e| panic!("{e}"));
        let row = (c.n_heads + 2 * c.n_kv) * c.hd;
        let qkv = random_bf16(&mut rng, n * row, 3.0);
        let bias = c.bias.then(|| random_bf16(&mut rng, row, 1.0));
        let norm = c.norm.then(|| (random_bf16(&mut rng, c.hd, 2.0), random_bf16(&mut rng, c.hd, 2.0)));
        let num_blocks = 3;
        let n_slots = num_blocks * block_size;
        let mut slots: Vec<u32> = (0..n_slots as u32).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, rng.next_u32() as usize % (i + 1));
        }
        slots.truncate(n);
        slots[1] = u32::MAX; // padding
        slots[2] = n_slots as u32; // one past the cache
        let mut positions: Vec<u32> = (0..n).map(|_| rng.next_u32() % max_pos as u32).collect();
        positions[4] = max_pos as u32;
        let cache = PagedKv { block_size, n_kv_heads: c.n_kv, head_dim: c.hd };
        let f = |b: &Option<Vec<bf16>>| b.as_deref().map(to_f32);
        let normf = norm.as_ref().map(|(a, b)| (to_f32(a), to_f32(b)));
        let (want_q, want_k, want_v) = qkv_reference(
            c,
            &to_f32(&qkv),
            f(&bias).as_deref(),
            normf.as_ref().map(|(a, b)| (a.as_slice(), b.as_slice())),
            &positions,
            &slots,
            &params,
            max_pos,
            &cache,
            n_slots,
        );
        let table = RopeTable::new(&dev, &params, max_pos).unwrap();
        let qkvd = dev.upload(&qkv).unwrap();
        let bd = bias.as_ref().map(|b| dev.upload(b).unwrap());
        let nd = norm.as_ref().map(|(a, b)| (dev.upload(a).unwrap(), dev.upload(b).unwrap()));
        let (pd, sd) = (dev.upload(&positions).unwrap(), dev.upload(&slots).unwrap());
        let mut q = poisoned(&dev, n * c.n_heads * c.hd);
        let (mut kc, mut vc) = (poisoned(&dev, want_k.len()), poisoned(&dev, want_v.len()));
        let inputs = QkvInputs {
            qkv: &qkvd,
            n_tokens: n,
            n_heads: c.n_heads,
            n_kv_heads: c.n_kv,
            head_dim: c.hd,
            bias: bd.as_ref(),
            qk_norm: nd.as_ref().map(|(a, b)| (a, b)),
            eps: 1e-6,
            positions: &pd,
            slots: &sd,
            rope: &table,
            style: c.style,
        };
        hip::qkv::qkv_rope_write(&dev, &mut q, &mut kc, &mut vc, &cache, &inputs).unwrap();
        let what = format!("{} heads / {} kv of {}", c.n_heads, c.n_kv, c.hd);
        assert_close(&format!("q {what}"), &dev.download(&q).unwrap(), &want_q, 1.0 / 128.0, 1e-3);
        assert_close(&format!("k cache {what}"), &dev.download(&kc).unwrap(), &want_k, 1.0 / 128.0, 1e-3);
        assert_close(&format!("v cache {what}"), &dev.download(&vc).unwrap(), &want_v, 1.0 / 128.0, 1e-5);
    }
}

#[test]
fn gemm_f32_and_row_copies() {
    if !enabled(HIP, "gemm_f32_and_row_copies") {
        return;
    }
    let dev = gpu();
    let blas = Blas::new(&dev).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(15);
    for (m, n, k) in [(1, 4099, 576), (5, 300, 128)] {
        let x = random_bf16(&mut rng, m * k, 1.0);
        let w = random_bf16(&mut rng, n * k, 1.0);
        let (xd, wd) = (dev.upload(&x).unwrap(), dev.upload(&w).unwrap());
        let mut out = dev.upload(&vec![f32::NAN; m * n]).unwrap();
        blas.gemm_f32(&dev, &mut out, &xd, &wd, (m, n, k)).unwrap();
        let got = dev.download(&out).unwrap();
        for (i, (&g, &(dot, mag))) in got.iter().zip(&gemm_reference(&x, &w, (m, n, k))).enumerate() {
            let g = f64::from(g);
            assert!((g - dot).abs() <= dot.abs() / 65536.0 + mag / 1048576.0, "[{i}]: {g} vs {dot}");
        }
        // Rows 1..m of x copied to the front of a NaN buffer, the rest untouched.
        let mut dst = poisoned(&dev, m * k);
        dev.copy_rows(&mut dst, 0, &xd, 1, m - 1, k).unwrap();
        let mut want = to_f32(&x[k..]);
        want.extend(std::iter::repeat_n(f32::NAN, k));
        assert_close("copy_rows", &dev.download(&dst).unwrap(), &want, 0.0, 0.0);
        assert!(dev.copy_rows(&mut dst, 1, &xd, 1, m, k).is_err(), "past the end");
    }
}
