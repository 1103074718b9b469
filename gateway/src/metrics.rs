//! The gateway's request metrics, vLLM's names under `tessera:`: every generation request
//! (`/v1/chat/completions`, `/v1/completions`, after authentication) is counted once when it
//! arrives (`tessera:requests_total`) and once when it ends, in exactly one outcome:
//!
//! - `tessera:request_success_total{finished_reason}`: every choice finished (`stop`,
//!   `length`, or `abort` when the engine gave a sequence up; the request's reason is its
//!   choices' worst: abort > length > stop);
//! - `tessera:request_failure_total{reason}`: a choice failed after admission (the reason is
//!   the engine's or the gateway's error kind);
//! - `tessera:request_cancelled_total`: the client went away before the end;
//! - `tessera:request_rejected_total{reason}`: an error response before generation started
//!   (invalid request, overloaded, unavailable, ...).
//!
//! So `requests = successes + failures + cancellations + rejections` once nothing is in
//! flight (`tessera:requests_in_progress` is the difference meanwhile). Token timings come
//! from the engine's token events, not from the text sent: `time_to_first_token_seconds`
//! (arrival to the request's first token, once per request that produced one),
//! `inter_token_latency_seconds` (between consecutive tokens of one choice) and
//! `e2e_request_latency_seconds` (arrival to the end, successes only). Label values come
//! from fixed lists, so cardinality is bounded.
//!
//! Wiring: the `track_requests` middleware on the generation routes makes a
//! [`RequestTracker`] and, for the duration of the handler, makes it the task's current one;
//! `generate::start` takes it ([`RequestTracker::current`]) so the handlers need no extra
//! argument, and each choice stream holds a [`ChoiceClock`]. The tracker's outcome is decided
//! by whichever comes first: all choices finished, a choice failed, the middleware saw an
//! error status, or the last holder dropped it unfinished (cancelled).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use tessera_telemetry::metrics_buckets as buckets;
use tessera_telemetry::{Counter, Family, Gauge, Histogram, Registry};

use crate::app::AppState;
use crate::choice::{ApiFinish, ChoiceError};
use crate::engine::{EngineError, EngineEvent};
use crate::generate::{ChoiceEvent, ChoiceItem, PromptPlan};

/// Finish reasons of successful requests.
pub const FINISH_REASONS: &[&str] = &["stop", "length", "abort"];
/// Why a request failed after admission.
pub const FAILURE_REASONS: &[&str] =
    &["overloaded", "unavailable", "invalid_request", "internal", "engine_error", "codec", "bad_token", "truncated"];
/// Why a request was refused before generation.
pub const REJECTION_REASONS: &[&str] = &[
    "invalid_request",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "too_large",
    "overloaded",
    "unavailable",
    "internal",
    "other",
];

