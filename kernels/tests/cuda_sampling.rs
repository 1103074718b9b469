//! GPU sampling (`Device::sample`) against a straightforward CPU reference written here,
//! on random logits (vocabularies 8, 50, 1000, 49152 and 151936), plus a benchmark. The
//! kernel's candidate fast path and its full-row fallback both run here (see
//! `candidate_path_edges_match_reference`), and so does the split path (greedy and
//! untruncated rows over many CTAs: `split_rows_match_reference_and_the_per_row_path`).
//!
//! The reference follows `worker/src/sampling.rs`: the adjusted logits are computed with
//! the CPU sampler's exact f32 operations (so they must match bit for bit, and greedy
//! decoding must equal its `argmax` exactly, ties and -inf included); logprobs and
//! truncation masses are f64. The kept set is classified per token as *allowed* (not
//! certainly dropped) or *definite* (certainly kept): tokens whose top-p cumulative mass or
//! min-p ratio lies within 1e-4 (relative) of the cut are allowed but not definite, since
//! the kernel sums f32. Top-k and top-p keep all tokens equal to the boundary logit (the
//! kernel's documented rule). Every sampled token must be allowed; and because the kernel
//! draws by Gumbel-max with the documented noise (`sample_params::gumbel_noise`), the
//! reference also predicts the token itself whenever the best allowed score is definite and
//! leads the next by more than 1e-6, which must then match exactly.
//!
//! Needs a GPU: tests run only with `TESSERA_GPU_TESTS=1`, benchmarks with
//! `TESSERA_GPU_BENCH=1` (`bench/gpu/run.sh` runs both on the device machine).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use rand_chacha::ChaCha8Rng;
use rand_core::Rng;
use tessera_kernels::cuda::sample_params::{gumbel_noise, order_key, SAMPLE_CANDIDATES, SPLIT_MAX_ROWS};
use tessera_kernels::cuda::{Device, SampleParams, SamplePaths, SampledRow};
use tessera_kernels::KernelError;

// ---------------------------------------------------------------- harness

/// One row's inputs: logits, parameters, (token, count) penalty entries (count = 1 + the
/// token's occurrences in the output, 0 = none) and (token, bias) entries.
#[derive(Clone)]
struct Row {
    logits: Vec<f32>,
    params: SampleParams,
    pen: Vec<(u32, u32)>,
    bias: Vec<(u32, f32)>,
}

impl Row {
    fn new(logits: Vec<f32>, params: SampleParams) -> Self {
        Row { logits, params, pen: Vec::new(), bias: Vec::new() }
    }
}

/// CSR offsets and entries of per-row lists, plus one trailing entry no row owns (the
/// kernel must ignore it; it also keeps the buffers non-empty).
fn csr<T: Copy>(lists: &[&[(u32, T)]], pad: T) -> (Vec<u32>, Vec<u32>, Vec<T>) {
    let (mut off, mut tok, mut val) = (vec![0u32], Vec::new(), Vec::new());
    for l in lists {
        for &(t, v) in l.iter() {
            tok.push(t);
            val.push(v);
        }
        off.push(tok.len() as u32);
    }
    tok.push(0);
    val.push(pad);
    (off, tok, val)
}

/// Samples all rows in one call; returns the results and the adjusted logits.
fn run(dev: &Device, vocab: usize, rows: &[Row], max_logprobs: usize) -> (Vec<SampledRow>, Vec<f32>) {
    let logits: Vec<f32> = rows.iter().flat_map(|r| r.logits.iter().copied()).collect();
    assert_eq!(logits.len(), rows.len() * vocab);
    let params: Vec<SampleParams> = rows.iter().map(|r| r.params).collect();
    let pens: Vec<&[(u32, u32)]> = rows.iter().map(|r| r.pen.as_slice()).collect();
    let biases: Vec<&[(u32, f32)]> = rows.iter().map(|r| r.bias.as_slice()).collect();
    let (po, pt, pc) = csr(&pens, 0u32);
    let (bo, bt, bv) = csr(&biases, 0f32);
    let mut ld = dev.upload(&logits).unwrap();
    let pd = dev.upload(&params).unwrap();
    let (pod, ptd, pcd) = (dev.upload(&po).unwrap(), dev.upload(&pt).unwrap(), dev.upload(&pc).unwrap());
    let (bod, btd, bvd) = (dev.upload(&bo).unwrap(), dev.upload(&bt).unwrap(), dev.upload(&bv).unwrap());
    // One spare row: read() must return only the rows asked for.
    let mut out = dev.sample_output(rows.len() + 1, max_logprobs).unwrap();
    dev.sample(&mut out, &mut ld, vocab, &pd, &pod, &ptd, &pcd, &bod, &btd, &bvd).unwrap();
    let got = out.read(dev, rows.len(), true).unwrap();
    assert_eq!(got.len(), rows.len());
    // Read again without the top lists (what a step without logprobs asks for): the same
    // rows, their top lists empty.
    let bare = out.read(dev, rows.len(), false).unwrap();
    for (g, b) in got.iter().zip(&bare) {
        assert_eq!((b.token, b.logprob.to_bits(), b.flags), (g.token, g.logprob.to_bits(), g.flags));
        assert!(b.top.is_empty());
    }
    (got, dev.download(&ld).unwrap())
}

fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32, n_logprobs: u32) -> SampleParams {
    SampleParams { temperature, top_k, top_p, min_p, n_logprobs, ..SampleParams::default() }
}

fn rand_logits(r: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| unif(r, lo, hi)).collect()
}

/// `n` distinct token ids below `vocab`.
fn distinct(r: &mut ChaCha8Rng, n: usize, vocab: usize) -> Vec<u32> {
    let mut ids = Vec::with_capacity(n);
    while ids.len() < n.min(vocab) {
        let t = r.next_u32() % vocab as u32;
        if !ids.contains(&t) {
            ids.push(t);
        }
    }
    ids
}

// ---------------------------------------------------------------- reference

