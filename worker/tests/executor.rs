//! The step executor: per-sequence state across steps, deltas, sampling, and the
//! errors a malformed step gets.

mod common;

use common::synthetic::{self, Family, TINY};
use tessera_kernels::GgmlType;
use tessera_worker::backend::Backend;
use tessera_worker::executor::{Executor, NewSequence, Run, StepInput};
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::{argmax, Sampler, SamplingParams};
use tessera_worker::session::Session;

fn model() -> LlamaModel {
    let (files, _) = synthetic::build(Family::Qwen3, &TINY, GgmlType::Q8_0, 21);
    LlamaModel::load(files).expect("load")
}

/// Greedy tokens of one sequence through a private session.
fn greedy_alone(m: &LlamaModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut s = Session::new(m, 64);
    let mut logits = s.feed(prompt, false).expect("prefill");
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = s.feed(&[t], false).expect("decode");
    }
    out
}

fn new_seq(id: u64, table: Vec<u32>, cached: Vec<u32>) -> NewSequence {
    NewSequence {
        seq_id: id,
        params: SamplingParams::greedy(),
        block_table: table,
        cached_tokens: cached,
        num_generated: 0,
    }
}

#[test]
fn steps_with_deltas_reproduce_greedy_decoding() {
    let m = model();
    let a = synthetic::tokens(TINY.vocab, 7, 1);
    let b = synthetic::tokens(TINY.vocab, 5, 2);
    let want_a = greedy_alone(&m, &a, 6);
    let want_b = greedy_alone(&m, &b, 6);
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
    // Step 0: both prompts; a's table has 2 blocks, b's 2; more blocks are appended later.
    let out = ex
        .step(StepInput {
            new_sequences: vec![new_seq(1, vec![5, 0], vec![]), new_seq(2, vec![3, 6], vec![])],
            runs: vec![
                Run { seq_id: 1, tokens: a.clone(), first_pos: 0, sample: true, from_previous: false },
                Run { seq_id: 2, tokens: b.clone(), first_pos: 0, sample: true, from_previous: false },
            ],
            ..Default::default()
        })
        .expect("step 0");
    let (mut got_a, mut got_b) = (vec![out.sampled[0].1.token], vec![out.sampled[1].1.token]);
    for step in 1..6 {
        let appends = match step {
            1 => vec![(1, vec![7])],
            4 => vec![(2, vec![1])],
            _ => vec![],
        };
        let out = ex
            .step(StepInput {
                appends,
                runs: vec![
                    Run {
                        seq_id: 1,
                        tokens: vec![*got_a.last().unwrap()],
                        first_pos: a.len() + step - 1,
                        sample: true,
                        from_previous: false,
                    },
                    Run {
                        seq_id: 2,
                        tokens: vec![*got_b.last().unwrap()],
                        first_pos: b.len() + step - 1,
                        sample: true,
                        from_previous: false,
                    },
                ],
                ..Default::default()
            })
            .expect("decode step");
        got_a.push(out.sampled[0].1.token);
        got_b.push(out.sampled[1].1.token);
    }
    assert_eq!(got_a, want_a);
    assert_eq!(got_b, want_b);
    ex.step(StepInput { finished: vec![1, 2], ..Default::default() }).expect("finish");
    assert_eq!(ex.live_sequences(), 0);
}

/// Lookahead decodes (the coordinator sent the step before the previous token came back):
/// a run marked `from_previous` with no tokens runs the token this executor sampled for the
/// sequence last, so decoding that way reproduces greedy decoding; one with nothing
/// sampled before is refused.
#[test]
fn lookahead_runs_take_the_token_sampled_before() {
    let m = model();
    let a = synthetic::tokens(TINY.vocab, 7, 3);
    let want = greedy_alone(&m, &a, 5);
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
    let early = ex.step(StepInput {
        new_sequences: vec![new_seq(1, vec![5, 0, 7], vec![])],
        runs: vec![Run { seq_id: 1, tokens: Vec::new(), first_pos: 0, sample: true, from_previous: true }],
        ..Default::default()
    });
    assert!(early.is_err(), "no token sampled yet");
    let out = ex
        .step(StepInput {
            runs: vec![Run { seq_id: 1, tokens: a.clone(), first_pos: 0, sample: true, from_previous: false }],
            ..Default::default()
        })
        .expect("prompt");
    let mut got = vec![out.sampled[0].1.token];
    for step in 1..5 {
        let run =
            Run { seq_id: 1, tokens: Vec::new(), first_pos: a.len() + step - 1, sample: true, from_previous: true };
        let out = ex.step(StepInput { runs: vec![run], ..Default::default() }).expect("lookahead step");
        got.push(out.sampled[0].1.token);
    }
    assert_eq!(got, want);
}

