//! OpenTelemetry traces: the OTLP exporter's setup and shutdown, span helpers, and W3C
//! trace-context propagation (`traceparent`) through gRPC metadata and plain strings.
//!
//! Off by default. `init` with an endpoint installs a global tracer provider whose batch
//! processor exports over OTLP/HTTP (protobuf, what collectors accept on port 4318) from its
//! own thread; without one nothing is installed, [`enabled`] is false, the helpers here build
//! no span and inject no header, so a request costs one atomic load per hook.
//!
//! Endpoint semantics follow the OTLP exporter specification: the configured value is the
//! collector's base URL (`http://collector:4318`; plain HTTP only, the binary has no TLS
//! stack) and traces go to `<base>/v1/traces`;
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (a full URL) is honoured when no base is given, and
//! `OTEL_SDK_DISABLED=true` turns tracing off. Batching follows the standard `OTEL_BSP_*`
//! variables (`OTEL_BSP_SCHEDULE_DELAY` in ms, 5000 by default).
//!
//! Propagation: the caller injects the W3C `traceparent` (and `tracestate`) of its current
//! span into a gRPC request's metadata; the callee extracts it and parents its spans on it.
//! Where one call carries many requests (the coordinator's step stream to a worker), the
//! `traceparent` travels per sequence as a string ([`traceparent`] / [`from_traceparent`]).
//! A missing or malformed header is ignored: the span starts a new trace, nothing fails.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::Tracer as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;

pub use opentelemetry::trace::{FutureExt, SpanKind, Status, TraceContextExt};
pub use opentelemetry::{Array, Context, KeyValue, StringValue, Value};

/// Whether a tracer provider with an exporter is installed (set once by [`init`]).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Name of the instrumentation scope of every Tessera span.
const SCOPE: &str = "tessera";

/// Path of the traces signal under an OTLP/HTTP base URL.
const TRACES_PATH: &str = "/v1/traces";

/// How long shutdown waits for the last spans to reach the collector.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(3);

/// Why tracing could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("invalid OTLP endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(String),
}

/// Whether spans are being recorded and exported in this process.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Keeps the tracer provider alive; dropping it (or [`TraceGuard::shutdown`]) flushes the
/// spans still queued and stops the exporter thread.
#[must_use = "dropping the guard shuts tracing down"]
pub struct TraceGuard {
    provider: Option<SdkTracerProvider>,
}

impl TraceGuard {
    /// Exports what is queued (waiting up to a few seconds for the collector) and stops.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let Some(p) = self.provider.take() {
            ENABLED.store(false, Ordering::Relaxed);
            // A collector that is down must not hold the process's exit for long; what
            // could not be sent is lost, as with any exporter.
            let _ = p.shutdown_with_timeout(SHUTDOWN_TIMEOUT);
        }
    }
}

impl Drop for TraceGuard {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The OTLP/HTTP traces URL for a configured endpoint: `base` is the collector's base URL
/// (spec: `OTEL_EXPORTER_OTLP_ENDPOINT`), to which `/v1/traces` is appended unless it is
/// already there. `None` for an empty value.
pub fn traces_url(base: &str) -> Result<Option<String>, TraceError> {
    let base = base.trim();
    if base.is_empty() {
        return Ok(None);
    }
    let bad = |reason: &str| TraceError::Endpoint { endpoint: base.to_owned(), reason: reason.to_owned() };
    if base.starts_with("https://") {
        // The exporter's HTTP client is built without TLS (no TLS stack in the binary).
        return Err(bad("https is not supported: send to a collector over http:// (e.g. one on the same host)"));
    }
    let rest = base.strip_prefix("http://").ok_or_else(|| bad("it must start with http://"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(bad("it has no host"));
    }
    let trimmed = base.trim_end_matches('/');
    if trimmed.ends_with(TRACES_PATH) {
        return Ok(Some(trimmed.to_owned()));
    }
    Ok(Some(format!("{trimmed}{TRACES_PATH}")))
}

/// Sets tracing up for one process. `endpoint` is the collector's base URL (the
/// `--otlp-endpoint` flag or `OTEL_EXPORTER_OTLP_ENDPOINT`); with none (and no
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) tracing stays off. `service` names the process in
/// the traces (`tessera-gateway`, `tessera-coordinator`, `tessera-worker`).
pub fn init(service: &'static str, endpoint: Option<&str>) -> Result<TraceGuard, TraceError> {
    let off = TraceGuard { provider: None };
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
        return Ok(off);
    }
    let url = match endpoint.map(traces_url).transpose()?.flatten() {
        Some(url) => url,
        None => match std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            // A full URL: checked like a base, used as it is.
            Ok(url) if !url.trim().is_empty() => traces_url(&url).map(|_| url.trim().to_owned())?,
            _ => return Ok(off),
        },
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .build()
        .map_err(|e| match e {
            opentelemetry_otlp::ExporterBuildError::InvalidConfiguration(reason) => {
                TraceError::Endpoint { endpoint: url.clone(), reason }
            }
            e => TraceError::Exporter(e.to_string()),
        })?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(service)
                // Tells apart processes of one service (a replica's worker ranks).
                .with_attribute(KeyValue::new("process.pid", i64::from(std::process::id())))
                .build(),
        )
        .build();
    install(provider.clone());
    Ok(TraceGuard { provider: Some(provider) })
}

