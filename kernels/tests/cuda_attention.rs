//! The CUDA paged-attention kernels (K/V cache write, split-KV decode, causal prefill)
//! against the CPU reference `tessera_kernels::cpu::attention`, run on f32 copies of the
//! same bf16 data, plus micro-benchmarks at Llama-3.1-8B shapes.
//!
//! Inputs are random (q in [-3, 3) so the softmax is far from flat, K/V in [-1, 1)), the
//! whole cache is random (a wrong slot reads plausible junk, not zeros), block tables are
//! shuffled and padded with out-of-range ids (reading past the context would give NaN), and
//! every output starts as NaN. Shapes: GQA ratios 1, 3, 4, 8 and 12, head_dim 64 and 128,
//! block size 16, contexts 1, 17, 500, 4096, batches of 1 and 33 sequences of different
//! lengths, prefill chunks starting at 0 and mid-context; decode with the automatic split,
//! a forced split of 64 positions (many splits merged by the last CTA) and no split at
//! all, and with the engine's graph-sized `max_context` (8192, far past the real contexts,
//! so most splits start past them), twice on one workspace (its merge counters must be
//! back at zero after each launch).
//!
//! Prefill also runs chunks of 1..16 tokens mixed with decode-like rows, chunk lengths and
//! contexts that are not multiples of the kernel's 16-row / 64-position tiles, groups 1, 3,
//! 4, 8, 12, and checks NaN rows for unmapped blocks and over-long chunks, and that a
//! sequence whose `cu_q` range leaves q writes nothing.
//!
//! Tolerances: the cache write is bit-exact. Attention outputs are bf16 of an f32
//! computation on identical inputs: `|gpu - ref| <= 2^-7 |ref| + 1e-4` per element (the
//! output's bf16 rounding, with room for f32 reordering and exp2 vs exp to flip it; 1e-4
//! covers outputs that average out near zero, V being in [-1, 1)), and relative L2 error
//! <= 4e-3 over the whole output. NaN never passes. Decode applies each softmax weight as
//! two bf16 terms (relative error about 2^-17), inside these bounds. Prefill rounds each
//! softmax weight `w_p` to bf16 (relative error <= 2^-8) before multiplying V, which moves
//! an output by at most `2^-8 * sum_p w_p |v_p|`: its per-element bound adds exactly that,
//! computed by the CPU reference run on `|V|`. The L2 bound stays 4e-3 (those roundings
//! are independent, so their sum grows like a random walk, far below the worst case).
//!
//! Needs a GPU: tests run only with `TESSERA_GPU_TESTS=1`, benchmarks with
//! `TESSERA_GPU_BENCH=1` (`bench/gpu/run.sh` runs both on the device machine).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;
use rand_chacha::ChaCha8Rng;
use rand_core::Rng;
use tessera_kernels::cpu::attention::{self as cpu, PagedKv, SeqSlice};
use tessera_kernels::cuda::{Buf, DecodeWorkspace, Device, PagedBatch};
use tessera_kernels::KernelError;

// ---------------------------------------------------------------- harness

const RTOL: f32 = 1.0 / 128.0;
const ATOL: f32 = 1e-4;
const MAX_REL_L2: f64 = 4e-3;

/// Relative error of rounding one softmax weight to bf16 (8 significant bits, nearest).
const P_ROUND: f32 = 1.0 / 256.0;

/// Per-element bound and relative L2 error; NaN never passes.
fn assert_close(what: &str, got: &[bf16], want: &[f32]) {
    assert_close_with(what, got, want, None);
}

/// As [`assert_close`], with `P_ROUND * abs_v[i]` added to element `i`'s bound, `abs_v`
/// being the attention output over `|V|` (the sum of weight x |v| that bf16 weights can
/// move).
fn assert_close_with(what: &str, got: &[bf16], want: &[f32], abs_v: Option<&[f32]>) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut e2, mut r2, mut worst) = (0f64, 0f64, 0f32);
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32();
        let err = (g - w).abs();
        let bound = ATOL + RTOL * w.abs() + abs_v.map_or(0.0, |a| P_ROUND * a[i]);
        assert!(err <= bound, "{what}[{i}]: got {g}, want {w} (err {err:e}, bound {bound:e})");
        e2 += f64::from(err) * f64::from(err);
        r2 += f64::from(w) * f64::from(w);
        worst = worst.max(err);
    }
    let rel = (e2 / r2.max(1e-30)).sqrt();
    assert!(rel <= MAX_REL_L2, "{what}: relative L2 error {rel:e}");
    eprintln!("{what}: ok, {} values, max abs err {worst:.2e}, rel L2 {rel:.2e}", got.len());
}

// ---------------------------------------------------------------- cases

/// One test batch: model geometry and, per sequence, (first_pos, new tokens).
struct Case {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    seqs: Vec<(usize, usize)>,
    scale: f32,
}

const BS: usize = 16;

/// Host and device state of a case after the new tokens' K/V were written by the GPU.
struct Setup {
    cache: PagedKv,
    tables: Vec<Vec<u32>>,
    max_blocks: usize,
    /// f32 copies of the caches after the CPU reference's write.
    kc: Vec<f32>,
    vc: Vec<f32>,
    q: Vec<bf16>,
    kd: Buf<bf16>,
    vd: Buf<bf16>,
    tables_d: Buf<u32>,
    ctx_d: Buf<u32>,
    q_d: Buf<bf16>,
}

