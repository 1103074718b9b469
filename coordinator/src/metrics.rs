//! The coordinator's metrics, vLLM's names under `tessera:`: per replica (label `replica`, its
//! index: bounded by the replicas formed) the running and waiting sequences, KV cache usage,
//! prefix-cache queries and hits (in tokens, as vLLM counts them) and preemptions; over all
//! replicas the queue time (submission to first scheduling), tokens and sequences per step,
//! and the step's wall and coordinator-CPU time.
//!
//! Each engine owns a [`ReplicaMetrics`] (no lock on its path: plain fields plus atomic
//! metrics) and calls it at a few points of its loop. Scheduler counters are cumulative per
//! scheduler, and a re-formed replica gets a fresh scheduler, so they are turned into
//! increments here (a count that went down started over).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_telemetry::metrics_buckets as buckets;
use tessera_telemetry::{Counter, Family, Gauge, Histogram, Registry};

use crate::batch::ScheduledBatch;
use crate::scheduler::SchedulerStats;

/// The coordinator's registry and its metrics, shared by every replica's engine.
pub struct CoordinatorMetrics {
    registry: Registry,
    running: Arc<Family<Gauge>>,
    waiting: Arc<Family<Gauge>>,
    kv_usage: Arc<Family<Gauge>>,
    prefix_queries: Arc<Family<Counter>>,
    prefix_hits: Arc<Family<Counter>>,
    preemptions: Arc<Family<Counter>>,
    lookahead: Arc<Family<Counter>>,
    queue_time: Arc<Histogram>,
    iteration_tokens: Arc<Histogram>,
    batch_size: Arc<Histogram>,
    step_duration: Arc<Histogram>,
    step_cpu: Arc<Histogram>,
    step_worker: Arc<Histogram>,
}

impl CoordinatorMetrics {
    pub fn new() -> Arc<Self> {
        let r = Registry::new();
        let replica = &["replica"];
        Arc::new(CoordinatorMetrics {
            running: r.gauge_family("tessera:num_requests_running", "Sequences in the running set.", replica),
            waiting: r.gauge_family(
                "tessera:num_requests_waiting",
                "Sequences waiting for admission (preempted ones included).",
                replica,
            ),
            kv_usage: r.gauge_family("tessera:kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", replica),
            prefix_queries: r.counter_family(
                "tessera:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache at admission.",
                replica,
            ),
            prefix_hits: r.counter_family(
                "tessera:prefix_cache_hits",
                "Prompt tokens served from the prefix cache.",
                replica,
            ),
            preemptions: r.counter_family("tessera:num_preemptions", "Sequences preempted (recompute).", replica),
            lookahead: r.counter_family(
                "tessera:lookahead_decodes",
                "Decode runs scheduled ahead, on the token the workers were still sampling.",
                replica,
            ),
            queue_time: r.histogram(
                "tessera:request_queue_time_seconds",
                "Time from submission to the first scheduling of a request.",
                buckets::REQUEST_LATENCY_SECONDS,
            ),
            iteration_tokens: r.histogram(
                "tessera:iteration_tokens_total",
                "Tokens run per step (prefill chunks plus decodes).",
                buckets::ITERATION_TOKENS,
            ),
            batch_size: r.histogram("tessera:batch_size", "Sequences per step.", buckets::BATCH_SIZE),
            step_duration: r.histogram(
                "tessera:step_duration_seconds",
                "Wall time of one engine step: schedule, workers' forward pass, postprocess.",
                buckets::STEP_SECONDS,
            ),
            step_cpu: r.histogram(
                "tessera:step_cpu_seconds",
                "Coordinator time of one step (schedule, build, postprocess), without the workers.",
                buckets::STEP_SECONDS,
            ),
            step_worker: r.histogram(
                "tessera:step_worker_seconds",
                "Time the worker reports for one step (forward pass and sampling); the step's \
                 duration less this and its coordinator time is spent between the processes.",
                buckets::STEP_SECONDS,
            ),
            registry: r,
        })
    }

