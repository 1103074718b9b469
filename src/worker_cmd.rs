//! `tessera worker`: one worker process serving `tessera.worker.v1.Worker` over gRPC.
//! The coordinator connects, sends Load, then drives the Step stream. With the mTLS flags
//! (tls.rs) only clients with a certificate signed by the CA are served.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_telemetry::Readiness;
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
    /// Where the model runs: `cpu`, `cuda` (GPU 0), `cuda:N`, `hip` (AMD GPU 0), `hip:N`, or
    /// `auto`: GPU 0 of the first GPU backend compiled in that sees a GPU (CUDA, then HIP),
    /// else the CPU.
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu")]
    pub device: DeviceChoice,
    /// On SIGTERM: seconds to keep serving the coordinator's open streams (until it hangs
    /// up) before exiting anyway.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Address of the admin HTTP endpoint (`/health`, `/ready`, `/metrics`); off when absent.
    #[arg(long, env = "TESSERA_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// etcd mode (see etcd_cmd.rs): register this worker under a lease.
    #[command(flatten)]
    pub etcd: crate::etcd_cmd::EtcdFlags,
    /// Traces and logs.
    #[command(flatten)]
    pub trace_log: crate::trace_logs::TraceLogFlags,
    /// mTLS on the gRPC server (see tls.rs).
    #[command(flatten)]
    pub tls: crate::tls::TlsFlags,
}

pub fn run(args: WorkerArgs) -> Result<()> {
    let _trace = args.trace_log.init("tessera-worker")?;
    let tls = args.tls.load()?;
    crate::threads::init(args.threads)?;
    if let DeviceChoice::Hip(ordinal) = args.device {
        // Opens the GPU and compiles its kernel modules now: a machine without a usable AMD
        // GPU or toolchain (or a build without HIP) stops here with the reason.
        let found = tessera_worker::hip::probe(ordinal).map_err(|e| anyhow::anyhow!("--device hip:{ordinal}: {e}"))?;
        eprintln!("tessera worker: {found}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        // A GPU shard's step still blocked on a peer after the coordinator gave the replica
        // up cannot be cancelled inside its collective, and a GPU context lost to a fault
        // fails every later step: end the process so its supervisor restarts it with a
        // fresh context (tessera_worker::step_watch).
        let on_unrecoverable: tessera_worker::step_watch::StuckHook = Arc::new(|what: &str| {
            eprintln!("tessera worker: {what}; exiting so a restart gives the GPU a fresh context (exit code 75)");
            // _exit, not exit: no atexit teardown (CUDA, NCCL) on a context that is stuck
            // in a collective or lost, which can hang or fault.
            // SAFETY: ends the process; nothing runs after it.
            unsafe { libc::_exit(75) }
        });
        let service = WorkerService::on(args.device)
            .with_collective_host(args.listen.ip())
            .with_unrecoverable_hook(tessera_worker::step_watch::grace_from_env(), on_unrecoverable);
        let readiness = Readiness::new(false);
        if let Some(addr) = args.admin_listen {
            let m = service.metrics();
            crate::admin::spawn("worker", addr, readiness.clone(), Arc::new(move || m.render())).await?;
        }
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        // The bound address on one line, so a parent that asked for port 0 can read it.
        println!("tessera worker listening on {}", listener.local_addr()?);
        readiness.set(true);
        let registration = crate::etcd_cmd::register_worker(&args.etcd, listener.local_addr()?, args.device).await?;
        // SIGTERM: not ready, no new connections, Load refused; the coordinator's open
        // Step streams are served until it hangs up or the drain timeout passes.
        // HTTP/2 and TCP keepalives: a coordinator that vanishes without closing its step
        // streams (host down, network cut) is noticed, its streams close, and a step stuck
        // on a peer is then watched (step_watch) instead of waiting forever.
        let server = crate::tls::server_builder(tls.as_ref())?
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .tcp_keepalive(Some(Duration::from_secs(30)))
            .layer(crate::drain::RefuseWhenNotReady::new(readiness.clone(), &["/tessera.worker.v1.Worker/Load"]))
            .add_service(WorkerServer::new(service).max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES))
            // No Nagle delay on step replies: each is small and awaited.
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                {
                    let readiness = readiness.clone();
                    async move {
                        tessera_gateway::serve::shutdown_signal().await;
                        readiness.set(false);
                    }
                },
            );
        crate::drain::serve_bounded("worker", server, Duration::from_secs(args.drain_timeout_s)).await?;
        crate::etcd_cmd::deregister_worker(registration).await;
        Ok(())
    })
}