/// Bias, then penalties, with the CPU sampler's f32 operations in its order.
fn adjust_ref(row: &Row) -> Vec<f32> {
    let mut l = row.logits.clone();
    for &(t, b) in &row.bias {
        l[t as usize] += b;
    }
    let p = &row.params;
    if p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for &(t, c) in &row.pen {
            if c == 0 {
                continue;
            }
            let g = c - 1; // occurrences in the output: presence and frequency count only these
            let v = &mut l[t as usize];
            if *v > 0.0 {
                *v = (*v / p.repetition_penalty).min(f32::MAX);
            } else {
                *v *= p.repetition_penalty;
            }
            *v -= g as f32 * p.frequency_penalty + if g > 0 { p.presence_penalty } else { 0.0 };
        }
    }
    l
}

/// The CPU sampler's greedy rule: the first index of the largest logit.
fn argmax_ref(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

fn max_of(l: &[f32]) -> f32 {
    l.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// log-sum-exp in f64.
fn lse_ref(l: &[f32]) -> f64 {
    let m = f64::from(max_of(l));
    m + l.iter().map(|&v| (f64::from(v) - m).exp()).sum::<f64>().ln()
}

/// The `n` most likely ids: logit descending (total order), then lower id.
fn top_ref(l: &[f32], n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    let desc = |a: &u32, b: &u32| l[*b as usize].total_cmp(&l[*a as usize]).then(a.cmp(b));
    let mut ids: Vec<u32> = (0..l.len() as u32).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, desc);
    }
    ids.truncate(n);
    ids.sort_by(desc);
    ids
}

/// Per token: may the kernel keep it (`allowed`), must it (`definite`)?
struct Kept {
    allowed: Vec<bool>,
    definite: Vec<bool>,
    /// exp((l - max) / T) in f64.
    weight: Vec<f64>,
}

const CUT_TOL: f64 = 1e-4;

fn kept_ref(l: &[f32], p: &SampleParams) -> Kept {
    let n = l.len();
    let max = max_of(l);
    let t = f64::from(p.temperature);
    let weight: Vec<f64> = l.iter().map(|&v| ((f64::from(v) - f64::from(max)) / t).exp()).collect();
    let mut allowed: Vec<bool> = l.iter().map(|&v| v > f32::NEG_INFINITY).collect();
    let n_finite = allowed.iter().filter(|&&a| a).count();
    let k = p.top_k as usize;
    if k > 0 && k < n_finite {
        let mut keys: Vec<u32> = (0..n).filter(|&i| allowed[i]).map(|i| order_key(l[i])).collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        let cut = keys[k - 1];
        for i in 0..n {
            allowed[i] &= order_key(l[i]) >= cut;
        }
    }
    let mut definite = allowed.clone();
    if p.top_p < 1.0 {
        let mut ids: Vec<usize> = (0..n).filter(|&i| allowed[i]).collect();
        ids.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        let total: f64 = ids.iter().map(|&i| weight[i]).sum();
        let (target, eps) = (f64::from(p.top_p) * total, CUT_TOL * total);
        // Groups of equal logits are kept or dropped together by the mass before them.
        let mut before = 0.0;
        let mut g = 0;
        while g < ids.len() {
            let end = g + ids[g..].iter().take_while(|&&i| l[i].to_bits() == l[ids[g]].to_bits()).count();
            let group = &ids[g..end];
            if before > target + eps {
                group.iter().for_each(|&i| (allowed[i], definite[i]) = (false, false));
            } else if before >= target - eps {
                group.iter().for_each(|&i| definite[i] = false);
            }
            before += group.iter().map(|&i| weight[i]).sum::<f64>();
            g = end;
        }
    }
    if p.min_p > 0.0 {
        let mp = f64::from(p.min_p);
        for i in 0..n {
            if weight[i] < mp * (1.0 - CUT_TOL) {
                (allowed[i], definite[i]) = (false, false);
            } else if weight[i] <= mp * (1.0 + CUT_TOL) {
                definite[i] = false;
            }
        }
    }
    Kept { allowed, definite, weight }
}

/// The token the Gumbel-max draw must pick, when the reference can tell: the best allowed
/// score is definite (so it wins over any kept set between definite and allowed) and leads
/// the runner-up by more than 1e-6. Scores use the kernel's f32 `(l - max) * (1 / T)`.
fn replica(l: &[f32], p: &SampleParams, kept: &Kept) -> Option<u32> {
    let (max, inv_t) = (max_of(l), 1.0f32 / p.temperature);
    let mut scored: Vec<(f64, u32)> = (0..l.len())
        .filter(|&i| kept.allowed[i])
        .map(|i| (f64::from((l[i] - max) * inv_t) + gumbel_noise(p.seed, p.draw, i as u32), i as u32))
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let (best, i) = *scored.first()?;
    let clear = scored.get(1).is_none_or(|&(second, _)| best - second > 1e-6);
    (kept.definite[i as usize] && clear).then_some(i)
}

fn close_logprob(got: f32, want: f64) -> bool {
    if want.is_infinite() {
        f64::from(got) == want
    } else {
        (f64::from(got) - want).abs() <= 1e-3
    }
}

/// Checks one row against the reference on its adjusted logits (which must equal
/// [`adjust_ref`] bit for bit); returns whether the token was predicted exactly.
fn check_row(what: &str, got: &SampledRow, adjusted: &[f32], row: &Row, max_logprobs: usize) -> bool {
    let want_adj = adjust_ref(row);
    assert!(
        adjusted.iter().zip(&want_adj).all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: adjusted logits differ from the reference"
    );
    let l = adjusted;
    assert_eq!(got.flags, 0, "{what}: flags");
    let p = &row.params;
    let mut exact = false;
    if p.is_greedy() {
        assert_eq!(got.token, argmax_ref(l), "{what}: greedy token");
        exact = true;
    } else {
        let kept = kept_ref(l, p);
        assert!(kept.allowed[got.token as usize], "{what}: token {} is outside the kept set", got.token);
        if let Some(t) = replica(l, p, &kept) {
            assert_eq!(got.token, t, "{what}: token differs from the Gumbel-max reference");
            exact = true;
        }
    }
    let lse = lse_ref(l);
    let lp = |t: u32| f64::from(l[t as usize]) - lse;
    assert!(close_logprob(got.logprob, lp(got.token)), "{what}: logprob {} want {}", got.logprob, lp(got.token));
    let n = (p.n_logprobs as usize).min(max_logprobs).min(l.len());
    let ids: Vec<u32> = got.top.iter().map(|&(t, _)| t).collect();
    assert_eq!(ids, top_ref(l, n), "{what}: top ids");
    for &(t, v) in &got.top {
        assert!(close_logprob(v, lp(t)), "{what}: top logprob of {t}: {v} want {}", lp(t));
    }
    exact
}

