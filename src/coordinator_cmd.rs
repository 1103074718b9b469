//! `tessera coordinator`: connects to its workers, has each load the model (or its shard:
//! with `--tp T --pp P`, every T x P consecutive workers form one replica), builds one
//! scheduler + engine loop per replica, and serves `tessera.coordinator.v1` to gateways.
//! A replica whose workers fail is re-formed from the workers discovery lists once they
//! pass a readiness check; on SIGTERM the coordinator drains (refuses new streams, lets
//! those in flight finish up to `--drain-timeout-s`) and exits. With the mTLS flags
//! (tls.rs) both its server and its links to the workers are mutual TLS.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};
use clap::Args;
use tessera_cluster::{Discovery, StaticDiscovery};
use tessera_coordinator::drain::Drain;
use tessera_coordinator::engine::Engine;
use tessera_coordinator::metrics::CoordinatorMetrics;
use tessera_coordinator::placement::Placement;
use tessera_coordinator::replica_link::LoadSpec;
use tessera_coordinator::replica_set::ReplicaSet;
use tessera_coordinator::routing::RoutingConfig;
use tessera_coordinator::service::CoordinatorService;
use tessera_coordinator::supervisor::{form, FormSpec, Supervision};
use tessera_coordinator::SchedulerConfig;
use tessera_proto::coordinator::coordinator_server::CoordinatorServer;
use tessera_telemetry::Readiness;

/// Run the coordinator.
#[derive(Debug, Args)]
pub struct CoordinatorArgs {
    /// Address to serve gRPC on.
    #[arg(long, env = "TESSERA_COORDINATOR_LISTEN", default_value = "127.0.0.1:50050")]
    pub listen: SocketAddr,
    /// Worker addresses, comma separated; each runs one replica (data parallel).
    #[arg(long, env = "TESSERA_WORKERS", value_delimiter = ',', required_unless_present = "etcd_endpoints")]
    pub workers: Vec<String>,
    /// Model path, as the workers see it (with etcd, or `model` in the cluster settings).
    #[arg(long = "model", value_name = "MODEL", env = "TESSERA_MODEL", required_unless_present = "etcd_endpoints")]
    pub model_flag: Option<PathBuf>,
    /// The model path in use: `--model`, else the cluster settings' (set by
    /// `etcd_cmd::prepare_coordinator` before anything reads it).
    #[arg(skip)]
    pub model: PathBuf,
    /// etcd mode (see etcd_cmd.rs): workers from etcd, leader election, cluster settings.
    #[command(flatten)]
    pub etcd: crate::etcd_cmd::EtcdFlags,
    /// Traces and logs.
    #[command(flatten)]
    pub trace_log: crate::trace_logs::TraceLogFlags,
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
    /// Seconds a step may take before its replica is failed (a hung worker). Default: 60
    /// for a replica of GPU workers only, else 300 (a long CPU prefill takes seconds).
    #[arg(long, env = "TESSERA_STEP_TIMEOUT_S")]
    pub step_timeout_s: Option<u64>,
    /// Seconds to wait for workers to come up.
    #[arg(long, env = "TESSERA_CONNECT_TIMEOUT_S", default_value_t = 120)]
    pub connect_timeout_s: u64,
    /// Prefix-cache affinity: a request goes to the replica that last served its prefix
    /// unless that one holds more than this many sequences beyond the least loaded.
    #[arg(long, env = "TESSERA_AFFINITY_MARGIN", default_value_t = 8)]
    pub affinity_margin: usize,
    /// On SIGTERM: seconds the streams in flight may take to finish (new ones are refused
    /// with UNAVAILABLE meanwhile) before the coordinator exits anyway.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Address of the admin HTTP endpoint (`/health`, `/ready`, `/metrics`); off when absent.
    #[arg(long, env = "TESSERA_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// mTLS on the gRPC server and on the links to the workers (see tls.rs).
    #[command(flatten)]
    pub tls: crate::tls::TlsFlags,
}

