//! The metric types every role records into: [`Counter`], [`Gauge`], [`Histogram`] (fixed
//! buckets, like vLLM's) and [`Family`] (one child per label set, with a cap on the number of
//! label sets so cardinality stays bounded), collected in a [`Registry`] that renders them in
//! Prometheus text format (`prometheus.rs`).
//!
//! Hot path: recording is one or two relaxed atomic operations, no lock and no allocation.
//! A caller that records under a label set holds the child's `Arc` (from [`Family::get`])
//! rather than looking it up per observation.
//!
//! Registration takes names that are compile-time constants: an invalid or duplicate name is
//! a programming error and panics at registration, which every test that builds the role's
//! metrics catches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::prometheus::{self, valid_label_name, valid_metric_name};

/// A monotonically increasing count (tokens, requests, preemptions).
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// Raises the count to `total` when a source keeps its own running total (a scheduler's
    /// preemption count); never lowers it, so the counter stays monotonic.
    pub fn raise_to(&self, total: u64) {
        self.0.fetch_max(total, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (running sequences, KV usage); an `f64` stored as its bits.
#[derive(Debug, Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Ordering::Relaxed);
    }

    pub fn add(&self, delta: f64) {
        add_f64(&self.0, delta);
    }

    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

fn add_f64(cell: &AtomicU64, delta: f64) {
    let mut cur = cell.load(Ordering::Relaxed);
    loop {
        let next = (f64::from_bits(cur) + delta).to_bits();
        match cell.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(actual) => cur = actual,
        }
    }
}

/// Observations counted into fixed buckets (`le` upper bounds, ascending) plus their sum.
#[derive(Debug)]
pub struct Histogram {
    /// Finite upper bounds, strictly ascending; `+Inf` is implicit.
    bounds: Arc<[f64]>,
    /// Non-cumulative counts, `bounds.len() + 1` (the last is the `+Inf` overflow).
    counts: Box<[AtomicU64]>,
    sum: AtomicU64,
}

/// A consistent-enough copy of a histogram for rendering: cumulative bucket counts.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    /// `(le, observations <= le)`, ascending, ending with `(+Inf, count)`.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum: f64,
}

impl Histogram {
    /// Panics unless `bounds` are finite and strictly ascending (bucket lists are constants).
    pub fn new(bounds: &[f64]) -> Self {
        assert!(
            bounds.iter().all(|b| b.is_finite()) && bounds.windows(2).all(|w| w[0] < w[1]),
            "histogram bounds must be finite and strictly ascending: {bounds:?}"
        );
        Histogram {
            bounds: bounds.into(),
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// Counts `v` in the first bucket whose bound is >= `v`. NaN is ignored.
    pub fn observe(&self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        add_f64(&self.sum, v);
    }

    pub fn observe_duration(&self, d: std::time::Duration) {
        self.observe(d.as_secs_f64());
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum.load(Ordering::Relaxed))
    }

    /// The buckets made cumulative; `count` is the `+Inf` bucket, so the rendered lines agree
    /// with each other even while other threads observe.
    pub fn snapshot(&self) -> HistogramSnapshot {
        let mut acc = 0;
        let mut buckets = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c.load(Ordering::Relaxed);
            buckets.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), acc));
        }
        HistogramSnapshot { buckets, count: acc, sum: self.sum() }
    }
}

/// The label value every label takes for label sets past a family's limit.
pub const OVERFLOW_LABEL_VALUE: &str = "other";

/// Label sets a family holds at most unless told otherwise.
pub const DEFAULT_MAX_LABEL_SETS: usize = 64;

/// One metric per label set. Label sets are created on first use up to `max_label_sets`;
/// later new sets all share one child whose every label is [`OVERFLOW_LABEL_VALUE`].
pub struct Family<M> {
    label_names: Vec<&'static str>,
    children: RwLock<Vec<(Vec<String>, Arc<M>)>>,
    max_label_sets: usize,
    make: Box<dyn Fn() -> M + Send + Sync>,
}