/// Makes `provider` this process's tracer provider and turns the span helpers on.
pub(crate) fn install(provider: SdkTracerProvider) {
    opentelemetry::global::set_tracer_provider(provider);
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    ENABLED.store(true, Ordering::Relaxed);
}

/// Starts a span named `name` as a child of the span in `parent` (the root of a new trace
/// when `parent` holds none) and returns the context that holds it; `None` when tracing is
/// off. The span ends with [`end`], or when the last clone of the context is dropped.
pub fn start(
    name: impl Into<Cow<'static, str>>,
    kind: SpanKind,
    parent: &Context,
    attributes: Vec<KeyValue>,
) -> Option<Context> {
    start_at(name, kind, parent, attributes, None)
}

/// Like [`start`], with an explicit start time (for work timed before its span is built,
/// such as a batched step that serves many traced sequences at once).
pub fn start_at(
    name: impl Into<Cow<'static, str>>,
    kind: SpanKind,
    parent: &Context,
    attributes: Vec<KeyValue>,
    start_time: Option<SystemTime>,
) -> Option<Context> {
    if !enabled() {
        return None;
    }
    let tracer = opentelemetry::global::tracer(SCOPE);
    let mut builder = tracer.span_builder(name).with_kind(kind).with_attributes(attributes);
    if let Some(t) = start_time {
        builder = builder.with_start_time(t);
    }
    let span = builder.start_with_context(&tracer, parent);
    Some(parent.with_span(span))
}

/// Ends the span held by `cx` now, or at `end_time`.
pub fn end(cx: &Context, end_time: Option<SystemTime>) {
    match end_time {
        Some(t) => cx.span().end_with_timestamp(t),
        None => cx.span().end(),
    }
}

/// Starts and ends a span over `[start_time, end_time]` in one go (work already done).
pub fn record(
    name: impl Into<Cow<'static, str>>,
    parent: &Context,
    attributes: Vec<KeyValue>,
    start_time: SystemTime,
    end_time: SystemTime,
    error: Option<&str>,
) {
    if let Some(cx) = start_at(name, SpanKind::Internal, parent, attributes, Some(start_time)) {
        if let Some(e) = error {
            set_error(&cx, e);
        }
        end(&cx, Some(end_time));
    }
}

/// Marks the span in `cx` as failed with `message`.
pub fn set_error(cx: &Context, message: &str) {
    cx.span().set_status(Status::error(message.to_owned()));
}

/// The `(trace_id, span_id)` of the span in `cx`, hex encoded, when it is a valid one.
pub fn ids(cx: &Context) -> Option<(String, String)> {
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| (sc.trace_id().to_string(), sc.span_id().to_string()))
}

/// Writes the trace context of `cx` into gRPC metadata (`traceparent`, and `tracestate`
/// when there is one). Does nothing when `cx` holds no valid span (tracing off, untraced).
pub fn inject(cx: &Context, metadata: &mut tonic::metadata::MetadataMap) {
    if !cx.span().span_context().is_valid() {
        return;
    }
    TraceContextPropagator::new().inject_context(cx, &mut MetadataInjector(metadata));
}

/// The remote parent carried in gRPC metadata, when it holds a well-formed `traceparent`.
pub fn extract(metadata: &tonic::metadata::MetadataMap) -> Option<Context> {
    let cx = TraceContextPropagator::new().extract_with_context(&Context::new(), &MetadataExtractor(metadata));
    cx.span().span_context().is_valid().then_some(cx)
}