/// The gateway's registry and the metrics recorded into it.
pub struct GatewayMetrics {
    registry: Registry,
    requests: Arc<Counter>,
    in_progress: Arc<Gauge>,
    success: Arc<Family<Counter>>,
    failure: Arc<Family<Counter>>,
    cancelled: Arc<Counter>,
    rejected: Arc<Family<Counter>>,
    ttft: Arc<Histogram>,
    itl: Arc<Histogram>,
    e2e: Arc<Histogram>,
    prompt_tokens: Arc<Counter>,
    generation_tokens: Arc<Counter>,
    request_prompt_tokens: Arc<Histogram>,
    request_generation_tokens: Arc<Histogram>,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl GatewayMetrics {
    pub fn new() -> Self {
        let r = Registry::new();
        let m = GatewayMetrics {
            requests: r.counter("tessera:requests", "Generation requests received (after authentication)."),
            in_progress: r.gauge("tessera:requests_in_progress", "Generation requests received and not ended yet."),
            success: r.counter_family(
                "tessera:request_success",
                "Requests whose every choice finished, by finish reason.",
                &["finished_reason"],
            ),
            failure: r.counter_family(
                "tessera:request_failure",
                "Requests that failed after admission, by reason.",
                &["reason"],
            ),
            cancelled: r.counter("tessera:request_cancelled", "Requests whose client went away before the end."),
            rejected: r.counter_family(
                "tessera:request_rejected",
                "Requests refused before generation started, by reason.",
                &["reason"],
            ),
            ttft: r.histogram(
                "tessera:time_to_first_token_seconds",
                "Time from the request's arrival to its first token.",
                buckets::TTFT_SECONDS,
            ),
            itl: r.histogram(
                "tessera:inter_token_latency_seconds",
                "Time between consecutive tokens of one choice.",
                buckets::INTER_TOKEN_SECONDS,
            ),
            e2e: r.histogram(
                "tessera:e2e_request_latency_seconds",
                "Time from arrival to the end of successful requests.",
                buckets::REQUEST_LATENCY_SECONDS,
            ),
            prompt_tokens: r.counter("tessera:prompt_tokens", "Prompt tokens of admitted requests."),
            generation_tokens: r.counter("tessera:generation_tokens", "Tokens generated (every choice)."),
            request_prompt_tokens: r.histogram(
                "tessera:request_prompt_tokens",
                "Prompt tokens per successful request.",
                buckets::REQUEST_TOKENS,
            ),
            request_generation_tokens: r.histogram(
                "tessera:request_generation_tokens",
                "Generated tokens per successful request.",
                buckets::REQUEST_TOKENS,
            ),
            registry: r,
        };
        // Every label value exists from the start, so dashboards and rate() see zeros.
        for v in FINISH_REASONS {
            m.success.get(&[v]);
        }
        for v in FAILURE_REASONS {
            m.failure.get(&[v]);
        }
        for v in REJECTION_REASONS {
            m.rejected.get(&[v]);
        }
        m
    }

    /// The gateway's metrics in Prometheus text format.
    pub fn render(&self) -> String {
        self.registry.render()
    }
}

/// The rejection reason of an error status.
pub fn status_reason(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request",
        401 | 403 => "unauthorized",
        404 => "not_found",
        405 => "method_not_allowed",
        413 => "too_large",
        429 => "overloaded",
        503 => "unavailable",
        500..=599 => "internal",
        _ => "other",
    }
}

/// The failure reason of a choice error.
pub fn failure_reason(e: &ChoiceError) -> &'static str {
    match e {
        ChoiceError::Engine(EngineError::Overloaded { .. }) => "overloaded",
        ChoiceError::Engine(EngineError::Unavailable { .. }) => "unavailable",
        ChoiceError::Engine(EngineError::InvalidRequest(_)) => "invalid_request",
        ChoiceError::Engine(EngineError::Internal(_)) => "internal",
        ChoiceError::EngineFailed => "engine_error",
        ChoiceError::Codec(_) => "codec",
        ChoiceError::BadTokenId(_) => "bad_token",
        ChoiceError::Truncated => "truncated",
    }
}

fn severity(f: ApiFinish) -> u8 {
    match f {
        ApiFinish::Stop => 0,
        ApiFinish::Length => 1,
        ApiFinish::Abort => 2,
    }
}

/// One generation request's progress; cheap to clone. The outcome is recorded once.
#[derive(Clone)]
pub struct RequestTracker(Option<Arc<Tracked>>);

struct Tracked {
    metrics: Arc<GatewayMetrics>,
    arrival: Instant,
    state: Mutex<Progress>,
}

#[derive(Default)]
struct Progress {
    admitted: bool,
    ended: bool,
    produced_token: bool,
    choices: u32,
    finished: u32,
    worst: Option<ApiFinish>,
    prompt_tokens: u64,
    completion_tokens: u64,
}

tokio::task_local! {
    static CURRENT: RequestTracker;
}

impl RequestTracker {
    /// Counts a new request.
    pub fn new(metrics: Arc<GatewayMetrics>) -> Self {
        metrics.requests.inc();
        metrics.in_progress.add(1.0);
        RequestTracker(Some(Arc::new(Tracked { metrics, arrival: Instant::now(), state: Mutex::default() })))
    }

    /// A tracker that records nothing (a handler run outside `track_requests`).
    pub fn detached() -> Self {
        RequestTracker(None)
    }

    /// The tracker of the request this task is handling, else a detached one.
    pub fn current() -> Self {
        CURRENT.try_with(Clone::clone).unwrap_or_else(|_| Self::detached())
    }