// ---------------------------------------------------------------- tests

/// Greedy decoding equals the CPU argmax exactly, on rows with ties at the maximum,
/// -inf entries, a coarse grid of values, and -0.0 / +0.0 as the maximum; chosen and
/// top-N logprobs match.
#[test]
fn greedy_matches_cpu_argmax() {
    let Some(dev) = gpu("greedy_matches_cpu_argmax") else { return };
    let mut r = rng(31);
    for (vocab, n_rows) in [(50usize, 64usize), (49152, 24), (151936, 16)] {
        let rows: Vec<Row> = (0..n_rows)
            .map(|i| {
                let mut l = rand_logits(&mut r, vocab, -15.0, 15.0);
                let at = |r: &mut ChaCha8Rng| r.next_u32() as usize % vocab;
                match i % 6 {
                    1 => {
                        // The maximum repeated below and above its first position.
                        let m = argmax_ref(&l) as usize;
                        let (a, b) = (at(&mut r) % (m + 1), m + at(&mut r) % (vocab - m));
                        let v = l[m] + 1.0;
                        (l[a], l[m], l[b]) = (v, v, v);
                    }
                    2 => (0..vocab / 3).for_each(|_| l[at(&mut r)] = f32::NEG_INFINITY),
                    3 => {
                        // Nearly everything banned, index 0 included.
                        let keep: Vec<usize> = (0..3).map(|_| at(&mut r)).collect();
                        for (j, v) in l.iter_mut().enumerate() {
                            if !keep.contains(&j) {
                                *v = f32::NEG_INFINITY;
                            }
                        }
                    }
                    4 => l.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
                    5 => {
                        // Everything negative; -0.0 then +0.0 share the maximum.
                        l.iter_mut().for_each(|v| *v = -v.abs() - 0.5);
                        let (a, b) = (at(&mut r) % (vocab / 2), vocab / 2 + at(&mut r) % (vocab / 2));
                        (l[a], l[b]) = (-0.0, 0.0);
                    }
                    _ => {}
                }
                Row::new(l, params(0.0, 0, 1.0, 0.0, [0, 1, 5, 20][i % 4]))
            })
            .collect();
        let (got, adjusted) = run(&dev, vocab, &rows, 20);
        for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
            check_row(&format!("greedy vocab {vocab} row {i}"), g, &adjusted[i * vocab..(i + 1) * vocab], row, 20);
        }
        eprintln!("greedy vocab {vocab}: {n_rows} rows ok");
    }
}

/// Bias then penalties give the reference's adjusted logits bit for bit, and the token and
/// logprobs that follow from them (penalty counts 0-5: no entry, a token of the prompt only,
/// 1-4 occurrences in the output); a +100 bias forces its token, -100 bans the winner, a
/// repetition penalty demotes a positive greedy winner, and a presence penalty leaves a token
/// seen only in the prompt alone.
#[test]
fn penalties_and_bias_match_reference() {
    let Some(dev) = gpu("penalties_and_bias_match_reference") else { return };
    let mut r = rng(32);
    for vocab in [50usize, 49152] {
        let rows: Vec<Row> = (0..32)
            .map(|i| {
                let p = SampleParams {
                    repetition_penalty: [1.0, 1.3, 0.8, 2.0][i % 4],
                    presence_penalty: unif(&mut r, -2.0, 2.0),
                    frequency_penalty: unif(&mut r, -2.0, 2.0),
                    seed: r.next_u64(),
                    draw: i as u64,
                    ..if i % 2 == 0 { params(0.0, 0, 1.0, 0.0, 5) } else { params(0.8, 20, 1.0, 0.0, 5) }
                };
                let ids = distinct(&mut r, 40, vocab);
                let mut row = Row::new(rand_logits(&mut r, vocab, -6.0, 6.0), p);
                row.pen = ids[..30].iter().map(|&t| (t, r.next_u32() % 6)).collect();
                row.bias = ids[25..].iter().map(|&t| (t, unif(&mut r, -5.0, 5.0))).collect();
                row
            })
            .collect();
        let (got, adjusted) = run(&dev, vocab, &rows, 20);
        let mut exact = 0;
        for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
            exact += check_row(
                &format!("penalties vocab {vocab} row {i}"),
                g,
                &adjusted[i * vocab..(i + 1) * vocab],
                row,
                20,
            ) as usize;
        }
        assert!(exact >= rows.len() / 2, "vocab {vocab}: only {exact} rows predicted exactly");
        eprintln!("penalties vocab {vocab}: ok, {exact} of {} tokens predicted exactly", rows.len());

        // Forcing, banning, demoting.
        let base = rand_logits(&mut r, vocab, -6.0, 6.0);
        let winner = argmax_ref(&base);
        let forced = (winner + 1 + r.next_u32() % (vocab as u32 - 1)) % vocab as u32;
        let mut rows = Vec::new();
        for p in [params(0.0, 0, 1.0, 0.0, 0), params(1.0, 0, 1.0, 0.0, 0)] {
            let mut row = Row::new(base.clone(), SampleParams { seed: 5, ..p });
            row.bias = vec![(forced, 100.0)];
            rows.push(row);
            let mut row = Row::new(base.clone(), p);
            row.bias = vec![(winner, -100.0)];
            rows.push(row);
        }
        let mut pos = base.clone();
        pos[winner as usize] = pos[winner as usize].abs() + 0.25;
        let mut row = Row::new(pos, SampleParams { repetition_penalty: 4.0, ..params(0.0, 0, 1.0, 0.0, 0) });
        row.pen = vec![(winner, 1)];
        rows.push(row);
        // A tiny penalty lifts a repeated positive logit past f32's range: held at the
        // largest finite value, so that token wins (not a bad-logit row).
        let mut lifted = base.clone();
        lifted[forced as usize] = lifted[forced as usize].abs() + 4.0;
        let mut row = Row::new(lifted, SampleParams { repetition_penalty: 1e-38, ..params(0.0, 0, 1.0, 0.0, 0) });
        row.pen = vec![(forced, 1)];
        rows.push(row);
        // Presence 5: not for a token of the prompt only (count 1), once for one in the output.
        for count in [1, 2] {
            let mut row = Row::new(base.clone(), SampleParams { presence_penalty: 5.0, ..params(0.0, 0, 1.0, 0.0, 0) });
            row.pen = vec![(winner, count)];
            rows.push(row);
        }
        let (got, adjusted) = run(&dev, vocab, &rows, 0);
        for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
            check_row(&format!("force/ban vocab {vocab} row {i}"), g, &adjusted[i * vocab..(i + 1) * vocab], row, 0);
        }
        let w = winner as usize;
        assert_eq!((got[6].token, adjusted[6 * vocab + w]), (winner, base[w]), "presence skips prompt-only tokens");
        assert_eq!(adjusted[7 * vocab + w], base[w] - 5.0, "presence once for an output token");
        assert_eq!((got[0].token, got[2].token), (forced, forced), "a +100 bias forces its token");
        assert!(got[1].token != winner && got[3].token != winner, "a -100 bias bans the winner");
        assert_eq!(got[1].token, argmax_ref(&adjusted[vocab..2 * vocab]));
        assert_ne!(got[4].token, winner, "the repetition penalty demotes the winner");
        assert_eq!((got[5].token, adjusted[5 * vocab + forced as usize]), (forced, f32::MAX), "a tiny penalty lifts");
        eprintln!("force/ban/demote vocab {vocab}: ok");
    }
}

