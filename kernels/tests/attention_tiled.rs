//! The tiled f32-softmax attention (`cpu::attention_tiled`) on random inputs: a batch of
//! sequences (prefill chunks from position 0 and mid-context, decodes far in) sharing one
//! paged f16 cache, against exact attention computed here in f64 over the same f16 K/V
//! and f16-rounded queries, on every instruction set this CPU has (scalar rows, AVX2, the
//! AVX-512VL build).
//! Also: batch invariance (each sequence alone and each token alone give the batch's
//! bits), non-finite caches handled as the scalar rows handle them, extreme scores, shape
//! errors, and the exact path's batch entry (`attention_f16_batch`) against a call per
//! sequence.

use half::f16;
use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_kernels::cpu::attention::{PagedKv, SeqSlice};
use tessera_kernels::cpu::attention_f16::{attention_f16, attention_f16_batch, write_kv_f16};
use tessera_kernels::cpu::attention_tiled::{attention_tiled, attention_tiled_with};
use tessera_kernels::cpu::matmul::Isa;
use tessera_kernels::KernelError;

fn rand_vec(r: &mut ChaCha8Rng, n: usize, range: f32) -> Vec<f32> {
    (0..n).map(|_| range * (2.0 * (r.next_u32() >> 8) as f32 / (1u32 << 24) as f32 - 1.0)).collect()
}

/// The instruction sets to test: scalar always, AVX2 and AVX-512VL where present.
fn isas() -> Vec<(&'static str, Isa)> {
    let mut v = vec![("scalar", Isa::scalar())];
    for (name, isa) in [("AVX2", Isa::avx2()), ("AVX-512VL", Isa::vnni())] {
        match isa {
            Some(isa) => v.push((name, isa)),
            None => eprintln!("skipped {name}: this CPU lacks it"),
        }
    }
    v
}

/// One sequence of a batch: `first_pos` cached positions, then `n_tokens` new ones; `k`,
/// `v` `[ctx, n_kv * hd]`, `q` `[n_tokens, n_heads * hd]`; its own blocks of the cache.
struct Seq {
    first_pos: usize,
    n_tokens: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    table: Vec<u32>,
}

/// A batch of sequences in one NaN-poisoned cache, their K/V written.
struct Batch {
    n_heads: usize,
    n_kv: usize,
    hd: usize,
    cache: PagedKv,
    kc: Vec<f16>,
    vc: Vec<f16>,
    seqs: Vec<Seq>,
}

