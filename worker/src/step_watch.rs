//! What a worker does about a step that is still running after its coordinator hung up.
//!
//! A GPU rank of a tensor-parallel group or pipeline waits for its peers inside GPU
//! collectives that have no timeout of their own (NCCL; the one-shot all-reduce only gives
//! up after 30 s, by trapping, which leaves the CUDA context unusable). When a peer dies or
//! hangs, the coordinator fails the replica (at once for a broken stream, after its
//! per-step deadline for a silent rank) and drops its step streams; the surviving ranks
//! stay blocked in the collective, holding the loaded model, so they can neither answer
//! Info nor take the Load of a re-formed replica; a hung kernel on any GPU blocks its step
//! the same way. [`watch_step`] notices that the stream
//! is gone while the step still runs and, after a grace period in which a healthy step
//! would have ended, calls the service's unrecoverable-worker hook once (the service also
//! calls it when a step error left the GPU context unusable). The `tessera worker` binary's
//! hook logs why and ends the process, so its supervisor (`tessera serve`, systemd,
//! Kubernetes) restarts it with a fresh CUDA context and the coordinator re-forms the
//! replica: the failure is bounded instead of a worker held forever.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Called with a description of the stuck step.
pub type StuckHook = Arc<dyn Fn(&str) + Send + Sync>;

/// How long a step may go on after its coordinator hung up, unless
/// `TESSERA_STUCK_STEP_GRACE_S` says otherwise: far above any healthy GPU step (a few
/// hundred milliseconds for the largest prefill chunk), below the one-shot all-reduce's
/// 30 s trap.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);

/// The grace period from `TESSERA_STUCK_STEP_GRACE_S`, else [`DEFAULT_GRACE`].
pub fn grace_from_env() -> Duration {
    env_seconds("TESSERA_STUCK_STEP_GRACE_S").unwrap_or(DEFAULT_GRACE)
}

/// A duration from environment variable `name` in seconds (> 0, fractions allowed);
/// `None` when unset or not such a number. Also the one-shot all-reduce's dead-peer wait
/// (crate::cuda::allreduce).
pub(crate) fn env_seconds(name: &str) -> Option<Duration> {
    parse_seconds(std::env::var(name).ok().as_deref())
}

fn parse_seconds(v: Option<&str>) -> Option<Duration> {
    v.and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
}

/// Awaits `step`. If `hung_up` resolves first (the coordinator dropped the stream) and
/// `watch` is set, waits at most its grace period more for the step; if the step still
/// has not ended, calls its hook with `what` and goes on waiting (the hook normally ends
/// the process). Without `watch` (a step that cannot block on a peer forever), just awaits.
pub async fn watch_step<T>(
    step: impl Future<Output = T>,
    hung_up: impl Future<Output = ()>,
    watch: Option<(Duration, &StuckHook)>,
    what: impl FnOnce() -> String,
) -> T {
    tokio::pin!(step);
    let Some((grace, hook)) = watch else { return step.await };
    tokio::select! {
        out = &mut step => return out,
        () = hung_up => {}
    }
    match tokio::time::timeout(grace, &mut step).await {
        Ok(out) => out,
        Err(_) => {
            hook(&format!("{}: still running {grace:?} after the coordinator closed the step stream", what()));
            step.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn recorder() -> (StuckHook, Arc<Mutex<Vec<String>>>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let c = calls.clone();
        (Arc::new(move |m: &str| c.lock().unwrap().push(m.to_string())), calls)
    }

    async fn slow(ms: u64) -> u32 {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        7
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_stuck_after_the_hang_up_calls_the_hook_once() {
        let (hook, calls) = recorder();
        let grace = Duration::from_secs(10);
        let out = watch_step(slow(60_000), std::future::ready(()), Some((grace, &hook)), || "step 3".into()).await;
        assert_eq!(out, 7, "the step's own result once it ends");
        let calls = calls.lock().unwrap();
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(calls[0].starts_with("step 3: still running 10s"), "{}", calls[0]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_that_ends_within_the_grace_or_before_the_hang_up_is_left_alone() {
        let (hook, calls) = recorder();
        let grace = Duration::from_secs(10);
        // Hung up at once, but the step ends 9 s later.
        assert_eq!(watch_step(slow(9_000), std::future::ready(()), Some((grace, &hook)), String::new).await, 7);
        // Ends before the coordinator ever hangs up.
        let never = std::future::pending::<()>();
        assert_eq!(watch_step(slow(60_000), never, Some((grace, &hook)), String::new).await, 7);
        // Not watched: however long it takes after a hang-up.
        assert_eq!(watch_step(slow(60_000), std::future::ready(()), None, String::new).await, 7);
        assert!(calls.lock().unwrap().is_empty());
    }

    #[test]
    fn seconds_parse_positive_numbers_only() {
        assert_eq!(parse_seconds(Some("2.5")), Some(Duration::from_millis(2500)));
        assert_eq!(parse_seconds(Some(" 30 ")), Some(Duration::from_secs(30)));
        for bad in [None, Some(""), Some("0"), Some("-1"), Some("soon"), Some("inf"), Some("NaN"), Some("1e300")] {
            assert_eq!(parse_seconds(bad), None, "{bad:?}");
        }
    }
}
