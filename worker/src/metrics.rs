//! The worker's metrics: the duration of each step it runs (`phase`: prefill, decode or a
//! mix), the tokens it runs, and the time each step spends in collectives per parallel group
//! (`group`: tp or pp; only sharded workers observe it). Each worker process exposes its own,
//! so the per-worker view is Prometheus's `instance`.
//!
//! Collective time is measured by [`TimedCollective`], a wrapper around any [`Collective`]
//! that adds the wall time of every call to its group's [`CollectiveClock`]; a step reads and
//! resets the clocks. Steps run one at a time per worker (the executor is behind one lock),
//! so the clocks hold exactly one step's time.
//!
//! The CUDA backend's NCCL calls are not timed: they only enqueue work on a stream, so the
//! host-side time around them says nothing about the collective.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_telemetry::metrics_buckets as buckets;
use tessera_telemetry::{Counter, Histogram, Registry};

use crate::collective::{Collective, CollectiveError};
use crate::executor::{Run, StepInput};

/// Nanoseconds spent in one group's collective calls since the last `take`.
#[derive(Debug, Default)]
pub struct CollectiveClock(AtomicU64);

impl CollectiveClock {
    fn add(&self, d: Duration) {
        self.0.fetch_add(d.as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }

    /// The time accumulated since the last call, and starts over.
    pub fn take(&self) -> Duration {
        Duration::from_nanos(self.0.swap(0, Ordering::Relaxed))
    }
}

/// A collective whose every call is timed into a clock.
pub struct TimedCollective {
    inner: Box<dyn Collective>,
    clock: Arc<CollectiveClock>,
}

impl TimedCollective {
    pub fn new(inner: Box<dyn Collective>, clock: Arc<CollectiveClock>) -> Self {
        TimedCollective { inner, clock }
    }

    fn timed<T>(&mut self, f: impl FnOnce(&mut dyn Collective) -> T) -> T {
        let t0 = Instant::now();
        let out = f(&mut *self.inner);
        self.clock.add(t0.elapsed());
        out
    }
}

impl Collective for TimedCollective {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.inner.world()
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.timed(|c| c.all_reduce_sum(data))
    }

    fn all_gather(&mut self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        self.timed(|c| c.all_gather(local, out))
    }

    fn send(&mut self, to: usize, data: &[f32]) -> Result<(), CollectiveError> {
        self.timed(|c| c.send(to, data))
    }

    fn recv(&mut self, from: usize, data: &mut [f32]) -> Result<(), CollectiveError> {
        self.timed(|c| c.recv(from, data))
    }

    fn send_u32(&mut self, to: usize, data: &[u32]) -> Result<(), CollectiveError> {
        self.timed(|c| c.send_u32(to, data))
    }

    fn recv_u32(&mut self, from: usize, data: &mut Vec<u32>) -> Result<(), CollectiveError> {
        self.timed(|c| c.recv_u32(from, data))
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.timed(|c| c.barrier())
    }
}

/// A step's phase, tokens and start, from [`WorkerMetrics::step_clock`].
#[derive(Debug, Clone, Copy)]
pub struct StepClock {
    phase: Option<StepPhase>,
    tokens: usize,
    t0: Instant,
}

/// What kind of work a step held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepPhase {
    /// Every run computes several positions (prompts, chunks, re-prefills).
    Prefill,
    /// Every run computes one position after earlier ones.
    Decode,
    Mixed,
}

impl StepPhase {
    /// `None` for a step with no runs (deltas only).
    pub fn of(input: &StepInput) -> Option<StepPhase> {
        let decodes = input.runs.iter().filter(|r| r.num_tokens() == 1 && r.first_pos > 0).count();
        match (input.runs.len(), decodes) {
            (0, _) => None,
            (n, d) if d == n => Some(StepPhase::Decode),
            (_, 0) => Some(StepPhase::Prefill),
            _ => Some(StepPhase::Mixed),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            StepPhase::Prefill => "prefill",
            StepPhase::Decode => "decode",
            StepPhase::Mixed => "mixed",
        }
    }
}

