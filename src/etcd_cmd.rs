//! The etcd side of `tessera worker | coordinator | gateway` (`--etcd-endpoints`). Without
//! that flag every role works as before (static `--workers` and `--coordinator` lists);
//! `tessera serve` never uses etcd. With it:
//! - a worker registers `{id, addr, device, free_memory_bytes}` under a lease kept alive
//!   while it runs, and revokes it when it stops;
//! - a coordinator reads the cluster settings (`/tessera/<cluster>/config`; flags and their
//!   environment variables win), campaigns for leadership and waits as a standby until it
//!   leads, then finds its workers through etcd, writes the replica plan and publishes its
//!   address, both fenced by its leadership. **If it loses leadership it stops serving and
//!   exits with an error**, so its supervisor (systemd, Kubernetes) restarts it and it
//!   campaigns again as a standby; a deposed leader never keeps acting. On a clean shutdown
//!   it resigns, so a standby takes over at once;
//! - a gateway follows the published leader address instead of `--coordinator`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{Args, CommandFactory};
use tessera_cluster::{
    ClusterError, ClusterSettings, Discovery, EtcdDiscovery, Leadership, Registration, WorkerRecord,
};
use tessera_worker::service::DeviceChoice;

use crate::coordinator_cmd::CoordinatorArgs;

/// Flags shared by the roles that can use etcd.
#[derive(Debug, Clone, Args)]
pub struct EtcdFlags {
    /// etcd endpoints, comma separated (`host:port` or `http://host:port`). When set, the
    /// process finds the cluster through etcd: workers register, coordinators elect a
    /// leader and discover workers, gateways follow the leader.
    #[arg(long, env = "TESSERA_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Name of the cluster: its keys live under `/tessera/<name>/` in etcd.
    #[arg(long, env = "TESSERA_CLUSTER_NAME", default_value = "tessera")]
    pub cluster_name: String,
    /// Seconds a worker registration or a coordinator's leadership outlives its process
    /// (the etcd lease TTL): failures are noticed within it.
    #[arg(long, env = "TESSERA_LEASE_TTL_S", default_value_t = 5)]
    pub lease_ttl_s: u64,
    /// The `host:port` others dial to reach this process (worker, coordinator); default:
    /// the address it listens on (required when that is 0.0.0.0 or ::).
    #[arg(long, env = "TESSERA_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
}

impl EtcdFlags {
    /// The endpoints given, empty entries dropped.
    pub fn endpoints(&self) -> Vec<String> {
        self.etcd_endpoints.iter().map(|e| e.trim()).filter(|e| !e.is_empty()).map(str::to_string).collect()
    }

    pub fn enabled(&self) -> bool {
        !self.endpoints().is_empty()
    }

    /// Where others reach this process listening on `bound`.
    fn advertise(&self, bound: SocketAddr) -> Result<String> {
        if let Some(a) = &self.advertise_addr {
            return Ok(a.clone());
        }
        if bound.ip().is_unspecified() {
            bail!("listening on {bound}: give --advertise-addr, the address others dial to reach this process");
        }
        Ok(bound.to_string())
    }
}

// ---- worker -------------------------------------------------------------------------------

/// Registers the worker listening on `bound`, when etcd is configured.
pub async fn register_worker(
    flags: &EtcdFlags,
    bound: SocketAddr,
    device: DeviceChoice,
) -> Result<Option<Registration>> {
    if !flags.enabled() {
        return Ok(None);
    }
    let addr = flags.advertise(bound)?;
    let record = WorkerRecord {
        id: addr.clone(),
        addr,
        device: device_name(device),
        free_memory_bytes: free_memory_bytes(device).await,
    };
    let reg =
        tessera_cluster::register_worker(&flags.endpoints(), &flags.cluster_name, record.clone(), flags.lease_ttl_s)
            .await
            .context("registering the worker in etcd")?;
    tracing::info!("tessera worker: registered as {} in cluster {:?}", record.id, flags.cluster_name);
    Ok(Some(reg))
}

/// Removes the registration at shutdown (its lease would expire anyway).
pub async fn deregister_worker(reg: Option<Registration>) {
    if let Some(reg) = reg {
        if let Err(e) = reg.deregister().await {
            tracing::warn!("tessera worker: deregistering: {e} (the record expires with its lease)");
        }
    }
}

fn device_name(d: DeviceChoice) -> String {
    match d {
        DeviceChoice::Cpu => "cpu".into(),
        DeviceChoice::Cuda(n) => format!("cuda:{n}"),
        DeviceChoice::Hip(n) => format!("hip:{n}"),
    }
}

