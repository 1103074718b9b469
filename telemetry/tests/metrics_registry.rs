//! The metrics library: Prometheus text rendering, bucket placement, label-set limits,
//! concurrent recording, and the admin endpoint's routes.

use std::sync::Arc;

use tessera_telemetry::metrics::OVERFLOW_LABEL_VALUE;
use tessera_telemetry::prometheus::format_float;
use tessera_telemetry::{Histogram, Readiness, Registry};

fn lines(text: &str) -> Vec<&str> {
    text.lines().collect()
}

#[test]
fn counters_render_with_total_suffix_help_and_type() {
    let r = Registry::new();
    let c = r.counter("tessera:prompt_tokens", "Prompt tokens processed.");
    c.add(5);
    c.inc();
    let g = r.gauge("tessera:num_requests_running", "Running.\nTwo lines \\ here.");
    g.set(3.0);
    assert_eq!(
        lines(&r.render()),
        [
            "# HELP tessera:prompt_tokens_total Prompt tokens processed.",
            "# TYPE tessera:prompt_tokens_total counter",
            "tessera:prompt_tokens_total 6",
            "# HELP tessera:num_requests_running Running.\\nTwo lines \\\\ here.",
            "# TYPE tessera:num_requests_running gauge",
            "tessera:num_requests_running 3.0",
        ]
    );
}

#[test]
fn histograms_render_cumulative_buckets_sum_and_count() {
    let r = Registry::new();
    let h = r.histogram("tessera:x_seconds", "X.", &[0.1, 1.0, 5.0]);
    for v in [0.05, 0.1, 0.5, 1.0, 7.0] {
        h.observe(v);
    }
    h.observe(f64::NAN);
    assert_eq!(
        lines(&r.render()),
        [
            "# HELP tessera:x_seconds X.",
            "# TYPE tessera:x_seconds histogram",
            "tessera:x_seconds_bucket{le=\"0.1\"} 2",
            "tessera:x_seconds_bucket{le=\"1.0\"} 4",
            "tessera:x_seconds_bucket{le=\"5.0\"} 4",
            "tessera:x_seconds_bucket{le=\"+Inf\"} 5",
            "tessera:x_seconds_sum 8.65",
            "tessera:x_seconds_count 5",
        ]
    );
}

/// An observation equal to a bound belongs to that bucket (`le` is inclusive); one above
/// every bound only to `+Inf`; one below every bound to all.
#[test]
fn bucket_placement_is_inclusive_of_the_upper_bound() {
    let h = Histogram::new(&[1.0, 2.0, 4.0]);
    let cumulative = |h: &Histogram| h.snapshot().buckets.iter().map(|&(_, n)| n).collect::<Vec<_>>();
    h.observe(2.0);
    assert_eq!(cumulative(&h), [0, 1, 1, 1]);
    h.observe(2.0000001);
    assert_eq!(cumulative(&h), [0, 1, 2, 2]);
    h.observe(1e9);
    assert_eq!(cumulative(&h), [0, 1, 2, 3]);
    h.observe(-3.0);
    assert_eq!(cumulative(&h), [1, 2, 3, 4]);
    assert_eq!(h.count(), 4);
}

#[test]
fn labelled_families_escape_values_and_keep_creation_order() {
    let r = Registry::new();
    let f = r.counter_family("tessera:request_success", "Finished requests.", &["finished_reason"]);
    f.get(&["stop"]).add(2);
    f.get(&["length"]).inc();
    f.get(&["stop"]).inc();
    f.get(&["we\"ird\\"]).inc();
    let h = r.histogram_family("tessera:step_seconds", "Steps.", &["phase"], &[1.0]);
    h.get(&["decode"]).observe(0.5);
    let text = r.render();
    assert_eq!(
        lines(&text),
        [
            "# HELP tessera:request_success_total Finished requests.",
            "# TYPE tessera:request_success_total counter",
            "tessera:request_success_total{finished_reason=\"stop\"} 3",
            "tessera:request_success_total{finished_reason=\"length\"} 1",
            "tessera:request_success_total{finished_reason=\"we\\\"ird\\\\\"} 1",
            "# HELP tessera:step_seconds Steps.",
            "# TYPE tessera:step_seconds histogram",
            "tessera:step_seconds_bucket{phase=\"decode\",le=\"1.0\"} 1",
            "tessera:step_seconds_bucket{phase=\"decode\",le=\"+Inf\"} 1",
            "tessera:step_seconds_sum{phase=\"decode\"} 0.5",
            "tessera:step_seconds_count{phase=\"decode\"} 1",
        ]
    );
}