    /// The metrics of replica `index`, for its engine.
    pub fn replica(self: &Arc<Self>, index: usize) -> ReplicaMetrics {
        let label = index.to_string();
        let l = &[label.as_str()];
        ReplicaMetrics {
            running: self.running.get(l),
            waiting: self.waiting.get(l),
            kv_usage: self.kv_usage.get(l),
            prefix_queries: self.prefix_queries.get(l),
            prefix_hits: self.prefix_hits.get(l),
            preemptions: self.preemptions.get(l),
            lookahead: self.lookahead.get(l),
            shared: self.clone(),
            last: SchedulerStats::default(),
            queued: HashMap::new(),
        }
    }

    /// Every metric in Prometheus text format.
    pub fn render(&self) -> String {
        self.registry.render()
    }
}

/// One engine's view of the metrics; owned by the engine task.
pub struct ReplicaMetrics {
    shared: Arc<CoordinatorMetrics>,
    running: Arc<Gauge>,
    waiting: Arc<Gauge>,
    kv_usage: Arc<Gauge>,
    prefix_queries: Arc<Counter>,
    prefix_hits: Arc<Counter>,
    preemptions: Arc<Counter>,
    lookahead: Arc<Counter>,
    /// The scheduler counters last published.
    last: SchedulerStats,
    /// Sequences submitted and not scheduled yet, with their submission time.
    queued: HashMap<u64, Instant>,
}

impl ReplicaMetrics {
    /// Metrics no one reads (an engine built without a registry, as in tests).
    pub fn detached() -> Self {
        CoordinatorMetrics::new().replica(0)
    }

    /// The scheduler's state after a step (or any change).
    pub fn publish(&mut self, s: &SchedulerStats, total_blocks: usize) {
        self.running.set(s.running as f64);
        self.waiting.set(s.waiting as f64);
        self.kv_usage.set(if total_blocks > 0 { s.used_blocks as f64 / total_blocks as f64 } else { 0.0 });
        let delta = |now: u64, before: u64| if now >= before { now - before } else { now };
        self.prefix_queries.add(delta(s.prefix_query_tokens, self.last.prefix_query_tokens));
        self.prefix_hits.add(delta(s.prefix_hit_tokens, self.last.prefix_hit_tokens));
        self.preemptions.add(delta(s.preemptions, self.last.preemptions));
        self.last = *s;
    }

    /// Sequence `id` was admitted to the waiting queue now.
    pub fn queued(&mut self, id: u64) {
        self.queued.insert(id, Instant::now());
    }

    /// Sequence `id` will never be scheduled here (its client left, the replica failed).
    pub fn forget(&mut self, id: u64) {
        self.queued.remove(&id);
    }

    pub fn forget_all(&mut self) {
        self.queued.clear();
    }

    /// A batch was scheduled: its size, its lookahead decodes, and the queue time of the
    /// sequences it starts.
    pub fn scheduled(&mut self, batch: &ScheduledBatch) {
        let m = &self.shared;
        m.iteration_tokens.observe(batch.num_tokens() as f64);
        m.batch_size.observe(batch.runs.len() as f64);
        self.lookahead.add(batch.runs.iter().filter(|r| r.from_previous).count() as u64);
        if self.queued.is_empty() {
            return;
        }
        let now = Instant::now();
        for n in &batch.new_seqs {
            if let Some(t) = self.queued.remove(&n.seq_id) {
                m.queue_time.observe_duration(now - t);
            }
        }
    }

