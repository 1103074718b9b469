//! The Prometheus text exposition format (version 0.0.4) for a [`Registry`](crate::Registry):
//! `# HELP` and `# TYPE` per metric, counters with `_total` appended (as vLLM's Python client
//! exposes them), histograms as cumulative `_bucket{le="..."}` lines then `_sum` and `_count`.
//! Floats are written as the Python client writes them (`1.0`, `0.005`, `+Inf`), so `le`
//! values match what vLLM dashboards query.

use std::fmt::Write;

use crate::metrics::{kind_of, Collector, Entry, Histogram, Kind};

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
pub fn valid_metric_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`, not starting with the reserved `__`.
pub fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    !name.starts_with("__")
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The name a metric's samples carry: a counter gets `_total` unless it already ends so.
pub fn exposed_name(name: &str, kind: Kind) -> String {
    if kind == Kind::Counter && !name.ends_with("_total") {
        format!("{name}_total")
    } else {
        name.to_owned()
    }
}

/// A sample value or `le` bound: integral values keep a `.0`, infinities are `+Inf`/`-Inf`.
pub fn format_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn escape_help(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label_value(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// `{a="x",b="y"}` (empty when there are no labels), with `extra` appended last (`le`).
fn label_block(names: &[&str], values: &[String], extra: Option<(&str, &str)>) -> String {
    let mut pairs: Vec<String> =
        names.iter().zip(values).map(|(n, v)| format!("{n}=\"{}\"", escape_label_value(v))).collect();
    if let Some((n, v)) = extra {
        pairs.push(format!("{n}=\"{}\"", escape_label_value(v)));
    }
    if pairs.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", pairs.join(","))
    }
}

fn render_histogram(out: &mut String, name: &str, names: &[&str], values: &[String], h: &Histogram) {
    let s = h.snapshot();
    for (le, n) in &s.buckets {
        let labels = label_block(names, values, Some(("le", &format_float(*le))));
        let _ = writeln!(out, "{name}_bucket{labels} {n}");
    }
    let labels = label_block(names, values, None);
    let _ = writeln!(out, "{name}_sum{labels} {}", format_float(s.sum));
    let _ = writeln!(out, "{name}_count{labels} {}", s.count);
}

pub(crate) fn render_entry(out: &mut String, e: &Entry) {
    let kind = kind_of(&e.collector);
    let name = exposed_name(e.name, kind);
    let type_name = match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
        Kind::Histogram => "histogram",
    };
    let _ = writeln!(out, "# HELP {name} {}", escape_help(e.help));
    let _ = writeln!(out, "# TYPE {name} {type_name}");
    match &e.collector {
        Collector::Counter(c) => {
            let _ = writeln!(out, "{name} {}", c.get());
        }
        Collector::Gauge(g) => {
            let _ = writeln!(out, "{name} {}", format_float(g.get()));
        }
        Collector::Histogram(h) => render_histogram(out, &name, &[], &[], h),
        Collector::CounterFamily(f) => {
            for (values, c) in f.children() {
                let _ = writeln!(out, "{name}{} {}", label_block(f.label_names(), &values, None), c.get());
            }
        }
        Collector::GaugeFamily(f) => {
            for (values, g) in f.children() {
                let _ =
                    writeln!(out, "{name}{} {}", label_block(f.label_names(), &values, None), format_float(g.get()));
            }
        }
        Collector::HistogramFamily(f) => {
            for (values, h) in f.children() {
                render_histogram(out, &name, f.label_names(), &values, &h);
            }
        }
    }
}