/// Free memory of the device at registration, 0 when it cannot be read: the host's
/// available memory for the CPU; `nvidia-smi`'s figure for a GPU (the worker has not
/// opened the device yet).
async fn free_memory_bytes(d: DeviceChoice) -> u64 {
    match d {
        DeviceChoice::Cpu => std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
                line.split_whitespace().nth(1)?.parse::<u64>().ok()
            })
            .map_or(0, |kib| kib << 10),
        DeviceChoice::Cuda(n) => {
            let out = tokio::process::Command::new("nvidia-smi")
                .args(["--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", &n.to_string()])
                .output();
            match tokio::time::timeout(Duration::from_secs(5), out).await {
                Ok(Ok(o)) if o.status.success() => {
                    String::from_utf8_lossy(&o.stdout).trim().parse::<u64>().map_or(0, |mib| mib << 20)
                }
                _ => 0,
            }
        }
        // Not read for AMD GPUs (rocm-smi is not assumed): unknown.
        DeviceChoice::Hip(_) => 0,
    }
}

// ---- coordinator --------------------------------------------------------------------------

/// A coordinator that leads its cluster through etcd.
pub struct CoordinatorCluster {
    flags: EtcdFlags,
    leadership: Leadership,
    discovery: Arc<EtcdDiscovery>,
}

/// How long the registered workers must stay unchanged before replicas are formed on them.
const SETTLE: Duration = Duration::from_secs(2);

