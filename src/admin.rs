//! `--admin-listen ADDR` of the roles without an HTTP server of their own (coordinator,
//! worker): binds the address, prints `tessera <role> admin on ADDR` (so a parent that asked
//! for port 0 can read it) and serves `/health`, `/ready` and `/metrics` in the background
//! for the life of the process. On SIGTERM readiness turns false at once (the process is
//! draining), while `/health` and `/metrics` keep answering until it exits.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use tessera_telemetry::Readiness;

/// Starts the admin endpoint of `role` on `addr`; returns the bound address.
pub async fn spawn(
    role: &str,
    addr: SocketAddr,
    ready: Readiness,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> Result<SocketAddr> {
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding the admin address {addr}"))?;
    let bound = listener.local_addr()?;
    println!("tessera {role} admin on {bound}");
    let draining = ready.clone();
    tokio::spawn(async move {
        tessera_gateway::serve::shutdown_signal().await;
        draining.set(false);
    });
    let role = role.to_owned();
    tokio::spawn(async move {
        if let Err(e) = tessera_telemetry::serve_admin(listener, ready, render, std::future::pending()).await {
            tracing::warn!("tessera {role}: the admin endpoint stopped: {e}");
        }
    });
    Ok(bound)
}
