//! Constrained decoding in the executor, on a tiny random-weight model whose 61 token ids
//! are given single-character texts: the sampled text must follow the grammar whatever the
//! model prefers, an unconstrained neighbour in the same batch is unchanged, a re-admitted
//! sequence's grammar resumes after the tokens it generated before, and a grammar that
//! fails ends only its own sequence.

mod common;

use std::sync::Arc;

use common::synthetic::{self, Family, TINY};
use tessera_constrain::{Compiler, Constraint, Limits, Vocabulary};
use tessera_kernels::GgmlType;
use tessera_worker::backend::Backend;
use tessera_worker::constrained::Grammars;
use tessera_worker::executor::{Executor, NewSequence, Run, StepInput};
use tessera_worker::llama::LlamaModel;
use tessera_worker::sampling::{argmax, SamplingParams};
use tessera_worker::session::Session;

/// Token 0 ends a sequence (a control token); token `i > 0` is one character of this text.
const CHARS: &[u8] = b"0123456789abcdef-";
const EOS: u32 = 0;

fn text_of(id: u32) -> u8 {
    CHARS[(id as usize - 1) % CHARS.len()]
}

fn model() -> LlamaModel {
    let (files, _) = synthetic::build(Family::Qwen3, &TINY, GgmlType::Q8_0, 21);
    LlamaModel::load(files).expect("load")
}

fn grammars() -> Arc<Grammars> {
    let vocab = Vocabulary::from_pieces(TINY.vocab, &[EOS], |id| {
        if id == EOS {
            (b"<|end|>".to_vec(), true)
        } else {
            (vec![text_of(id)], false)
        }
    })
    .expect("vocabulary");
    Arc::new(Grammars::from_compiler(Compiler::new(vocab, Limits::default()).expect("compiler")))
}

fn seq(id: u64, params: SamplingParams, table: Vec<u32>, num_generated: u64) -> NewSequence {
    NewSequence { seq_id: id, params, block_table: table, cached_tokens: vec![], num_generated }
}

fn constrained(c: Constraint) -> SamplingParams {
    SamplingParams { constraint: Some(c), ..SamplingParams::greedy() }
}

/// Decodes `ids` up to (not including) the end token.
fn text(ids: &[u32]) -> String {
    ids.iter().take_while(|&&t| t != EOS).map(|&t| text_of(t) as char).collect()
}

fn matches_pattern(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 6
        && b[..3].iter().all(u8::is_ascii_digit)
        && b[3] == b'-'
        && b[4..].iter().all(|c| (b'a'..=b'f').contains(c))
}

const PATTERN: &str = "[0-9]{3}-[a-f]{2}";

#[test]
fn constrained_output_follows_the_grammar_and_the_neighbour_is_unchanged() {
    let m = model();
    let free_prompt = synthetic::tokens(TINY.vocab, 6, 5);
    let want_free = {
        let mut s = Session::new(&m, 64);
        let mut logits = s.feed(&free_prompt, false).expect("prefill");
        let mut out = Vec::new();
        for _ in 0..8 {
            let t = argmax(&logits);
            out.push(t);
            logits = s.feed(&[t], false).expect("decode");
        }
        out
    };
    let prompt = synthetic::tokens(TINY.vocab, 5, 9);
    let mut ex = Executor::new(Backend::cpu(model(), 16, 4)).with_grammars(grammars());
    let mut out = ex
        .step(StepInput {
            new_sequences: vec![
                seq(1, constrained(Constraint::Regex(PATTERN.into())), vec![0, 1, 2, 3], 0),
                seq(2, SamplingParams::greedy(), vec![4, 5, 6, 7], 0),
            ],
            runs: vec![
                Run { seq_id: 1, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false },
                Run { seq_id: 2, tokens: free_prompt.clone(), first_pos: 0, sample: true, from_previous: false },
            ],
            ..Default::default()
        })
        .expect("prefill step");
    let (mut got, mut free) = (vec![out.sampled[0].1.token], vec![out.sampled[1].1.token]);
    for step in 1..8 {
        out = ex
            .step(StepInput {
                runs: vec![
                    Run {
                        seq_id: 1,
                        tokens: vec![*got.last().unwrap()],
                        first_pos: prompt.len() + step - 1,
                        sample: true,
                        from_previous: false,
                    },
                    Run {
                        seq_id: 2,
                        tokens: vec![*free.last().unwrap()],
                        first_pos: free_prompt.len() + step - 1,
                        sample: true,
                        from_previous: false,
                    },
                ],
                ..Default::default()
            })
            .expect("decode step");
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        got.push(out.sampled[0].1.token);
        free.push(out.sampled[1].1.token);
    }
    assert!(matches_pattern(&text(&got)), "{:?} from {got:?}", text(&got));
    // Once complete, only the end token is allowed (and then again, for ignore_eos).
    assert_eq!(&got[6..], &[EOS, EOS]);
    assert_eq!(free, want_free, "the unconstrained neighbour changed");
}

