//! End-to-end simulation: hundreds of sequences with shared system prompts arrive over
//! time into small KV pools, some are aborted (between steps and mid-step), and a fake
//! model that reads its context back from paged KV (see `common::FakeWorker`) produces
//! the tokens. Every sequence's output must equal the same model run on it alone; the
//! scheduler must never stall, every running decode must get a token each step, the
//! invariants hold after every step, and at the end all blocks are back.

mod common;

use std::collections::HashMap;

use common::{next_token, reference, Collected, FakeWorker, Rng, EOS, VOCAB};
use tessera_coordinator::{AdmissionError, Scheduler, SchedulerConfig, Sequence, StopCriteria};

struct Sim {
    cfg: SchedulerConfig,
    num_seqs: u64,
    seed: u64,
}

fn run(sim: Sim) {
    let Sim { cfg, num_seqs, seed } = sim;
    let mut rng = Rng::new(seed);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let mut w = FakeWorker::new(&cfg);
    let mut got = Collected::default();
    let systems: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let n = if i == 0 { 2 * cfg.block_size } else { rng.range(1, 3 * cfg.block_size + 2) };
            rng.tokens(n, VOCAB)
        })
        .collect();
    let mut specs: HashMap<u64, (Vec<u32>, StopCriteria)> = HashMap::new();
    let mut aborted = Vec::new();
    let (mut next_id, mut steps, mut lookaheads) = (0u64, 0u64, 0u64);
    // Batches scheduled and run by the fake worker whose outputs are not consumed yet.
    let mut pending: std::collections::VecDeque<(Vec<u64>, Vec<tessera_coordinator::StepOutput>)> =
        std::collections::VecDeque::new();
    loop {
        for _ in 0..rng.below(3) {
            if next_id == num_seqs {
                break;
            }
            let n = rng.range(1, 20);
            let prompt = [systems[rng.below(4)].clone(), rng.tokens(n, VOCAB)].concat();
            let stop = StopCriteria {
                max_tokens: rng.range(1, 40),
                eos_ids: vec![EOS],
                stop_ids: if rng.chance(1, 3) { vec![1 + rng.below(VOCAB as usize - 1) as u32] } else { vec![] },
                ignore_eos: rng.chance(1, 4),
            };
            match s.add(Sequence::new(next_id, prompt.clone(), stop.clone(), steps)) {
                Ok(()) => {
                    specs.insert(next_id, (prompt, stop));
                }
                Err(AdmissionError::ExceedsKvCapacity { needed_blocks, .. }) => assert!(needed_blocks > cfg.num_blocks),
                Err(e) => panic!("unexpected refusal: {e}"),
            }
            next_id += 1;
        }
        if rng.chance(1, 40) {
            if let Some(&id) = s.running_ids().first() {
                assert!(s.abort(id));
                aborted.push(id);
            }
        }

        // Decodes not executing now must all get their token (with one batch in flight,
        // that is every decode).
        let decoding: Vec<u64> = s
            .running_ids()
            .iter()
            .copied()
            .filter(|&id| s.get(id).is_some_and(Sequence::is_decoding))
            .filter(|id| !pending.iter().any(|(ids, _)| ids.contains(id)))
            .collect();
        let scheduled = if pending.len() < cfg.max_in_flight { s.schedule() } else { None };
        if let Some(batch) = &scheduled {
            steps += 1;
            assert!(batch.num_tokens() <= cfg.max_num_batched_tokens && batch.runs.len() <= cfg.max_num_seqs);
            for id in decoding {
                let ran = batch.runs.iter().any(|r| r.seq_id == id && r.tokens.len() == 1);
                assert!(ran || s.get(id).is_some_and(|q| q.num_preemptions > 0), "decode {id} stalled");
            }
            for (ids, _) in &pending {
                assert!(
                    batch.runs.iter().all(|r| r.from_previous || !ids.contains(&r.seq_id)),
                    "a sequence in two executing batches"
                );
            }
            for r in batch.runs.iter().filter(|r| r.from_previous) {
                assert!(cfg.lookahead, "lookahead run without lookahead");
                assert!(pending.back().is_some_and(|(ids, _)| ids.contains(&r.seq_id)), "lookahead after its decode");
                lookaheads += 1;
            }
            let out = w.run(&s, batch);
            if rng.chance(1, 40) {
                if let Some(r) = batch.runs.last() {
                    assert!(s.abort(r.seq_id));
                    aborted.push(r.seq_id);
                }
            }
            pending.push_back((batch.runs.iter().map(|r| r.seq_id).collect::<Vec<u64>>(), out));
            if pending.len() < cfg.max_in_flight {
                continue; // fill the pipeline before the oldest batch returns
            }
        }
        let Some((_, out)) = pending.pop_front() else {
            assert!(!s.has_work(), "stalled with work at step {steps}");
            if next_id == num_seqs {
                break;
            }
            continue;
        };
        got.record(&s.postprocess(&out));
        s.check_invariants().unwrap();
        assert!(steps < 100_000, "no progress");
    }

    let max_len = cfg.max_model_len;
    for (id, (prompt, stop)) in &specs {
        let want = reference(prompt, stop, max_len);
        let tokens = got.tokens.get(id).cloned().unwrap_or_default();
        if aborted.contains(id) {
            assert!(want.0.starts_with(&tokens), "aborted seq {id}: its tokens so far are right");
        } else {
            assert_eq!((&tokens, got.finished.get(id)), (&want.0, Some(&want.1)), "seq {id}");
        }
    }
    let stats = s.stats();
    assert_eq!((stats.used_blocks, stats.running, stats.waiting), (0, 0, 0));
    assert_eq!(stats.free_blocks + stats.evictable_blocks, cfg.num_blocks);
    assert!(stats.preemptions > 0, "the workload preempted: {stats:?}");
    assert!(stats.prefix_hit_tokens > 0, "the workload hit the prefix cache: {stats:?}");
    assert!(!aborted.is_empty());
    assert!(next_token(&[1, 2]) != next_token(&[2, 1]), "the fake model depends on order");
    assert_eq!(lookaheads > 0, cfg.lookahead, "lookahead decodes ran iff enabled ({lookaheads})");
}

