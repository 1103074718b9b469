//! Decode attention launched early (`Device::set_decode_early_start`): its CTAs start while
//! the kernel that writes this step's q and newest K/V still runs, copy the older K/V
//! meanwhile, and must still see that kernel's q and K/V.
//!
//! Each case is one decode step of a layer: the fused norm + qkv + RoPE + K/V-write GEMV (as
//! the engine's steps of up to 8 tokens run it) or the unfused GEMV then `qkv_rope_write`,
//! followed by decode attention. Shapes: Llama-8B (32 q heads, 8 kv heads, head_dim 128,
//! hidden 4096: the qkv GEMV streams 50 MB and runs well past the attention's start) and
//! SmolLM2-135M (9 / 3 heads, head_dim 64, hidden 576: the hd64 kernels). q and the cache
//! rows of the newest positions start as NaN, so an attention that reads either before its
//! predecessor wrote it gives NaN rows. The early launch must give finite outputs, the same
//! bits as the plain launch. Batches of 1 and 3 sequences take the lean kernel, 8 the
//! default one; contexts from 1 (only the newest position) to 700. One split workspace
//! serves every launch of a case, so its merge counters must be back at zero after each.
//!
//! Not covered: at 5-8 sequences behind the fused GEMV, the default kernel's CTAs cannot
//! share an SM with the GEMV's, so they start only as GEMV CTAs retire, after the q rows are
//! written; a q read before the wait would go unseen there (the `qkv_rope_write` case and
//! the lean kernel's cases do see one).
//!
//! Needs a GPU: runs only with `TESSERA_GPU_TESTS=1` (`bench/gpu/run.sh` on the device).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use tessera_kernels::cpu::attention::PagedKv;
use tessera_kernels::cpu::rope::{RopeParams, RopeStyle};
use tessera_kernels::cuda::{Buf, DecodeWorkspace, Device, PagedBatch, QkvPrep, RopeCache};

/// A layer's attention geometry and hidden width.
#[derive(Clone, Copy, Debug)]
struct Shape {
    nh: usize,
    nkv: usize,
    hd: usize,
    cols: usize,
}

const LLAMA_8B: Shape = Shape { nh: 32, nkv: 8, hd: 128, cols: 4096 };
const SMOLLM2: Shape = Shape { nh: 9, nkv: 3, hd: 64, cols: 576 };
const BS: usize = 16;
const EPS: f32 = 1e-5;
const MAX_POS: usize = 1024;
const CONTEXTS: [usize; 8] = [700, 1, 33, 250, 16, 17, 129, 512];

/// What one step needs, made once per case: weights, inputs, the tables and the cache's
/// starting contents (random, with NaN at each sequence's newest position).
struct Step {
    shape: Shape,
    m: usize,
    x: Buf<bf16>,
    gamma: Buf<bf16>,
    w: Buf<bf16>,
    rope: RopeCache,
    positions: Buf<u32>,
    slots: Buf<u32>,
    tables: Buf<u32>,
    ctx: Buf<u32>,
    max_blocks: usize,
    cache0: (Vec<bf16>, Vec<bf16>),
    ws: DecodeWorkspace,
}

impl Step {
    fn new(dev: &Device, shape: Shape, m: usize, seed: u64) -> Step {
        let Shape { nh, nkv, hd, cols } = shape;
        let mut r = rng(seed);
        let rows = (nh + 2 * nkv) * hd;
        let ctx = &CONTEXTS[..m];
        let max_blocks = ctx.iter().map(|c| c.div_ceil(BS)).max().unwrap_or(1);
        // Sequence s owns blocks s, s + m, s + 2m, ... (interleaved, so no two share one).
        let table: Vec<u32> = (0..m).flat_map(|s| (0..max_blocks).map(move |b| (b * m + s) as u32)).collect();
        let num_blocks = m * max_blocks;
        let newest: Vec<u32> = (0..m)
            .map(|s| {
                let p = ctx[s] - 1;
                table[s * max_blocks + p / BS] * BS as u32 + (p % BS) as u32
            })
            .collect();
        let stride = nkv * hd;
        let mut k0 = rand_bf16(&mut r, num_blocks * BS * stride, -1.0, 1.0);
        let mut v0 = rand_bf16(&mut r, num_blocks * BS * stride, -1.0, 1.0);
        for &slot in &newest {
            let at = slot as usize * stride;
            k0[at..at + stride].fill(bf16::NAN);
            v0[at..at + stride].fill(bf16::NAN);
        }
        let params = RopeParams::new(hd, 500000.0, None, None).unwrap();
        Step {
            shape,
            m,
            x: dev.upload(&rand_bf16(&mut r, m * cols, -2.0, 2.0)).unwrap(),
            gamma: dev.upload(&rand_bf16(&mut r, cols, 0.5, 1.5)).unwrap(),
            w: dev.upload(&rand_bf16(&mut r, rows * cols, -0.05, 0.05)).unwrap(),
            rope: dev.rope_cache(&params, MAX_POS).unwrap(),
            positions: dev.upload(&ctx.iter().map(|&c| (c - 1) as u32).collect::<Vec<_>>()).unwrap(),
            slots: dev.upload(&newest).unwrap(),
            tables: dev.upload(&table).unwrap(),
            ctx: dev.upload(&ctx.iter().map(|&c| c as u32).collect::<Vec<_>>()).unwrap(),
            max_blocks,
            cache0: (k0, v0),
            ws: dev.decode_workspace(m, nh, hd, 64).unwrap(),
        }
    }

