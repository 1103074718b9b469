//! One trace per generation request, and its log line. The root span (`chat <model>` for
//! `/v1/chat/completions` and Anthropic's `/v1/messages`, told apart by `http.route`, or
//! `text_completion <model>`, kind server) covers the whole request; its children are the
//! phases `validate`, `tokenize` and `stream` (admission to the last event). The `stream`
//! span is the current OpenTelemetry context while the engine admits the sequences, so the
//! coordinator client injects its `traceparent` into each Generate call and the
//! coordinator's and workers' spans hang below it.
//!
//! Attributes follow the OpenTelemetry GenAI semantic conventions: `gen_ai.operation.name`,
//! `gen_ai.request.model`, `gen_ai.request.max_tokens`, `gen_ai.request.temperature`,
//! `gen_ai.request.top_p`, `gen_ai.request.seed`, `gen_ai.response.id`,
//! `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`,
//! `gen_ai.response.finish_reasons`; failures set the span status and `error.type`. A
//! client's own `traceparent` header makes the root a child of the client's span.
//!
//! A streamed response outlives its handler, so the trace ends when the last holder lets go:
//! the handler and every choice stream hold a clone (`observe`), and the final drop records
//! the usage, ends the spans and logs one `request finished` line at info level, with
//! `trace_id` in JSON logs. With tracing off no span is built; the log line remains.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::http::HeaderMap;
use futures::stream::{Stream, StreamExt};
use tessera_telemetry::trace::{self as otel, Context, KeyValue, SpanKind, StringValue, TraceContextExt, Value};

use crate::error::ApiError;
use crate::generate::{ChoiceEvent, ChoiceItem, PromptPlan};
use crate::validate::CommonParams;

/// What kind of generation a request is (`gen_ai.operation.name`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Chat,
    TextCompletion,
    /// Anthropic's `/v1/messages`: a chat (`gen_ai.operation.name` "chat").
    Messages,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Chat | Operation::Messages => "chat",
            Operation::TextCompletion => "text_completion",
        }
    }

    fn route(self) -> &'static str {
        match self {
            Operation::Chat => "/v1/chat/completions",
            Operation::TextCompletion => "/v1/completions",
            Operation::Messages => "/v1/messages",
        }
    }
}

/// The trace of one request; cheap to clone, finished when the last clone drops.
#[derive(Clone)]
pub struct RequestTrace {
    inner: Arc<Inner>,
}

struct Inner {
    operation: Operation,
    model: String,
    started: Instant,
    /// The root span; `None` when tracing is off.
    root: Option<Context>,
    tally: Mutex<Tally>,
}