/// Presence and frequency penalties count the sequence's output, not its prompt (vLLM's
/// rule; the repetition penalty counts both), however the prompt arrives: in one run, in
/// chunks, or re-admitted after a preemption with its earlier output folded into the prompt
/// runs. The reference is a private session whose sampler is told which tokens are output;
/// the prompt is chosen so that counting it too would change the tokens.
#[test]
fn penalties_count_the_output_not_the_prompt() {
    let m = model();
    let params = SamplingParams {
        presence_penalty: 2.0,
        frequency_penalty: 2.0,
        repetition_penalty: 1.3,
        ..SamplingParams::greedy()
    };
    let n = 6;
    let reference = |prompt: &[u32], count_prompt: bool| -> Vec<u32> {
        let mut s = Session::new(&m, 64);
        let mut sampler = Sampler::new(params.clone()).expect("params");
        let mut logits = s.feed(prompt, false).expect("prefill");
        let mut history = prompt.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let generated = if count_prompt { history.len() } else { out.len() };
            let t = sampler.sample(&mut logits, &history, generated).expect("sample").token;
            out.push(t);
            history.push(t);
            logits = s.feed(&[t], false).expect("decode");
        }
        out
    };
    // A prompt ending in four copies of the token greedy decoding would pick next.
    let (prompt, want) = (1..40)
        .find_map(|seed| {
            let mut p = synthetic::tokens(TINY.vocab, 12, seed);
            let t = greedy_alone(&m, &p, 1)[0];
            p.extend([t; 4]);
            let want = reference(&p, false);
            (want != reference(&p, true)).then_some((p, want))
        })
        .expect("a prompt where counting it changes the output");
    let table: Vec<u32> = (0..6).collect();
    let seq = |num_generated: u64| NewSequence {
        seq_id: 1,
        params: params.clone(),
        block_table: table.clone(),
        cached_tokens: Vec::new(),
        num_generated,
    };
    let run = |tokens: Vec<u32>, first_pos: usize, sample: bool| Run {
        seq_id: 1,
        tokens,
        first_pos,
        sample,
        from_previous: false,
    };
    // (label, prompt runs as (start, end, sample), tokens generated before admission)
    let cases = [
        ("one run", vec![(0, prompt.len(), true)], 0),
        ("chunked", vec![(0, 5, false), (5, prompt.len(), true)], 0),
        ("re-admitted after 3", vec![(0, prompt.len() + 3, true)], 3),
    ];
    for (label, runs, prior) in cases {
        let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
        let all: Vec<u32> = prompt.iter().chain(&want[..prior]).copied().collect();
        let mut got = want[..prior].to_vec();
        for (i, &(a, b, sample)) in runs.iter().enumerate() {
            let out = ex
                .step(StepInput {
                    new_sequences: if i == 0 { vec![seq(prior as u64)] } else { Vec::new() },
                    runs: vec![run(all[a..b].to_vec(), a, sample)],
                    ..Default::default()
                })
                .expect("prompt run");
            if sample {
                got.push(out.sampled[0].1.token);
            }
        }
        while got.len() < n {
            let pos = prompt.len() + got.len() - 1;
            let out = ex
                .step(StepInput { runs: vec![run(vec![*got.last().unwrap()], pos, true)], ..Default::default() })
                .expect("decode step");
            got.push(out.sampled[0].1.token);
        }
        assert_eq!(got, want, "{label}");
    }
}