impl Case {
    fn name(&self) -> String {
        let lens: Vec<usize> = self.seqs.iter().map(|&(f, n)| f + n).collect();
        let shown = if lens.len() > 4 {
            format!("{} seqs, ctx {}..{}", lens.len(), lens.iter().min().unwrap(), lens.iter().max().unwrap())
        } else {
            format!("ctx {lens:?}")
        };
        format!("{}q/{}kv hd{} {shown}", self.n_heads, self.n_kv, self.hd)
    }

    fn new_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.1).sum()
    }

    /// Builds the cache (random, shuffled tables), writes the new K/V on the GPU and checks
    /// the result bit for bit against the CPU write.
    fn setup(&self, dev: &Device, r: &mut ChaCha8Rng) -> Setup {
        let cache = PagedKv { block_size: BS, n_kv_heads: self.n_kv, head_dim: self.hd };
        let stride = self.n_kv * self.hd;
        let needed: Vec<usize> = self.seqs.iter().map(|&(f, n)| (f + n).div_ceil(BS)).collect();
        let num_blocks = needed.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, r.next_u32() as usize % (i + 1));
        }
        let mut next = 0;
        let tables: Vec<Vec<u32>> = needed
            .iter()
            .map(|&n| {
                next += n;
                ids[next - n..next].to_vec()
            })
            .collect();
        // Padding entries point past the cache: a kernel reading them produces NaN.
        let max_blocks = needed.iter().max().copied().unwrap_or(0) + 1;
        let mut flat = vec![num_blocks as u32 + 1000; self.seqs.len() * max_blocks];
        for (row, t) in flat.chunks_mut(max_blocks).zip(&tables) {
            row[..t.len()].copy_from_slice(t);
        }

        let k0 = rand_bf16(r, num_blocks * BS * stride, -1.0, 1.0);
        let v0 = rand_bf16(r, num_blocks * BS * stride, -1.0, 1.0);
        let n_new = self.new_tokens();
        let k_new = rand_bf16(r, n_new * stride, -1.0, 1.0);
        let v_new = rand_bf16(r, n_new * stride, -1.0, 1.0);
        let mut slots = Vec::with_capacity(n_new);
        for (&(f, n), t) in self.seqs.iter().zip(&tables) {
            slots.extend((f..f + n).map(|p| t[p / BS] * BS as u32 + (p % BS) as u32));
        }

        let (mut kc, mut vc) = (to_f32(&k0), to_f32(&v0));
        let (kn, vn) = (to_f32(&k_new), to_f32(&v_new));
        let mut t0 = 0;
        for (&(f, n), t) in self.seqs.iter().zip(&tables) {
            let seq = SeqSlice { block_table: t, first_pos: f, n_tokens: n };
            cpu::write_kv(
                &cache,
                &mut kc,
                &mut vc,
                &kn[t0 * stride..(t0 + n) * stride],
                &vn[t0 * stride..(t0 + n) * stride],
                &seq,
            )
            .unwrap();
            t0 += n;
        }

        let (mut kd, mut vd) = (dev.upload(&k0).unwrap(), dev.upload(&v0).unwrap());
        let (knd, vnd, sd) = (dev.upload(&k_new).unwrap(), dev.upload(&v_new).unwrap(), dev.upload(&slots).unwrap());
        dev.write_kv(&cache, &mut kd, &mut vd, &knd, &vnd, &sd).unwrap();
        let (kg, vg) = (dev.download(&kd).unwrap(), dev.download(&vd).unwrap());
        assert!(
            kg.iter().zip(&kc).all(|(g, &w)| g.to_f32().to_bits() == w.to_bits()),
            "{}: k cache after write_kv",
            self.name()
        );
        assert!(
            vg.iter().zip(&vc).all(|(g, &w)| g.to_f32().to_bits() == w.to_bits()),
            "{}: v cache after write_kv",
            self.name()
        );

        let ctx: Vec<u32> = self.seqs.iter().map(|&(f, n)| (f + n) as u32).collect();
        let q = rand_bf16(r, n_new * self.n_heads * self.hd, -3.0, 3.0);
        Setup {
            cache,
            tables,
            max_blocks,
            kc,
            vc,
            q_d: dev.upload(&q).unwrap(),
            q,
            kd,
            vd,
            tables_d: dev.upload(&flat).unwrap(),
            ctx_d: dev.upload(&ctx).unwrap(),
        }
    }

    /// The CPU reference output, `[new tokens, n_heads, hd]`.
    fn reference(&self, s: &Setup) -> Vec<f32> {
        self.reference_over(s, &s.vc)
    }

    /// The CPU reference run on `|V|`: per element, the sum of softmax weight x |v|.
    fn reference_abs_v(&self, s: &Setup) -> Vec<f32> {
        let abs: Vec<f32> = s.vc.iter().map(|v| v.abs()).collect();
        self.reference_over(s, &abs)
    }

    fn reference_over(&self, s: &Setup, v_cache: &[f32]) -> Vec<f32> {
        let row = self.n_heads * self.hd;
        let q = to_f32(&s.q);
        let mut out = vec![f32::NAN; q.len()];
        let mut t0 = 0;
        for (&(f, n), t) in self.seqs.iter().zip(&s.tables) {
            let seq = SeqSlice { block_table: t, first_pos: f, n_tokens: n };
            let (a, b) = (t0 * row, (t0 + n) * row);
            cpu::attention(&s.cache, &s.kc, v_cache, &mut out[a..b], &q[a..b], &seq, self.n_heads, self.scale).unwrap();
            t0 += n;
        }
        out
    }

    /// `cu_q` of the case's chunks laid out one after another.
    fn cu_q(&self) -> Vec<u32> {
        let mut cu = vec![0u32];
        for &(_, n) in &self.seqs {
            cu.push(cu.last().unwrap() + n as u32);
        }
        cu
    }
}