#[derive(Default)]
struct Tally {
    /// The `stream` span, from admission to the last event.
    stream: Option<Context>,
    response_id: Option<String>,
    input_tokens: u32,
    output_tokens: u32,
    finish_reasons: Vec<&'static str>,
    /// HTTP status of a refused request, or 200.
    status: u16,
    /// `error.type` and the message, when the request failed.
    error: Option<(&'static str, String)>,
}

/// A phase of the request (`validate`, `tokenize`): its span ends when this drops.
pub struct Phase(#[allow(dead_code)] Option<Context>);

impl RequestTrace {
    /// Starts the trace of a request for `model`; a W3C `traceparent` among the request's
    /// `headers` makes it part of the caller's trace.
    pub fn start(operation: Operation, model: &str, headers: &HeaderMap) -> Self {
        let attributes = vec![
            KeyValue::new("gen_ai.operation.name", operation.as_str()),
            KeyValue::new("gen_ai.request.model", model.to_owned()),
            KeyValue::new("http.request.method", "POST"),
            KeyValue::new("http.route", operation.route()),
        ];
        let name = format!("{} {model}", operation.as_str());
        let parent = otel::enabled().then(|| otel::extract_http(headers)).flatten().unwrap_or_default();
        let root = otel::start(name, SpanKind::Server, &parent, attributes);
        let tally = Tally { status: 200, ..Tally::default() };
        RequestTrace {
            inner: Arc::new(Inner {
                operation,
                model: model.to_owned(),
                started: Instant::now(),
                root,
                tally: Mutex::new(tally),
            }),
        }
    }

    /// The context to run the handler in (the root span; empty when tracing is off).
    pub fn context(&self) -> Context {
        self.inner.root.clone().unwrap_or_default()
    }

    /// Starts a phase span under the root.
    pub fn phase(&self, name: &'static str) -> Phase {
        Phase(self.inner.root.as_ref().and_then(|root| otel::start(name, SpanKind::Internal, root, Vec::new())))
    }

    /// Records the validated request parameters.
    pub fn request(&self, params: &CommonParams) {
        let Some(root) = &self.inner.root else { return };
        let span = root.span();
        let spec = &params.spec;
        if let Some(m) = params.max_tokens {
            span.set_attribute(KeyValue::new("gen_ai.request.max_tokens", i64::from(m)));
        }
        span.set_attribute(KeyValue::new("gen_ai.request.temperature", f64::from(spec.temperature)));
        span.set_attribute(KeyValue::new("gen_ai.request.top_p", f64::from(spec.top_p)));
        if let Some(seed) = spec.seed {
            span.set_attribute(KeyValue::new("gen_ai.request.seed", seed as i64));
        }
        if params.n != 1 {
            span.set_attribute(KeyValue::new("gen_ai.request.choice.count", i64::from(params.n)));
        }
        span.set_attribute(KeyValue::new("tessera.stream", params.stream));
    }

    /// Starts the `stream` span for the response `response_id` of `prompts` and returns its
    /// context: admit the sequences inside it (`FutureExt::with_context`) so the coordinator
    /// calls carry it.
    pub fn begin_stream(&self, response_id: &str, prompts: &[PromptPlan]) -> Context {
        let input: usize = prompts.iter().map(|p| p.ids.len()).sum();
        let mut t = self.tally();
        t.input_tokens = input.min(u32::MAX as usize) as u32;
        t.response_id = Some(response_id.to_owned());
        let Some(root) = &self.inner.root else { return Context::new() };
        let attributes = vec![KeyValue::new("gen_ai.usage.input_tokens", i64::from(t.input_tokens))];
        t.stream = otel::start("stream", SpanKind::Internal, root, attributes);
        t.stream.clone().unwrap_or_default()
    }

    /// Wraps the choice streams so the trace sees their outcomes and lives as long as they do.
    pub fn observe<S>(&self, streams: Vec<S>) -> Vec<impl Stream<Item = ChoiceItem> + Send + 'static>
    where
        S: Stream<Item = ChoiceItem> + Send + 'static,
    {
        streams
            .into_iter()
            .map(|s| {
                let trace = self.clone();
                s.inspect(move |item| trace.on_item(item))
            })
            .collect()
    }

    fn on_item(&self, item: &ChoiceItem) {
        match &item.event {
            ChoiceEvent::Delta { .. } => {}
            ChoiceEvent::Finished { reason, completion_tokens, .. } => {
                let mut t = self.tally();
                t.output_tokens = t.output_tokens.saturating_add(*completion_tokens);
                t.finish_reasons.push(reason.as_str());
            }
            ChoiceEvent::Failed(e) => {
                let e = ApiError::from(e.clone());
                self.record_error(&e);
            }
        }
    }

    /// Records how the handler ended: an error response is the request's outcome.
    pub fn handler_result<T>(&self, result: &Result<T, ApiError>) {
        if let Err(e) = result {
            self.record_error(e);
        }
    }

    fn record_error(&self, e: &ApiError) {
        self.failed(e.status().as_u16(), e.error_type(), e.to_string());
    }

    /// Records a failure answered with `status` (for error shapes other than OpenAI's, such
    /// as Anthropic's); the first failure recorded is the request's outcome.
    pub fn failed(&self, status: u16, error_type: &'static str, message: String) {
        let mut t = self.tally();
        if t.error.is_none() {
            t.status = status;
            t.error = Some((error_type, message));
        }
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.inner.tally.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let t = std::mem::take(self.tally.get_mut().unwrap_or_else(|e| e.into_inner()));
        if let Some(root) = &self.root {
            let span = root.span();
            span.set_attribute(KeyValue::new("gen_ai.usage.input_tokens", i64::from(t.input_tokens)));
            span.set_attribute(KeyValue::new("gen_ai.usage.output_tokens", i64::from(t.output_tokens)));
            let reasons: Vec<StringValue> = t.finish_reasons.iter().map(|r| StringValue::from(*r)).collect();
            span.set_attribute(KeyValue::new("gen_ai.response.finish_reasons", Value::Array(reasons.into())));
            if let Some(id) = &t.response_id {
                span.set_attribute(KeyValue::new("gen_ai.response.id", id.clone()));
                span.set_attribute(KeyValue::new("gen_ai.response.model", self.model.clone()));
            }
            span.set_attribute(KeyValue::new("http.response.status_code", i64::from(t.status)));
            if let Some((kind, message)) = &t.error {
                span.set_attribute(KeyValue::new("error.type", *kind));
                otel::set_error(root, message);
                if let Some(stream) = &t.stream {
                    otel::set_error(stream, message);
                }
            }
            if let Some(stream) = &t.stream {
                stream.span().set_attribute(KeyValue::new("gen_ai.usage.output_tokens", i64::from(t.output_tokens)));
                otel::end(stream, None);
            }
        }
        {
            // The log line carries the root span's trace id.
            let _guard = self.root.clone().map(Context::attach);
            let reasons = t.finish_reasons.join(",");
            let elapsed_ms = self.started.elapsed().as_secs_f64() * 1e3;
            // Fields of a failure only when it failed (`None` records nothing).
            let error_type = t.error.as_ref().map(|(kind, _)| *kind);
            let error = t.error.as_ref().map(|(_, message)| message.as_str());
            tracing::info!(
                operation = self.operation.as_str(),
                route = self.operation.route(),
                model = %self.model,
                status = t.status,
                input_tokens = t.input_tokens,
                output_tokens = t.output_tokens,
                finish_reasons = %reasons,
                duration_ms = elapsed_ms,
                error_type,
                error,
                "request finished"
            );
        }
        if let Some(root) = &self.root {
            otel::end(root, None);
        }
    }
}