#[test]
fn a_prefix_cache_hit_starts_from_the_shared_blocks() {
    let m = model();
    let prompt = synthetic::tokens(TINY.vocab, 10, 3);
    let want = greedy_alone(&m, &prompt, 1);
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
    // Sequence 1 computes the first 8 positions (blocks 2 and 4).
    ex.step(StepInput {
        new_sequences: vec![new_seq(1, vec![2, 4], vec![])],
        runs: vec![Run { seq_id: 1, tokens: prompt[..8].to_vec(), first_pos: 0, sample: false, from_previous: false }],
        ..Default::default()
    })
    .expect("first");
    // Sequence 2 shares those blocks and runs only the rest.
    let out = ex
        .step(StepInput {
            new_sequences: vec![new_seq(2, vec![2, 4, 6], prompt[..8].to_vec())],
            runs: vec![Run {
                seq_id: 2,
                tokens: prompt[8..].to_vec(),
                first_pos: 8,
                sample: true,
                from_previous: false,
            }],
            ..Default::default()
        })
        .expect("second");
    assert_eq!(out.sampled[0].1.token, want[0]);
}

#[test]
fn malformed_steps_are_errors_and_leave_others_working() {
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
    let run = |id, first_pos| Run { seq_id: id, tokens: vec![1, 2], first_pos, sample: true, from_previous: false };
    assert!(ex.step(StepInput { runs: vec![run(9, 0)], ..Default::default() }).is_err(), "unknown sequence");
    ex.step(StepInput { new_sequences: vec![new_seq(1, vec![0, 1], vec![])], ..Default::default() }).expect("new");
    assert!(
        ex.step(StepInput { new_sequences: vec![new_seq(1, vec![2], vec![])], ..Default::default() }).is_err(),
        "duplicate sequence"
    );
    assert!(ex.step(StepInput { runs: vec![run(1, 3)], ..Default::default() }).is_err(), "gap before the run");
    assert!(ex.step(StepInput { runs: vec![run(1, 7)], ..Default::default() }).is_err(), "past the block table");
    let twice = ex.step(StepInput { runs: vec![run(1, 0), run(1, 2)], ..Default::default() });
    assert!(twice.expect_err("one sequence sampled twice").to_string().contains("sampled twice"));
    let bad_params = NewSequence {
        seq_id: 2,
        params: SamplingParams { temperature: 9.0, ..SamplingParams::greedy() },
        block_table: vec![3],
        cached_tokens: vec![],
        num_generated: 0,
    };
    assert!(ex.step(StepInput { new_sequences: vec![bad_params], ..Default::default() }).is_err(), "bad sampling");
    // A table of one block repeated covers any length, but a step cannot hold more tokens
    // than the cache's 8 x 4 slots (each token writes a slot of its own).
    ex.step(StepInput { new_sequences: vec![new_seq(3, vec![4; 40], vec![])], ..Default::default() }).expect("new");
    let long = Run { seq_id: 3, tokens: vec![1; 33], first_pos: 0, sample: true, from_previous: false };
    let err = ex.step(StepInput { runs: vec![long], ..Default::default() }).expect_err("more tokens than slots");
    assert!(err.to_string().contains("33 tokens in one step"), "{err}");
    // The good sequence still runs.
    let out = ex.step(StepInput { runs: vec![run(1, 0)], ..Default::default() }).expect("valid step");
    assert_eq!(out.sampled.len(), 1);
}

#[test]
fn steps_over_the_loaded_token_budget_are_refused_before_any_change() {
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4)).with_max_step_tokens(5);
    // Two new sequences running `a` and `b` prompt tokens.
    let two = |a: usize, b: usize| StepInput {
        new_sequences: vec![new_seq(1, vec![0, 1], vec![]), new_seq(2, vec![2, 3], vec![])],
        runs: [(1, a), (2, b)]
            .map(|(id, n)| Run { seq_id: id, tokens: vec![1; n], first_pos: 0, sample: true, from_previous: false })
            .to_vec(),
        ..Default::default()
    };
    // Six tokens: refused, and the new sequences it carried are not created.
    let err = ex.step(two(3, 3)).expect_err("six tokens with a budget of five");
    assert!(err.to_string().contains("6 tokens in one step") && err.to_string().contains("max_step_tokens"), "{err}");
    assert_eq!(ex.live_sequences(), 0);
    // Exactly the budget runs.
    assert_eq!(ex.step(two(3, 2)).expect("five tokens").sampled.len(), 2);
}