/// The remote parent carried in HTTP headers (an incoming request's `traceparent`).
pub fn extract_http(headers: &http::HeaderMap) -> Option<Context> {
    let cx = TraceContextPropagator::new().extract_with_context(&Context::new(), &HeaderExtractor(headers));
    cx.span().span_context().is_valid().then_some(cx)
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// The W3C `traceparent` of the span in `cx` (`00-<trace id>-<span id>-<flags>`); `None`
/// when `cx` holds no valid span.
pub fn traceparent(cx: &Context) -> Option<String> {
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = OneHeader(None);
    TraceContextPropagator::new().inject_context(cx, &mut carrier);
    carrier.0
}

/// The remote parent a `traceparent` string names; `None` when it is empty or malformed.
pub fn from_traceparent(value: &str) -> Option<Context> {
    if value.is_empty() {
        return None;
    }
    let carrier = OneHeader(Some(value.to_owned()));
    let cx = TraceContextPropagator::new().extract_with_context(&Context::new(), &carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        let key = tonic::metadata::MetadataKey::from_bytes(key.as_bytes());
        if let (Ok(key), Ok(value)) = (key, value.parse()) {
            self.0.insert(key, value);
        }
    }
}

struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// A carrier holding only `traceparent` (the per-sequence field of the step stream).
struct OneHeader(Option<String>);

const TRACEPARENT: &str = "traceparent";

impl Injector for OneHeader {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            self.0 = Some(value);
        }
    }
}

impl Extractor for OneHeader {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0.as_deref()).flatten()
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    fn remote(trace: u128, span: u64) -> Context {
        let sc = SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        Context::new().with_remote_span_context(sc)
    }

    #[test]
    fn metadata_round_trip_keeps_trace_and_span_ids() {
        let cx = remote(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7);
        let mut md = tonic::metadata::MetadataMap::new();
        inject(&cx, &mut md);
        assert_eq!(
            md.get("traceparent").and_then(|v| v.to_str().ok()),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let back = extract(&md).expect("a valid parent");
        let sc = back.span().span_context().clone();
        assert_eq!(sc.trace_id(), TraceId::from(0x4bf92f3577b34da6a3ce929d0e0e4736));
        assert_eq!(sc.span_id(), SpanId::from(0x00f067aa0ba902b7));
        assert!(sc.is_sampled() && sc.is_remote());
    }

    #[test]
    fn string_round_trip() {
        let cx = remote(7, 9);
        let s = traceparent(&cx).expect("traceparent");
        assert_eq!(s, "00-00000000000000000000000000000007-0000000000000009-01");
        assert_eq!(ids(&from_traceparent(&s).expect("parsed")), Some((format!("{:032x}", 7), format!("{:016x}", 9))));
    }

    #[test]
    fn nothing_is_injected_without_a_span() {
        let mut md = tonic::metadata::MetadataMap::new();
        inject(&Context::new(), &mut md);
        assert!(md.is_empty());
        assert_eq!(traceparent(&Context::new()), None);
        assert!(extract(&md).is_none());
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        let bad = [
            "",
            "garbage",
            "00-xyz-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01", // zero trace id
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // zero span id
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", // forbidden version
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", // upper case
            "\u{1F600}-é-ü",
        ];
        for s in bad {
            assert!(from_traceparent(s).is_none(), "{s:?} was accepted");
            let mut md = tonic::metadata::MetadataMap::new();
            if let Ok(v) = s.parse() {
                md.insert("traceparent", v);
            }
            assert!(extract(&md).is_none(), "{s:?} was accepted from metadata");
        }
        // Binary and non-ASCII metadata next to it do not disturb extraction.
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert_bin("trace-bin", tonic::metadata::MetadataValue::from_bytes(&[0xff, 0x00]));
        md.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        assert!(extract(&md).is_some());
    }

    #[test]
    fn http_headers_carry_a_parent() {
        let mut headers = http::HeaderMap::new();
        headers.insert("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap());
        let ids = ids(&extract_http(&headers).expect("parent"));
        assert_eq!(ids, Some(("4bf92f3577b34da6a3ce929d0e0e4736".to_owned(), "00f067aa0ba902b7".to_owned())));
        headers.insert("traceparent", "00-nope".parse().unwrap());
        assert!(extract_http(&headers).is_none());
        assert!(extract_http(&http::HeaderMap::new()).is_none());
    }

    #[test]
    fn traces_url_appends_the_signal_path_once() {
        assert_eq!(traces_url("http://c:4318").unwrap().as_deref(), Some("http://c:4318/v1/traces"));
        assert_eq!(traces_url("http://c:4318/").unwrap().as_deref(), Some("http://c:4318/v1/traces"));
        assert_eq!(traces_url("http://c/v1/traces").unwrap().as_deref(), Some("http://c/v1/traces"));
        assert!(traces_url("https://c:4318").is_err());
        assert_eq!(traces_url(" ").unwrap(), None);
        assert!(traces_url("c:4318").is_err());
        assert!(traces_url("http://").is_err());
    }

    #[test]
    fn no_spans_are_built_while_tracing_is_off() {
        assert!(!enabled());
        assert!(start("x", SpanKind::Internal, &Context::new(), Vec::new()).is_none());
    }
}