/// With top-k, top-p and min-p (alone and combined, with ties on a coarse grid and with
/// -inf entries) every sampled token is in the reference's kept set over many draws, and
/// most are predicted exactly; logprobs match.
#[test]
fn truncation_keeps_only_the_reference_set() {
    let Some(dev) = gpu("truncation_keeps_only_the_reference_set") else { return };
    let mut r = rng(33);
    let configs = [
        params(0.8, 40, 1.0, 0.0, 0),
        params(1.2, 0, 0.8, 0.0, 3),
        params(1.0, 0, 1.0, 0.05, 0),
        params(0.7, 100, 0.9, 0.01, 20),
        params(1.5, 1, 1.0, 0.0, 0),
        params(1.0, 0, 1.0, 0.0, 1),
        params(0.3, 0, 0.5, 0.0, 5),
        params(2.0, 7, 0.95, 0.2, 0),
    ];
    for vocab in [50usize, 49152, 151936] {
        for (c, cfg) in configs.iter().enumerate() {
            // 4 logit rows x 8 draws each.
            let mut rows = Vec::new();
            for b in 0..4u64 {
                let mut l = rand_logits(&mut r, vocab, -8.0, 8.0);
                if b % 2 == 1 {
                    l.iter_mut().for_each(|v| *v = (*v * 4.0).round() / 4.0);
                }
                if b == 2 {
                    (0..vocab / 5).for_each(|_| l[r.next_u32() as usize % vocab] = f32::NEG_INFINITY);
                }
                let seed = r.next_u64();
                for d in 0..8u64 {
                    rows.push(Row::new(l.clone(), SampleParams { seed, draw: d * 1_000_003 + b, ..*cfg }));
                }
            }
            let (got, adjusted) = run(&dev, vocab, &rows, 20);
            let mut exact = 0;
            for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
                let what = format!("truncation vocab {vocab} config {c} row {i}");
                exact += check_row(&what, g, &adjusted[i * vocab..(i + 1) * vocab], row, 20) as usize;
            }
            assert!(exact >= rows.len() / 2, "vocab {vocab} config {c}: only {exact} rows predicted exactly");
            eprintln!("truncation vocab {vocab} config {c}: ok, {exact} of {} tokens predicted exactly", rows.len());
        }
    }
}

/// The candidate fast path and its fallbacks: top-k above the candidate cap, top-k at the
/// cap, plain softmax draws (top_k 0, top_p 1), top-p / min-p alone (proved from the
/// candidates or falling back), all-equal logits (ties beyond the cap), rows that are mostly
/// -inf, and logprobs with each; on vocabularies 50 and 151936. Every token is in the
/// reference's kept set, most are predicted exactly, logprobs match.
#[test]
fn candidate_path_edges_match_reference() {
    let Some(dev) = gpu("candidate_path_edges_match_reference") else { return };
    let mut r = rng(37);
    let cap = SAMPLE_CANDIDATES as u32;
    let configs = [
        params(0.8, 50, 0.95, 0.0, 5),
        params(1.0, cap + 1000, 0.9, 0.0, 3),
        params(1.0, cap, 0.95, 0.0, 0),
        params(1.0, 0, 1.0, 0.0, 5),
        params(0.3, 0, 0.6, 0.0, 0),
        params(1.0, 0, 0.95, 0.0, 20),
        params(0.5, 0, 1.0, 0.1, 1),
        params(1.0, 3, 1.0, 0.0, 20),
    ];
    for vocab in [50usize, 151936] {
        let mut rows = Vec::new();
        for (c, cfg) in configs.iter().enumerate() {
            for kind in 0..4u64 {
                let mut l = rand_logits(&mut r, vocab, -8.0, 8.0);
                match kind {
                    // A peaked row: the top-p / min-p sets are a few tokens.
                    1 => (0..5).for_each(|j| l[(r.next_u32() as usize + j) % vocab] = 14.0 + j as f32),
                    // All equal.
                    2 => l.iter_mut().for_each(|v| *v = 0.75),
                    // All but a few -inf.
                    3 => {
                        let keep = distinct(&mut r, 30, vocab);
                        for (j, v) in l.iter_mut().enumerate() {
                            if !keep.contains(&(j as u32)) {
                                *v = f32::NEG_INFINITY;
                            }
                        }
                    }
                    _ => {}
                }
                let seed = r.next_u64();
                for d in 0..2u64 {
                    rows.push(Row::new(l.clone(), SampleParams { seed, draw: d + 10 * c as u64, ..*cfg }));
                }
            }
        }
        let (got, adjusted) = run(&dev, vocab, &rows, 20);
        let mut exact = 0;
        for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
            let what = format!("candidates vocab {vocab} config {} row {i}", i / 8);
            exact += check_row(&what, g, &adjusted[i * vocab..(i + 1) * vocab], row, 20) as usize;
        }
        assert!(exact >= rows.len() / 2, "vocab {vocab}: only {exact} rows predicted exactly");
        eprintln!("candidates vocab {vocab}: ok, {exact} of {} tokens predicted exactly", rows.len());
    }
}