    fn with<R>(&self, f: impl FnOnce(&Tracked, &mut Progress) -> R) -> Option<R> {
        let t = self.0.as_ref()?;
        let mut p = t.state.lock().unwrap_or_else(|e| e.into_inner());
        Some(f(t, &mut p))
    }

    /// Every sequence was admitted: `n` choices per prompt.
    pub fn admitted(&self, prompts: &[PromptPlan], n: u32) {
        self.with(|t, p| {
            p.admitted = true;
            p.choices = prompts.len() as u32 * n;
            p.prompt_tokens = prompts.iter().map(|pr| pr.ids.len() as u64).sum();
            t.metrics.prompt_tokens.add(p.prompt_tokens);
        });
    }

    /// The clock of one choice's token events.
    pub fn choice(&self) -> ChoiceClock {
        ChoiceClock { tracker: self.clone(), last_token: None }
    }

    fn token(&self, now: Instant, previous: Option<Instant>) {
        self.with(|t, p| {
            t.metrics.generation_tokens.inc();
            if !p.produced_token {
                p.produced_token = true;
                t.metrics.ttft.observe_duration(now - t.arrival);
            }
            if let Some(prev) = previous {
                t.metrics.itl.observe_duration(now - prev);
            }
        });
    }

    fn choice_finished(&self, reason: ApiFinish, completion_tokens: u32) {
        self.with(|t, p| {
            if p.ended {
                return;
            }
            p.finished += 1;
            p.completion_tokens += u64::from(completion_tokens);
            if p.worst.is_none_or(|w| severity(reason) > severity(w)) {
                p.worst = Some(reason);
            }
            if p.finished >= p.choices {
                p.ended = true;
                let reason = p.worst.unwrap_or(ApiFinish::Stop).as_str();
                t.metrics.success.get(&[reason]).inc();
                t.metrics.e2e.observe_duration(t.arrival.elapsed());
                t.metrics.request_prompt_tokens.observe(p.prompt_tokens as f64);
                t.metrics.request_generation_tokens.observe(p.completion_tokens as f64);
            }
        });
    }

    /// A choice failed after admission.
    pub fn failed(&self, reason: &'static str) {
        self.with(|t, p| {
            if !std::mem::replace(&mut p.ended, true) {
                t.metrics.failure.get(&[reason]).inc();
            }
        });
    }

    /// The handler answered with an error status: a rejection unless generation had started.
    pub fn error_status(&self, status: StatusCode) {
        self.with(|t, p| {
            if !std::mem::replace(&mut p.ended, true) {
                let family = if p.admitted { &t.metrics.failure } else { &t.metrics.rejected };
                family.get(&[status_reason(status)]).inc();
            }
        });
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let p = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if !p.ended {
            self.metrics.cancelled.inc();
        }
        self.metrics.in_progress.add(-1.0);
    }
}

/// Times one choice's tokens; held by its stream, so dropping the stream lets go of the request.
pub struct ChoiceClock {
    tracker: RequestTracker,
    last_token: Option<Instant>,
}

impl ChoiceClock {
    /// An event from the engine (`None`: the channel closed).
    pub fn on_event(&mut self, event: &Option<EngineEvent>) {
        if let Some(EngineEvent::Token { .. }) = event {
            let now = Instant::now();
            self.tracker.token(now, self.last_token.replace(now));
        }
    }

    /// An item the choice stream produced.
    pub fn on_item(&self, item: &ChoiceItem) {
        match &item.event {
            ChoiceEvent::Delta { .. } => {}
            ChoiceEvent::Finished { reason, completion_tokens, .. } => {
                self.tracker.choice_finished(*reason, *completion_tokens)
            }
            ChoiceEvent::Failed(e) => self.tracker.failed(failure_reason(e)),
        }
    }
}

/// Middleware of the generation routes: counts the request, makes its tracker current for
/// the handler, and records an error status as a rejection (or a failure, after admission).
pub async fn track_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let tracker = RequestTracker::new(state.metrics().clone());
    let response = CURRENT.scope(tracker.clone(), next.run(req)).await;
    if !response.status().is_success() {
        tracker.error_status(response.status());
    }
    response
}
