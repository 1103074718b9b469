//! Scheduler scenarios: admission order and limits, the token budget, chunked prefill next
//! to decodes, prefix reuse, preemption, aborts, the bounded queue and stop conditions.
//! Outputs come from the fake model in `common`, checked against each sequence run alone.

mod common;

use common::{config, reference, seq, step, Collected, FakeWorker, Rng};
use tessera_coordinator::config::MAX_BLOCKS;
use tessera_coordinator::{
    AdmissionError, ConfigError, FinishReason, ScheduledBatch, Scheduler, Sequence, StepOutput, StopCriteria,
};

fn ids(batch: &ScheduledBatch) -> Vec<u64> {
    batch.runs.iter().map(|r| r.seq_id).collect()
}

fn lens(batch: &ScheduledBatch) -> Vec<(u64, usize)> {
    batch.runs.iter().map(|r| (r.seq_id, r.tokens.len())).collect()
}

#[test]
fn admission_is_fifo_within_max_num_seqs() {
    let cfg = config(4, 64, 64, 2, 64);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(10);
    s.add(seq(1, rng.tokens(5, 50), 3)).unwrap();
    s.add(seq(2, rng.tokens(5, 50), 10)).unwrap();
    s.add(seq(3, rng.tokens(5, 50), 10)).unwrap();
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(ids(&b), [1, 2]);
    assert_eq!(b.new_seqs.iter().map(|n| n.seq_id).collect::<Vec<_>>(), [1, 2]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    assert_eq!(ids(&step(&mut s, &mut w, &mut got).unwrap()), [1, 2]);
    assert_eq!(ids(&step(&mut s, &mut w, &mut got).unwrap()), [1, 2]);
    assert_eq!(got.finished.get(&1), Some(&FinishReason::Length), "3 tokens then done");
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(ids(&b), [2, 3], "seq 3 takes the freed slot");
    assert_eq!(b.finished, [1]);
}

#[test]
fn head_of_queue_that_does_not_fit_blocks_later_arrivals() {
    let cfg = config(4, 8, 64, 8, 32);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(11);
    s.add(seq(1, rng.tokens(20, 50), 8)).unwrap();
    step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(s.num_used_blocks(), 5);
    s.add(seq(2, rng.tokens(16, 50), 4)).unwrap(); // 4 blocks, 3 left
    s.add(seq(3, rng.tokens(2, 50), 4)).unwrap(); // would fit, but is behind 2
    while !got.finished.contains_key(&1) {
        let b = step(&mut s, &mut w, &mut got).unwrap();
        assert_eq!(ids(&b), [1]);
    }
    assert_eq!(ids(&step(&mut s, &mut w, &mut got).unwrap()), [2, 3]);
}

#[test]
fn token_budget_is_filled_exactly_and_never_exceeded() {
    let cfg = config(4, 64, 10, 8, 64);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(12);
    for id in 1..=3 {
        s.add(seq(id, rng.tokens(7, 50), 5)).unwrap();
    }
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(lens(&b), [(1, 7), (2, 3)]);
    assert_eq!(b.runs.iter().map(|r| r.sample).collect::<Vec<_>>(), [true, false]);
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(lens(&b), [(1, 1), (2, 4), (3, 5)]);
    assert_eq!(b.runs.iter().map(|r| r.first_pos).collect::<Vec<_>>(), [7, 3, 0]);
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(lens(&b), [(1, 1), (2, 1), (3, 2)]);
    assert!(b.runs.iter().all(|r| r.sample));
}

#[test]
fn chunked_prefill_never_stalls_running_decodes() {
    for threshold in [0, 4] {
        let mut cfg = config(4, 64, 8, 4, 128);
        cfg.long_prefill_threshold = threshold;
        let chunk = if threshold == 0 { 7 } else { 4 };
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        let mut w = FakeWorker::new(&cfg);
        let mut got = Collected::default();
        let mut rng = Rng::new(13);
        let a_prompt = rng.tokens(3, 50);
        let b_prompt = rng.tokens(40, 50);
        s.add(seq(1, a_prompt.clone(), 100)).unwrap();
        step(&mut s, &mut w, &mut got).unwrap();
        s.add(seq(2, b_prompt.clone(), 5)).unwrap();
        let mut pos = 0;
        for k in 0.. {
            let b = step(&mut s, &mut w, &mut got).unwrap();
            let (a, bb) = (&b.runs[0], &b.runs[1]);
            assert_eq!((a.seq_id, a.tokens.len(), a.first_pos, a.sample), (1, 1, 3 + k, true), "decode every step");
            assert_eq!((bb.seq_id, bb.first_pos, bb.is_prompt), (2, pos, true));
            assert_eq!(bb.tokens, b_prompt[pos..(pos + chunk).min(40)]);
            pos += bb.tokens.len();
            assert_eq!(bb.sample, pos == 40, "only the last chunk samples");
            if pos == 40 {
                assert_eq!(k + 1, 40usize.div_ceil(chunk));
                break;
            }
        }
        while s.has_work() {
            step(&mut s, &mut w, &mut got);
            if got.finished.contains_key(&2) {
                break;
            }
        }
        let want = reference(&b_prompt, &StopCriteria::new(5, Vec::new()), 128);
        assert_eq!((&got.tokens[&2], got.finished[&2]), (&want.0, want.1));
    }
}

#[test]
fn second_sequence_reuses_shared_full_blocks() {
    let cfg = config(4, 64, 64, 8, 128);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(14);
    let shared = rng.tokens(12, 50);
    let a = [shared.clone(), rng.tokens(2, 50)].concat();
    s.add(seq(1, a.clone(), 6)).unwrap();
    let first = step(&mut s, &mut w, &mut got).unwrap();
    let a_table = first.new_seqs[0].block_table.clone();
    assert_eq!(s.stats().prefix_hit_tokens, 0);

    // While 1 still decodes: 2 shares its three full blocks and computes only its own tail.
    let b = [shared.clone(), rng.tokens(3, 50)].concat();
    s.add(seq(2, b.clone(), 6)).unwrap();
    let batch = step(&mut s, &mut w, &mut got).unwrap();
    let run = batch.runs.iter().find(|r| r.seq_id == 2).unwrap();
    assert_eq!((run.first_pos, &run.tokens[..]), (12, &b[12..]));
    assert_eq!(batch.new_seqs[0].block_table[..3], a_table[..3]);
    assert_eq!(s.get(2).unwrap().num_cached_prompt, 12);
    let stats = s.stats();
    assert_eq!((stats.prefix_hit_tokens, stats.prefix_query_tokens), (12, (a.len() + b.len()) as u64));

    // A prompt that is exactly the shared blocks recomputes its last block's tokens.
    s.add(seq(3, shared.clone(), 6)).unwrap();
    let batch = step(&mut s, &mut w, &mut got).unwrap();
    let run = batch.runs.iter().find(|r| r.seq_id == 3).unwrap();
    assert_eq!((run.first_pos, run.tokens.len()), (8, 4));
    while step(&mut s, &mut w, &mut got).is_some() {}
    for (id, prompt) in [(1, &a), (2, &b), (3, &shared)] {
        let want = reference(prompt, &StopCriteria::new(6, Vec::new()), 128);
        assert_eq!(got.tokens[&id], want.0, "seq {id}");
    }
    assert_eq!(s.num_used_blocks(), 0);
}

#[test]
fn no_prefix_hit_when_only_later_blocks_agree() {
    let cfg = config(4, 64, 64, 8, 128);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(15);
    let (x1, x2, x3, y1) = (rng.tokens(4, 50), rng.tokens(4, 50), rng.tokens(4, 50), rng.tokens(4, 50));
    s.add(seq(1, [x1, x2.clone(), x3.clone(), vec![1]].concat(), 2)).unwrap();
    while step(&mut s, &mut w, &mut got).is_some() {}
    s.add(seq(2, [y1, x2, x3, vec![1]].concat(), 2)).unwrap();
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!((b.runs[0].first_pos, b.runs[0].tokens.len()), (0, 13));
    assert_eq!(s.stats().prefix_hit_tokens, 0);
}

#[test]
fn kv_pressure_preempts_the_newest_which_later_completes_identically() {
    let cfg = config(4, 10, 64, 4, 40);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(16);
    let prompts = [rng.tokens(8, 50), rng.tokens(8, 50)];
    s.add(seq(1, prompts[0].clone(), 24)).unwrap();
    s.add(seq(2, prompts[1].clone(), 24)).unwrap();
    let mut preempted_at = None;
    let mut readmitted = false;
    let mut a_next = 0;
    while let Some(b) = step(&mut s, &mut w, &mut got) {
        if !got.finished.contains_key(&1) || b.runs.iter().any(|r| r.seq_id == 1) {
            let a = b.runs.iter().find(|r| r.seq_id == 1).expect("the oldest runs every step");
            assert_eq!((a.first_pos, a.tokens.len()), (a_next, if a_next == 0 { 8 } else { 1 }));
            a_next += a.tokens.len();
        }
        if preempted_at.is_none() && s.num_preemptions() > 0 {
            assert_eq!(ids(&b), [1], "the newest (2) was preempted, 1 decodes, nothing admitted");
            assert_eq!(b.finished, [2], "workers drop the preempted sequence's state first");
            assert_eq!(s.get(2).unwrap().num_preemptions, 1);
            preempted_at = Some(b.step_id);
        }
        if let Some(n) = b.new_seqs.iter().find(|n| n.seq_id == 2 && preempted_at.is_some()) {
            let sampled_now = b.runs.iter().filter(|r| r.seq_id == 2 && r.sample).count();
            let so_far = &got.tokens[&2][..got.tokens[&2].len() - sampled_now];
            assert!(!so_far.is_empty() && n.prior_output == so_far, "re-admitted with its output so far");
            readmitted = true;
        }
    }
    assert!(preempted_at.is_some() && readmitted);
    assert_eq!(s.get(1).map(|q| q.num_preemptions), None);
    for (id, prompt) in [(1u64, &prompts[0]), (2, &prompts[1])] {
        let want = reference(prompt, &StopCriteria::new(24, Vec::new()), 40);
        assert_eq!((&got.tokens[&id], got.finished[&id]), (&want.0, want.1), "seq {id}");
    }
    assert_eq!(s.num_used_blocks(), 0);
}

#[test]
fn abort_frees_blocks_now_or_after_the_executing_step() {
    let cfg = config(4, 64, 64, 8, 64);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(17);
    s.add(seq(1, rng.tokens(9, 50), 20)).unwrap();
    assert!(s.abort(1) && !s.has_work() && s.schedule().is_none(), "a waiting sequence just leaves");
    assert!(!s.abort(1));

    s.add(seq(2, rng.tokens(9, 50), 20)).unwrap();
    s.add(seq(3, rng.tokens(9, 50), 20)).unwrap();
    step(&mut s, &mut w, &mut got).unwrap();
    assert_eq!(s.num_used_blocks(), 6);
    assert!(s.abort(2));
    assert_eq!(s.num_used_blocks(), 3, "not executing: freed at once");

    let b = s.schedule().unwrap();
    assert_eq!(b.finished, [2]);
    let out = w.run(&s, &b);
    assert!(s.abort(3));
    assert_eq!(s.num_used_blocks(), 3, "executing: blocks still in use by the workers");
    let updates = s.postprocess(&out);
    assert!(updates.is_empty(), "no token for an aborted sequence");
    assert_eq!((s.num_used_blocks(), s.num_running()), (0, 0));
    s.check_invariants().unwrap();
    s.add(seq(4, rng.tokens(3, 50), 1)).unwrap();
    assert_eq!(s.schedule().unwrap().finished, [3]);
}

#[test]
fn bounded_queue_refuses_with_an_overload_error() {
    let mut cfg = config(4, 64, 64, 8, 64);
    cfg.max_waiting = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    s.add(seq(1, vec![1, 2], 4)).unwrap();
    s.add(seq(2, vec![1, 2], 4)).unwrap();
    let err = s.add(seq(3, vec![1, 2], 4)).unwrap_err();
    assert_eq!(err, AdmissionError::QueueFull { max_waiting: 2 });
    assert!(err.is_overload() && err.to_string().contains("2 requests are already waiting"));
    s.schedule().unwrap();
    assert_eq!(s.num_waiting(), 0);
    s.add(seq(3, vec![1, 2], 4)).unwrap();
}

#[test]
fn impossible_requests_and_configs_are_refused_with_reasons() {
    let mut s = Scheduler::new(config(4, 4, 64, 8, 64)).unwrap();
    assert_eq!(s.add(seq(1, vec![], 4)), Err(AdmissionError::EmptyPrompt));
    assert_eq!(s.add(seq(1, vec![1], 0)), Err(AdmissionError::ZeroMaxTokens));
    let long = s.add(seq(1, vec![1; 65], 1)).unwrap_err();
    assert_eq!(long, AdmissionError::PromptTooLong { len: 65, max_model_len: 64 });
    // 10 prompt + 10 output: KV for 19 positions, 5 blocks of 4 > 4 blocks.
    let big = s.add(seq(1, vec![1; 10], 10)).unwrap_err();
    assert_eq!(big, AdmissionError::ExceedsKvCapacity { tokens: 19, needed_blocks: 5, num_blocks: 4 });
    assert!(!big.is_overload() && big.to_string().contains("needs up to 5 KV blocks"));
    s.add(seq(1, vec![1; 10], 7)).unwrap(); // 16 positions: exactly the pool
    assert_eq!(s.add(seq(1, vec![1], 1)), Err(AdmissionError::DuplicateId(1)));

    let mut bad = config(4, 4, 4, 8, 64);
    assert_eq!(Scheduler::new(bad.clone()).unwrap_err(), ConfigError::BudgetBelowSeqs { budget: 4, seqs: 8 });
    bad.block_size = 0;
    assert_eq!(Scheduler::new(bad).unwrap_err(), ConfigError::Zero("block_size"));
    // A pool size a worker could report but no machine holds: refused before any block
    // state is allocated for it.
    let mut huge = config(4, 4, 64, 8, 64);
    huge.num_blocks = MAX_BLOCKS + 1;
    assert_eq!(Scheduler::new(huge.clone()).unwrap_err(), ConfigError::TooManyBlocks(MAX_BLOCKS + 1));
    huge.num_blocks = u32::MAX as usize - 1;
    assert_eq!(Scheduler::new(huge).unwrap_err(), ConfigError::TooManyBlocks(u32::MAX as usize - 1));
}

/// Drives one sequence with scripted tokens; returns its updates' tokens and ending.
fn scripted(
    stop: StopCriteria,
    prompt_len: usize,
    max_model_len: usize,
    script: &[u32],
) -> (Vec<u32>, Option<FinishReason>) {
    let mut s = Scheduler::new(config(4, 64, 64, 8, max_model_len)).unwrap();
    s.add(Sequence::new(7, vec![3; prompt_len], stop, 0)).unwrap();
    let (mut toks, mut end) = (Vec::new(), None);
    for &t in script {
        let Some(b) = s.schedule() else { break };
        assert_eq!(b.num_samples(), 1);
        for u in s.postprocess(&[StepOutput { seq_id: 7, token: t }]) {
            toks.extend(u.token);
            end = end.or(u.finished);
        }
    }
    assert_eq!(s.has_work(), end.is_none());
    (toks, end)
}

#[test]
fn stop_conditions_are_applied_after_each_token() {
    let stop = |ignore_eos| StopCriteria { max_tokens: 4, eos_ids: vec![5], stop_ids: vec![9], ignore_eos };
    assert_eq!(scripted(stop(false), 3, 64, &[3, 5, 4]), (vec![3, 5], Some(FinishReason::Stop)));
    assert_eq!(scripted(stop(true), 3, 64, &[3, 5, 4, 4, 4]), (vec![3, 5, 4, 4], Some(FinishReason::Length)));
    assert_eq!(scripted(stop(true), 3, 64, &[3, 9, 4]), (vec![3, 9], Some(FinishReason::Stop)));
    assert_eq!(scripted(stop(false), 6, 8, &[1, 2, 3]), (vec![1, 2], Some(FinishReason::Length)), "context full");
    assert_eq!(scripted(stop(false), 3, 64, &[1, 2]), (vec![1, 2], None));
}

#[test]
fn a_step_output_missing_for_a_sequence_ends_it_with_an_error() {
    let mut s = Scheduler::new(config(4, 64, 64, 8, 64)).unwrap();
    s.add(seq(1, vec![1, 2, 3], 4)).unwrap();
    s.add(seq(2, vec![4, 5, 6], 4)).unwrap();
    s.schedule().unwrap();
    let updates = s.postprocess(&[StepOutput { seq_id: 2, token: 8 }]);
    assert_eq!(updates.len(), 2);
    assert_eq!((updates[0].seq_id, updates[0].token, updates[0].finished), (1, None, Some(FinishReason::Error)));
    assert_eq!((updates[1].seq_id, updates[1].token, updates[1].finished), (2, Some(8), None));
    assert_eq!((s.num_running(), s.num_used_blocks()), (1, 1));
    s.check_invariants().unwrap();
}

#[test]
fn fail_all_ends_everything_and_frees_every_block() {
    let cfg = config(4, 64, 16, 8, 64);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut rng = Rng::new(18);
    for id in 1..=4 {
        s.add(seq(id, rng.tokens(9, 50), 8)).unwrap();
    }
    let b = s.schedule().unwrap();
    assert_eq!(ids(&b), [1, 2], "3 and 4 still wait");
    let mut ended: Vec<(u64, Option<u32>, Option<FinishReason>)> =
        s.fail_all().iter().map(|u| (u.seq_id, u.token, u.finished)).collect();
    ended.sort_by_key(|e| e.0);
    let want: Vec<_> = (1..=4).map(|id| (id, None, Some(FinishReason::Error))).collect();
    assert_eq!(ended, want);
    assert!(!s.has_work() && s.schedule().is_none() && s.postprocess(&[]).is_empty());
    assert_eq!(s.num_used_blocks(), 0);
    s.check_invariants().unwrap();
    // A fresh set of workers sees a clean start.
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    s.add(seq(1, rng.tokens(5, 50), 2)).unwrap();
    let b = step(&mut s, &mut w, &mut got).unwrap();
    assert!(b.finished.is_empty() && b.new_seqs.len() == 1);
}

/// Decode lookahead: while a decode executes, the next batch runs the sequence once more on
/// the token being sampled (`from_previous`, position `len()`), and the tokens still equal
/// the sequence's run alone; with fewer free blocks than running sequences it is skipped
/// (an executing sequence cannot be preempted, so its slots would crowd out the others).
#[test]
fn lookahead_decodes_follow_the_executing_step_unless_blocks_are_short() {
    let run_two = |num_blocks: usize| {
        let cfg = tessera_coordinator::SchedulerConfig {
            lookahead: true,
            max_in_flight: 2,
            ..config(4, num_blocks, 64, 8, 64)
        };
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        let mut w = FakeWorker::new(&cfg);
        let mut rng = Rng::new(23);
        let prompts = [rng.tokens(6, 50), rng.tokens(5, 50)];
        for (id, p) in prompts.iter().enumerate() {
            s.add(seq(id as u64, p.clone(), 8)).unwrap();
        }
        let mut got = Collected::default();
        let (mut lookaheads, mut short_steps, mut pending) = (0, 0, std::collections::VecDeque::new());
        for _ in 0..200 {
            if pending.len() < 2 {
                let short = s.block_manager().num_available() < s.num_running();
                if let Some(b) = s.schedule() {
                    let ahead = b.runs.iter().filter(|r| r.from_previous).count();
                    assert!(!short || ahead == 0, "a lookahead with fewer free blocks than running sequences");
                    short_steps += usize::from(short);
                    lookaheads += ahead;
                    for r in b.runs.iter().filter(|r| r.from_previous) {
                        assert_eq!(r.first_pos, s.get(r.seq_id).unwrap().len(), "the pending token's position");
                    }
                    pending.push_back(w.run(&s, &b));
                    continue;
                }
            }
            let Some(out) = pending.pop_front() else { break };
            got.record(&s.postprocess(&out));
            s.check_invariants().unwrap();
        }
        for (id, p) in prompts.iter().enumerate() {
            let want = reference(p, &StopCriteria::new(8, Vec::new()), 64);
            assert_eq!(got.tokens[&(id as u64)], want.0, "seq {id}");
        }
        assert_eq!(s.num_used_blocks(), 0);
        (lookaheads, short_steps)
    };
    assert!(run_two(32).0 > 0, "a roomy pool runs lookaheads");
    // Two sequences of up to 14 positions need 4 blocks each: 7 blocks leave fewer free
    // blocks than running sequences once both have grown.
    let (_, short_steps) = run_two(7);
    assert!(short_steps > 0, "the tight pool was short of blocks at some step");
}

/// Each new sequence's first step message carries its sampling parameters (a structured-
/// output constraint can be 1 MiB): a step admits new sequences only while they fit
/// `max_step_new_bytes`, FIFO, the first of a step always; the others wait for later
/// steps and still generate their reference tokens.
#[test]
fn admission_keeps_a_steps_new_sequences_within_its_message_room() {
    let cfg = tessera_coordinator::SchedulerConfig { max_step_new_bytes: 10_000, ..config(4, 256, 64, 16, 64) };
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let mut rng = Rng::new(40);
    // 4,000 bytes of parameters + 5 tokens each: two fit in 10,000 bytes, three do not.
    let prompts: Vec<Vec<u32>> = (0..5).map(|_| rng.tokens(5, 50)).collect();
    for (i, p) in prompts.iter().enumerate() {
        s.add(seq(i as u64 + 1, p.clone(), 4).with_wire_bytes(4_000)).unwrap();
    }
    // One bigger than the whole room, behind them: admitted alone when it is first.
    let big = rng.tokens(5, 50);
    s.add(seq(6, big.clone(), 4).with_wire_bytes(50_000)).unwrap();
    let mut admitted = Vec::new();
    while got.finished.len() < 6 {
        let b = step(&mut s, &mut w, &mut got).unwrap();
        admitted.push(b.new_seqs.iter().map(|n| n.seq_id).collect::<Vec<_>>());
    }
    let admitted: Vec<Vec<u64>> = admitted.into_iter().filter(|a| !a.is_empty()).collect();
    assert_eq!(admitted, [vec![1, 2], vec![3, 4], vec![5], vec![6]], "FIFO, two per step, the big one alone");
    for (i, p) in prompts.iter().chain([&big]).enumerate() {
        let (want, _) = reference(p, &StopCriteria::new(4, Vec::new()), 64);
        assert_eq!(got.tokens[&(i as u64 + 1)], want, "sequence {}", i + 1);
    }
    assert!(Scheduler::new(tessera_coordinator::SchedulerConfig { max_step_new_bytes: 0, ..cfg }).is_err());
}