impl Setup {
    fn batch(&self) -> PagedBatch<'_> {
        PagedBatch {
            cache: self.cache,
            k_cache: &self.kd,
            v_cache: &self.vd,
            block_tables: &self.tables_d,
            max_blocks: self.max_blocks,
            context_lens: &self.ctx_d,
        }
    }
}

/// Context lengths of a 33-sequence batch: the named edge lengths plus random ones.
fn mixed_lengths(r: &mut ChaCha8Rng, edge: &[usize]) -> Vec<usize> {
    let mut v: Vec<usize> = edge.to_vec();
    while v.len() < 33 {
        v.push(1 + r.next_u32() as usize % 1500);
    }
    v
}

fn decode_cases(r: &mut ChaCha8Rng) -> Vec<Case> {
    let one = |n_heads, n_kv, hd, ctx: &[usize], scale| Case {
        n_heads,
        n_kv,
        hd,
        seqs: ctx.iter().map(|&c| (c - 1, 1)).collect(),
        scale,
    };
    let s = |hd: usize| 1.0 / (hd as f32).sqrt();
    let mixed = mixed_lengths(r, &[1, 17, 500, 4096, 16, 32]);
    let mixed2 = mixed_lengths(r, &[1, 2, 17, 500, 1024]);
    let mixed3 = mixed_lengths(r, &[1, 17, 300]);
    vec![
        one(8, 8, 64, &[1], s(64)),
        one(32, 8, 128, &[17], s(128)),
        one(32, 4, 128, &[500], s(128)),
        one(32, 8, 128, &[4096], s(128)),
        one(8, 8, 128, &[4096], 0.5), // MHA, peaky softmax
        one(16, 4, 64, &mixed, s(64)),
        one(32, 4, 128, &mixed2, s(128)),
        one(9, 3, 64, &mixed3, s(64)),          // SmolLM2: group 3
        one(24, 2, 128, &[1, 700, 33], s(128)), // group 12: two head chunks per kv head
    ]
}

// ---------------------------------------------------------------- tests

#[test]
fn decode_matches_cpu() {
    let Some(dev) = gpu("decode_matches_cpu") else { return };
    let mut r = rng(41);
    for case in decode_cases(&mut r) {
        let s = case.setup(&dev, &mut r);
        let want = case.reference(&s);
        let batch = s.batch();
        let max_ctx = case.seqs.iter().map(|&(f, n)| f + n).max().unwrap();
        let n = s.q.len();
        let mut ws = dev.decode_workspace(case.seqs.len(), case.n_heads, case.hd, 128).unwrap();
        for (label, split, use_ws) in [("auto", None, true), ("split 64", Some(64), true), ("one split", None, false)] {
            // The default kernel, then the lean one (shallower ring, early dependents):
            // both match the reference, and each other bit for bit.
            let mut first: Option<Vec<bf16>> = None;
            for (kernel, lean_max) in [("default", 0), ("lean", usize::MAX)] {
                dev.set_decode_lean_max_seqs(lean_max);
                let mut out = poisoned(&dev, n);
                let plan = dev
                    .paged_decode_attention(
                        &mut out,
                        &s.q_d,
                        &batch,
                        case.n_heads,
                        case.scale,
                        max_ctx,
                        split,
                        use_ws.then_some(&mut ws),
                    )
                    .unwrap();
                let what = format!(
                    "decode {} [{label}, {kernel} kernel: {} splits of {}]",
                    case.name(),
                    plan.n_splits,
                    plan.split_len
                );
                let got = dev.download(&out).unwrap();
                assert_close(&what, &got, &want);
                match &first {
                    None => first = Some(got),
                    Some(f) => assert!(
                        f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: differs from the default kernel"
                    ),
                }
            }
        }
    }
    dev.set_decode_lean_max_seqs(4);
}