    /// A step completed: its wall time, the coordinator's share of it and the time the
    /// worker reported for it.
    pub fn step_done(&self, wall: Duration, cpu: Duration, worker: Duration) {
        self.shared.step_duration.observe_duration(wall);
        self.shared.step_cpu.observe_duration(cpu);
        self.shared.step_worker.observe_duration(worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{NewSeq, SeqRun};

    fn sample(text: &str, key: &str) -> f64 {
        let line = text.lines().find(|l| l.starts_with(key)).unwrap_or_else(|| panic!("no {key} in\n{text}"));
        line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
    }

    /// Scheduler totals become increments, also across a fresh scheduler (a re-formed
    /// replica) whose totals start over; gauges carry the replica's label.
    #[test]
    fn scheduler_totals_become_monotonic_counters() {
        let m = CoordinatorMetrics::new();
        let mut r = m.replica(1);
        let stats = |q, h, p| SchedulerStats {
            running: 3,
            waiting: 2,
            used_blocks: 5,
            prefix_query_tokens: q,
            prefix_hit_tokens: h,
            preemptions: p,
            ..Default::default()
        };
        r.publish(&stats(100, 32, 1), 20);
        r.publish(&stats(150, 48, 1), 20);
        r.publish(&stats(10, 0, 0), 20); // a fresh scheduler
        let text = m.render();
        assert_eq!(sample(&text, "tessera:prefix_cache_queries_total{replica=\"1\"}"), 160.0);
        assert_eq!(sample(&text, "tessera:prefix_cache_hits_total{replica=\"1\"}"), 48.0);
        assert_eq!(sample(&text, "tessera:num_preemptions_total{replica=\"1\"}"), 1.0);
        assert_eq!(sample(&text, "tessera:num_requests_running{replica=\"1\"}"), 3.0);
        assert_eq!(sample(&text, "tessera:num_requests_waiting{replica=\"1\"}"), 2.0);
        assert_eq!(sample(&text, "tessera:kv_cache_usage_perc{replica=\"1\"}"), 0.25);
    }

    /// Queue time is observed once per sequence, at its first scheduling; a sequence that
    /// left before it was scheduled is not observed.
    #[test]
    fn queue_time_is_observed_once_per_scheduled_sequence() {
        let m = CoordinatorMetrics::new();
        let mut r = m.replica(0);
        for id in 1..=3 {
            r.queued(id);
        }
        r.forget(3);
        let new = |seq_id| NewSeq { seq_id, block_table: vec![0], prior_output: Vec::new() };
        let run = |seq_id, n| SeqRun {
            seq_id,
            tokens: vec![1; n],
            first_pos: 0,
            sample: true,
            is_prompt: true,
            from_previous: false,
        };
        let batch =
            ScheduledBatch { new_seqs: vec![new(1), new(2)], runs: vec![run(1, 5), run(2, 7)], ..Default::default() };
        r.scheduled(&batch);
        // Re-sent as new after a preemption: not queued again.
        r.scheduled(&ScheduledBatch { new_seqs: vec![new(1)], runs: vec![run(1, 12)], ..Default::default() });
        assert_eq!(m.queue_time.count(), 2);
        assert_eq!(m.iteration_tokens.count(), 2);
        assert_eq!(m.iteration_tokens.sum(), 24.0);
        assert_eq!(m.batch_size.sum(), 3.0);
    }

    /// Lookahead decodes are counted per replica, other runs not.
    #[test]
    fn lookahead_decodes_are_counted() {
        let m = CoordinatorMetrics::new();
        let mut r = m.replica(2);
        let run = |seq_id, from_previous| SeqRun {
            seq_id,
            tokens: if from_previous { Vec::new() } else { vec![1] },
            first_pos: 9,
            sample: true,
            is_prompt: false,
            from_previous,
        };
        r.scheduled(&ScheduledBatch { runs: vec![run(1, true), run(2, false), run(3, true)], ..Default::default() });
        r.scheduled(&ScheduledBatch { runs: vec![run(2, true)], ..Default::default() });
        assert_eq!(sample(&m.render(), "tessera:lookahead_decodes_total{replica=\"2\"}"), 3.0);
    }

    /// A step's wall time, coordinator time and worker time land in their own histograms,
    /// so what the processes spend between them can be read off /metrics.
    #[test]
    fn step_times_are_split_by_who_spent_them() {
        let m = CoordinatorMetrics::new();
        let r = m.replica(0);
        r.step_done(Duration::from_micros(4500), Duration::from_micros(40), Duration::from_micros(4100));
        r.step_done(Duration::from_micros(4600), Duration::from_micros(60), Duration::from_micros(4200));
        let text = m.render();
        let close = |key: &str, want: f64| {
            let got = sample(&text, key);
            assert!((got - want).abs() < 1e-9, "{key}: {got}, want {want}");
        };
        close("tessera:step_duration_seconds_sum", 0.0091);
        close("tessera:step_cpu_seconds_sum", 0.0001);
        close("tessera:step_worker_seconds_sum", 0.0083);
        close("tessera:step_worker_seconds_count", 2.0);
    }
}
