//! The worker's spans: one `prefill` or `decode` span per traced sequence per step it runs
//! in, a child of that sequence's coordinator span.
//!
//! Why per sequence in the step message: the coordinator drives a worker through one
//! long-lived Step stream that carries many requests' sequences in every message, so the
//! call's gRPC metadata cannot say which trace a sequence belongs to. Instead the
//! coordinator sends the W3C `traceparent` once per sequence, in its `NewSequence` (only
//! when the request is traced), and this tracker keeps it until the sequence is finished.
//! A batched step runs many sequences in one forward pass: each traced sequence gets its
//! own span over the same step interval, with the batch's shape as attributes, and, on a
//! sharded worker, a `collective` child carrying the step's time in collectives.
//!
//! A run is `prefill` until the run that samples the sequence's first token (inclusive),
//! `decode` after; a re-admitted sequence (a new `NewSequence`, e.g. after a preemption)
//! starts over with prefill. With tracing off nothing is kept and no span is built.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use tessera_proto::worker as pb;
use tessera_telemetry::trace::{self as otel, Context, KeyValue};

/// A traced sequence: its parent context and whether it has sampled yet.
struct Traced {
    parent: Context,
    decoding: bool,
}

/// Trace contexts of this worker's traced sequences, updated from each step's deltas.
#[derive(Default)]
pub struct StepTracer {
    seqs: HashMap<u64, Traced>,
}

/// The spans to record for one step once its reply is known.
pub struct TracedStep {
    step_id: u64,
    start: SystemTime,
    batch_sequences: usize,
    batch_tokens: usize,
    /// (parent context, "prefill" | "decode", tokens run, first position).
    runs: Vec<(Context, &'static str, usize, u32)>,
}

impl StepTracer {
    /// Applies a step's deltas (finished sequences are forgotten, new ones' contexts kept)
    /// and returns the step's traced runs, if any. Call before running the step.
    pub fn begin(&mut self, req: &pb::StepRequest) -> Option<TracedStep> {
        if !otel::enabled() {
            return None;
        }
        let runs = self.track(req);
        if runs.is_empty() {
            return None;
        }
        Some(TracedStep {
            step_id: req.step_id,
            start: SystemTime::now(),
            batch_sequences: req.runs.len(),
            batch_tokens: req.runs.iter().map(pb::SeqRun::num_tokens).sum(),
            runs,
        })
    }

    /// Applies the deltas; returns the traced runs with their span names.
    fn track(&mut self, req: &pb::StepRequest) -> Vec<(Context, &'static str, usize, u32)> {
        for id in &req.finished {
            self.seqs.remove(id);
        }
        for s in &req.new_sequences {
            match otel::from_traceparent(&s.traceparent) {
                Some(parent) => {
                    self.seqs.insert(s.seq_id, Traced { parent, decoding: false });
                }
                None => {
                    self.seqs.remove(&s.seq_id);
                }
            }
        }
        let mut runs = Vec::new();
        if self.seqs.is_empty() {
            return runs;
        }
        for r in &req.runs {
            let Some(t) = self.seqs.get_mut(&r.seq_id) else { continue };
            let kind = if t.decoding { "decode" } else { "prefill" };
            t.decoding |= r.sample;
            runs.push((t.parent.clone(), kind, r.num_tokens(), r.first_pos));
        }
        runs
    }

    /// Sequences whose context is kept.
    pub fn len(&self) -> usize {
        self.seqs.len()
    }

