//! Graceful drain of the coordinator: once started, new Generate calls are refused
//! (UNAVAILABLE with `retry-after`) and Status reports not ready, while the streams in
//! flight run on; `idle` completes when the last of them has ended.
//!
//! A stream counts as in flight from admission until its response stream is dropped (the
//! gateway read its end, or went away), through an [`InFlight`] guard the stream owns.

use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
pub use tessera_telemetry::drain::{Drain, InFlight};

/// A response stream that holds its [`InFlight`] guard until it is dropped.
pub struct Tracked<S> {
    inner: S,
    _guard: InFlight,
}

impl<S> Tracked<S> {
    pub fn new(inner: S, guard: InFlight) -> Self {
        Tracked { inner, _guard: guard }
    }
}

impl<S: Stream + Unpin> Stream for Tracked<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        Pin::new(&mut self.inner).poll_next(cx)
    }
}