/// 20000 draws from a fixed 8-token row (many rows at once, one draw index each): token
/// frequencies match the reference probabilities after temperature and truncation within
/// 5 standard deviations, and truncated tokens never appear.
#[test]
fn sampled_frequencies_match_reference() {
    let Some(dev) = gpu("sampled_frequencies_match_reference") else { return };
    let logits = vec![1.2f32, -0.3, 2.0, 0.7, 1.9, -1.5, 0.1, 1.0];
    let n = 20_000usize;
    for cfg in [params(0.7, 0, 0.9, 0.0, 0), params(1.3, 5, 1.0, 0.4, 0), params(1.0, 0, 1.0, 0.0, 0)] {
        let kept = kept_ref(&logits, &cfg);
        assert_eq!(kept.allowed, kept.definite, "the test row must have no borderline token");
        let total: f64 = (0..8).filter(|&i| kept.allowed[i]).map(|i| kept.weight[i]).sum();
        let rows: Vec<Row> =
            (0..n).map(|d| Row::new(logits.clone(), SampleParams { seed: 77, draw: d as u64, ..cfg })).collect();
        let (got, _) = run(&dev, 8, &rows, 0);
        let mut counts = [0usize; 8];
        for g in &got {
            counts[g.token as usize] += 1;
        }
        for (i, &count) in counts.iter().enumerate() {
            if !kept.allowed[i] {
                assert_eq!(count, 0, "{cfg:?}: truncated token {i} drawn");
                continue;
            }
            let p = kept.weight[i] / total;
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!(
                (count as f64 - mean).abs() <= 5.0 * sd + 1.0,
                "{cfg:?}: token {i} drawn {count} times, expected {mean:.0} +- {sd:.0}"
            );
        }
        eprintln!("frequencies {cfg:?}: {counts:?}");
    }
}

/// The same (seed, draw) gives the same token, in any batch and at any position; other
/// draws or seeds give different tokens.
#[test]
fn draws_are_deterministic_and_vary() {
    let Some(dev) = gpu("draws_are_deterministic_and_vary") else { return };
    let mut r = rng(34);
    let vocab = 1000;
    let l = rand_logits(&mut r, vocab, -1.0, 1.0);
    let by_draw: Vec<Row> = (0..256)
        .map(|d| Row::new(l.clone(), SampleParams { seed: 99, draw: d, ..params(1.0, 0, 1.0, 0.0, 0) }))
        .collect();
    let a: Vec<u32> = run(&dev, vocab, &by_draw, 0).0.iter().map(|g| g.token).collect();
    let b: Vec<u32> = run(&dev, vocab, &by_draw, 0).0.iter().map(|g| g.token).collect();
    assert_eq!(a, b, "same seeds and draws, different tokens");
    let alone = run(&dev, vocab, &by_draw[17..18], 0).0[0].token;
    assert_eq!(alone, a[17], "a row alone draws what it draws in a batch");
    let mut distinct_draws = a.clone();
    distinct_draws.sort_unstable();
    distinct_draws.dedup();
    let by_seed: Vec<Row> = (0..256)
        .map(|s| Row::new(l.clone(), SampleParams { seed: s * 7919, draw: 3, ..params(1.0, 0, 1.0, 0.0, 0) }))
        .collect();
    let mut c: Vec<u32> = run(&dev, vocab, &by_seed, 0).0.iter().map(|g| g.token).collect();
    c.sort_unstable();
    c.dedup();
    // A near-flat 1000-token row: 256 independent draws hit ~200 distinct tokens.
    assert!(distinct_draws.len() > 120 && c.len() > 120, "{} / {} distinct tokens", distinct_draws.len(), c.len());
    eprintln!("determinism: ok, {} distinct over draws, {} over seeds", distinct_draws.len(), c.len());
}