/// Cardinality is bounded: past the limit, new label sets share the overflow child.
#[test]
fn families_cap_their_label_sets() {
    let r = Registry::new();
    let f = r.counter_family("tessera:capped", "Capped.", &["replica"]);
    for i in 0..1000 {
        f.get(&[&i.to_string()]).inc();
    }
    f.get(&["a", "b"]).inc(); // wrong arity: overflow too
    let children = f.children();
    assert_eq!(children.len(), tessera_telemetry::metrics::DEFAULT_MAX_LABEL_SETS + 1);
    let (values, overflow) = children.last().unwrap();
    assert_eq!(values, &[OVERFLOW_LABEL_VALUE.to_string()]);
    assert_eq!(overflow.get(), 1000 - tessera_telemetry::metrics::DEFAULT_MAX_LABEL_SETS as u64 + 1);
    assert_eq!(f.get(&["0"]).get(), 1);
}

#[test]
fn registration_refuses_bad_and_duplicate_names() {
    let r = Registry::new();
    r.counter("tessera:a", "A.");
    let panics = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err();
    assert!(panics(&|| drop(r.counter("tessera:a_total", "dup"))));
    assert!(panics(&|| drop(r.counter("9bad", "bad"))));
    assert!(panics(&|| drop(r.counter_family("tessera:b", "b", &["le"]))));
    assert!(panics(&|| drop(r.counter_family("tessera:c", "c", &["a-b"]))));
    assert!(!panics(&|| drop(r.counter_family("tessera:d", "d", &["ok_name"]))));
    assert!(std::panic::catch_unwind(|| Histogram::new(&[1.0, 1.0])).is_err());
}

/// Counts from many threads add up exactly, and a render taken meanwhile is self-consistent
/// (the `+Inf` bucket equals `_count`).
#[test]
fn concurrent_recording_loses_nothing() {
    let r = Arc::new(Registry::new());
    let c = r.counter("tessera:n", "N.");
    let h = r.histogram("tessera:h", "H.", &[0.5]);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (c, h) = (c.clone(), h.clone());
            std::thread::spawn(move || {
                for i in 0..10_000 {
                    c.inc();
                    h.observe(if (i + t) % 2 == 0 { 0.25 } else { 1.0 });
                }
            })
        })
        .collect();
    let reader = {
        let r = r.clone();
        std::thread::spawn(move || {
            for _ in 0..50 {
                let text = r.render();
                let get = |prefix: &str| {
                    text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).unwrap().to_owned()
                };
                assert_eq!(get("tessera:h_bucket{le=\"+Inf\"}"), get("tessera:h_count"));
            }
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    reader.join().unwrap();
    assert_eq!(c.get(), 80_000);
    let s = h.snapshot();
    assert_eq!(s.count, 80_000);
    assert_eq!(s.buckets[0].1, 40_000);
    assert_eq!(s.sum, 40_000.0 * 0.25 + 40_000.0);
}

#[test]
fn floats_render_as_the_python_client_does() {
    assert_eq!(format_float(1.0), "1.0");
    assert_eq!(format_float(0.005), "0.005");
    assert_eq!(format_float(2560.0), "2560.0");
    assert_eq!(format_float(f64::INFINITY), "+Inf");
    assert_eq!(format_float(f64::NEG_INFINITY), "-Inf");
    assert_eq!(format_float(f64::NAN), "NaN");
}

#[test]
fn counters_raised_to_a_total_never_go_down() {
    let r = Registry::new();
    let c = r.counter("tessera:preemptions", "P.");
    c.raise_to(5);
    c.raise_to(3);
    assert_eq!(c.get(), 5);
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.unwrap();
    let status = buf.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, buf)
}

#[tokio::test]
async fn admin_endpoint_serves_health_readiness_and_metrics() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let registry = Arc::new(Registry::new());
    registry.counter("tessera:admin_test", "T.").add(7);
    let ready = Readiness::new(false);
    let render = {
        let registry = registry.clone();
        Arc::new(move || registry.render())
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(tessera_telemetry::serve_admin(listener, ready.clone(), render, async {
        let _ = stop_rx.await;
    }));

    assert_eq!(get(addr, "/health").await.0, 200);
    let (status, raw) = get(addr, "/ready").await;
    assert_eq!(status, 503);
    assert!(raw.to_ascii_lowercase().contains("retry-after: 1"), "{raw}");
    ready.set(true);
    assert_eq!(get(addr, "/ready").await.0, 200);
    let (status, raw) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(raw.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{raw}");
    assert!(raw.contains("\ntessera:admin_test_total 7\n"), "{raw}");
    assert_eq!(get(addr, "/nope").await.0, 404);

    stop_tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}
