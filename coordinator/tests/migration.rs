//! Migration of unfinished sequences from a failed replica: re-admitted on another
//! replica's scheduler as prompt + tokens so far, they finish with exactly the tokens an
//! undisturbed run produces (none twice, none missing) and stop at the original budget.

mod common;

use common::{config, reference, step, Collected, FakeWorker, Rng, EOS};
use tessera_coordinator::migration::{ClientState, Migrant};
use tessera_coordinator::{FinishReason, Scheduler, Sequence, StopCriteria};
use tessera_proto::worker as pb;
use tokio::sync::mpsc;

fn client(prompt_tokens: usize) -> ClientState {
    let (tx, _rx) = mpsc::unbounded_channel();
    // The receiver is dropped: these tests only use the sequence side of a migrant.
    ClientState::new(tx, pb::SamplingParams::default(), prompt_tokens)
}

#[test]
fn migrated_sequences_finish_like_undisturbed_ones() {
    let cfg = config(4, 64, 32, 8, 96);
    let mut rng = Rng::new(61);
    let seqs: Vec<(Vec<u32>, StopCriteria)> = (0..6)
        .map(|i| (rng.tokens(3 + 4 * i, 64), StopCriteria::new(6 + 3 * i, if i % 2 == 0 { vec![EOS] } else { vec![] })))
        .collect();
    let mut a = Scheduler::new(cfg.clone()).unwrap();
    let mut wa = FakeWorker::new(&cfg);
    let mut before = Collected::default();
    for (i, (p, stop)) in seqs.iter().enumerate() {
        a.add(Sequence::new(i as u64 + 1, p.clone(), stop.clone(), 0)).unwrap();
    }
    for _ in 0..5 {
        step(&mut a, &mut wa, &mut before);
    }
    // Replica A fails with one step in flight: its tokens never come back.
    let _lost = a.schedule();
    let mut migrants = Vec::new();
    for id in 1..=seqs.len() as u64 {
        if let Some(s) = a.get(id).filter(|s| !s.is_finished()) {
            assert_eq!(s.output(), before.tokens.get(&id).map_or(&[][..], Vec::as_slice), "output == tokens sent");
            migrants.push((id, Migrant::new(s, client(s.prompt_len()), "worker lost")));
        }
    }
    assert!(migrants.len() >= 3, "most sequences were unfinished when A failed");
    a.fail_all();

    let mut b = Scheduler::new(cfg.clone()).unwrap();
    let mut wb = FakeWorker::new(&cfg);
    let mut after = Collected::default();
    let mut new_ids = Vec::new();
    for (k, (old, m)) in migrants.iter().enumerate() {
        let id = 100 + k as u64;
        let s = m.sequence(id);
        assert_eq!((s.prompt(), s.output()), (&m.prompt[..], &m.output[..]));
        b.add(s).unwrap();
        new_ids.push((*old, id, m.output.clone()));
    }
    let first = b.schedule().expect("the migrants are admitted");
    for n in &first.new_seqs {
        let (_, _, out) = new_ids.iter().find(|(_, id, _)| *id == n.seq_id).unwrap();
        assert_eq!(&n.prior_output, out, "the sampler learns what was generated before");
    }
    // Give the batch back to the worker, then run to the end.
    let outs = wb.run(&b, &first);
    after.record(&b.postprocess(&outs));
    while step(&mut b, &mut wb, &mut after).is_some() {}

    for (old, new, out_before) in &new_ids {
        let (prompt, stop) = &seqs[*old as usize - 1];
        let (want, why) = reference(prompt, stop, cfg.max_model_len);
        let mut got = out_before.clone();
        got.extend(after.tokens.get(new).cloned().unwrap_or_default());
        assert_eq!(got, want, "seq {old}: tokens before + after the move == an undisturbed run");
        assert_eq!(after.finished.get(new), Some(&why), "seq {old}: same ending");
    }
    // Sequences that finished on A before the failure finished as the reference says too.
    for (id, why) in &before.finished {
        let (prompt, stop) = &seqs[*id as usize - 1];
        assert_eq!(*why, reference(prompt, stop, cfg.max_model_len).1);
        assert_ne!(*why, FinishReason::Error);
    }
}

#[test]
fn failing_a_migrant_ends_its_stream_with_an_error_event() {
    use tessera_proto::coordinator as cpb;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut c = ClientState::new(tx, pb::SamplingParams::default(), 7);
    c.completion_tokens = 3;
    let s = Sequence::new(1, vec![1, 2, 3, 4, 5, 6, 7], StopCriteria::new(10, vec![]), 0);
    Migrant::new(&s, c, "worker 127.0.0.1:1: the step stream closed").fail();
    let ev = rx.try_recv().unwrap().unwrap().event.unwrap();
    let cpb::generate_event::Event::Finished(f) = ev else { panic!("expected Finished, got {ev:?}") };
    assert_eq!(f.reason, cpb::FinishReason::Error as i32);
    assert_eq!((f.prompt_tokens, f.completion_tokens), (7, 3));
    assert!(f.message.contains("step stream closed"), "{}", f.message);
    assert!(rx.try_recv().is_err(), "nothing after the end");
}