/// NaN / +inf logits, all-banned rows and bad entries are reported per row, and the other
/// rows are unaffected.
#[test]
fn flags_report_bad_rows() {
    let Some(dev) = gpu("flags_report_bad_rows") else { return };
    let mut r = rng(35);
    let vocab = 64;
    let mut rows: Vec<Row> =
        (0..6).map(|_| Row::new(rand_logits(&mut r, vocab, -4.0, 4.0), params(0.0, 0, 1.0, 0.0, 3))).collect();
    rows[0].logits.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    rows[1].logits[9] = f32::NAN;
    rows[2].logits[10] = f32::INFINITY;
    rows[3].bias = vec![(vocab as u32 + 3, 1.0), (4, 100.0)];
    rows[4].params.repetition_penalty = 2.0;
    rows[4].pen = vec![(vocab as u32, 1)];
    let (got, adjusted) = run(&dev, vocab, &rows, 3);
    assert_eq!((got[0].token, got[0].flags), (0, SampledRow::ALL_BANNED));
    assert_eq!(got[1].flags, SampledRow::BAD_LOGIT);
    assert_eq!(got[2].flags, SampledRow::BAD_LOGIT);
    assert_eq!((got[3].token, got[3].flags), (4, SampledRow::BAD_ENTRY), "the in-vocabulary bias still applies");
    assert_eq!(got[4].flags, SampledRow::BAD_ENTRY);
    check_row("clean row", &got[5], &adjusted[5 * vocab..], &rows[5], 3);

    // Offsets past the entries: the row's list is skipped and flagged.
    let l = rand_logits(&mut r, 2 * vocab, -4.0, 4.0);
    let mut ld = dev.upload(&l).unwrap();
    let pd = dev.upload(&[params(0.0, 0, 1.0, 0.0, 0); 2]).unwrap();
    let (off, tok, val) =
        (dev.upload(&[0u32, 1, 9]).unwrap(), dev.upload(&[2u32, 3]).unwrap(), dev.upload(&[50f32, 50.0]).unwrap());
    let (poff, ptok, pcnt) =
        (dev.upload(&[0u32, 0, 0]).unwrap(), dev.upload(&[0u32]).unwrap(), dev.upload(&[0u32]).unwrap());
    let mut out = dev.sample_output(2, 0).unwrap();
    dev.sample(&mut out, &mut ld, vocab, &pd, &poff, &ptok, &pcnt, &off, &tok, &val).unwrap();
    let got = out.read(&dev, 2, false).unwrap();
    assert_eq!((got[0].token, got[0].flags), (2, 0));
    assert_eq!((got[1].token, got[1].flags), (argmax_ref(&l[vocab..]), SampledRow::BAD_ENTRY));
}

/// A queued read (`queue_read`, then `take`) returns the rows of the sampling queued before
/// it, whatever is queued after it: a second sampling into the same output, another
/// output's sampling and read, and a long copy. Two reads in a row and a take with nothing
/// queued are refused.
#[test]
fn queued_reads_return_their_own_rows() {
    let Some(dev) = gpu("queued_reads_return_their_own_rows") else { return };
    let mut r = rng(43);
    let (vocab, n) = (4096usize, 5usize);
    let off = dev.upload(&vec![0u32; n + 1]).unwrap();
    let (u1, f1) = (dev.upload(&[0u32]).unwrap(), dev.upload(&[0f32]).unwrap());
    let pd = dev.upload(&vec![SampleParams::greedy(); n]).unwrap();
    let (mut a, mut b) = (dev.sample_output(n, 0).unwrap(), dev.sample_output(n, 0).unwrap());
    let logits: Vec<Vec<f32>> = (0..3).map(|_| rand_logits(&mut r, n * vocab, -8.0, 8.0)).collect();
    let want = |l: &[f32]| -> Vec<u32> { (0..n).map(|i| argmax_ref(&l[i * vocab..(i + 1) * vocab])).collect() };
    let sample = |out: &mut tessera_kernels::cuda::SampleOutput, l: &[f32]| {
        let mut ld = dev.upload(l).unwrap();
        dev.sample(out, &mut ld, vocab, &pd, &off, &u1, &u1, &off, &u1, &f1).unwrap();
    };
    sample(&mut a, &logits[0]);
    a.queue_read(&dev, n, false).unwrap();
    assert!(a.is_queued());
    assert!(a.queue_read(&dev, n, false).is_err(), "a second read before the take");
    sample(&mut a, &logits[1]);
    sample(&mut b, &logits[2]);
    b.queue_read(&dev, n, false).unwrap();
    let big = 256 << 20;
    let (src, mut dst) = (dev.alloc::<u32>(big).unwrap(), dev.alloc::<u32>(big).unwrap());
    dev.copy_rows(&mut dst, 0, &src, 0, 1, big).unwrap();
    let tokens = |rows: Vec<SampledRow>| -> Vec<u32> { rows.iter().map(|r| r.token).collect() };
    assert_eq!(tokens(b.take().unwrap()), want(&logits[2]), "b");
    assert_eq!(tokens(a.take().unwrap()), want(&logits[0]), "a: the rows before its second sampling");
    assert!(!a.is_queued() && a.take().is_err(), "nothing queued");
    // The second sampling's rows, read now; and through `read`.
    assert_eq!(tokens(a.read(&dev, n, false).unwrap()), want(&logits[1]), "a, second sampling");
    // The device's tokens are the last sampling's.
    assert_eq!(dev.download(a.tokens()).unwrap()[..n], want(&logits[1]));
}

/// Greedy-only split batches leave out the draw launch (`SamplePaths` with `draws: false`):
/// right after a sampling call has filled the split results with draws, a greedy call on
/// the same output still returns each row's argmax, with the token and logprob bits of the
/// path that launches the draw.
#[test]
fn greedy_split_rows_skip_the_draw() {
    let Some(dev) = gpu("greedy_split_rows_skip_the_draw") else { return };
    let mut r = rng(41);
    for vocab in [49152usize, 151936] {
        let n = 8;
        let mut out = dev.sample_output(n, 0).unwrap();
        let off = dev.upload(&vec![0u32; n + 1]).unwrap();
        let (u1, f1) = (dev.upload(&[0u32]).unwrap(), dev.upload(&[0f32]).unwrap());
        let call = |out: &mut tessera_kernels::cuda::SampleOutput, logits: &[f32], ps: &[SampleParams], paths| {
            let mut ld = dev.upload(logits).unwrap();
            let pd = dev.upload(ps).unwrap();
            dev.sample_paths(out, &mut ld, vocab, &pd, &off, &u1, &u1, &off, &u1, &f1, paths).unwrap();
            out.read(&dev, ps.len(), false).unwrap()
        };
        // A sampling call first: every split slice holds a draw's score and pick.
        let hot: Vec<SampleParams> =
            (0..n).map(|i| SampleParams { seed: 9, draw: i as u64, ..params(1.0, 0, 1.0, 0.0, 0) }).collect();
        let hot_paths = SamplePaths::for_rows(vocab, hot.iter().map(|&p| (p, 0, 0)));
        assert_eq!(hot_paths, SamplePaths::SplitOnly { draws: true });
        call(&mut out, &rand_logits(&mut r, n * vocab, -8.0, 8.0), &hot, hot_paths);
        // Then greedy rows on new logits, with and without the draw launch.
        let logits = rand_logits(&mut r, n * vocab, -8.0, 8.0);
        let greedy = vec![SampleParams::greedy(); n];
        let paths = SamplePaths::for_rows(vocab, greedy.iter().map(|&p| (p, 0, 0)));
        assert_eq!(paths, SamplePaths::SplitOnly { draws: false });
        let skipped = call(&mut out, &logits, &greedy, paths);
        let drawn = call(&mut out, &logits, &greedy, SamplePaths::SplitOnly { draws: true });
        for (i, (a, b)) in skipped.iter().zip(&drawn).enumerate() {
            assert_eq!(a.token, argmax_ref(&logits[i * vocab..(i + 1) * vocab]), "vocab {vocab} row {i}: argmax");
            assert_eq!((a.token, a.logprob.to_bits(), a.flags), (b.token, b.logprob.to_bits(), b.flags), "row {i}");
        }
    }
    eprintln!("greedy split rows without the draw: ok");
}

