//! The admin HTTP endpoint of the roles that do not serve HTTP themselves (coordinator, worker):
//! `GET /health` (the process is up), `GET /ready` (it can take work; 503 with `Retry-After: 1`
//! while it cannot, e.g. still loading or draining) and `GET /metrics` (Prometheus text format).
//! The role owns a [`Readiness`] flag it flips and a render closure producing its metrics text.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The Prometheus text exposition content type.
pub const METRICS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether the role can take work now; cheap to clone and share (one atomic flag).
#[derive(Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn new(ready: bool) -> Self {
        Readiness(Arc::new(AtomicBool::new(ready)))
    }

    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Readiness").field(&self.is_ready()).finish()
    }
}

/// Renders the role's metrics in Prometheus text format.
pub type RenderFn = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Clone)]
struct AdminState {
    ready: Readiness,
    render: RenderFn,
}

/// The admin routes, for a caller that wants to serve them itself (tests, or merged into a
/// larger router).
pub fn admin_router(ready: Readiness, render: RenderFn) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/ready", get(ready_handler))
        .route("/metrics", get(metrics))
        .with_state(AdminState { ready, render })
}

/// Serves the admin routes on `listener` until `shutdown` completes.
pub async fn serve_admin(
    listener: tokio::net::TcpListener,
    ready: Readiness,
    render: RenderFn,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, admin_router(ready, render)).with_graceful_shutdown(shutdown).await
}

async fn health() -> &'static str {
    "ok\n"
}

async fn ready_handler(State(state): State<AdminState>) -> Response {
    if state.ready.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")], "not ready\n").into_response()
    }
}

async fn metrics(State(state): State<AdminState>) -> Response {
    let body = (state.render)();
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], body).into_response()
}