impl Batch {
    /// `shape`: (first_pos, n_tokens) per sequence; q, k, v uniform in +-`ranges`.
    fn new(
        r: &mut ChaCha8Rng,
        (n_heads, n_kv, hd): (usize, usize, usize),
        block_size: usize,
        shape: &[(usize, usize)],
        (qr, kr, vr): (f32, f32, f32),
    ) -> Self {
        let stride = n_kv * hd;
        let needed: Vec<usize> = shape.iter().map(|(f, n)| (f + n).div_ceil(block_size)).collect();
        let num_blocks = needed.iter().sum::<usize>() + 3;
        // Every sequence gets distinct blocks, in shuffled order.
        let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, (r.next_u64() % (i as u64 + 1)) as usize);
        }
        let cache = PagedKv { block_size, n_kv_heads: n_kv, head_dim: hd };
        let mut kc = vec![f16::NAN; num_blocks * block_size * stride];
        let mut vc = kc.clone();
        let mut seqs = Vec::new();
        for (&(first_pos, n_tokens), need) in shape.iter().zip(needed) {
            let ctx = first_pos + n_tokens;
            let table: Vec<u32> = pool.drain(..need).collect();
            let s = Seq {
                first_pos,
                n_tokens,
                q: rand_vec(r, n_tokens * n_heads * hd, qr),
                k: rand_vec(r, ctx * stride, kr),
                v: rand_vec(r, ctx * stride, vr),
                table,
            };
            let all = SeqSlice { block_table: &s.table, first_pos: 0, n_tokens: ctx };
            write_kv_f16(&cache, &mut kc, &mut vc, &s.k, &s.v, &all).unwrap();
            seqs.push(s);
        }
        Batch { n_heads, n_kv, hd, cache, kc, vc, seqs }
    }

    fn slices(&self) -> Vec<SeqSlice<'_>> {
        self.seqs
            .iter()
            .map(|s| SeqSlice { block_table: &s.table, first_pos: s.first_pos, n_tokens: s.n_tokens })
            .collect()
    }

    fn q(&self) -> Vec<f32> {
        self.seqs.iter().flat_map(|s| s.q.iter().copied()).collect()
    }

    fn run(&self, isa: Isa, scale: f32) -> Vec<f32> {
        let q = self.q();
        let mut out = vec![f32::NAN; q.len()];
        attention_tiled_with(isa, &self.cache, &self.kc, &self.vc, &mut out, &q, &self.slices(), self.n_heads, scale)
            .unwrap();
        out
    }

    /// Exact attention (f64) over the f16-rounded queries, keys and values, and for each
    /// row the largest `scale · Σ |q_i k_i|` over its positions.
    fn exact(&self, scale: f32) -> (Vec<f64>, Vec<f64>) {
        let (hd, n_kv, group) = (self.hd, self.n_kv, self.n_heads / self.n_kv);
        let r16 = |x: f32| f64::from(f16::from_f32(x).to_f32());
        let (mut out, mut smax) = (Vec::new(), Vec::new());
        for s in &self.seqs {
            let kv = |x: &[f32], p: usize, h: usize| -> Vec<f64> {
                x[(p * n_kv + h / group) * hd..][..hd].iter().map(|&v| r16(v)).collect()
            };
            for t in 0..s.n_tokens {
                for h in 0..self.n_heads {
                    let q = &s.q[(t * self.n_heads + h) * hd..][..hd];
                    let n_ctx = s.first_pos + t + 1;
                    let sc: Vec<f64> = (0..n_ctx)
                        .map(|p| {
                            let d: f64 = q.iter().zip(kv(&s.k, p, h)).map(|(&a, b)| r16(a) * b).sum();
                            d * f64::from(scale)
                        })
                        .collect();
                    let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    // The scores' condition: scale · Σ |q_i k_i| (their f32 rounding scales with it).
                    smax.push((0..n_ctx).fold(0.0f64, |a, p| {
                        let d: f64 = q.iter().zip(kv(&s.k, p, h)).map(|(&a, b)| (r16(a) * b).abs()).sum();
                        a.max(d * f64::from(scale))
                    }));
                    let w: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = w.iter().sum();
                    let mut acc = vec![0.0f64; hd];
                    for (p, wp) in w.iter().enumerate() {
                        for (a, v) in acc.iter_mut().zip(kv(&s.v, p, h)) {
                            *a += wp * v;
                        }
                    }
                    out.extend(acc.iter().map(|a| a / z));
                }
            }
        }
        (out, smax)
    }
}

/// Every head size and GQA shape the engine's models have, and some the register kernel
/// leaves to the scalar rows (hd 80, 40), at cache blocks that are and are not whole
/// tiles: each output within f32 rounding of exact attention. The error: a weight
/// `e^(s - M)` carries the rounding of the f32 score `s`, which scales with
/// `S = scale · Σ |q_i k_i|`; relative to `max |v|` the outputs are off by at most 1.24
/// units of `2^-24 (S + 1)` over these cases (measured, the `e^x` polynomial's few ulp
/// included); the bound allows 4.
#[test]
fn tiled_attention_approaches_exact() {
    let mut r = ChaCha8Rng::seed_from_u64(31);
    // A whole prompt, a chunk mid-context, a sequence with no new tokens this step,
    // decodes far in (one past a tile boundary).
    let shape = [(0, 19), (37, 11), (7, 0), (90, 1), (16, 1), (200, 1)];
    for dims in [(9, 3, 64), (8, 2, 64), (5, 1, 64), (4, 4, 128), (14, 2, 128), (2, 1, 256), (8, 2, 80), (2, 1, 40)] {
        for block_size in [16, 5] {
            // Ordinary; q large (peaked softmax, weights under e^-87); V large.
            for ranges in [(2.0, 2.0, 1.0), (300.0, 2.0, 1.0), (1.0, 1.0, 6.0e4)] {
                let batch = Batch::new(&mut r, dims, block_size, &shape, ranges);
                let scale = 1.0 / (dims.2 as f32).sqrt();
                let (exact, smax) = batch.exact(scale);
                let vmax = f64::from(ranges.2);
                for (name, isa) in isas() {
                    let got = batch.run(isa, scale);
                    let what = format!("{name} {dims:?} bs{block_size} ranges {ranges:?}");
                    for (i, (g, e)) in got.iter().zip(&exact).enumerate() {
                        let s = smax[i / dims.2];
                        let bound = vmax * 4.0 * 2f64.powi(-24) * (s + 1.0);
                        let err = (f64::from(*g) - e).abs();
                        assert!(err <= bound, "{what}: value {i} off by {err:e} > {bound:e} (exact {e})");
                    }
                }
            }
        }
    }
}