fn cfg(
    block_size: usize,
    num_blocks: usize,
    budget: usize,
    seqs: usize,
    max_len: usize,
    chunk: usize,
) -> SchedulerConfig {
    cfg_in_flight(block_size, num_blocks, budget, seqs, max_len, chunk, 1)
}

fn cfg_in_flight(
    block_size: usize,
    num_blocks: usize,
    budget: usize,
    seqs: usize,
    max_len: usize,
    chunk: usize,
    in_flight: usize,
) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: budget,
        max_waiting: 1 << 20,
        block_size,
        num_blocks,
        max_model_len: max_len,
        long_prefill_threshold: chunk,
        max_in_flight: in_flight,
        lookahead: false,
        max_step_new_bytes: tessera_coordinator::config::DEFAULT_STEP_NEW_BYTES,
    }
}

/// A replica of one worker with decode lookahead: while a batch executes, the next holds
/// the lookahead decodes of its sequences (on tokens the fake worker fills in). Every
/// sequence still generates exactly its reference tokens; aborts, stops and preemption
/// with a lookahead in flight leak nothing.
#[test]
fn random_workload_with_lookahead_decodes() {
    let cfg = SchedulerConfig { lookahead: true, ..cfg_in_flight(4, 40, 32, 8, 96, 0, 2) };
    run(Sim { cfg, num_seqs: 400, seed: 13 });
}

#[test]
fn random_workload_pipelined_two_batches_in_flight() {
    run(Sim { cfg: cfg_in_flight(4, 40, 32, 8, 96, 0, 2), num_seqs: 400, seed: 11 });
}

#[test]
fn random_workload_pipelined_three_batches_in_flight_chunked() {
    run(Sim { cfg: cfg_in_flight(8, 14, 16, 4, 64, 6, 3), num_seqs: 300, seed: 12 });
}

#[test]
fn random_workload_small_blocks_tight_pool() {
    run(Sim { cfg: cfg(4, 40, 32, 8, 96, 0), num_seqs: 400, seed: 1 });
}

#[test]
fn random_workload_chunk_cap_and_small_budget() {
    run(Sim { cfg: cfg(8, 24, 16, 4, 64, 6), num_seqs: 300, seed: 2 });
}

#[test]
fn random_workload_block_size_one() {
    run(Sim { cfg: cfg(1, 90, 24, 6, 80, 0), num_seqs: 300, seed: 3 });
}

#[test]
fn random_workload_large_blocks() {
    run(Sim { cfg: cfg(16, 10, 64, 6, 128, 0), num_seqs: 300, seed: 4 });
}