    /// True when no traced sequence is known.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

impl TracedStep {
    /// Records the spans of the step that `reply` answered; `collective` is the step's time
    /// in collectives, when the worker is sharded.
    pub fn end(self, reply: &pb::StepReply, collective: Option<Duration>) {
        let end = SystemTime::now();
        let error = (!reply.error.is_empty()).then_some(reply.error.as_str());
        for (parent, kind, tokens, first_pos) in self.runs {
            let attributes = vec![
                KeyValue::new("tessera.step_id", self.step_id as i64),
                KeyValue::new("tessera.tokens", tokens as i64),
                KeyValue::new("tessera.first_position", i64::from(first_pos)),
                KeyValue::new("tessera.batch.sequences", self.batch_sequences as i64),
                KeyValue::new("tessera.batch.tokens", self.batch_tokens as i64),
                KeyValue::new("tessera.forward_us", i64::from(reply.forward_us)),
                KeyValue::new("tessera.sample_us", i64::from(reply.sample_us)),
            ];
            let Some(cx) = otel::start_at(kind, otel::SpanKind::Internal, &parent, attributes, Some(self.start)) else {
                continue;
            };
            if let Some(c) = collective.filter(|c| !c.is_zero()) {
                // Collectives interleave with compute inside the forward pass; the child
                // spans their total time from the step's start (its length is what counts).
                let attributes = vec![KeyValue::new("tessera.collective_us", c.as_micros() as i64)];
                otel::record("collective", &cx, attributes, self.start, (self.start + c).min(end), None);
            }
            if let Some(e) = error {
                otel::set_error(&cx, e);
            }
            otel::end(&cx, Some(end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(id: u64, new: &[(u64, &str)], finished: &[u64], runs: &[(u64, usize, bool)]) -> pb::StepRequest {
        pb::StepRequest {
            step_id: id,
            new_sequences: new
                .iter()
                .map(|&(seq_id, tp)| pb::NewSequence { seq_id, traceparent: tp.to_owned(), ..Default::default() })
                .collect(),
            finished: finished.to_vec(),
            runs: runs
                .iter()
                .map(|&(seq_id, n, sample)| pb::SeqRun {
                    seq_id,
                    tokens: vec![1; n],
                    first_pos: 0,
                    sample,
                    from_previous: false,
                })
                .collect(),
            ..Default::default()
        }
    }

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn kinds(t: &mut StepTracer, req: &pb::StepRequest) -> Vec<(String, usize)> {
        t.track(req)
            .into_iter()
            .map(|(cx, kind, n, _)| {
                assert_eq!(otel::ids(&cx).map(|ids| ids.1), Some("00f067aa0ba902b7".to_owned()));
                (kind.to_owned(), n)
            })
            .collect()
    }

    #[test]
    fn runs_are_prefill_until_the_first_sample_then_decode() {
        let mut t = StepTracer::default();
        // Sequence 1 traced, 2 not traced, 3 with a malformed traceparent.
        let s1 = step(1, &[(1, TP), (2, ""), (3, "00-bad")], &[], &[(1, 8, false), (2, 8, true), (3, 8, true)]);
        assert_eq!(kinds(&mut t, &s1), [("prefill".to_owned(), 8)]);
        assert_eq!(t.len(), 1);
        assert_eq!(kinds(&mut t, &step(2, &[], &[], &[(1, 3, true), (2, 1, true)])), [("prefill".to_owned(), 3)]);
        assert_eq!(kinds(&mut t, &step(3, &[], &[], &[(2, 1, true), (1, 1, true)])), [("decode".to_owned(), 1)]);
        // Preempted: forgotten, then re-admitted as new; it prefills again.
        assert!(kinds(&mut t, &step(4, &[], &[1], &[(2, 1, true)])).is_empty());
        assert!(t.is_empty());
        assert_eq!(kinds(&mut t, &step(5, &[(1, TP)], &[], &[(1, 12, true)])), [("prefill".to_owned(), 12)]);
        assert_eq!(kinds(&mut t, &step(6, &[], &[], &[(1, 1, true)])), [("decode".to_owned(), 1)]);
    }

    #[test]
    fn nothing_is_kept_while_tracing_is_off() {
        let mut t = StepTracer::default();
        assert!(t.begin(&step(1, &[(1, TP)], &[], &[(1, 4, true)])).is_none());
        assert!(t.is_empty());
    }
}