/// Tables and cached tokens arrive before the runs that read them; what a sequence may
/// park on the worker is bounded by the model's context (4096 positions here, blocks of
/// 4: 1024 blocks plus one) and the cache's blocks (8).
#[test]
fn sequence_state_is_bounded_by_the_context_and_the_cache() {
    let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
    let refused = |ex: &mut Executor, input: StepInput, what: &str| {
        let err = ex.step(input).expect_err(what).to_string();
        assert!(err.contains(what), "{what}: {err}");
    };
    let admit = |s: NewSequence| StepInput { new_sequences: vec![s], ..Default::default() };
    refused(&mut ex, admit(new_seq(1, vec![4; 1026], vec![])), "a block table of 1026 blocks");
    refused(&mut ex, admit(new_seq(1, vec![0, 8], vec![])), "block 8 is not one of the cache's 8 blocks");
    refused(&mut ex, admit(new_seq(1, vec![0], vec![1; 4097])), "4097 cached tokens");
    assert_eq!(ex.live_sequences(), 0);
    // At the bounds: admitted.
    ex.step(admit(new_seq(1, vec![4; 1025], vec![1; 4096]))).expect("a whole context");
    ex.step(admit(new_seq(2, vec![0; 1024], vec![]))).expect("new");
    // Appends are held to the same bounds.
    let append = |id, blocks: Vec<u32>| StepInput { appends: vec![(id, blocks)], ..Default::default() };
    refused(&mut ex, append(2, vec![0, 0]), "a block table of 1026 blocks");
    refused(&mut ex, append(2, vec![u32::MAX]), "block 4294967295");
    ex.step(append(2, vec![3])).expect("the last block");
    // A run past the context is refused before the forward pass (the CPU's RoPE could
    // place it; the GPU backends refuse it the same way).
    let run = Run { seq_id: 1, tokens: vec![1], first_pos: 4096, sample: true, from_previous: false };
    refused(&mut ex, StepInput { runs: vec![run], ..Default::default() }, "positions up to 4097");
    // Sequence 1's last position in the context still runs.
    let run = Run { seq_id: 1, tokens: vec![1], first_pos: 4095, sample: true, from_previous: false };
    assert_eq!(ex.step(StepInput { runs: vec![run], ..Default::default() }).expect("last position").sampled.len(), 1);
}

/// vLLM's `min_tokens` through the executor: a stop id that greedy decoding would pick every
/// time (a +100 bias) is not sampled until the sequence has `min_tokens` output tokens, and
/// is from then on. The output is counted across a re-admission too (the prompt runs of a
/// preempted sequence hold its earlier output, `num_generated` says how much).
#[test]
fn min_tokens_holds_back_the_stop_ids_until_enough_output() {
    let stop = 5u32;
    let params = SamplingParams {
        logit_bias: vec![(stop, 100.0)],
        min_tokens: 3,
        min_tokens_stop_ids: vec![stop, 6],
        ..SamplingParams::greedy()
    };
    let prompt = synthetic::tokens(TINY.vocab, 6, 4);
    // Decodes `n` tokens of a sequence admitted with `prior` earlier outputs in its prompt run.
    let decode = |prior: &[u32], n: usize| -> Vec<u32> {
        let mut ex = Executor::new(Backend::cpu(model(), 8, 4));
        let new = NewSequence {
            seq_id: 1,
            params: params.clone(),
            block_table: (0..6).collect(),
            cached_tokens: Vec::new(),
            num_generated: prior.len() as u64,
        };
        let all: Vec<u32> = prompt.iter().chain(prior).copied().collect();
        let first = Run { seq_id: 1, tokens: all.clone(), first_pos: 0, sample: true, from_previous: false };
        let out = ex.step(StepInput { new_sequences: vec![new], runs: vec![first], ..Default::default() });
        let mut got = vec![out.expect("prompt").sampled[0].1.token];
        while got.len() < n {
            let pos = all.len() + got.len() - 1;
            let run =
                Run { seq_id: 1, tokens: vec![got[got.len() - 1]], first_pos: pos, sample: true, from_previous: false };
            got.push(ex.step(StepInput { runs: vec![run], ..Default::default() }).expect("decode").sampled[0].1.token);
        }
        got
    };
    let got = decode(&[], 5);
    assert!(got[..3].iter().all(|&t| t != stop && t != 6), "a stop id before 3 output tokens: {got:?}");
    assert_eq!(got[3..], [stop, stop], "{got:?}");
    // Re-admitted after two of those tokens: one more is held back, then the stop id.
    assert_eq!(decode(&got[..2], 2), [got[2], stop]);
}