#[test]
fn decode_with_understated_max_context_is_still_right() {
    // The last split runs to the real context: a stale max_context costs speed, not results.
    let Some(dev) = gpu("decode_with_understated_max_context_is_still_right") else { return };
    let mut r = rng(42);
    let case = Case { n_heads: 32, n_kv: 8, hd: 128, seqs: vec![(999, 1), (16, 1)], scale: 0.09 };
    let s = case.setup(&dev, &mut r);
    let want = case.reference(&s);
    let mut ws = dev.decode_workspace(2, 32, 128, 16).unwrap();
    let mut out = poisoned(&dev, s.q.len());
    let plan =
        dev.paged_decode_attention(&mut out, &s.q_d, &s.batch(), 32, 0.09, 300, Some(100), Some(&mut ws)).unwrap();
    assert_eq!(plan.n_splits, 3);
    assert_close("decode, max_context 300 for a 1000-position context", &dev.download(&out).unwrap(), &want);
    // The automatic plan sizes the grid for 300 positions; each sequence then divides its
    // own context among those splits.
    let mut out = poisoned(&dev, s.q.len());
    let plan = dev.paged_decode_attention(&mut out, &s.q_d, &s.batch(), 32, 0.09, 300, None, Some(&mut ws)).unwrap();
    assert!(plan.n_splits > 1, "{plan:?}");
    let what = format!("decode, max_context 300 for a 1000-position context [auto: {} splits]", plan.n_splits);
    assert_close(&what, &dev.download(&out).unwrap(), &want);
}

#[test]
fn decode_with_graph_sized_max_context() {
    // The engine's captured decode graphs pass max_context 8192 whatever the real contexts
    // (and size the workspace for 512 sequence-splits per head). The automatic plan sizes
    // the grid for 8192 positions, every sequence splits its own context and the splits
    // past it exit; forced splits leave most of the grid past the contexts. Each call runs
    // twice on the same workspace: the merge counters must be back at zero after a launch.
    let Some(dev) = gpu("decode_with_graph_sized_max_context") else { return };
    let mut r = rng(47);
    let small = vec![600usize, 65, 9000]; // 9000: past max_context, handled by its last split
    let mut large = vec![1usize, 16, 63, 64, 65, 600, 601, 1000, 2049];
    while large.len() < 24 {
        large.push(500 + r.next_u32() as usize % 200);
    }
    for (n_heads, n_kv, hd) in [(32usize, 8usize, 128usize), (9, 3, 64), (8, 8, 128)] {
        for lens in [&small, &large] {
            let scale = 1.0 / (hd as f32).sqrt();
            let case = Case { n_heads, n_kv, hd, seqs: lens.iter().map(|&c| (c - 1, 1)).collect(), scale };
            let s = case.setup(&dev, &mut r);
            let want = case.reference(&s);
            let mut ws = dev.decode_workspace(512, n_heads, hd, 1).unwrap();
            for (label, split) in [("auto", None), ("split 64", Some(64))] {
                for rep in 0..2 {
                    let mut out = poisoned(&dev, s.q.len());
                    let plan = dev
                        .paged_decode_attention(
                            &mut out,
                            &s.q_d,
                            &s.batch(),
                            n_heads,
                            scale,
                            8192,
                            split,
                            Some(&mut ws),
                        )
                        .unwrap();
                    if lens.len() < 4 {
                        assert!(plan.n_splits > 1, "{label}: {plan:?}");
                    }
                    let what = format!(
                        "decode {} max_context 8192 [{label}: {} splits of {}, call {}]",
                        case.name(),
                        plan.n_splits,
                        plan.split_len,
                        rep + 1
                    );
                    assert_close(&what, &dev.download(&out).unwrap(), &want);
                }
            }
        }
    }
}

fn prefill_cases(r: &mut ChaCha8Rng) -> Vec<Case> {
    let s = |hd: usize| 1.0 / (hd as f32).sqrt();
    let mut mixed: Vec<(usize, usize)> = vec![(0, 1), (16, 17), (1000, 64), (4000, 96), (0, 300), (499, 1), (3, 29)];
    while mixed.len() < 33 {
        mixed.push((r.next_u32() as usize % 600, 1 + r.next_u32() as usize % 80));
    }
    // Chunks of 1..16 tokens (decode-sized up to one warp's rows) among single-token rows,
    // at contexts that are mostly not multiples of 16 or 64.
    let mut small: Vec<(usize, usize)> = vec![(0, 1), (0, 16), (47, 13), (63, 1), (64, 15), (127, 2)];
    while small.len() < 24 {
        let n = if r.next_u32().is_multiple_of(3) { 1 } else { 1 + r.next_u32() as usize % 16 };
        small.push((r.next_u32() as usize % 700, n));
    }
    vec![
        Case { n_heads: 32, n_kv: 8, hd: 128, seqs: vec![(0, 100)], scale: s(128) },
        Case { n_heads: 32, n_kv: 4, hd: 128, seqs: vec![(300, 77)], scale: s(128) }, // mid-context, group 8
        Case { n_heads: 32, n_kv: 8, hd: 128, seqs: small.clone(), scale: s(128) },
        Case { n_heads: 32, n_kv: 4, hd: 64, seqs: small.clone(), scale: s(64) }, // group 8
        Case { n_heads: 8, n_kv: 8, hd: 128, seqs: small, scale: s(128) },        // group 1
        Case { n_heads: 4, n_kv: 4, hd: 128, seqs: vec![(0, 130), (61, 67), (5, 200)], scale: s(128) },
        Case { n_heads: 8, n_kv: 8, hd: 64, seqs: mixed.clone(), scale: s(64) },
        Case { n_heads: 9, n_kv: 3, hd: 64, seqs: mixed[..7].to_vec(), scale: s(64) },
        Case { n_heads: 16, n_kv: 4, hd: 128, seqs: mixed[..12].to_vec(), scale: 0.4 },
        Case { n_heads: 8, n_kv: 2, hd: 128, seqs: vec![(2048, 2048)], scale: s(128) }, // 4096 positions
        Case { n_heads: 24, n_kv: 2, hd: 64, seqs: vec![(17, 40), (0, 5)], scale: s(64) }, // group 12
    ]
}

