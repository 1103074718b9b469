//! A request's spans on the coordinator: `generate` (kind server, a child of the gateway's
//! span named by the call's `traceparent`) from arrival to the end, with children `queue`
//! (waiting for admission, again after a preemption or a move to another replica) and one
//! `schedule` per step the sequence runs in (from the scheduler's decision to the step's
//! result: step id, prefill or decode, tokens, batch size).
//!
//! The workers' `prefill` / `decode` spans are children of `generate`: its `traceparent`
//! travels once per sequence in the step stream's `NewSequence` (see the worker's
//! `step_trace`). When this process does not trace but the caller did, the caller's context
//! is passed on unchanged, so the workers' spans still join the caller's trace; when
//! neither traces, nothing is kept and no `traceparent` is sent.
//!
//! The trace travels with the client's state (`ClientState`), so it follows a migrated
//! sequence to its new replica. Dropping it ends every open span (a client that went away).

use std::collections::HashMap;

use tessera_telemetry::trace::{self as otel, Context, KeyValue, SpanKind, StringValue, TraceContextExt, Value};

use crate::batch::ScheduledBatch;
use crate::migration::ClientState;

/// The coordinator's spans of one request; empty (`Default`) when it is not traced.
#[derive(Default)]
pub struct SeqTrace {
    /// The `generate` span, or the caller's context passed on when this process does not
    /// trace; `None` when the request is not traced at all.
    root: Option<Context>,
    /// The open `queue` span.
    queue: Option<Context>,
    /// The open `schedule` span and its step id.
    step: Option<(u64, Context)>,
    finished: bool,
}

impl std::fmt::Debug for SeqTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqTrace").field("traced", &self.root.is_some()).finish()
    }
}

impl SeqTrace {
    /// The trace of a Generate call whose metadata may carry the caller's `traceparent`.
    pub fn start(metadata: &tonic::metadata::MetadataMap, model: &str, request_id: &str, max_tokens: u32) -> Self {
        let parent = otel::extract(metadata);
        if !otel::enabled() {
            return SeqTrace { root: parent, queue: None, step: None, finished: false };
        }
        let attributes = vec![
            KeyValue::new("gen_ai.operation.name", "generate"),
            KeyValue::new("gen_ai.request.model", model.to_owned()),
            KeyValue::new("gen_ai.request.max_tokens", i64::from(max_tokens)),
            KeyValue::new("tessera.request_id", request_id.to_owned()),
            KeyValue::new("rpc.system", "grpc"),
            KeyValue::new("rpc.method", "tessera.coordinator.v1.Coordinator/Generate"),
        ];
        let root = otel::start("generate", SpanKind::Server, &parent.unwrap_or_default(), attributes);
        let queue = root.as_ref().and_then(|r| otel::start("queue", SpanKind::Internal, r, Vec::new()));
        SeqTrace { root, queue, step: None, finished: false }
    }

    /// The `traceparent` the workers get for this sequence (empty when untraced).
    pub fn traceparent(&self) -> String {
        self.root.as_ref().and_then(otel::traceparent).unwrap_or_default()
    }

    /// The request was refused (queue full, replica down) before it ran.
    pub fn refused(mut self, message: &str) {
        self.fail(message);
    }

    /// Scheduled in step `step_id`: the wait ends, a `schedule` span starts.
    fn scheduled(&mut self, step_id: u64, kind: &'static str, tokens: usize, batch: &ScheduledBatch) {
        let Some(root) = &self.root else { return };
        if let Some(q) = self.queue.take() {
            otel::end(&q, None);
        }
        // A lookahead decode is scheduled while the sequence's previous step still runs:
        // that step's span ends here.
        if let Some((_, cx)) = self.step.take() {
            otel::end(&cx, None);
        }
        let attributes = vec![
            KeyValue::new("tessera.step_id", step_id as i64),
            KeyValue::new("tessera.step.kind", kind),
            KeyValue::new("tessera.tokens", tokens as i64),
            KeyValue::new("tessera.batch.sequences", batch.runs.len() as i64),
            KeyValue::new("tessera.batch.tokens", batch.num_tokens() as i64),
        ];
        self.step = otel::start("schedule", SpanKind::Internal, root, attributes).map(|cx| (step_id, cx));
    }

