//! `tessera worker`: one worker process serving `tessera.worker.v1.Worker` over gRPC.
//! The coordinator connects, sends Load, then drives the Step stream.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use clap::Args;
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_worker::service::{DeviceChoice, WorkerService};

/// Run one worker process.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Address to serve gRPC on.
    #[arg(long, env = "TESSERA_WORKER_LISTEN", default_value = "127.0.0.1:50061")]
    pub listen: SocketAddr,
    /// CPU threads for the kernels (default: all cores).
    #[arg(long, env = "TESSERA_THREADS")]
    pub threads: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` (GPU 0) or `cuda:N`.
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu")]
    pub device: DeviceChoice,
}

pub fn run(args: WorkerArgs) -> Result<()> {
    crate::threads::init(args.threads)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        // The bound address on one line, so a parent that asked for port 0 can read it.
        println!("tessera worker listening on {}", listener.local_addr()?);
        tonic::transport::Server::builder()
            .add_service(
                WorkerServer::new(WorkerService::on(args.device).with_collective_host(args.listen.ip()))
                    .max_decoding_message_size(64 << 20),
            )
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                tessera_gateway::serve::shutdown_signal(),
            )
            .await?;
        Ok(())
    })
}