#[test]
fn prefill_matches_cpu() {
    let Some(dev) = gpu("prefill_matches_cpu") else { return };
    let mut r = rng(43);
    for case in prefill_cases(&mut r) {
        let s = case.setup(&dev, &mut r);
        let (want, abs_v) = (case.reference(&s), case.reference_abs_v(&s));
        let cu_d = dev.upload(&case.cu_q()).unwrap();
        let max_q = case.seqs.iter().map(|s| s.1).max().unwrap();
        // The grid hint at its real value, and far too small (blocks stride over tiles).
        for (label, hint) in [("", max_q), (", grid hint 1", 1)] {
            let mut out = poisoned(&dev, s.q.len());
            dev.paged_prefill_attention(&mut out, &s.q_d, &s.batch(), &cu_d, hint, case.n_heads, case.scale).unwrap();
            let what = format!("prefill {} chunks {:?}{label}", case.name(), &case.seqs[..case.seqs.len().min(3)]);
            assert_close_with(&what, &dev.download(&out).unwrap(), &want, Some(&abs_v));
        }
    }
}

#[test]
fn prefill_bad_rows_are_nan_and_skipped_rows_untouched() {
    let Some(dev) = gpu("prefill_bad_rows_are_nan_and_skipped_rows_untouched") else { return };
    let mut r = rng(46);
    // Group 1 (a CTA holds 64 tokens of one head: good and NaN rows share it) and group 4.
    for (n_heads, n_kv, hd) in [(2usize, 2usize, 128usize), (8, 2, 64)] {
        let case = Case { n_heads, n_kv, hd, seqs: vec![(0, 70), (0, 100), (0, 5), (0, 5)], scale: 0.1 };
        let s = case.setup(&dev, &mut r);
        let (want, abs_v) = (case.reference(&s), case.reference_abs_v(&s));
        // Sequence 1: block 2 (positions 32..48) unmapped; sequence 2: context 3 for its 5
        // tokens; sequence 3: a cu_q range past the end of q (180 tokens).
        let mut flat = vec![u32::MAX; 4 * s.max_blocks];
        for (row, t) in flat.chunks_mut(s.max_blocks).zip(&s.tables) {
            row[..t.len()].copy_from_slice(t);
        }
        flat[s.max_blocks + 2] = 1 << 30;
        let tables = dev.upload(&flat).unwrap();
        let ctx = dev.upload(&[70u32, 100, 3, 5]).unwrap();
        let cu = dev.upload(&[0u32, 70, 170, 175, 190]).unwrap();
        let batch = PagedBatch { block_tables: &tables, context_lens: &ctx, ..s.batch() };
        let sentinel = bf16::from_f32(7.0);
        let mut out = dev.upload(&vec![sentinel; s.q.len()]).unwrap();
        dev.paged_prefill_attention(&mut out, &s.q_d, &batch, &cu, 100, n_heads, 0.1).unwrap();
        let got = dev.download(&out).unwrap();
        let row = n_heads * hd;
        // Rows of sequence 1 from position 32 on see the unmapped block.
        let (good, seen) = (0..(70 + 32) * row, (70 + 32) * row..170 * row);
        let name = case.name();
        assert_close_with(
            &format!("prefill {name}: rows that see no bad position"),
            &got[good.clone()],
            &want[good.clone()],
            Some(&abs_v[good]),
        );
        assert!(got[seen].iter().all(|v| v.is_nan()), "{name}: rows that see an unmapped block must be NaN");
        assert!(got[170 * row..175 * row].iter().all(|v| v.is_nan()), "{name}: a chunk longer than its context");
        assert!(
            got[175 * row..].iter().all(|v| v.to_bits() == sentinel.to_bits()),
            "{name}: a sequence whose cu_q range leaves q must write nothing"
        );
        // Shapes are checked on the host.
        let short_cu = dev.upload(&[0u32, 70]).unwrap();
        assert!(matches!(
            dev.paged_prefill_attention(&mut out, &s.q_d, &batch, &short_cu, 100, n_heads, 0.1),
            Err(KernelError::Shape { .. })
        ));
        let hd96 = PagedBatch { cache: PagedKv { head_dim: 96, ..s.cache }, ..s.batch() };
        assert!(matches!(
            dev.paged_prefill_attention(&mut out, &s.q_d, &hd96, &cu, 100, n_heads, 0.1),
            Err(KernelError::Unsupported { .. })
        ));
    }
}

