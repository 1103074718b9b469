//! `tessera coordinator`: connects to its workers, has each load the model (or its shard:
//! with `--tp T --pp P`, every T x P consecutive workers form one replica), builds one
//! scheduler + engine loop per replica, and serves `tessera.coordinator.v1` to gateways.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_coordinator::engine::Engine;
use tessera_coordinator::placement::Placement;
use tessera_coordinator::replica_link::{LoadSpec, ReplicaLink};
use tessera_coordinator::service::CoordinatorService;
use tessera_coordinator::{Scheduler, SchedulerConfig};
use tessera_proto::coordinator::coordinator_server::CoordinatorServer;

/// Run the coordinator.
#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// Address to serve gRPC on.
    #[arg(long, env = "TESSERA_COORDINATOR_LISTEN", default_value = "127.0.0.1:50050")]
    pub listen: SocketAddr,
    /// Worker addresses, comma separated; each runs one replica (data parallel).
    #[arg(long, env = "TESSERA_WORKERS", value_delimiter = ',', required = true)]
    pub workers: Vec<String>,
    /// Model path, as the workers see it.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: PathBuf,
    /// Positions per KV block.
    #[arg(long, env = "TESSERA_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// KV memory per worker in MiB (the worker sizes its block pool from it); 0 lets each
    /// worker decide (1 GiB on a CPU, most of the free memory on a GPU).
    #[arg(long, env = "TESSERA_KV_MEMORY_MIB", default_value_t = 1024)]
    pub kv_memory_mib: u64,
    /// Most sequences running at once per replica.
    #[arg(long, env = "TESSERA_MAX_NUM_SEQS", default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Token budget of one step (prefill chunk tokens + one per decode).
    #[arg(long, env = "TESSERA_MAX_NUM_BATCHED_TOKENS", default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Most requests waiting per replica; more are refused with 429.
    #[arg(long, env = "TESSERA_MAX_WAITING", default_value_t = 256)]
    pub max_waiting: usize,
    /// Context length to serve (default: the model's).
    #[arg(long, env = "TESSERA_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    /// Tensor-parallel ranks per replica.
    #[arg(long, env = "TESSERA_TP", default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages per replica.
    #[arg(long, env = "TESSERA_PP", default_value_t = 1)]
    pub pp: usize,
    /// Seconds a step may take before its replica is failed (a hung worker).
    #[arg(long, env = "TESSERA_STEP_TIMEOUT_S", default_value_t = 300)]
    pub step_timeout_s: u64,
    /// Seconds to wait for workers to come up.
    #[arg(long, default_value_t = 120)]
    pub connect_timeout_s: u64,
}

pub fn run(args: CoordinatorArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let mut handles = Vec::new();
        let mut served_len = usize::MAX;
        let mut vocab = usize::MAX;
        // Only a sharded replica needs the model's shape here; a whole-model worker reads
        // the file on its own machine.
        let placement = if args.tp == 1 && args.pp == 1 {
            Placement::single()
        } else {
            let files = tessera_model::weights::ModelFiles::open(&args.model)
                .with_context(|| format!("reading {} to place its shards", args.model.display()))?;
            let config = files.config().context("model config")?;
            Placement::plan(&config, args.tp, args.pp).context("placing the model")?
        };
        let per_replica = placement.workers();
        if args.workers.is_empty() || args.workers.len() % per_replica != 0 {
            bail!(
                "{} workers do not form whole replicas of tp {} x pp {} = {per_replica}",
                args.workers.len(),
                args.tp,
                args.pp
            );
        }
        for (r, addrs) in args.workers.chunks(per_replica).enumerate() {
            let addr = addrs.join(",");
            let spec = LoadSpec {
                model_path: args.model.display().to_string(),
                block_size: args.block_size,
                kv_memory_bytes: args.kv_memory_mib << 20,
                group: (std::process::id() as u64) << 16 | r as u64,
            };
            let (link, info) =
                ReplicaLink::connect(addrs, &placement, &spec, Duration::from_secs(args.connect_timeout_s))
                    .await
                    .with_context(|| format!("setting up replica {r} on {addr}"))?;
            let link = link.with_step_timeout(Duration::from_secs(args.step_timeout_s.max(1)));
            let max_len = args.max_model_len.unwrap_or(info.max_model_len as usize).min(info.max_model_len as usize);
            served_len = served_len.min(max_len);
            vocab = vocab.min(info.vocab_size as usize);
            let cfg = SchedulerConfig {
                max_num_seqs: args.max_num_seqs,
                max_num_batched_tokens: args.max_num_batched_tokens.max(args.max_num_seqs),
                max_waiting: args.max_waiting,
                block_size: info.block_size as usize,
                num_blocks: info.num_blocks as usize,
                max_model_len: max_len,
                long_prefill_threshold: 0,
                max_in_flight: placement.pp,
            };
            let sched = Scheduler::new(cfg).context("scheduler configuration")?;
            let (engine, handle) = Engine::new(sched, link);
            tokio::spawn(engine.run());
            eprintln!(
                "tessera coordinator: worker {addr} ready ({} KV blocks of {}, {} positions max)",
                info.num_blocks, info.block_size, max_len
            );
            handles.push(handle);
        }
        if handles.is_empty() {
            bail!("no workers given");
        }
        let name = args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let service = CoordinatorService::new(handles, name, served_len, vocab);
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        println!("tessera coordinator listening on {}", listener.local_addr()?);
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(service))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                tessera_gateway::serve::shutdown_signal(),
            )
            .await?;
        Ok(())
    })
}
