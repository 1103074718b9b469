//! The in-flight count behind a graceful drain, shared by the roles that drain (the
//! gateway's HTTP requests, the coordinator's Generate streams): once [`Drain::start`] is
//! called a role refuses new work and reports not ready, and [`Drain::idle`] completes when
//! the last piece of work in flight (an [`InFlight`] guard) has been dropped. What counts as
//! in flight, and how new work is refused, is each role's.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// Shared drain state; cheap to clone.
#[derive(Clone, Default)]
pub struct Drain {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    draining: AtomicBool,
    in_flight: AtomicUsize,
    changed: Notify,
}

impl Drain {
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts draining: new work is refused from now on.
    pub fn start(&self) {
        self.inner.draining.store(true, Ordering::SeqCst);
        self.inner.changed.notify_waiters();
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::SeqCst)
    }

    /// Work in flight now.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Counts one piece of work in flight until the guard is dropped.
    pub fn track(&self) -> InFlight {
        self.inner.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight { inner: self.inner.clone() }
    }

    /// Completes once nothing is in flight.
    pub async fn idle(&self) {
        loop {
            let changed = self.inner.changed.notified();
            if self.in_flight() == 0 {
                return;
            }
            changed.await;
        }
    }
}

/// One piece of work in flight; dropping it ends it.
pub struct InFlight {
    inner: Arc<Inner>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.inner.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.inner.changed.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_guard() {
        let d = Drain::new();
        assert!(!d.is_draining());
        let (a, b) = (d.track(), d.track());
        d.start();
        assert!(d.is_draining());
        assert_eq!(d.in_flight(), 2);
        drop(a);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.idle().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "idle with one piece of work still in flight");
        drop(b);
        tokio::time::timeout(Duration::from_secs(1), waiter).await.unwrap().unwrap();
        assert_eq!(d.in_flight(), 0);
    }
}