/// Batch invariance: each sequence alone, and each token of a chunk alone (as a decode
/// at its position), gives the batch's bits; so does a batch run from one thread, and
/// (where the CPU has both) the AVX-512VL build gives the AVX2 build's. The
/// batch is large enough for the parallel split (and whole GQA groups per task); one
/// decode alone splits by single heads.
#[test]
fn tiled_attention_rows_do_not_depend_on_the_batch() {
    let mut r = ChaCha8Rng::seed_from_u64(32);
    let shape = [(0, 40), (13, 1), (100, 1), (31, 9), (64, 1)];
    for dims in [(9, 3, 64), (8, 2, 128), (8, 2, 80)] {
        let batch = Batch::new(&mut r, dims, 16, &shape, (2.0, 2.0, 1.0));
        let (n_heads, hd) = (dims.0, dims.2);
        let row = n_heads * hd;
        let mut by_isa = Vec::new();
        for (name, isa) in isas() {
            let all = batch.run(isa, 0.125);
            by_isa.push((name, all.clone()));
            let one_thread = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            assert!(
                bits_eq(&one_thread.install(|| batch.run(isa, 0.125)), &all),
                "{name} {dims:?}: one thread differs"
            );
            let mut at = 0;
            for s in &batch.seqs {
                for t in 0..s.n_tokens {
                    let seq = SeqSlice { block_table: &s.table, first_pos: s.first_pos + t, n_tokens: 1 };
                    let mut out = vec![f32::NAN; row];
                    let q = &s.q[t * row..(t + 1) * row];
                    attention_tiled_with(isa, &batch.cache, &batch.kc, &batch.vc, &mut out, q, &[seq], n_heads, 0.125)
                        .unwrap();
                    assert!(bits_eq(&out, &all[at..at + row]), "{name} {dims:?}: token {t} at {} alone", s.first_pos);
                    at += row;
                }
            }
        }
        // The AVX-512VL build runs the AVX2 build's instructions: the same bits.
        if let [_, (_, avx2), (_, vl)] = &by_isa[..] {
            assert!(bits_eq(avx2, vl), "{dims:?}: AVX2 and AVX-512VL differ");
        }
    }
}

fn bits_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Wrong shapes, tables and scales are errors (and write nothing); no sequences or
/// empty chunks are no work.
#[test]
fn tiled_attention_rejects_bad_inputs() {
    let is_shape_err = |r: Result<(), KernelError>| matches!(r, Err(KernelError::Shape { .. }));
    let (hd, n_kv, bs) = (8, 2, 4);
    let cache = PagedKv { block_size: bs, n_kv_heads: n_kv, head_dim: hd };
    let kc = vec![f16::from_f32(0.1); 3 * bs * n_kv * hd];
    let vc = kc.clone();
    let q = vec![0.3f32; 3 * 4 * hd];
    let mut out = vec![7.0f32; q.len()];
    let (t1, t2) = ([2u32, 0], [1u32]);
    let ok = [
        SeqSlice { block_table: &t1, first_pos: 5, n_tokens: 2 },
        SeqSlice { block_table: &t2, first_pos: 2, n_tokens: 1 },
    ];
    assert!(attention_tiled(&cache, &kc, &vc, &mut out, &q, &ok, 4, 0.3).is_ok());
    assert!(out.iter().all(|x| (x - 0.1).abs() < 1e-3), "constant V gives its value");
    out.fill(7.0);
    let short = [ok[0], SeqSlice { block_table: &t2, first_pos: 4, n_tokens: 1 }];
    assert!(is_shape_err(attention_tiled(&cache, &kc, &vc, &mut out, &q, &short, 4, 0.3)));
    let bad_table = [1u32, 3];
    let bad = [SeqSlice { block_table: &bad_table, first_pos: 5, n_tokens: 2 }, ok[1]];
    assert!(is_shape_err(attention_tiled(&cache, &kc, &vc, &mut out, &q, &bad, 4, 0.3)));
    assert!(is_shape_err(attention_tiled(&cache, &kc, &vc, &mut out, &q, &ok[..1], 4, 0.3)), "rows != q's");
    assert!(is_shape_err(attention_tiled(&cache, &kc, &vc, &mut out[..3 * 3 * hd], &q[..3 * 3 * hd], &ok, 3, 0.3)));
    assert!(is_shape_err(attention_tiled(&cache, &kc, &vc, &mut out, &q, &ok, 4, f32::INFINITY)));
    assert!(is_shape_err(attention_tiled(&cache, &kc[1..], &vc[1..], &mut out, &q, &ok, 4, 0.3)));
    assert!(out.iter().all(|&x| x == 7.0), "a refused call wrote its output");
    assert!(attention_tiled(&cache, &kc, &vc, &mut [], &[], &[], 4, 0.3).is_ok());
    let empty = [SeqSlice { block_table: &t2, first_pos: 3, n_tokens: 0 }];
    assert!(attention_tiled(&cache, &kc, &vc, &mut [], &[], &empty, 4, 0.3).is_ok());
}