pub fn run(args: CoordinatorArgs) -> Result<()> {
    let _trace = args.trace_log.init("tessera-coordinator")?;
    let tls = args.tls.load()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let mut args = args;
        let metrics = CoordinatorMetrics::new();
        let readiness = Readiness::new(false);
        if let Some(addr) = args.admin_listen {
            let m = metrics.clone();
            crate::admin::spawn("coordinator", addr, readiness.clone(), Arc::new(move || m.render())).await?;
        }
        // etcd mode: settings applied, and this coordinator leads once this returns.
        let cluster = crate::etcd_cmd::prepare_coordinator(&mut args).await?;
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
        let discovery: Arc<dyn Discovery> = match &cluster {
            Some(c) => c.discovery(per_replica, Duration::from_secs(args.connect_timeout_s)).await?,
            None => Arc::new(StaticDiscovery::new(&args.workers)),
        };
        let client_tls = tls.as_ref().map(crate::tls::Tls::client);
        let (set, supervision, served_len, vocab) =
            form_replicas(&args, placement, discovery, &metrics, client_tls).await?;
        supervision.spawn_all();
        // Workers registered later (etcd) form new replicas.
        let spawn_engine: tessera_coordinator::supervisor::SpawnEngine = {
            let (set, metrics) = (set.clone(), metrics.clone());
            Box::new(move |r, formed| {
                let (engine, handle) = Engine::new(formed.sched, formed.link);
                tokio::spawn(engine.in_set(set.clone(), r).with_metrics(metrics.replica(r)).run());
                handle
            })
        };
        tokio::spawn(tessera_coordinator::supervisor::scale_out(supervision.clone(), spawn_engine));
        let name = args.model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let drain = Drain::new();
        let service = CoordinatorService::with_set(set, name, served_len, vocab).with_drain(drain.clone());
        let listener =
            tokio::net::TcpListener::bind(args.listen).await.with_context(|| format!("binding {}", args.listen))?;
        println!("tessera coordinator listening on {}", listener.local_addr()?);
        readiness.set(true);
        if let Some(c) = &cluster {
            c.publish(listener.local_addr()?, per_replica).await?;
        }
        let drain_timeout = Duration::from_secs(args.drain_timeout_s);
        let server = crate::tls::server_builder(tls.as_ref())?
            // tonic's 4 MiB default is near what a request the gateway accepts can reach (a
            // 1 MiB schema, a full-vocabulary logit_bias, a long prompt as token ids, a
            // raised --max-body-bytes); past it a request was refused as a 500.
            .add_service(CoordinatorServer::new(service).max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES))
            .serve_with_incoming_shutdown(
                // Token events are small writes: without TCP_NODELAY, Nagle's algorithm holds
                // each one until the previous is acknowledged and tokens arrive in bursts.
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                drained(drain, readiness.clone(), drain_timeout),
            );
        // After the drain, connections get a few seconds to close.
        let server = crate::drain::serve_bounded("coordinator", server, drain_timeout + Duration::from_secs(5));
        match &cluster {
            Some(c) => c.serve_while_leading(server).await,
            None => server.await,
        }
    })
}