#[test]
fn a_readmitted_sequence_replays_its_output_into_the_grammar() {
    let prompt = synthetic::tokens(TINY.vocab, 5, 13);
    let mut ex = Executor::new(Backend::cpu(model(), 16, 4)).with_grammars(grammars());
    // Its first life: the prompt and three generated tokens.
    let c = constrained(Constraint::Regex(PATTERN.into()));
    let mut got = Vec::new();
    let mut step = StepInput {
        new_sequences: vec![seq(1, c.clone(), vec![0, 1, 2], 0)],
        runs: vec![Run { seq_id: 1, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false }],
        ..Default::default()
    };
    for i in 0..3 {
        let out = ex.step(step).expect("step");
        got.push(out.sampled[0].1.token);
        step = StepInput {
            runs: vec![Run {
                seq_id: 1,
                tokens: vec![got[i]],
                first_pos: prompt.len() + i,
                sample: true,
                from_previous: false,
            }],
            ..Default::default()
        };
    }
    assert!(got.iter().all(|&t| text_of(t).is_ascii_digit()), "{got:?}");
    // Preempted, then re-admitted under a new id: prompt + output re-run in one chunk.
    let history: Vec<u32> = prompt.iter().chain(&got).copied().collect();
    let out = ex
        .step(StepInput {
            finished: vec![1],
            new_sequences: vec![seq(2, c, vec![3, 4, 5], 3)],
            runs: vec![Run { seq_id: 2, tokens: history, first_pos: 0, sample: true, from_previous: false }],
            ..Default::default()
        })
        .expect("re-admission");
    // Three digits are behind it: only '-' may come now (a fresh grammar would want a digit).
    assert_eq!(text_of(out.sampled[0].1.token), b'-', "{:?}", out.sampled);
}

#[test]
fn a_failing_grammar_ends_only_its_own_sequence() {
    let prompt = synthetic::tokens(TINY.vocab, 4, 17);
    let mut ex = Executor::new(Backend::cpu(model(), 16, 4)).with_grammars(grammars());
    let out = ex
        .step(StepInput {
            new_sequences: vec![
                seq(1, constrained(Constraint::Lark("start: missing_rule".into())), vec![0], 0),
                seq(2, SamplingParams::greedy(), vec![1], 0),
            ],
            runs: vec![
                Run { seq_id: 1, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false },
                Run { seq_id: 2, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false },
            ],
            ..Default::default()
        })
        .expect("the step itself succeeds");
    assert_eq!(out.sampled.len(), 1);
    assert_eq!(out.sampled[0].0, 2);
    assert_eq!(out.errors.len(), 1);
    assert_eq!(out.errors[0].0, 1);
    assert!(out.errors[0].1.contains("missing_rule"), "{}", out.errors[0].1);
}

#[test]
fn without_grammars_constraints_are_left_to_the_sampling_rank() {
    let prompt = synthetic::tokens(TINY.vocab, 4, 19);
    let mut ex = Executor::new(Backend::cpu(model(), 16, 4));
    let out = ex
        .step(StepInput {
            new_sequences: vec![seq(1, constrained(Constraint::Lark("start: missing_rule".into())), vec![0], 0)],
            runs: vec![Run { seq_id: 1, tokens: prompt, first_pos: 0, sample: true, from_previous: false }],
            ..Default::default()
        })
        .expect("step");
    assert!(out.errors.is_empty());
    assert_eq!(out.sampled.len(), 1);
}

/// A sequence refused at admission (bad sampling parameters) leaves no grammar behind: a
/// later sequence reusing its id without a constraint is not held to the old one.
#[test]
fn a_refused_admission_leaves_no_grammar_for_its_id() {
    let prompt = synthetic::tokens(TINY.vocab, 4, 23);
    let mut ex = Executor::new(Backend::cpu(model(), 16, 4)).with_grammars(grammars());
    let bad = SamplingParams { temperature: 3.0, ..constrained(Constraint::Lark("start: missing_rule".into())) };
    let refused = ex.step(StepInput { new_sequences: vec![seq(7, bad, vec![0], 0)], ..Default::default() });
    assert!(refused.is_err(), "temperature 3 is out of range");
    let out = ex
        .step(StepInput {
            new_sequences: vec![seq(7, SamplingParams::greedy(), vec![0], 0)],
            runs: vec![Run { seq_id: 7, tokens: prompt.clone(), first_pos: 0, sample: true, from_previous: false }],
            ..Default::default()
        })
        .expect("step");
    assert!(out.errors.is_empty(), "the refused sequence's grammar was applied: {:?}", out.errors);
    assert_eq!(out.sampled.len(), 1);
    // Its token is the unconstrained greedy one.
    let m = model();
    let mut s = Session::new(&m, 16);
    let want = argmax(&s.feed(&prompt, false).expect("prefill"));
    assert_eq!(out.sampled[0].1.token, want);
}
