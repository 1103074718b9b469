//! Spans kept in memory, for tests: [`capture`] turns tracing on in this process with an
//! exporter that hands every ended span over at once (no batching, no network), so a test
//! can assert on the spans its code made. Once on, tracing stays on for the process; tests
//! that share it tell their spans apart by trace id.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::SystemTime;

use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::Value;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};

/// An ended span as a test sees it.
#[derive(Debug, Clone)]
pub struct CapturedSpan {
    pub name: String,
    pub kind: SpanKind,
    /// Hex, as in `traceparent`.
    pub trace_id: String,
    pub span_id: String,
    /// All zeros for a root.
    pub parent_span_id: String,
    pub attributes: HashMap<String, Value>,
    /// The status message of a failed span.
    pub error: Option<String>,
    pub start: SystemTime,
    pub end: SystemTime,
}

impl CapturedSpan {
    /// An integer attribute.
    pub fn int(&self, key: &str) -> Option<i64> {
        match self.attributes.get(key) {
            Some(Value::I64(v)) => Some(*v),
            _ => None,
        }
    }

    /// A string attribute.
    pub fn str(&self, key: &str) -> Option<String> {
        match self.attributes.get(key) {
            Some(Value::String(v)) => Some(v.to_string()),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Memory(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Memory {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend(batch);
        std::future::ready(Ok(()))
    }
}

/// The spans ended in this process since tracing was turned on by [`capture`].
#[derive(Clone)]
pub struct Capture(Memory);

static CAPTURE: OnceLock<Capture> = OnceLock::new();

/// Turns tracing on for this process (the first call) with an in-memory exporter.
pub fn capture() -> Capture {
    CAPTURE
        .get_or_init(|| {
            let memory = Memory::default();
            let provider = SdkTracerProvider::builder().with_simple_exporter(memory.clone()).build();
            crate::trace::install(provider);
            Capture(memory)
        })
        .clone()
}

impl Capture {
    /// Every span ended so far.
    pub fn spans(&self) -> Vec<CapturedSpan> {
        let data = self.0 .0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        data.into_iter().map(convert).collect()
    }

    /// The spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<CapturedSpan> {
        self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect()
    }
}

fn convert(s: SpanData) -> CapturedSpan {
    CapturedSpan {
        name: s.name.to_string(),
        kind: s.span_kind,
        trace_id: s.span_context.trace_id().to_string(),
        span_id: s.span_context.span_id().to_string(),
        parent_span_id: s.parent_span_id.to_string(),
        attributes: s.attributes.into_iter().map(|kv| (kv.key.to_string(), kv.value)).collect(),
        error: match s.status {
            Status::Error { description } => Some(description.to_string()),
            _ => None,
        },
        start: s.start_time,
        end: s.end_time,
    }
}