#[test]
fn write_kv_skips_padding_slots() {
    let Some(dev) = gpu("write_kv_skips_padding_slots") else { return };
    let mut r = rng(44);
    let cache = PagedKv { block_size: BS, n_kv_heads: 2, head_dim: 64 };
    let stride = 128;
    let num_blocks = 4;
    let k0 = rand_bf16(&mut r, num_blocks * BS * stride, -1.0, 1.0);
    let v0 = rand_bf16(&mut r, num_blocks * BS * stride, -1.0, 1.0);
    let kn = rand_bf16(&mut r, 3 * stride, -1.0, 1.0);
    let vn = rand_bf16(&mut r, 3 * stride, -1.0, 1.0);
    let slots = [37u32, u32::MAX, 5];
    let (mut kd, mut vd) = (dev.upload(&k0).unwrap(), dev.upload(&v0).unwrap());
    let (knd, vnd, sd) = (dev.upload(&kn).unwrap(), dev.upload(&vn).unwrap(), dev.upload(&slots).unwrap());
    dev.write_kv(&cache, &mut kd, &mut vd, &knd, &vnd, &sd).unwrap();
    let (mut kw, mut vw) = (k0.clone(), v0.clone());
    for (t, &slot) in slots.iter().enumerate() {
        if slot != u32::MAX {
            let o = slot as usize * stride;
            kw[o..o + stride].copy_from_slice(&kn[t * stride..(t + 1) * stride]);
            vw[o..o + stride].copy_from_slice(&vn[t * stride..(t + 1) * stride]);
        }
    }
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&dev.download(&kd).unwrap()), bits(&kw));
    assert_eq!(bits(&dev.download(&vd).unwrap()), bits(&vw));
    // Shape errors name the op.
    let short = dev.upload(&kn[..stride]).unwrap();
    assert!(matches!(dev.write_kv(&cache, &mut kd, &mut vd, &short, &vnd, &sd), Err(KernelError::Shape { .. })));
}

#[test]
fn bad_rows_are_nan_or_zero_and_stay_contained() {
    let Some(dev) = gpu("bad_rows_are_nan_or_zero_and_stay_contained") else { return };
    let mut r = rng(45);
    let case = Case { n_heads: 8, n_kv: 2, hd: 64, seqs: vec![(40, 1), (20, 1), (30, 1)], scale: 0.125 };
    let s = case.setup(&dev, &mut r);
    let want = case.reference(&s);
    // Sequence 1: an unmapped block id; sequence 2: context 0 (a padding row).
    let mut flat = vec![0u32; 3 * s.max_blocks];
    for (row, t) in flat.chunks_mut(s.max_blocks).zip(&s.tables) {
        row.fill(u32::MAX);
        row[..t.len()].copy_from_slice(t);
    }
    flat[s.max_blocks] = 1 << 30;
    let tables = dev.upload(&flat).unwrap();
    let ctx = dev.upload(&[41u32, 21, 0]).unwrap();
    let batch = PagedBatch { block_tables: &tables, context_lens: &ctx, ..s.batch() };
    let row = 8 * 64;
    let mut ws: DecodeWorkspace = dev.decode_workspace(3, 8, 64, 8).unwrap();
    // Splits of 16: the NaN row merges a NaN split with good ones; max_context 8192: most
    // splits start past the contexts.
    for (split, max_ctx) in [(None, 41), (Some(16), 41), (None, 8192), (Some(16), 8192)] {
        let mut out = poisoned(&dev, s.q.len());
        dev.paged_decode_attention(&mut out, &s.q_d, &batch, 8, 0.125, max_ctx, split, Some(&mut ws)).unwrap();
        let got = dev.download(&out).unwrap();
        assert_close("decode next to bad rows", &got[..row], &want[..row]);
        assert!(got[row..2 * row].iter().all(|v| v.is_nan()), "unmapped block must give NaN");
        assert!(got[2 * row..].iter().all(|v| v.to_f32() == 0.0), "context 0 must give zeros");
    }
    // Shapes are checked on the host.
    let mut out = poisoned(&dev, s.q.len() - 1);
    assert!(matches!(
        dev.paged_decode_attention(&mut out, &s.q_d, &batch, 8, 0.125, 41, None, None),
        Err(KernelError::Shape { .. })
    ));
    let mut out = poisoned(&dev, s.q.len());
    assert!(matches!(
        dev.paged_decode_attention(&mut out, &s.q_d, &batch, 6, 0.125, 41, None, None),
        Err(KernelError::Shape { .. })
    ));
    let hd96 = PagedBatch { cache: PagedKv { head_dim: 96, ..s.cache }, ..s.batch() };
    assert!(matches!(
        dev.paged_decode_attention(&mut out, &s.q_d, &hd96, 8, 0.125, 41, None, None),
        Err(KernelError::Unsupported { .. })
    ));
}

// ---------------------------------------------------------------- benchmarks

fn fast_rand_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

/// Random K and V rows (64k tokens) that [`filled_cache`] copies around the cache.
struct KvPool {
    k: Buf<bf16>,
    v: Buf<bf16>,
    tokens: usize,
}

fn kv_pool(dev: &Device, cache: &PagedKv) -> KvPool {
    let (tokens, stride) = (65536, cache.n_kv_heads * cache.head_dim);
    let k = dev.upload(&fast_rand_bf16(tokens * stride, 11)).unwrap();
    let v = dev.upload(&fast_rand_bf16(tokens * stride, 12)).unwrap();
    KvPool { k, v, tokens }
}

