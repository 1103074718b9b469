//! The sampler against references computed here in f64: argmax, empirical frequencies
//! vs `softmax(logits / T)` (a chi-square bound at fixed seeds), the exact candidate
//! sets of top-k / top-p / min-p, penalties and bias on exactly the right logits,
//! log-probabilities, seeding, and parameter validation.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use tessera_worker::sampling::{Sampled, Sampler, SamplingError, SamplingParams};

fn rand_logits(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| lo + (hi - lo) * ((r.next_u32() >> 8) as f32 / (1u32 << 24) as f32)).collect()
}

/// `softmax(logits / t)` in f64.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let m = logits.iter().copied().fold(f64::NEG_INFINITY, |a, b| a.max(b.into()));
    let e: Vec<f64> = logits.iter().map(|&l| ((f64::from(l) - m) / t).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Token ids by probability, most likely first, ties by lower id.
fn ranked(p: &[f64]) -> Vec<usize> {
    let mut ids: Vec<usize> = (0..p.len()).collect();
    ids.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    ids
}

fn sampler(params: SamplingParams) -> Sampler {
    Sampler::new(params).unwrap()
}

fn draw(s: &mut Sampler, logits: &[f32]) -> Sampled {
    let mut l = logits.to_vec();
    s.sample(&mut l, &[], 0).unwrap()
}

/// Draws `n` tokens and counts them per id.
fn counts(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
    let mut c = vec![0usize; logits.len()];
    for _ in 0..n {
        c[draw(s, logits).token as usize] += 1;
    }
    c
}

/// Pearson chi-square of `counts` against probabilities `p` (over ids with p > 0).
fn chi_square(counts: &[usize], p: &[f64]) -> f64 {
    let n: usize = counts.iter().sum();
    counts
        .iter()
        .zip(p)
        .filter(|(_, &p)| p > 0.0)
        .map(|(&c, &p)| {
            let e = p * n as f64;
            (c as f64 - e).powi(2) / e
        })
        .sum()
}

/// `p` restricted to `set` and renormalised.
fn restricted(p: &[f64], set: &[usize]) -> Vec<f64> {
    let z: f64 = set.iter().map(|&i| p[i]).sum();
    let mut q = vec![0.0; p.len()];
    for &i in set {
        q[i] = p[i] / z;
    }
    q
}

/// Asserts every draw is in `set` and every member of `set` was drawn.
fn assert_support(what: &str, c: &[usize], set: &[usize]) {
    for (i, &n) in c.iter().enumerate() {
        assert_eq!(n > 0, set.contains(&i), "{what}: token {i} drawn {n} times, in set: {}", set.contains(&i));
    }
}

#[test]
fn greedy_picks_argmax_lowest_id_on_ties() {
    let mut logits = rand_logits(1, 1000, -10.0, 10.0);
    let best = ranked(&softmax(&logits, 1.0))[0];
    let mut s = sampler(SamplingParams::greedy());
    assert_eq!(draw(&mut s, &logits).token as usize, best);
    // Temperatures below 1e-5 are greedy too, whatever the seed.
    let mut s = sampler(SamplingParams { temperature: 1e-6, seed: Some(9), ..SamplingParams::default() });
    for _ in 0..20 {
        assert_eq!(draw(&mut s, &logits).token as usize, best);
    }
    logits[700] = 20.0;
    logits[45] = 20.0;
    logits[900] = 20.0;
    let mut s = sampler(SamplingParams::greedy());
    assert_eq!(draw(&mut s, &logits).token, 45);
}

#[test]
fn seeds_replay_and_differ() {
    let logits = rand_logits(2, 200, -1.0, 1.0);
    let run = |seed: Option<u64>| -> Vec<u32> {
        let mut s = sampler(SamplingParams { seed, ..SamplingParams::default() });
        (0..300).map(|_| draw(&mut s, &logits).token).collect()
    };
    let a = run(Some(42));
    assert_eq!(a, run(Some(42)), "same seed, different sequence");
    // Near-uniform over 200 tokens: two independent runs agree at ~1% of positions.
    let same = |x: &[u32], y: &[u32]| x.iter().zip(y).filter(|(p, q)| p == q).count();
    assert!(same(&a, &run(Some(43))) < 30, "seeds 42 and 43 gave near-identical sequences");
    let (u, v) = (run(None), run(None));
    assert!(same(&u, &v) < 30, "two unseeded samplers gave near-identical sequences");
}

#[test]
fn frequencies_match_softmax_at_temperature() {
    // 20 tokens, 100k draws: the chi-square statistic (19 degrees of freedom) has mean
    // 19; 50 is beyond its 99.99th percentile. A missing or wrong temperature gives
    // thousands.
    let logits = rand_logits(3, 20, -2.0, 2.0);
    for (seed, t) in [(10u64, 0.7f32), (11, 1.0), (12, 1.6)] {
        let mut s = sampler(SamplingParams { temperature: t, seed: Some(seed), ..SamplingParams::default() });
        let c = counts(&mut s, &logits, 100_000);
        let chi = chi_square(&c, &softmax(&logits, t.into()));
        assert!(chi < 50.0, "T={t}: chi-square {chi:.1} over 19 dof");
    }
}

#[test]
fn top_k_samples_only_the_k_best_in_proportion() {
    let logits = rand_logits(4, 1000, -3.0, 3.0);
    let p = softmax(&logits, 1.3);
    let set: Vec<usize> = ranked(&p)[..7].to_vec();
    let params = SamplingParams { temperature: 1.3, top_k: 7, seed: Some(5), ..SamplingParams::default() };
    let c = counts(&mut sampler(params), &logits, 30_000);
    assert_support("top_k", &c, &set);
    // 6 degrees of freedom: mean 6, 99.99th percentile about 27.
    let chi = chi_square(&c, &restricted(&p, &set));
    assert!(chi < 27.0, "top_k: chi-square {chi:.1}");
}

/// The smallest most-likely prefix of `p` holding `top_p` of its mass.
fn nucleus(p: &[f64], top_p: f64) -> Vec<usize> {
    let mut cum = 0.0;
    let mut set = Vec::new();
    for i in ranked(p) {
        if p[i] == 0.0 {
            break;
        }
        set.push(i);
        cum += p[i];
        if cum >= top_p {
            break;
        }
    }
    set
}

#[test]
fn top_p_samples_only_the_nucleus() {
    let logits = rand_logits(6, 30, -3.0, 3.0);
    let p = softmax(&logits, 0.8);
    let set = nucleus(&p, 0.75);
    assert!(set.len() > 2 && set.len() < 25, "test needs a non-trivial nucleus, got {}", set.len());
    let params = SamplingParams { temperature: 0.8, top_p: 0.75, seed: Some(7), ..SamplingParams::default() };
    let c = counts(&mut sampler(params), &logits, 30_000);
    assert_support("top_p", &c, &set);
    let chi = chi_square(&c, &restricted(&p, &set));
    let dof = set.len() - 1;
    assert!(chi < 3.0 * dof as f64 + 20.0, "top_p: chi-square {chi:.1} over {dof} dof");
}

#[test]
fn top_p_over_a_large_flat_vocab_keeps_the_whole_nucleus() {
    // A nucleus of thousands of tokens: the sampler must grow its sorted prefix well
    // past its first 64 and cut at the same place as a full sort.
    let logits = rand_logits(8, 50_000, -1.0, 1.0);
    let p = softmax(&logits, 1.0);
    let set = nucleus(&p, 0.5);
    assert!(set.len() > 10_000, "nucleus of {}", set.len());
    let mut rank = vec![usize::MAX; p.len()];
    for (r, &i) in ranked(&p).iter().enumerate() {
        rank[i] = r;
    }
    let params = SamplingParams { top_p: 0.5, seed: Some(9), ..SamplingParams::default() };
    let mut s = sampler(params);
    let mut deepest = 0;
    for _ in 0..3000 {
        let r = rank[draw(&mut s, &logits).token as usize];
        assert!(r < set.len(), "drew rank {r}, nucleus has {}", set.len());
        deepest = deepest.max(r);
    }
    // The last tenth of the nucleus holds ~8% of its mass: 3000 draws reach it.
    assert!(deepest >= set.len() * 9 / 10, "deepest rank drawn {deepest} of {}", set.len());
}

#[test]
fn min_p_drops_tokens_below_its_share_of_the_max() {
    let logits = rand_logits(10, 200, -4.0, 4.0);
    let p = softmax(&logits, 0.9);
    let pmax = p.iter().copied().fold(0.0, f64::max);
    let set: Vec<usize> = (0..p.len()).filter(|&i| p[i] >= 0.2 * pmax).collect();
    assert!(set.len() > 2 && set.len() < 150, "test needs a non-trivial set, got {}", set.len());
    let params = SamplingParams { temperature: 0.9, min_p: 0.2, seed: Some(11), ..SamplingParams::default() };
    let c = counts(&mut sampler(params), &logits, 40_000);
    assert_support("min_p", &c, &set);
    let chi = chi_square(&c, &restricted(&p, &set));
    let dof = set.len() - 1;
    assert!(chi < 3.0 * dof as f64 + 20.0, "min_p: chi-square {chi:.1} over {dof} dof");
}

#[test]
fn truncations_apply_in_order_top_k_then_top_p_then_min_p() {
    let logits = rand_logits(12, 1000, -10.0, 10.0);
    let p = softmax(&logits, 0.6);
    let k_set: Vec<usize> = ranked(&p)[..60].to_vec();
    let pk = restricted(&p, &k_set);
    let kp_set = nucleus(&pk, 0.8);
    let pmax = pk[kp_set[0]];
    let set: Vec<usize> = kp_set.iter().copied().filter(|&i| pk[i] >= 0.4 * pmax).collect();
    assert!(set.len() < kp_set.len() && kp_set.len() < 60, "each stage should cut: {} {}", kp_set.len(), set.len());
    let params = SamplingParams {
        temperature: 0.6,
        top_k: 60,
        top_p: 0.8,
        min_p: 0.4,
        seed: Some(13),
        ..SamplingParams::default()
    };
    let c = counts(&mut sampler(params), &logits, 30_000);
    assert_support("top_k+top_p+min_p", &c, &set);
}

/// Repetition penalises every token of the sequence; presence and frequency only the
/// output's (the last `generated` of the history), as vLLM counts them.
#[test]
fn penalties_and_bias_change_exactly_the_right_logits() {
    let logits = rand_logits(14, 100, -5.0, 5.0);
    // Prompt 3, 10, 50; output 3, 77, 50, 3 (so 3 x2, 50 x1, 77 x1 in the output, 10 only
    // in the prompt); 77 also gets a bias, 20 only a bias.
    let history = [3u32, 10, 50, 3, 77, 50, 3];
    let generated = 4;
    let output = &history[history.len() - generated..];
    let (rp, pres, freq) = (1.3f32, 0.5f32, 0.25f32);
    let bias = vec![(77u32, 2.5f32), (20, -1.5)];
    let params = SamplingParams {
        repetition_penalty: rp,
        presence_penalty: pres,
        frequency_penalty: freq,
        logit_bias: bias,
        ..SamplingParams::greedy()
    };
    let mut got = logits.clone();
    sampler(params).sample(&mut got, &history, generated).unwrap();
    for (i, (&g, &l)) in got.iter().zip(&logits).enumerate() {
        let seen = history.iter().any(|&t| t as usize == i);
        let count = output.iter().filter(|&&t| t as usize == i).count();
        let l = f64::from(l)
            + if i == 77 {
                2.5
            } else if i == 20 {
                -1.5
            } else {
                0.0
            };
        let want = if !seen {
            l
        } else {
            let l = if l > 0.0 { l / f64::from(rp) } else { l * f64::from(rp) };
            l - count as f64 * f64::from(freq) - if count > 0 { f64::from(pres) } else { 0.0 }
        };
        assert!((f64::from(g) - want).abs() < 1e-5, "token {i} (output count {count}): got {g}, want {want}");
        if !seen && i != 20 && i != 77 {
            assert_eq!(g, logits[i], "token {i} is not in the history but changed");
        }
    }
    // Token 10, only in the prompt: the repetition penalty alone.
    let l10 = logits[10];
    assert_eq!(got[10], if l10 > 0.0 { l10 / rp } else { l10 * rp });
    // Both signs of logit were penalised in the history.
    assert!(history.iter().any(|&t| logits[t as usize] > 0.0) && history.iter().any(|&t| logits[t as usize] < 0.0));
}

/// Any repetition penalty > 0 is valid, and a tiny one divides a positive logit past f32's
/// range: the sampler holds it at the largest finite value (the repeated token wins, its
/// logprob is defined) instead of failing on an infinite logit.
#[test]
fn tiny_repetition_penalty_keeps_logits_finite() {
    let logits = rand_logits(31, 64, -4.0, 4.0);
    let pos = (0..64u32).find(|&t| logits[t as usize] > 3.5).expect("a logit > 3.5");
    let neg = (0..64u32).find(|&t| logits[t as usize] < -1.0).expect("a negative logit");
    let params = SamplingParams { repetition_penalty: 1e-38, logprobs: Some(2), ..SamplingParams::greedy() };
    let mut got = logits.clone();
    let s = sampler(params).sample(&mut got, &[pos, neg], 0).expect("sampled");
    assert_eq!(s.token, pos);
    assert_eq!(got[pos as usize], f32::MAX);
    assert!(s.logprob.is_finite() && s.logprob <= 0.0, "logprob {}", s.logprob);
    assert!(s.top.iter().all(|&(_, lp)| lp.is_finite()), "{:?}", s.top);
    // The negative one is scaled towards zero, as the rule says.
    assert_eq!(got[neg as usize], logits[neg as usize] * 1e-38);
}

/// A bias list is merged once per sequence: one entry per token in token order, a repeated
/// token's biases summed in their order; an already merged list is borrowed as it is.
#[test]
fn repeated_logit_biases_merge_in_order() {
    use std::borrow::Cow;
    use tessera_worker::sampling::merged_bias;
    let sorted = [(1u32, 0.5f32), (4, -1.0), (9, 2.0)];
    assert!(matches!(merged_bias(&sorted), Cow::Borrowed(_)));
    let got = merged_bias(&[(9, 2.0), (1, 0.1), (4, -1.0), (1, 0.2), (1, 0.3)]).into_owned();
    assert_eq!(got, vec![(1, (0.1f32 + 0.2) + 0.3), (4, -1.0), (9, 2.0)]);
    // The sampler applies the merged sum: the same logits as adding each entry.
    let logits = rand_logits(41, 16, -2.0, 2.0);
    let params = SamplingParams { logit_bias: vec![(3, 1.5), (7, -0.5), (3, 0.25)], ..SamplingParams::greedy() };
    let mut got = logits.clone();
    sampler(params).sample(&mut got, &[], 0).unwrap();
    assert_eq!(got[3], logits[3] + (1.5 + 0.25));
    assert_eq!(got[7], logits[7] - 0.5);
}

#[test]
fn logit_bias_bans_and_forces() {
    let logits = rand_logits(15, 50, -5.0, 5.0);
    let best = ranked(&softmax(&logits, 1.0))[0] as u32;
    let params = SamplingParams { logit_bias: vec![(best, -100.0)], seed: Some(16), ..SamplingParams::default() };
    let mut s = sampler(params);
    for _ in 0..20_000 {
        assert_ne!(draw(&mut s, &logits).token, best);
    }
    let mut processed = logits.clone();
    s.sample(&mut processed, &[], 0).unwrap();
    assert_eq!(processed[best as usize], logits[best as usize] - 100.0);
    let forced = ranked(&softmax(&logits, 1.0))[49] as u32; // the least likely
    let params = SamplingParams {
        logit_bias: vec![(forced, 100.0)],
        temperature: 2.0,
        seed: Some(17),
        logprobs: Some(1),
        ..SamplingParams::default()
    };
    let mut s = sampler(params);
    for _ in 0..2_000 {
        let d = draw(&mut s, &logits);
        assert_eq!(d.token, forced);
        assert!(d.logprob > -1e-3 && d.logprob <= 0.0, "forced token logprob {}", d.logprob);
        assert_eq!(d.top, vec![(forced, d.logprob)]);
    }
}

#[test]
fn logprobs_are_log_softmax_before_temperature_and_truncation() {
    let mut logits = rand_logits(18, 20, -3.0, 3.0);
    logits[7] = logits[3]; // a tie, reported lower id first
    let bias = vec![(5u32, 1.0f32)];
    let params = SamplingParams {
        temperature: 0.5,
        top_k: 3,
        logit_bias: bias,
        logprobs: Some(20),
        seed: Some(19),
        ..SamplingParams::default()
    };
    let mut biased = logits.clone();
    biased[5] += 1.0;
    let want: Vec<f64> = softmax(&biased, 1.0).iter().map(|p| p.ln()).collect();
    let order = ranked(&softmax(&biased, 1.0));
    let mut s = sampler(params);
    for _ in 0..50 {
        let d = draw(&mut s, &logits);
        assert_eq!(d.top.len(), 20);
        let total: f64 = d.top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "exp(logprobs) sums to {total}");
        let ids: Vec<usize> = d.top.iter().map(|&(t, _)| t as usize).collect();
        assert_eq!(ids, order, "top list not sorted by logprob, ties by id");
        for &(t, lp) in &d.top {
            assert!((f64::from(lp) - want[t as usize]).abs() < 1e-5, "token {t}: {lp} vs {}", want[t as usize]);
        }
        assert!(order[..3].contains(&(d.token as usize)), "top_k=3 drew {}", d.token);
        assert!((f64::from(d.logprob) - want[d.token as usize]).abs() < 1e-5);
    }

    // A large vocabulary, top 5 only.
    let logits = rand_logits(20, 5000, -8.0, 8.0);
    let want: Vec<f64> = softmax(&logits, 1.0).iter().map(|p| p.ln()).collect();
    let order = ranked(&softmax(&logits, 1.0));
    let d = draw(&mut sampler(SamplingParams { logprobs: Some(5), ..SamplingParams::greedy() }), &logits);
    assert_eq!(d.top.iter().map(|&(t, _)| t as usize).collect::<Vec<_>>(), order[..5]);
    assert_eq!(d.top[0], (d.token, d.logprob));
    for &(t, lp) in &d.top {
        assert!((f64::from(lp) - want[t as usize]).abs() < 1e-5);
    }
    // Not asked for: no list, and no log-sum-exp (the logprob reads 0); the same token.
    let plain = draw(&mut sampler(SamplingParams::greedy()), &logits);
    assert!(plain.top.is_empty());
    assert_eq!((plain.token, plain.logprob), (d.token, 0.0));
    // logprobs: Some(0) (chat's `logprobs: true` without top_logprobs): the token's own.
    let own = draw(&mut sampler(SamplingParams { logprobs: Some(0), ..SamplingParams::greedy() }), &logits);
    assert!(own.top.is_empty());
    assert!((f64::from(own.logprob) - want[own.token as usize]).abs() < 1e-5);
}