    /// Step `step_id` answered: its `schedule` span ends.
    fn step_done(&mut self, step_id: u64) {
        if self.step.as_ref().is_some_and(|(id, _)| *id == step_id) {
            if let Some((_, cx)) = self.step.take() {
                otel::end(&cx, None);
            }
        }
    }

    /// Back to waiting (preempted, or moved to another replica after `error`).
    pub fn requeued(&mut self, error: Option<&str>) {
        let Some(root) = &self.root else { return };
        if let Some((_, cx)) = self.step.take() {
            if let Some(e) = error {
                otel::set_error(&cx, e);
            }
            otel::end(&cx, None);
        }
        if self.queue.is_none() {
            let attributes = match error {
                Some(e) => vec![KeyValue::new("tessera.migrated_after", e.to_owned())],
                None => vec![KeyValue::new("tessera.preempted", true)],
            };
            self.queue = otel::start("queue", SpanKind::Internal, root, attributes);
        }
    }

    /// The sequence ended normally: usage and finish reason go on `generate`.
    pub fn finish(&mut self, reason: &'static str, prompt_tokens: usize, completion_tokens: usize, cached: usize) {
        if let Some(root) = self.root.as_ref().filter(|r| r.span().is_recording()) {
            let span = root.span();
            span.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", prompt_tokens as i64));
            span.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", completion_tokens as i64));
            span.set_attribute(KeyValue::new("tessera.cached_tokens", cached as i64));
            let reasons = Value::Array(vec![StringValue::from(reason)].into());
            span.set_attribute(KeyValue::new("gen_ai.response.finish_reasons", reasons));
        }
        self.close();
    }

    /// The sequence failed with `message`.
    pub fn fail(&mut self, message: &str) {
        if let Some(root) = self.root.as_ref().filter(|r| r.span().is_recording()) {
            otel::set_error(root, message);
            root.span().set_attribute(KeyValue::new("error.type", "engine_error"));
        }
        self.close();
    }

    fn close(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        for cx in [self.queue.take(), self.step.take().map(|s| s.1)].into_iter().flatten() {
            otel::end(&cx, None);
        }
        if let Some(root) = self.root.as_ref().filter(|r| r.span().is_recording()) {
            otel::end(root, None);
        }
    }
}

impl Drop for SeqTrace {
    fn drop(&mut self) {
        if !self.finished && self.root.is_some() {
            if let Some(root) = self.root.as_ref().filter(|r| r.span().is_recording()) {
                root.span().set_attribute(KeyValue::new("tessera.cancelled", true));
            }
            self.close();
        }
    }
}

/// After `schedule()`: every traced sequence of `batch` starts its `schedule` span, and a
/// live sequence the batch tells the workers to forget was preempted (back to `queue`).
pub fn on_scheduled(clients: &mut HashMap<u64, ClientState>, batch: &ScheduledBatch) {
    if !otel::enabled() {
        return;
    }
    for id in &batch.finished {
        if let Some(c) = clients.get_mut(id) {
            c.trace.requeued(None);
        }
    }
    for r in &batch.runs {
        if let Some(c) = clients.get_mut(&r.seq_id) {
            let kind = if r.is_prompt { "prefill" } else { "decode" };
            c.trace.scheduled(batch.step_id, kind, r.num_tokens(), batch);
        }
    }
}

/// Step `step_id` answered: the `schedule` spans of its sequences end.
pub fn on_step_done(clients: &mut HashMap<u64, ClientState>, step_id: u64) {
    if !otel::enabled() {
        return;
    }
    for c in clients.values_mut() {
        c.trace.step_done(step_id);
    }
}

/// The OpenAI-style name of a finish reason (`gen_ai.response.finish_reasons`).
pub fn reason_name(reason: tessera_proto::coordinator::FinishReason) -> &'static str {
    use tessera_proto::coordinator::FinishReason as R;
    match reason {
        R::Stop => "stop",
        R::Length => "length",
        R::Abort => "abort",
        _ => "error",
    }
}