/// A cache of `num_blocks` blocks filled on the GPU (write_kv from the random pool), so tens
/// of GB need no host upload.
fn filled_cache(dev: &Device, cache: &PagedKv, pool: &KvPool, num_blocks: usize) -> (Buf<bf16>, Buf<bf16>) {
    let stride = cache.n_kv_heads * cache.head_dim;
    let slots_total = num_blocks * cache.block_size;
    let (mut kc, mut vc) =
        (dev.alloc::<bf16>(slots_total * stride).unwrap(), dev.alloc::<bf16>(slots_total * stride).unwrap());
    let mut slots = dev.alloc::<u32>(pool.tokens).unwrap();
    for start in (0..slots_total).step_by(pool.tokens) {
        // Slots past the cache (u32::MAX) are skipped by write_kv.
        let ids: Vec<u32> =
            (start..start + pool.tokens).map(|s| if s < slots_total { s as u32 } else { u32::MAX }).collect();
        dev.write(&mut slots, &ids).unwrap();
        dev.write_kv(cache, &mut kc, &mut vc, &pool.k, &pool.v, &slots).unwrap();
    }
    dev.synchronize().unwrap();
    (kc, vc)
}

/// Shuffled, disjoint block tables: `copies` sets of `batch` sequences x `blocks` blocks.
fn shuffled_tables(dev: &Device, copies: usize, batch: usize, blocks: usize) -> Vec<Buf<u32>> {
    let n = copies * batch * blocks;
    let mut ids: Vec<u32> = (0..n as u32).collect();
    let mut s = 0x9e3779b97f4a7c15u64;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ids.swap(i, (s % (i as u64 + 1)) as usize);
    }
    ids.chunks(batch * blocks).map(|c| dev.upload(c).unwrap()).collect()
}

/// One decode benchmark shape at Llama-3.1-8B geometry (32 q heads, 8 kv heads, hd 128):
/// `batch` sequences of `ctx` positions in tables `max_blocks` wide, `max_context` passed to
/// the call (the engine's graphs pass 8192 whatever the contexts).
struct DecodeBench<'a> {
    dev: &'a Device,
    pool: &'a KvPool,
    ws: &'a mut DecodeWorkspace,
    batch: usize,
    ctx: usize,
    max_context: usize,
}

impl DecodeBench<'_> {
    const N_HEADS: usize = 32;
    const CACHE: PagedKv = PagedKv { block_size: 16, n_kv_heads: 8, head_dim: 128 };

    /// Runs `(label, split_len, use the workspace)` variants over one cache; prints a BENCH
    /// line per variant (microseconds, KV bytes read per second).
    fn run(&mut self, variants: &[(&str, Option<usize>, bool)]) {
        let (dev, cache, n_heads) = (self.dev, Self::CACHE, Self::N_HEADS);
        let (batch, ctx) = (self.batch, self.ctx);
        let hd = cache.head_dim;
        let scale = 1.0 / (hd as f32).sqrt();
        let blocks = ctx.div_ceil(16);
        let max_blocks = blocks.max(self.max_context.div_ceil(16));
        let bytes = batch * ctx * cache.n_kv_heads * hd * 2 * 2; // K + V, bf16
                                                                 // Rotate over enough disjoint tables that one timing loop reads well over L2.
        let copies = (512usize << 20).div_ceil(bytes).clamp(1, 64);
        let (kc, vc) = filled_cache(dev, &cache, self.pool, copies * batch * blocks);
        let tables: Vec<Buf<u32>> = shuffled_tables(dev, copies, batch, blocks)
            .iter()
            .map(|t| {
                // Rows max_blocks wide, the entries past the context pointing nowhere.
                let ids = dev.download(t).unwrap();
                let mut flat = vec![u32::MAX; batch * max_blocks];
                for (row, src) in flat.chunks_mut(max_blocks).zip(ids.chunks(blocks)) {
                    row[..blocks].copy_from_slice(src);
                }
                dev.upload(&flat).unwrap()
            })
            .collect();
        let ctx_d = dev.upload(&vec![ctx as u32; batch]).unwrap();
        let q = dev.upload(&fast_rand_bf16(batch * n_heads * hd, 13)).unwrap();
        let mut out = dev.alloc::<bf16>(batch * n_heads * hd).unwrap();
        let reps = if bytes > (1 << 30) { 3 } else { 20 };
        let b = |i: usize| PagedBatch {
            cache,
            k_cache: &kc,
            v_cache: &vc,
            block_tables: &tables[i % copies],
            max_blocks,
            context_lens: &ctx_d,
        };
        for &(label, split, use_ws) in variants {
            let mut call = |i: usize, out: &mut Buf<bf16>| {
                let ws = if use_ws { Some(&mut *self.ws) } else { None };
                dev.paged_decode_attention(out, &q, &b(i), n_heads, scale, self.max_context, split, ws)
            };
            let p = call(0, &mut out).unwrap();
            let ms = median_ms(dev, 5, reps, |i| call(i, &mut out).map(drop));
            let gbs = bytes as f64 / (ms * 1e-3) / 1e9;
            let shown =
                if self.max_context == ctx { String::new() } else { format!(", max_context {}", self.max_context) };
            println!(
                "BENCH | decode attention{label} | batch {batch} ctx {ctx}{shown} ({} split{} of {}) | {:.1} us | - | {gbs:.0} GB/s KV read ({:.0}% of 4300)",
                p.n_splits,
                if p.n_splits == 1 { "" } else { "s" },
                p.split_len,
                ms * 1e3,
                gbs / 43.0
            );
        }
    }
}

