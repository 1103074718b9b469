//! Serving the app on a TCP listener with graceful shutdown: on `shutdown`, stop accepting and
//! let in-flight requests (streams included) finish.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;

use crate::app::{app, AppState};
use crate::codec::Codec;
use crate::config::{ConfigError, GatewayConfig};
use crate::engine::Engine;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// Validates `config`, binds `config.listen` and serves until `shutdown` completes.
pub async fn serve(
    config: GatewayConfig,
    engine: Arc<dyn Engine>,
    codec: Arc<dyn Codec>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = config.listen;
    let state = AppState::new(config, engine, codec)?;
    let listener = TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?;
    serve_on(listener, state, shutdown).await
}

/// Serves on an already bound listener (tests bind port 0).
pub async fn serve_on(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, model = state.model_name(), "gateway listening");
    }
    // Streamed tokens are small writes: with Nagle's algorithm on, each waits for the
    // previous one's acknowledgement and they reach the client in bursts.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
    });
    axum::serve(listener, app(state)).with_graceful_shutdown(shutdown).await?;
    Ok(())
}

/// Completes on Ctrl-C or SIGTERM (what Kubernetes and systemd send).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
