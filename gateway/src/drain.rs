//! Graceful drain on SIGTERM: readiness goes false at once (`/ready` 503), every new
//! request gets 503 with `Retry-After` (only `/health` and `/metrics` still answer), and the
//! requests in flight, streams included, run to their end; the server stops when the last
//! has ended or the drain timeout has passed.
//!
//! The listener keeps accepting during the drain, so a client (or load balancer) that
//! connects gets a clear 503 instead of a refused connection. A request counts as in
//! flight until its response body is finished or dropped: the guard travels inside the
//! body, so an SSE stream counts until its last event.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};
pub use tessera_telemetry::drain::{Drain, InFlight};

use crate::app::AppState;
use crate::error::ApiError;

/// Seconds a refused client is told to wait (another gateway can take it meanwhile).
const RETRY_AFTER_S: u32 = 1;

/// The shutdown future for `serve_on`: waits for `signal`, starts the drain, then completes
/// when the requests in flight have ended or `timeout` has passed.
pub fn on_signal(
    drain: &Drain,
    signal: impl Future<Output = ()> + Send + 'static,
    timeout: Duration,
) -> impl Future<Output = ()> + Send + 'static {
    let drain = drain.clone();
    async move {
        signal.await;
        drain.start();
        tracing::info!(in_flight = drain.in_flight(), timeout_s = timeout.as_secs(), "draining");
        if tokio::time::timeout(timeout, drain.idle()).await.is_err() {
            tracing::warn!(in_flight = drain.in_flight(), "drain timeout: cutting the requests still in flight");
        }
    }
}

/// A response body that holds its request's [`InFlight`] guard until it ends or is dropped.
struct TrackedBody {
    inner: Body,
    guard: Option<InFlight>,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            self.guard = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The middleware: refuses new requests while draining (`/health` and `/metrics` still
/// answer; `/ready` says 503) and counts the others in flight until their body ends.
pub async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let drain = state.drain();
    let path = req.uri().path();
    if path == "/health" || path == "/metrics" {
        return next.run(req).await;
    }
    if drain.is_draining() {
        return ApiError::Unavailable { retry_after_s: RETRY_AFTER_S }.into_response();
    }
    let guard = drain.track();
    let response = next.run(req).await;
    response.map(|inner| Body::new(TrackedBody { inner, guard: Some(guard) }))
}