#[test]
fn bench_decode_attention_llama8b() {
    let Some(dev) = bench_enabled("bench_decode_attention_llama8b") else { return };
    let pool = kv_pool(&dev, &DecodeBench::CACHE);
    let mut ws = dev.decode_workspace(256, DecodeBench::N_HEADS, 128, 128).unwrap();
    for batch in [1usize, 64, 256] {
        for ctx in [512usize, 4096, 32768] {
            let mut bench = DecodeBench { dev: &dev, pool: &pool, ws: &mut ws, batch, ctx, max_context: ctx };
            if batch == 1 && ctx >= 4096 {
                // The same call without split-KV: what flash-decoding buys at batch 1.
                bench.run(&[("", None, true), (", no split", None, false)]);
            } else {
                bench.run(&[("", None, true)]);
            }
        }
    }
}

#[test]
fn bench_decode_attention_engine_shapes() {
    // The engine's decode graphs: max_context 8192 and a workspace of 512 sequence-splits
    // per head, at the contexts of a chat workload; then forced split lengths, to compare
    // the automatic plan with its neighbours.
    let Some(dev) = bench_enabled("bench_decode_attention_engine_shapes") else { return };
    let pool = kv_pool(&dev, &DecodeBench::CACHE);
    let mut ws = dev.decode_workspace(512, DecodeBench::N_HEADS, 128, 1).unwrap();
    for (batch, ctx) in [(1usize, 600usize), (16, 600), (64, 600), (256, 600)] {
        DecodeBench { dev: &dev, pool: &pool, ws: &mut ws, batch, ctx, max_context: 8192 }.run(&[("", None, true)]);
    }
    let forced = |lens: &[usize]| -> Vec<(String, Option<usize>)> {
        lens.iter().map(|&l| (format!(", forced split {l}"), Some(l))).collect()
    };
    for (batch, ctx, lens) in [
        (1usize, 512usize, forced(&[64, 128, 256, 512])),
        (1, 4096, forced(&[64, 128, 256, 512])),
        (1, 32768, forced(&[512, 1024, 2048])),
        (64, 600, forced(&[152, 304, 600])),
        (64, 4096, forced(&[1024, 2048, 4096])),
    ] {
        let variants: Vec<(&str, Option<usize>, bool)> = lens.iter().map(|(l, s)| (l.as_str(), *s, true)).collect();
        DecodeBench { dev: &dev, pool: &pool, ws: &mut ws, batch, ctx, max_context: ctx }.run(&variants);
    }
}

#[test]
fn bench_prefill_and_write_kv_llama8b() {
    let Some(dev) = bench_enabled("bench_prefill_and_write_kv_llama8b") else { return };
    let (n_heads, n_kv, hd) = (32usize, 8usize, 128usize);
    let cache = PagedKv { block_size: 16, n_kv_heads: n_kv, head_dim: hd };
    let pool = kv_pool(&dev, &cache);
    for tokens in [512usize, 4096] {
        let blocks = tokens.div_ceil(16);
        let (mut kc, mut vc) = filled_cache(&dev, &cache, &pool, blocks);
        let tables = shuffled_tables(&dev, 1, 1, blocks);
        let ctx_d = dev.upload(&[tokens as u32]).unwrap();
        let cu = dev.upload(&[0u32, tokens as u32]).unwrap();
        let q = dev.upload(&fast_rand_bf16(tokens * n_heads * hd, 14)).unwrap();
        let mut out = dev.alloc::<bf16>(tokens * n_heads * hd).unwrap();
        let b = PagedBatch {
            cache,
            k_cache: &kc,
            v_cache: &vc,
            block_tables: &tables[0],
            max_blocks: blocks,
            context_lens: &ctx_d,
        };
        let ms = median_ms(&dev, 5, 3, |_| dev.paged_prefill_attention(&mut out, &q, &b, &cu, tokens, n_heads, 0.088));
        // Causal: query i sees i + 1 keys; 2 flops per multiply-add, QK and PV.
        let flops = 4.0 * (n_heads * hd) as f64 * (tokens * (tokens + 1) / 2) as f64;
        println!("BENCH | prefill attention (tensor cores) | 1 x {tokens} tokens, 32q/8kv hd128 | {:.1} us | {:.1} TFLOP/s | -", ms * 1e3, flops / (ms * 1e-3) / 1e12);

        let kn = dev.upload(&fast_rand_bf16(tokens * n_kv * hd, 15)).unwrap();
        let vn = dev.upload(&fast_rand_bf16(tokens * n_kv * hd, 16)).unwrap();
        let slots = dev.upload(&(0..tokens as u32).map(|i| (i * 7) % (tokens as u32)).collect::<Vec<_>>()).unwrap();
        let ms = median_ms(&dev, 5, 20, |_| dev.write_kv(&cache, &mut kc, &mut vc, &kn, &vn, &slots));
        let bytes = 4 * tokens * n_kv * hd * 2;
        println!(
            "BENCH | write_kv | {tokens} tokens x 8 kv x 128 | {:.2} us | - | {:.0} GB/s (read k, v; write cache)",
            ms * 1e3,
            bytes as f64 / (ms * 1e-3) / 1e9
        );
    }
}