/// Fills the coordinator's model from `--model` or, in etcd mode, the cluster settings,
/// applies the other settings no flag gave, and (in etcd mode) campaigns: returns once this
/// coordinator leads. Static mode returns `None` and needs `--model`.
pub async fn prepare_coordinator(args: &mut CoordinatorArgs) -> Result<Option<CoordinatorCluster>> {
    let flags = args.etcd.clone();
    if !flags.enabled() {
        args.model = args.model_flag.clone().context("--model is required")?;
        return Ok(None);
    }
    tessera_cluster::etcd::check_ttl(flags.lease_ttl_s)?;
    tessera_cluster::ClusterKeys::new(&flags.cluster_name)?;
    let eps = flags.endpoints();
    let settings = tessera_cluster::load_settings(&eps, &flags.cluster_name)
        .await
        .context("reading the cluster settings from etcd")?;
    let given = flags_given(std::env::args_os());
    apply_settings(args, &settings, |id| given.contains(&id.to_string()));
    if args.model.as_os_str().is_empty() {
        bail!("no model: give --model or set \"model\" in /tessera/{}/config", flags.cluster_name);
    }
    let candidate = flags.advertise(args.listen)?;
    tracing::info!(
        "tessera coordinator: campaigning for leadership of cluster {:?} as {candidate}",
        flags.cluster_name
    );
    let leadership = loop {
        tokio::select! {
            r = tessera_cluster::campaign(&eps, &flags.cluster_name, &candidate, flags.lease_ttl_s) => match r {
                Ok(l) => break l,
                Err(e @ (ClusterError::Invalid(_) | ClusterError::Malformed { .. })) => return Err(e.into()),
                Err(e) => {
                    tracing::warn!("tessera coordinator: campaign failed, retrying in 1 s: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
            _ = tessera_gateway::serve::shutdown_signal() => {
                tracing::warn!("tessera coordinator: stopped while standing by");
                std::process::exit(0);
            }
        }
    };
    tracing::info!(
        "tessera coordinator: leading cluster {:?} (fencing token {})",
        flags.cluster_name,
        leadership.token()
    );
    let discovery =
        Arc::new(EtcdDiscovery::connect(&eps, &flags.cluster_name).await.context("watching the workers in etcd")?);
    Ok(Some(CoordinatorCluster { flags, leadership, discovery }))
}

/// Settings from etcd fill what no flag or environment variable gave.
fn apply_settings(args: &mut CoordinatorArgs, s: &ClusterSettings, given: impl Fn(&str) -> bool) {
    macro_rules! fill {
        ($($field:ident),*) => {$(
            if let Some(v) = s.$field.clone() {
                if !given(stringify!($field)) {
                    args.$field = v;
                }
            }
        )*};
    }
    // Flags whose absence means "decided later" stay optional.
    macro_rules! fill_optional {
        ($($field:ident),*) => {$(
            if s.$field.is_some() && !given(stringify!($field)) {
                args.$field = s.$field;
            }
        )*};
    }
    fill!(max_num_seqs, max_num_batched_tokens, max_waiting, block_size, kv_memory_mib, tp, pp);
    fill_optional!(max_model_len, step_timeout_s);
    args.model = args.model_flag.clone().or_else(|| s.model.clone().map(Into::into)).unwrap_or_default();
}

/// The coordinator flags that `argv` (the process's arguments) or their environment
/// variables gave, as opposed to defaults.
fn flags_given(argv: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<String> {
    let Ok(m) = crate::Cli::command().try_get_matches_from(argv) else {
        return Vec::new();
    };
    let Some(c) = m.subcommand_matches("coordinator") else {
        return Vec::new();
    };
    c.ids()
        .filter(|id| matches!(c.value_source(id.as_str()), Some(ValueSource::CommandLine | ValueSource::EnvVariable)))
        .map(|id| id.as_str().to_string())
        .collect()
}

impl CoordinatorCluster {
    /// The workers etcd lists, once they are a non-empty whole number of replicas of
    /// `per_replica` and have not changed for a moment (workers register one by one).
    pub async fn discovery(&self, per_replica: usize, timeout: Duration) -> Result<Arc<dyn Discovery>> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = None;
        loop {
            let ws = self.discovery.workers().await.context("listing the workers in etcd")?;
            let whole = !ws.is_empty() && ws.len() % per_replica == 0;
            if whole && last.as_ref() == Some(&ws) {
                return Ok(self.discovery.clone());
            }
            if tokio::time::Instant::now() >= deadline {
                bail!(
                    "{} worker(s) registered in cluster {:?} after {timeout:?}: need a non-zero multiple of {per_replica}",
                    ws.len(),
                    self.flags.cluster_name
                );
            }
            last = whole.then_some(ws);
            self.discovery.wait_change(SETTLE).await;
        }
    }

    /// Writes the replica plan (every `per_replica` workers one replica, as formed) and
    /// publishes this leader's address, both fenced.
    pub async fn publish(&self, bound: SocketAddr, per_replica: usize) -> Result<()> {
        let ws = self.discovery.workers().await.context("listing the workers in etcd")?;
        let replicas = ws.chunks(per_replica.max(1)).map(|c| c.iter().map(|w| w.addr.clone()).collect()).collect();
        self.leadership.write_plan(replicas).await.context("writing the replica plan")?;
        let addr = self.flags.advertise(bound)?;
        self.leadership.publish_address(&addr).await.context("publishing the leader address")?;
        tracing::info!("tessera coordinator: published {addr} as the leader of cluster {:?}", self.flags.cluster_name);
        Ok(())
    }

    /// Runs `serve` while this coordinator leads. Losing leadership ends it with an error
    /// (the process exits, to be restarted as a standby); a clean end resigns.
    pub async fn serve_while_leading(&self, serve: impl std::future::Future<Output = Result<()>>) -> Result<()> {
        tokio::select! {
            r = serve => {
                if let Err(e) = self.leadership.resign().await {
                    tracing::warn!("tessera coordinator: resigning: {e} (the leadership expires with its lease)");
                }
                r
            }
            _ = self.leadership.lost() => bail!(
                "lost the leadership of cluster {:?} (fencing token {}): stopping so a restart campaigns again",
                self.flags.cluster_name,
                self.leadership.token()
            ),
        }
    }
}

// ---- gateway ------------------------------------------------------------------------------

/// The gateway's engine in etcd mode: a client of whichever coordinator leads. The returned
/// watch must live as long as the engine (dropping it stops following). With `tls`, every
/// leader is dialed over mutual TLS.
pub async fn leader_engine(
    flags: &EtcdFlags,
    tls: Option<tonic::transport::ClientTlsConfig>,
) -> Result<(tessera_gateway::leader::LeaderEngine, tessera_cluster::LeaderWatch)> {
    let watch = tessera_cluster::follow_leader(&flags.endpoints(), &flags.cluster_name)
        .await
        .context("finding the coordinator leader in etcd")?;
    match watch.current() {
        Some(a) => tracing::info!("tessera gateway: coordinator leader is {a}"),
        None => tracing::info!("tessera gateway: no coordinator leader published yet; waiting for one"),
    }
    let engine = tessera_gateway::leader::LeaderEngine::new(watch.subscribe(), watch.refresher()).with_tls(tls);
    Ok((engine, watch))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn settings_fill_what_no_flag_gave() {
        let argv = ["tessera", "coordinator", "--etcd-endpoints", "127.0.0.1:1", "--max-num-seqs", "7"];
        let crate::Command::Coordinator(mut args) = crate::Cli::parse_from(argv).command else {
            panic!("not the coordinator");
        };
        let settings = ClusterSettings::parse(
            "config",
            br#"{"model": "/m.gguf", "max_num_seqs": 3, "max_waiting": 5, "max_model_len": 99, "step_timeout_s": 20}"#,
        )
        .unwrap();
        let given = flags_given(argv.map(Into::into));
        assert!(given.contains(&"max_num_seqs".to_string()) && !given.contains(&"max_waiting".to_string()));
        apply_settings(&mut args, &settings, |id| given.contains(&id.to_string()));
        assert_eq!((args.max_num_seqs, args.max_waiting, args.max_model_len), (7, 5, Some(99)));
        assert_eq!(args.step_timeout_s, Some(20));
        assert_eq!(args.model, std::path::PathBuf::from("/m.gguf"));
        let crate::Command::Coordinator(plain) = crate::Cli::parse_from(argv).command else { unreachable!() };
        assert_eq!(args.max_num_batched_tokens, plain.max_num_batched_tokens, "a default changed with nothing set");
        // No deadline given anywhere: the replica's devices decide it at formation.
        assert_eq!(plain.step_timeout_s, None);
        // Without etcd, --workers and --model stay required.
        assert!(crate::Cli::try_parse_from(["tessera", "coordinator", "--model", "m"]).is_err());
        assert!(crate::Cli::try_parse_from(["tessera", "coordinator", "--workers", "a:1"]).is_err());
    }
}