/// The split path (greedy or untruncated rows without logprobs or entries, each row over
/// many CTAs): tokens and logprobs match the reference on large vocabularies; the token
/// equals the one-CTA path's (the same row with one logprob asked for) and the logprob its
/// within 1e-5; a row's results do not depend on its batch (bits equal alone and mixed with
/// one-CTA rows); NaN / +inf / all -inf rows are flagged as on the other path.
#[test]
fn split_rows_match_reference_and_the_per_row_path() {
    let Some(dev) = gpu("split_rows_match_reference_and_the_per_row_path") else { return };
    let mut r = rng(37);
    for vocab in [8usize, 1000, 49152, 151936] {
        let rows: Vec<Row> = (0..12)
            .map(|i| {
                let mut l = rand_logits(&mut r, vocab, -6.0, 6.0);
                if i % 4 == 1 {
                    // Ties at the maximum across slices, and banned tokens.
                    let m = argmax_ref(&l) as usize;
                    let v = l[m] + 1.0;
                    l[m] = v;
                    l[vocab - 1 - m / 2] = v;
                    (0..vocab / 5).for_each(|j| l[(j * 7) % vocab] = f32::NEG_INFINITY);
                }
                let t = [0.0f32, 0.5, 1.0, 1.7][i % 4];
                Row::new(l, SampleParams { seed: 5 + i as u64, draw: i as u64, ..params(t, 0, 1.0, 0.0, 0) })
            })
            .collect();
        assert!(rows.iter().all(|row| row.params.splits(vocab, 0, 0)));
        let (got, adjusted) = run(&dev, vocab, &rows, 0);
        let mut exact = 0;
        for (i, (g, row)) in got.iter().zip(&rows).enumerate() {
            exact +=
                check_row(&format!("split vocab {vocab} row {i}"), g, &adjusted[i * vocab..(i + 1) * vocab], row, 0)
                    as usize;
        }
        // The same rows on the one-CTA path (one logprob asked for).
        let per_row: Vec<Row> = rows
            .iter()
            .map(|row| Row { params: SampleParams { n_logprobs: 1, ..row.params }, ..row.clone() })
            .collect();
        let (other, _) = run(&dev, vocab, &per_row, 1);
        for (i, (a, b)) in got.iter().zip(&other).enumerate() {
            assert_eq!(a.token, b.token, "vocab {vocab} row {i}: split and per-row tokens differ");
            assert!((a.logprob - b.logprob).abs() <= 1e-5 * (1.0 + b.logprob.abs()), "vocab {vocab} row {i}");
        }
        // Batch independence: rows alone and interleaved with one-CTA rows.
        let mixed: Vec<Row> = rows.iter().zip(&per_row).flat_map(|(a, b)| [a.clone(), b.clone()]).collect();
        let (mixed_got, _) = run(&dev, vocab, &mixed, 1);
        for i in [0usize, 3, 6, 11] {
            let (alone, _) = run(&dev, vocab, &rows[i..i + 1], 0);
            for (what, g) in [("alone", &alone[0]), ("mixed", &mixed_got[2 * i])] {
                assert_eq!(
                    (g.token, g.logprob.to_bits(), g.flags),
                    (got[i].token, got[i].logprob.to_bits(), got[i].flags),
                    "vocab {vocab} row {i} {what}"
                );
            }
            assert_eq!(mixed_got[2 * i + 1], other[i], "vocab {vocab} row {i}: the per-row path in a mixed batch");
        }
        // A batch over SPLIT_MAX_ROWS samples every row one CTA each: same tokens.
        let many: Vec<Row> = rows.iter().cycle().take(SPLIT_MAX_ROWS + 8).cloned().collect();
        let (many_got, _) = run(&dev, vocab, &many, 0);
        for (i, g) in many_got.iter().enumerate() {
            let want = &got[i % rows.len()];
            assert_eq!(g.token, want.token, "vocab {vocab} row {i} of a large batch");
            assert!((g.logprob - want.logprob).abs() <= 1e-5 * (1.0 + want.logprob.abs()), "vocab {vocab} row {i}");
        }
        eprintln!("split vocab {vocab}: 12 rows ok, {exact} tokens predicted exactly");
    }
    let vocab = 5000;
    let mut bad: Vec<Row> =
        (0..4).map(|_| Row::new(rand_logits(&mut r, vocab, -4.0, 4.0), params(1.0, 0, 1.0, 0.0, 0))).collect();
    bad[0].logits.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    bad[1].logits[4321] = f32::NAN;
    bad[2].logits[17] = f32::INFINITY;
    let (got, adjusted) = run(&dev, vocab, &bad, 0);
    assert_eq!((got[0].token, got[0].flags), (0, SampledRow::ALL_BANNED));
    assert_eq!(got[1].flags, SampledRow::BAD_LOGIT);
    assert_eq!((got[2].token, got[2].flags), (17, SampledRow::BAD_LOGIT), "+inf: the argmax, not a draw");
    check_row("clean row beside bad ones", &got[3], &adjusted[3 * vocab..], &bad[3], 0);
}