/// The worker's registry and its metrics.
pub struct WorkerMetrics {
    registry: Registry,
    /// By phase, in `StepPhase` order.
    step: [Arc<Histogram>; 3],
    tokens: Arc<Counter>,
    tp_time: Arc<Histogram>,
    pp_time: Arc<Histogram>,
    tp_clock: Arc<CollectiveClock>,
    pp_clock: Arc<CollectiveClock>,
    /// The last step's collective time (both groups), nanoseconds.
    last_collective_ns: AtomicU64,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let step = r.histogram_family(
            "tessera:worker_step_duration_seconds",
            "Wall time of one step on this worker (deltas, forward pass, sampling), by phase.",
            &["phase"],
            buckets::STEP_SECONDS,
        );
        let collective = r.histogram_family(
            "tessera:worker_collective_seconds",
            "Time one step spent in collective calls, by parallel group (tp, pp).",
            &["group"],
            buckets::COLLECTIVE_SECONDS,
        );
        WorkerMetrics {
            step: [StepPhase::Prefill, StepPhase::Decode, StepPhase::Mixed].map(|p| step.get(&[p.as_str()])),
            tokens: r.counter("tessera:worker_tokens", "Tokens run through this worker's forward pass."),
            tp_time: collective.get(&["tp"]),
            pp_time: collective.get(&["pp"]),
            tp_clock: Arc::default(),
            pp_clock: Arc::default(),
            last_collective_ns: AtomicU64::new(0),
            registry: r,
        }
    }

    /// Wraps a tensor-parallel group's collective so its calls are timed.
    pub fn timed_tp(&self, c: Box<dyn Collective>) -> Box<dyn Collective> {
        Box::new(TimedCollective::new(c, self.tp_clock.clone()))
    }

    /// Wraps a pipeline's collective so its calls are timed.
    pub fn timed_pp(&self, c: Box<dyn Collective>) -> Box<dyn Collective> {
        Box::new(TimedCollective::new(c, self.pp_clock.clone()))
    }

    /// Starts timing a step of `input` (its phase, tokens, start); [`WorkerMetrics::record_step`]
    /// records it when it ends: a step queued on the GPU ends when its rows are read.
    pub fn step_clock(&self, input: &StepInput) -> StepClock {
        let phase = StepPhase::of(input);
        let tokens: usize = input.runs.iter().map(Run::num_tokens).sum();
        StepClock { phase, tokens, t0: Instant::now() }
    }

    /// Records a step timed since `clock` and the collective time since the last record
    /// (one step's, unless a step was queued behind another).
    pub fn record_step(&self, clock: StepClock) {
        let wall = clock.t0.elapsed();
        let (tp, pp) = (self.tp_clock.take(), self.pp_clock.take());
        self.last_collective_ns.store((tp + pp).as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
        if let Some(phase) = clock.phase {
            self.step[phase as usize].observe_duration(wall);
            self.tokens.add(clock.tokens as u64);
            if !tp.is_zero() {
                self.tp_time.observe_duration(tp);
            }
            if !pp.is_zero() {
                self.pp_time.observe_duration(pp);
            }
        }
    }

    /// The collective time of the last step (for its trace span).
    pub fn last_collective(&self) -> Duration {
        Duration::from_nanos(self.last_collective_ns.load(Ordering::Relaxed))
    }

    /// Every metric in Prometheus text format.
    pub fn render(&self) -> String {
        self.registry.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tokens: usize, first_pos: usize) -> Run {
        Run { seq_id: 1, tokens: vec![7; tokens], first_pos, sample: true, from_previous: false }
    }

    #[test]
    fn steps_are_classified_by_their_runs() {
        let input = |runs: Vec<Run>| StepInput { runs, ..Default::default() };
        assert_eq!(StepPhase::of(&input(vec![])), None);
        assert_eq!(StepPhase::of(&input(vec![run(5, 0), run(3, 16)])), Some(StepPhase::Prefill));
        assert_eq!(StepPhase::of(&input(vec![run(1, 9), run(1, 4)])), Some(StepPhase::Decode));
        assert_eq!(StepPhase::of(&input(vec![run(1, 9), run(4, 0)])), Some(StepPhase::Mixed));
        // A one-token prompt is a prefill.
        assert_eq!(StepPhase::of(&input(vec![run(1, 0)])), Some(StepPhase::Prefill));
    }

    /// A step's duration lands under its phase, its collective time under its group, and
    /// the clocks start over for the next step.
    #[test]
    fn recorded_steps_keep_duration_tokens_and_collective_time() {
        let m = WorkerMetrics::new();
        let input = StepInput { runs: vec![run(1, 3), run(1, 8)], ..Default::default() };
        let clock = m.step_clock(&input);
        m.tp_clock.add(Duration::from_millis(2));
        std::thread::sleep(Duration::from_millis(3));
        m.record_step(clock);
        assert_eq!(m.step[StepPhase::Decode as usize].count(), 1);
        assert!(m.step[StepPhase::Decode as usize].sum() >= 0.003);
        assert_eq!(m.step[StepPhase::Prefill as usize].count(), 0);
        assert_eq!(m.tokens.get(), 2);
        assert_eq!(m.tp_time.count(), 1);
        assert!((m.tp_time.sum() - 0.002).abs() < 1e-9);
        assert_eq!(m.pp_time.count(), 0, "an unused group observes nothing");
        assert_eq!(m.last_collective(), Duration::from_millis(2));
        m.record_step(m.step_clock(&StepInput::default()));
        assert_eq!(m.step.iter().map(|h| h.count()).sum::<u64>(), 1, "a step without runs is not a step");
        let text = m.render();
        assert!(text.contains("tessera:worker_step_duration_seconds_count{phase=\"decode\"} 1\n"), "{text}");
        assert!(text.contains("tessera:worker_collective_seconds_count{group=\"tp\"} 1\n"), "{text}");
        assert!(text.contains("tessera:worker_tokens_total 2\n"), "{text}");
    }
}
