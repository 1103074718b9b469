//! Process logs: `tracing` events written to stderr as text (for people) or as JSON lines
//! (for log pipelines), filtered by a `RUST_LOG`-style directive (`info`,
//! `tessera_coordinator=debug,info`, ...). stdout stays free for the "listening on" lines that
//! `tessera serve` reads from its children.
//!
//! A JSON line is one object: `timestamp` (RFC 3339, UTC), `level`, `target`, `message`,
//! the event's own fields, `span` (the innermost `tracing` span, if any) and, inside a traced
//! request, `trace_id` and `span_id` of the current OpenTelemetry span (hex, as in
//! `traceparent`), so a log line can be joined with its trace.

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use opentelemetry::trace::TraceContextExt;
use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// How log lines look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `tracing`'s human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, with the trace id.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format {other:?} (expected text or json)")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("invalid log filter {filter:?}: {reason}")]
    Filter { filter: String, reason: String },
    #[error("a logger is already installed")]
    AlreadySet,
}

/// Parses a `RUST_LOG`-style directive list; an empty one means `info`.
pub fn filter(directives: &str) -> Result<EnvFilter, LogError> {
    let directives = if directives.trim().is_empty() { "info" } else { directives.trim() };
    EnvFilter::try_new(directives)
        .map_err(|e| LogError::Filter { filter: directives.to_owned(), reason: e.to_string() })
}

/// Installs the process's logger: `format` lines on stderr, filtered by `directives`.
pub fn init(format: LogFormat, directives: &str) -> Result<(), LogError> {
    let filter = filter(directives)?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.with_ansi(false).event_format(JsonLines).try_init(),
    };
    result.map_err(|_| LogError::AlreadySet)
}

/// The JSON line format described in the module comment.
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut line = Map::new();
        let mut timestamp = String::new();
        tracing_subscriber::fmt::time::SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), Value::String(timestamp));
        let meta = event.metadata();
        line.insert("level".into(), Value::String(meta.level().to_string()));
        line.insert("target".into(), Value::String(meta.target().to_owned()));
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        // The standard keys win over event fields of the same name.
        for (k, v) in fields.0 {
            line.entry(k).or_insert(v);
        }
        if let Some(span) = ctx.lookup_current() {
            line.insert("span".into(), Value::String(span.name().to_owned()));
        }
        let cx = opentelemetry::Context::current();
        let span = cx.span();
        let sc = span.span_context();
        if sc.is_valid() {
            line.insert("trace_id".into(), Value::String(sc.trace_id().to_string()));
            line.insert("span_id".into(), Value::String(sc.span_id().to_string()));
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Collects an event's fields as JSON values (`message` included).
struct Fields(Map<String, Value>);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), Value::String(format!("{value:?}")));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), Value::String(value.to_owned()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), Value::from(value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn json_lines(f: impl FnOnce()) -> Vec<Value> {
        let buf = Buffer::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter("info").unwrap())
            .with_writer(move || out.clone())
            .event_format(JsonLines)
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines().map(|l| serde_json::from_str(l).expect("each line is JSON")).collect()
    }

    #[test]
    fn json_lines_carry_fields_and_the_trace_id_inside_a_trace() {
        let sc = SpanContext::new(
            TraceId::from(0xabcdef),
            SpanId::from(0x42),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let cx = opentelemetry::Context::new().with_remote_span_context(sc);
        let lines = json_lines(|| {
            tracing::info!(tokens = 7u64, ok = true, model = "m", "request finished");
            let _guard = cx.attach();
            tracing::warn!("inside");
            tracing::debug!("filtered out");
        });
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["message"], "request finished");
        assert_eq!(lines[0]["level"], "INFO");
        assert_eq!(lines[0]["tokens"], 7);
        assert_eq!(lines[0]["ok"], true);
        assert_eq!(lines[0]["model"], "m");
        assert!(lines[0].get("trace_id").is_none());
        assert!(lines[0]["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert_eq!(lines[1]["level"], "WARN");
        assert_eq!(lines[1]["trace_id"], format!("{:032x}", 0xabcdef));
        assert_eq!(lines[1]["span_id"], format!("{:016x}", 0x42));
    }

    #[test]
    fn formats_and_filters_parse() {
        assert_eq!("JSON".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!("text".parse::<LogFormat>(), Ok(LogFormat::Text));
        assert!("xml".parse::<LogFormat>().is_err());
        assert!(filter("tessera_gateway=debug,info").is_ok());
        assert!(filter("").is_ok());
        assert!(filter("tessera=notalevel").is_err());
    }
}