#[test]
fn invalid_params_are_rejected() {
    let d = SamplingParams::default;
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("temperature", SamplingParams { temperature: -0.1, ..d() }),
        ("temperature", SamplingParams { temperature: 2.5, ..d() }),
        ("temperature", SamplingParams { temperature: f32::NAN, ..d() }),
        ("top_p", SamplingParams { top_p: 0.0, ..d() }),
        ("top_p", SamplingParams { top_p: 1.01, ..d() }),
        ("min_p", SamplingParams { min_p: -0.01, ..d() }),
        ("min_p", SamplingParams { min_p: 1.5, ..d() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..d() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::INFINITY, ..d() }),
        ("presence_penalty", SamplingParams { presence_penalty: 2.01, ..d() }),
        ("frequency_penalty", SamplingParams { frequency_penalty: -2.5, ..d() }),
        ("logit_bias", SamplingParams { logit_bias: vec![(1, 0.0), (2, -101.0)], ..d() }),
        ("logprobs", SamplingParams { logprobs: Some(21), ..d() }),
    ];
    for (name, p) in cases {
        match p.validate() {
            Err(SamplingError::OutOfRange { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: expected OutOfRange, got {other:?}"),
        }
        assert!(Sampler::new(p).is_err());
    }
    // Range edges are valid.
    let edges = SamplingParams {
        temperature: 2.0,
        top_p: 1.0,
        min_p: 1.0,
        presence_penalty: -2.0,
        frequency_penalty: 2.0,
        logit_bias: vec![(0, -100.0), (1, 100.0)],
        logprobs: Some(20),
        ..d()
    };
    assert_eq!(edges.validate(), Ok(()));
    assert_eq!(SamplingParams::greedy().validate(), Ok(()));
    assert_eq!(d().validate(), Ok(()));
}

#[test]
fn bad_inputs_are_errors() {
    let logits = rand_logits(21, 10, -1.0, 1.0);
    let mut s = sampler(SamplingParams { logit_bias: vec![(10, 1.0)], ..SamplingParams::greedy() });
    assert_eq!(
        s.sample(&mut logits.clone(), &[], 0),
        Err(SamplingError::TokenOutOfVocab { what: "logit_bias", token: 10, vocab: 10 })
    );
    let mut s = sampler(SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() });
    assert!(matches!(
        s.sample(&mut logits.clone(), &[1, 12], 1),
        Err(SamplingError::TokenOutOfVocab { what: "history", token: 12, .. })
    ));
    let mut s = sampler(SamplingParams::default());
    assert_eq!(s.sample(&mut [], &[], 0), Err(SamplingError::EmptyLogits));
    let mut nan = logits.clone();
    nan[4] = f32::NAN;
    assert!(matches!(s.sample(&mut nan, &[], 0), Err(SamplingError::BadLogit { token: 4, .. })));
    let mut inf = logits.clone();
    inf[2] = f32::INFINITY;
    assert!(matches!(s.sample(&mut inf, &[], 0), Err(SamplingError::BadLogit { token: 2, .. })));
    assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 5], &[], 0), Err(SamplingError::AllBanned));
    // -inf entries are simply never drawn.
    let mut masked = vec![f32::NEG_INFINITY; 10];
    masked[6] = -3.0;
    for _ in 0..50 {
        assert_eq!(s.sample(&mut masked.clone(), &[], 0).unwrap().token, 6);
    }
}