/// Wrong lengths are shape errors naming the op, not panics or device faults.
#[test]
fn sample_rejects_bad_shapes() {
    let Some(dev) = gpu("sample_rejects_bad_shapes") else { return };
    let vocab = 10;
    let mut l = dev.upload(&[0.5f32; 30]).unwrap();
    let p3 = dev.upload(&[SampleParams::default(); 3]).unwrap();
    let p2 = dev.upload(&[SampleParams::default(); 2]).unwrap();
    let off4 = dev.upload(&[0u32; 4]).unwrap();
    let off3 = dev.upload(&[0u32; 3]).unwrap();
    let (u1, u2, f1) = (dev.upload(&[0u32]).unwrap(), dev.upload(&[0u32; 2]).unwrap(), dev.upload(&[0f32]).unwrap());
    let mut out = dev.sample_output(3, 5).unwrap();
    let mut small = dev.sample_output(2, 5).unwrap();
    let shape = |res: Result<(), KernelError>| matches!(res, Err(KernelError::Shape { op: "cuda_sample", .. }));
    assert!(dev.sample(&mut out, &mut l, vocab, &p3, &off4, &u1, &u1, &off4, &u1, &f1).is_ok());
    assert!(shape(dev.sample(&mut out, &mut l, 7, &p3, &off4, &u1, &u1, &off4, &u1, &f1)), "vocab does not divide");
    assert!(shape(dev.sample(&mut out, &mut l, 0, &p3, &off4, &u1, &u1, &off4, &u1, &f1)), "vocab 0");
    assert!(shape(dev.sample(&mut out, &mut l, vocab, &p2, &off4, &u1, &u1, &off4, &u1, &f1)), "params");
    assert!(shape(dev.sample(&mut out, &mut l, vocab, &p3, &off3, &u1, &u1, &off4, &u1, &f1)), "penalty offsets");
    assert!(shape(dev.sample(&mut out, &mut l, vocab, &p3, &off4, &u1, &u2, &off4, &u1, &f1)), "penalty lists");
    assert!(shape(dev.sample(&mut out, &mut l, vocab, &p3, &off4, &u1, &u1, &off3, &u1, &f1)), "bias offsets");
    assert!(shape(dev.sample(&mut out, &mut l, vocab, &p3, &off4, &u1, &u1, &off4, &u2, &f1)), "bias lists");
    assert!(shape(dev.sample(&mut small, &mut l, vocab, &p3, &off4, &u1, &u1, &off4, &u1, &f1)), "output rows");
    let mut huge = dev.alloc::<f32>((1 << 20) + 1).unwrap();
    let p1 = dev.upload(&[SampleParams::default()]).unwrap();
    let off2 = dev.upload(&[0u32; 2]).unwrap();
    assert!(
        shape(dev.sample(&mut out, &mut huge, (1 << 20) + 1, &p1, &off2, &u1, &u1, &off2, &u1, &f1)),
        "vocab > 2^20"
    );
    assert!(matches!(dev.sample_output(4, 21), Err(KernelError::Shape { .. })), "max_logprobs > 20");
    assert!(matches!(out.read(&dev, 4, true), Err(KernelError::Shape { .. })), "reading more rows than held");
}

// ---------------------------------------------------------------- benchmarks

#[test]
fn bench_sample() {
    let Some(dev) = bench_enabled("bench_sample") else { return };
    let vocab = 151936;
    let mut r = rng(36);
    for (rows, cfg, name) in [
        (256usize, params(0.0, 0, 1.0, 0.0, 0), "greedy"),
        (256, params(1.0, 0, 1.0, 0.0, 0), "T=1"),
        (64, params(1.0, 0, 1.0, 0.0, 0), "T=1"),
        (64, params(0.0, 0, 1.0, 0.0, 0), "greedy"),
        (256, params(0.8, 50, 0.95, 0.0, 0), "top-k 50 + top-p 0.95"),
        (256, params(0.8, 50, 0.95, 0.0, 5), "top-k 50 + top-p 0.95 + 5 logprobs"),
        (1, params(0.8, 50, 0.95, 0.0, 0), "top-k 50 + top-p 0.95"),
        (1, params(0.8, 50, 0.95, 0.0, 5), "top-k 50 + top-p 0.95 + 5 logprobs"),
        (8, params(0.8, 50, 0.95, 0.0, 0), "top-k 50 + top-p 0.95"),
        (8, params(0.8, 50, 0.95, 0.0, 5), "top-k 50 + top-p 0.95 + 5 logprobs"),
        (1, params(1.0, 0, 1.0, 0.0, 0), "T=1"),
        (8, params(1.0, 0, 1.0, 0.0, 0), "T=1"),
        (1, params(0.0, 0, 1.0, 0.0, 0), "greedy"),
        (1, params(0.0, 0, 1.0, 0.0, 5), "greedy + 5 logprobs"),
    ] {
        let l = rand_logits(&mut r, rows * vocab, -10.0, 10.0);
        let mut ld = dev.upload(&l).unwrap();
        let ps: Vec<SampleParams> = (0..rows).map(|i| SampleParams { draw: i as u64, ..cfg }).collect();
        let pd = dev.upload(&ps).unwrap();
        let off = dev.upload(&vec![0u32; rows + 1]).unwrap();
        let (u1, f1) = (dev.upload(&[0u32]).unwrap(), dev.upload(&[0f32]).unwrap());
        let mut out = dev.sample_output(rows, 5).unwrap();
        // The launches the worker's sampler makes for these rows.
        let paths = SamplePaths::for_rows(vocab, ps.iter().map(|&p| (p, 0, 0)));
        let ms = median_ms(&dev, 5, 10, |_| {
            dev.sample_paths(&mut out, &mut ld, vocab, &pd, &off, &u1, &u1, &off, &u1, &f1, paths)
        });
        let gbs = (rows * vocab * 4) as f64 / (ms * 1e-3) / 1e9;
        println!(
            "BENCH | sample {name} | {rows}x{vocab} f32 | {:.1} us | {paths:?} | {gbs:.0} GB/s (one read of the logits)",
            ms * 1e3
        );
    }
}