    /// One step from the starting cache: the q/K/V kernel(s), then decode attention
    /// launched early or plainly. Returns the attention output.
    fn run(&mut self, dev: &Device, fused: bool, early: bool) -> Vec<bf16> {
        let Shape { nh, nkv, hd, cols } = self.shape;
        let (m, rows) = (self.m, (nh + 2 * nkv) * hd);
        let cache = PagedKv { block_size: BS, n_kv_heads: nkv, head_dim: hd };
        let (mut k, mut v) = (dev.upload(&self.cache0.0).unwrap(), dev.upload(&self.cache0.1).unwrap());
        let mut q = poisoned(dev, m * nh * hd);
        let mut qkv = poisoned(dev, m * rows);
        let mut out = poisoned(dev, m * nh * hd);
        dev.set_decode_early_start(early);
        // Nothing queued before the step: it starts from settled inputs, as a model's does.
        dev.synchronize().unwrap();
        let prep = |qkv| QkvPrep {
            qkv,
            n_tokens: m,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            bias: None,
            qk_norm: None,
            eps: EPS,
            positions: &self.positions,
            rope: &self.rope,
            style: RopeStyle::Interleaved,
            slots: &self.slots,
        };
        if fused {
            assert!(dev.fused_rope_gemv_applies(&prep(&qkv), cols), "the fused qkv GEMV takes m = {m}");
            dev.matmul_rms_norm_rope(
                &mut q,
                &mut k,
                &mut v,
                &cache,
                &prep(&qkv),
                &self.x,
                &self.gamma,
                EPS,
                &self.w,
                cols,
            )
            .unwrap();
        } else {
            dev.matmul_rms_norm(&mut qkv, &self.x, &self.gamma, EPS, m, &self.w, rows, cols).unwrap();
            dev.qkv_rope_write(&mut q, &mut k, &mut v, &cache, &prep(&qkv)).unwrap();
        }
        let batch = PagedBatch {
            cache,
            k_cache: &k,
            v_cache: &v,
            block_tables: &self.tables,
            max_blocks: self.max_blocks,
            context_lens: &self.ctx,
        };
        let scale = 1.0 / (hd as f32).sqrt();
        dev.paged_decode_attention(&mut out, &q, &batch, nh, scale, 8192, None, Some(&mut self.ws)).unwrap();
        let got = dev.download(&out).unwrap();
        dev.set_decode_early_start(false);
        got
    }
}

#[test]
fn early_decode_attention_sees_this_steps_q_and_kv() {
    let Some(dev) = gpu("early_decode_attention_sees_this_steps_q_and_kv") else { return };
    // The engine's GEMV settings: persistent, W's first loads before the wait.
    dev.set_gemv_tuning(6, 8, true, 2).unwrap();
    for shape in [LLAMA_8B, SMOLLM2] {
        for (i, m) in [1usize, 3, 8].into_iter().enumerate() {
            let mut step = Step::new(&dev, shape, m, 40 + i as u64);
            for fused in [true, false] {
                let case = format!("{shape:?} m={m} fused={fused}");
                let plain = step.run(&dev, fused, false);
                let bad = plain.iter().filter(|v| !v.to_f32().is_finite()).count();
                assert_eq!(bad, 0, "{case}: the plain launch left {bad} non-finite outputs");
                for round in 0..5 {
                    let early = step.run(&dev, fused, true);
                    let bad = early.iter().filter(|v| !v.to_f32().is_finite()).count();
                    assert_eq!(bad, 0, "{case} round {round}: early launch read stale q or K/V ({bad} NaN)");
                    let diff = early.iter().zip(&plain).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    assert_eq!(diff, 0, "{case} round {round}: {diff} outputs differ from the plain launch");
                }
            }
        }
    }
}