/// Non-finite caches (a NaN or an f16 infinity in K, a NaN in V, a kv head NaN at every
/// position) give the register kernel the scalar rows' outcome: the same outputs NaN, the
/// others within f32 rounding of each other; a clean sequence stays finite.
#[test]
fn tiled_attention_non_finite_inputs_as_the_scalar_rows() {
    let mut r = ChaCha8Rng::seed_from_u64(33);
    let dims = (9, 3, 64);
    let shape = [(30, 1), (40, 1), (0, 20), (25, 1), (3, 1)];
    let mut batch = Batch::new(&mut r, dims, 16, &shape, (2.0, 2.0, 1.0));
    let stride = 3 * 64;
    let slot = |s: &Seq, p: usize| (s.table[p / 16] as usize * 16 + p % 16) * stride;
    // Sequence 0: a NaN score (NaN in K, kv head 1, position 7); sequence 1: NaN in V
    // (kv head 0, position 3); sequence 2: +-inf scores (inf in K, kv head 2, position 2).
    let at = [slot(&batch.seqs[0], 7) + 64 + 5, slot(&batch.seqs[1], 3) + 2, slot(&batch.seqs[2], 2) + 128 + 9];
    batch.kc[at[0]] = f16::NAN;
    batch.vc[at[1]] = f16::NAN;
    batch.kc[at[2]] = f16::INFINITY;
    // Sequence 4 (a decode at position 3): kv head 0's K and V NaN at every position, so
    // its heads 0-2 never see a finite score (the scalar rows give 0, nothing summed).
    for p in 0..4 {
        let o = slot(&batch.seqs[4], p);
        batch.kc[o..o + 64].fill(f16::NAN);
        batch.vc[o..o + 64].fill(f16::NAN);
    }
    let scalar = batch.run(Isa::scalar(), 0.125);
    let row = 9 * 64;
    for (s, range) in [(0, 0..row), (1, row..2 * row), (2, 2 * row..22 * row)] {
        assert!(scalar[range].iter().any(|x| x.is_nan()), "sequence {s}: some output NaN");
    }
    assert!(scalar[22 * row..23 * row].iter().all(|x| x.is_finite()), "the clean sequence");
    assert!(scalar[23 * row..23 * row + 3 * 64].iter().all(|&x| x == 0.0), "no finite score: 0");
    for (name, isa) in isas().into_iter().skip(1) {
        let got = batch.run(isa, 0.125);
        for (i, (a, b)) in got.iter().zip(&scalar).enumerate() {
            assert_eq!(a.is_nan(), b.is_nan(), "{name}: value {i}: {a} vs scalar {b}");
            assert!(a.is_nan() || (a - b).abs() <= 1e-5, "{name}: value {i}: {a} vs scalar {b}");
        }
    }
}

/// `attention_f16_batch` (the exact path over a step's sequences) gives each sequence
/// what `attention_f16` gives it alone, bit for bit, and refuses rows that do not match.
#[test]
fn f16_batch_equals_a_call_per_sequence() {
    let mut r = ChaCha8Rng::seed_from_u64(34);
    let batch = Batch::new(&mut r, (9, 3, 64), 16, &[(0, 21), (13, 1), (7, 0), (100, 1), (31, 9)], (2.0, 2.0, 1.0));
    let q = batch.q();
    let mut all = vec![f32::NAN; q.len()];
    let seqs = batch.slices();
    attention_f16_batch(&batch.cache, &batch.kc, &batch.vc, &mut all, &q, &seqs, 9, 0.125).unwrap();
    let mut at = 0;
    for seq in &seqs {
        let len = seq.n_tokens * 9 * 64;
        let mut out = vec![f32::NAN; len];
        attention_f16(&batch.cache, &batch.kc, &batch.vc, &mut out, &q[at..at + len], seq, 9, 0.125).unwrap();
        assert!(bits_eq(&out, &all[at..at + len]), "sequence at first_pos {}", seq.first_pos);
        at += len;
    }
    let short = &mut all[..q.len() - 64];
    let err = attention_f16_batch(&batch.cache, &batch.kc, &batch.vc, short, &q[..q.len() - 64], &seqs, 9, 0.125);
    assert!(matches!(err, Err(KernelError::Shape { .. })));
}
