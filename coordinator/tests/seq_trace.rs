//! The coordinator's spans of one request through its life: queued, scheduled (prefill, then
//! decodes), preempted and re-queued, moved to another replica mid-step, finished; and the
//! `traceparent` the workers get names the request's `generate` span.

use std::collections::HashMap;

use tessera_coordinator::migration::ClientState;
use tessera_coordinator::seq_trace::{self, SeqTrace};
use tessera_coordinator::{ScheduledBatch, SeqRun};
use tessera_proto::worker as pb;
use tessera_telemetry::trace_capture::{capture, CapturedSpan};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

fn step(step_id: u64, finished: &[u64], runs: &[(u64, usize, bool)]) -> ScheduledBatch {
    ScheduledBatch {
        step_id,
        finished: finished.to_vec(),
        runs: runs
            .iter()
            .map(|&(seq_id, n, is_prompt)| SeqRun {
                seq_id,
                tokens: vec![7; n],
                first_pos: 0,
                sample: true,
                is_prompt,
                from_previous: false,
            })
            .collect(),
        ..ScheduledBatch::default()
    }
}

fn one<'a>(spans: &'a [CapturedSpan], name: &str) -> &'a CapturedSpan {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "{name}: {found:?}");
    found[0]
}

#[test]
fn a_request_is_queued_scheduled_preempted_moved_and_finished() {
    let capture = capture();
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01").parse().unwrap());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let mut client = ClientState::new(tx, pb::SamplingParams::default(), 12);
    client.trace = SeqTrace::start(&md, "model.gguf", "chatcmpl-1-0", 4);
    let traceparent = client.trace.traceparent();
    let mut clients = HashMap::from([(1u64, client)]);

    seq_trace::on_scheduled(&mut clients, &step(1, &[], &[(1, 12, true), (2, 5, true)]));
    tick();
    seq_trace::on_step_done(&mut clients, 1);
    tick();
    seq_trace::on_scheduled(&mut clients, &step(2, &[], &[(1, 1, false)]));
    tick();
    seq_trace::on_step_done(&mut clients, 2);
    tick();
    // Preempted: the next batch tells the workers to forget it while it lives on.
    seq_trace::on_scheduled(&mut clients, &step(3, &[1], &[(2, 1, false)]));
    tick();
    seq_trace::on_step_done(&mut clients, 3);
    tick();
    seq_trace::on_scheduled(&mut clients, &step(4, &[], &[(1, 13, true)]));
    tick();
    // Its replica fails during step 4; another replica adopts it.
    clients.get_mut(&1).unwrap().trace.requeued(Some("worker lost"));
    tick();
    seq_trace::on_scheduled(&mut clients, &step(1, &[], &[(1, 13, true)]));
    tick();
    seq_trace::on_step_done(&mut clients, 1);
    tick();
    let mut client = clients.remove(&1).unwrap();
    client.trace.finish("length", 12, 4, 0);

    let spans = capture.trace(CALLER_TRACE);
    let generate = one(&spans, "generate");
    assert_eq!(generate.parent_span_id, CALLER_SPAN);
    assert_eq!(traceparent, format!("00-{CALLER_TRACE}-{}-01", generate.span_id));
    assert_eq!(generate.int("gen_ai.usage.input_tokens"), Some(12));
    assert_eq!(generate.int("gen_ai.usage.output_tokens"), Some(4));
    assert_eq!(generate.int("gen_ai.request.max_tokens"), Some(4));
    assert_eq!(generate.str("tessera.request_id").as_deref(), Some("chatcmpl-1-0"));
    assert!(generate.error.is_none());

    let children: Vec<_> = spans.iter().filter(|s| s.name != "generate").collect();
    assert!(children.iter().all(|s| s.parent_span_id == generate.span_id));
    let names: Vec<_> = {
        let mut c = children.clone();
        c.sort_by_key(|s| s.start);
        c.iter().map(|s| s.name.as_str()).collect()
    };
    assert_eq!(names, ["queue", "schedule", "schedule", "queue", "schedule", "queue", "schedule"]);
    let schedules: Vec<_> = {
        let mut s: Vec<_> = children.iter().filter(|s| s.name == "schedule").collect();
        s.sort_by_key(|s| s.start);
        s
    };
    let kinds: Vec<_> = schedules.iter().map(|s| s.str("tessera.step.kind").unwrap()).collect();
    assert_eq!(kinds, ["prefill", "decode", "prefill", "prefill"]);
    assert_eq!(schedules[0].int("tessera.batch.sequences"), Some(2));
    assert_eq!(schedules[0].int("tessera.batch.tokens"), Some(17));
    // The step cut short by the failure is an error; the others are not.
    let failed: Vec<_> = schedules.iter().filter(|s| s.error.is_some()).collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].int("tessera.step_id"), Some(4));
    let queues: Vec<_> = children.iter().filter(|s| s.name == "queue").collect();
    assert_eq!(queues.iter().filter(|s| s.attributes.contains_key("tessera.preempted")).count(), 1);
    assert_eq!(queues.iter().filter(|s| s.str("tessera.migrated_after").as_deref() == Some("worker lost")).count(), 1);
    for s in &spans {
        assert!(s.start <= s.end, "{s:?}");
    }
}

#[test]
fn a_failed_or_abandoned_request_still_closes_its_spans() {
    let capture = capture();
    let md = tonic::metadata::MetadataMap::new();

    // No caller context: the coordinator starts the trace.
    let mut failed = SeqTrace::start(&md, "m", "r-failed", 8);
    let failed_trace = traceparent_trace_id(&failed.traceparent());
    failed.fail("the replica failed");
    let spans = capture.trace(&failed_trace);
    let generate = one(&spans, "generate");
    assert_eq!(generate.parent_span_id, "0000000000000000");
    assert_eq!(generate.error.as_deref(), Some("the replica failed"));
    assert_eq!(one(&spans, "queue").parent_span_id, generate.span_id);

    // A client that went away: dropping the trace ends it, marked cancelled.
    let abandoned = SeqTrace::start(&md, "m", "r-gone", 8);
    let gone_trace = traceparent_trace_id(&abandoned.traceparent());
    drop(abandoned);
    let spans = capture.trace(&gone_trace);
    let generate = one(&spans, "generate");
    assert_eq!(generate.attributes.get("tessera.cancelled").map(|v| v.to_string()).as_deref(), Some("true"));

    // Refused at admission.
    let refused = SeqTrace::start(&md, "m", "r-refused", 8);
    let refused_trace = traceparent_trace_id(&refused.traceparent());
    refused.refused("queue full");
    assert_eq!(one(&capture.trace(&refused_trace), "generate").error.as_deref(), Some("queue full"));
}

/// Lets the clock move, so span start times order the phases.
fn tick() {
    std::thread::sleep(std::time::Duration::from_millis(1));
}

fn traceparent_trace_id(tp: &str) -> String {
    tp.split('-').nth(1).expect("a traceparent").to_owned()
}