#[test]
fn a_resumed_sampler_continues_the_seeded_stream() {
    // A preempted sequence is re-created with a fresh sampler told how many tokens it
    // had drawn; its next draws must be the ones the original would have made.
    let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32) * 0.2).collect();
    let params = SamplingParams { temperature: 1.0, seed: Some(7), ..SamplingParams::default() };
    let mut original = Sampler::new(params.clone()).expect("sampler");
    let first: Vec<u32> =
        (0..12).map(|_| original.sample(&mut logits.clone(), &[], 0).expect("sample").token).collect();
    let mut resumed = Sampler::new(params.clone()).expect("sampler");
    resumed.resume_at(5);
    let rest: Vec<u32> = (0..7).map(|_| resumed.sample(&mut logits.clone(), &[], 0).expect("sample").token).collect();
    assert_eq!(rest, first[5..]);
    // Not resumed, it would repeat the start instead (so the test can tell the two apart).
    let mut fresh = Sampler::new(params).expect("sampler");
    let again: Vec<u32> = (0..7).map(|_| fresh.sample(&mut logits.clone(), &[], 0).expect("sample").token).collect();
    assert_ne!(again, first[5..]);
}

/// vLLM's `min_tokens`: while the output is shorter, the stop ids cannot be drawn even when
/// one of them has by far the highest logit (greedy and sampled); from `min_tokens` output
/// tokens on they are ordinary tokens again.
#[test]
fn min_tokens_bans_the_stop_ids_until_enough_output() {
    let mut logits = rand_logits(31, 50, -1.0, 1.0);
    logits[7] = 40.0; // a stop id, by far the most likely
    logits[9] = 30.0; // another stop id, next
    let stops = vec![7u32, 9];
    let with = |base: SamplingParams| SamplingParams { min_tokens: 3, min_tokens_stop_ids: stops.clone(), ..base };
    let sampled = SamplingParams { temperature: 1.0, seed: Some(5), logprobs: Some(2), ..SamplingParams::default() };
    for params in [with(SamplingParams::greedy()), with(sampled)] {
        let mut s = sampler(params);
        for generated in 0..3 {
            for _ in 0..200 {
                let mut l = logits.clone();
                let got = s.sample(&mut l, &[], generated).unwrap();
                assert!(!stops.contains(&got.token), "stop id {} drawn after {generated} tokens", got.token);
                assert!(got.top.iter().all(|&(t, lp)| !stops.contains(&t) && lp.is_finite()), "{:?}", got.top);
                assert_eq!((l[7], l[9]), (f32::NEG_INFINITY, f32::NEG_INFINITY));
            }
        }
        for generated in [3, 4, 100] {
            assert_eq!(s.sample(&mut logits.clone(), &[], generated).unwrap().token, 7, "after {generated} tokens");
        }
    }
    // Without min_tokens the stop ids are never touched.
    let plain = SamplingParams { min_tokens_stop_ids: stops.clone(), ..SamplingParams::greedy() };
    assert_eq!(sampler(plain).sample(&mut logits.clone(), &[], 0).unwrap().token, 7);
    // A stop id past the vocabulary is an error while it is banned.
    let bad = SamplingParams { min_tokens: 2, min_tokens_stop_ids: vec![7, 50], ..SamplingParams::greedy() };
    assert_eq!(
        sampler(bad.clone()).sample(&mut logits.clone(), &[], 1),
        Err(SamplingError::TokenOutOfVocab { what: "min_tokens_stop_ids", token: 50, vocab: 50 })
    );
    assert_eq!(sampler(bad).sample(&mut logits.clone(), &[], 2).unwrap().token, 7);
}