/// Forms every replica on the workers `discovery` lists (every `tp x pp` consecutive
/// workers one replica; over mutual TLS with `tls`), waiting for them up to
/// `--connect-timeout-s`, and prepares the supervision that re-forms a replica whose
/// workers fail. Returns the set, the supervision, the served context length and the
/// vocabulary size.
async fn form_replicas(
    args: &CoordinatorArgs,
    placement: Placement,
    discovery: Arc<dyn Discovery>,
    metrics: &Arc<CoordinatorMetrics>,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<(Arc<ReplicaSet>, Arc<Supervision>, usize, usize)> {
    let per_replica = placement.workers();
    let records = discovery.workers().await.context("looking up the workers")?;
    if records.is_empty() || records.len() % per_replica != 0 {
        bail!(
            "{} workers do not form whole replicas of tp {} x pp {} = {per_replica}",
            records.len(),
            args.tp,
            args.pp
        );
    }
    let max_num_batched_tokens = args.max_num_batched_tokens.max(args.max_num_seqs);
    let spec = FormSpec {
        load: LoadSpec {
            model_path: args.model.display().to_string(),
            block_size: args.block_size,
            kv_memory_bytes: args.kv_memory_mib << 20,
            // The workers keep activation memory for the scheduler's largest step.
            max_step_tokens: u32::try_from(max_num_batched_tokens).unwrap_or(u32::MAX),
            // Keeps this coordinator's collectives apart; replica and formation numbers are
            // added in the low 16 bits.
            group: (std::process::id() as u64) << 16,
        },
        sched: SchedulerConfig {
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens,
            max_waiting: args.max_waiting,
            // Replicas without pipeline stages overlap the coordinator's round trip with
            // the next step (`TESSERA_LOOKAHEAD=0`: off, for A/B runs).
            lookahead: std::env::var("TESSERA_LOOKAHEAD").as_deref() != Ok("0"),
            ..SchedulerConfig::new(args.block_size as usize, 1, 1)
        },
        max_model_len: args.max_model_len,
        step_timeout: args.step_timeout_s.map(|s| Duration::from_secs(s.max(1))),
        placement,
        tls,
    };
    let routing = RoutingConfig { affinity_margin: args.affinity_margin, ..RoutingConfig::default() };
    let set = Arc::new(ReplicaSet::new(routing));
    let (mut handles, mut members) = (Vec::new(), Vec::new());
    let (mut served_len, mut vocab) = (usize::MAX, usize::MAX);
    for (r, chunk) in records.chunks(per_replica).enumerate() {
        let addrs: Vec<String> = chunk.iter().map(|w| w.addr.clone()).collect();
        let addr = addrs.join(",");
        let formed = form(&addrs, &spec, spec.load.group | r as u64, Duration::from_secs(args.connect_timeout_s))
            .await
            .with_context(|| format!("setting up replica {r} on {addr}"))?;
        let info = &formed.info;
        let max_len = formed.sched.config().max_model_len;
        served_len = served_len.min(max_len);
        vocab = vocab.min(info.vocab_size as usize);
        tracing::info!(
            "tessera coordinator: worker {addr} ready ({} KV blocks of {}, {} positions max, step deadline {} s)",
            info.num_blocks,
            info.block_size,
            max_len,
            formed.link.step_timeout().as_secs()
        );
        let (engine, handle) = Engine::new(formed.sched, formed.link);
        tokio::spawn(engine.in_set(set.clone(), r).with_metrics(metrics.replica(r)).run());
        handles.push(handle);
        members.push(addrs);
    }
    set.install(handles);
    let supervision = Arc::new(Supervision {
        set: set.clone(),
        discovery,
        spec,
        members: Mutex::new(members),
        period: Duration::from_secs(1),
        ready_timeout: Duration::from_secs(3),
        form_timeout: Duration::from_secs(args.connect_timeout_s.max(10)),
    });
    Ok((set, supervision, served_len, vocab))
}

/// Completes when the process is asked to stop and the streams in flight have ended (or
/// `timeout` passed): on the signal, `drain` starts (new calls refused, Status and the
/// admin `/ready` not ready).
async fn drained(drain: Drain, readiness: Readiness, timeout: Duration) {
    tessera_gateway::serve::shutdown_signal().await;
    readiness.set(false);
    tracing::info!("tessera coordinator: draining {} stream(s) (at most {} s)", drain.in_flight(), timeout.as_secs());
    drain.start();
    if tokio::time::timeout(timeout, drain.idle()).await.is_err() {
        tracing::warn!("tessera coordinator: drain timeout; {} stream(s) cut", drain.in_flight());
    }
}