impl<M> Family<M> {
    fn new(label_names: &[&'static str], max_label_sets: usize, make: Box<dyn Fn() -> M + Send + Sync>) -> Self {
        Family { label_names: label_names.to_vec(), children: RwLock::default(), max_label_sets, make }
    }

    pub fn label_names(&self) -> &[&'static str] {
        &self.label_names
    }

    /// The child for `values` (one per label name, in order). A wrong number of values, or a
    /// new set past the limit, gets the overflow child.
    pub fn get(&self, values: &[&str]) -> Arc<M> {
        let matches =
            |set: &[String], values: &[&str]| set.len() == values.len() && set.iter().zip(values).all(|(a, b)| a == b);
        {
            let children = self.children.read().unwrap_or_else(|e| e.into_inner());
            if let Some((_, m)) = children.iter().find(|(set, _)| matches(set, values)) {
                return m.clone();
            }
        }
        let mut children = self.children.write().unwrap_or_else(|e| e.into_inner());
        if let Some((_, m)) = children.iter().find(|(set, _)| matches(set, values)) {
            return m.clone();
        }
        let overflow: Vec<&str> = vec![OVERFLOW_LABEL_VALUE; self.label_names.len()];
        let key: &[&str] = if values.len() == self.label_names.len() && children.len() < self.max_label_sets {
            values
        } else {
            &overflow
        };
        if let Some((_, m)) = children.iter().find(|(set, _)| matches(set, key)) {
            return m.clone();
        }
        let child = Arc::new((self.make)());
        children.push((key.iter().map(|v| v.to_string()).collect(), child.clone()));
        child
    }

    /// The label sets and children, in creation order.
    pub fn children(&self) -> Vec<(Vec<String>, Arc<M>)> {
        self.children.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// What a registered metric is, for its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

pub(crate) enum Collector {
    Counter(Arc<Counter>),
    Gauge(Arc<Gauge>),
    Histogram(Arc<Histogram>),
    CounterFamily(Arc<Family<Counter>>),
    GaugeFamily(Arc<Family<Gauge>>),
    HistogramFamily(Arc<Family<Histogram>>),
}

pub(crate) struct Entry {
    /// As registered; counters render with `_total` appended.
    pub name: &'static str,
    pub help: &'static str,
    pub collector: Collector,
}

/// The metrics of one process, in registration order.
#[derive(Default)]
pub struct Registry {
    entries: Mutex<Vec<Entry>>,
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    fn register(&self, name: &'static str, help: &'static str, labels: &[&'static str], collector: Collector) {
        assert!(valid_metric_name(name), "invalid metric name {name:?}");
        for l in labels {
            assert!(valid_label_name(l) && *l != "le", "invalid label name {l:?} on {name}");
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let exposed = prometheus::exposed_name(name, kind_of(&collector));
        assert!(
            !entries.iter().any(|e| prometheus::exposed_name(e.name, kind_of(&e.collector)) == exposed),
            "metric {exposed} registered twice"
        );
        entries.push(Entry { name, help, collector });
    }

    /// A counter, exposed as `<name>_total` (pass the name without `_total`).
    pub fn counter(&self, name: &'static str, help: &'static str) -> Arc<Counter> {
        let m = Arc::new(Counter::default());
        self.register(name, help, &[], Collector::Counter(m.clone()));
        m
    }

    pub fn gauge(&self, name: &'static str, help: &'static str) -> Arc<Gauge> {
        let m = Arc::new(Gauge::default());
        self.register(name, help, &[], Collector::Gauge(m.clone()));
        m
    }

    pub fn histogram(&self, name: &'static str, help: &'static str, bounds: &[f64]) -> Arc<Histogram> {
        let m = Arc::new(Histogram::new(bounds));
        self.register(name, help, &[], Collector::Histogram(m.clone()));
        m
    }

    pub fn counter_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[&'static str],
    ) -> Arc<Family<Counter>> {
        let f = Arc::new(Family::new(labels, DEFAULT_MAX_LABEL_SETS, Box::new(Counter::default)));
        self.register(name, help, labels, Collector::CounterFamily(f.clone()));
        f
    }

    pub fn gauge_family(&self, name: &'static str, help: &'static str, labels: &[&'static str]) -> Arc<Family<Gauge>> {
        let f = Arc::new(Family::new(labels, DEFAULT_MAX_LABEL_SETS, Box::new(Gauge::default)));
        self.register(name, help, labels, Collector::GaugeFamily(f.clone()));
        f
    }

    pub fn histogram_family(
        &self,
        name: &'static str,
        help: &'static str,
        labels: &[&'static str],
        bounds: &[f64],
    ) -> Arc<Family<Histogram>> {
        // Checked once here rather than at the first child.
        drop(Histogram::new(bounds));
        let bounds: Arc<[f64]> = bounds.into();
        let make = move || Histogram::new(&bounds);
        let f = Arc::new(Family::new(labels, DEFAULT_MAX_LABEL_SETS, Box::new(make)));
        self.register(name, help, labels, Collector::HistogramFamily(f.clone()));
        f
    }

    /// Every metric in Prometheus text format (version 0.0.4).
    pub fn render(&self) -> String {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        for e in entries.iter() {
            prometheus::render_entry(&mut out, e);
        }
        out
    }
}

pub(crate) fn kind_of(c: &Collector) -> Kind {
    match c {
        Collector::Counter(_) | Collector::CounterFamily(_) => Kind::Counter,
        Collector::Gauge(_) | Collector::GaugeFamily(_) => Kind::Gauge,
        Collector::Histogram(_) | Collector::HistogramFamily(_) => Kind::Histogram,
    }
}
