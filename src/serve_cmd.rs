//! `tessera serve`: a whole local cluster in one command. Starts N worker processes, a
//! coordinator and a gateway on loopback (separate processes, joined by gRPC, exactly as
//! a deployment runs them), waits for each to report its address, and supervises them:
//! when one exits or the supervisor is asked to stop, all are stopped.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use tessera_worker::service::DeviceChoice;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Start gateway, coordinator and workers on this machine.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model file or directory; the default model when absent.
    #[arg(long, env = "TESSERA_MODEL")]
    pub model: Option<PathBuf>,
    /// HTTP port of the gateway.
    #[arg(long, env = "TESSERA_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Address the gateway binds.
    #[arg(long, env = "TESSERA_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Model replicas (each of --tp x --pp worker processes).
    #[arg(long, env = "TESSERA_NUM_WORKERS", default_value_t = 1)]
    pub workers: usize,
    /// Tensor-parallel ranks per replica.
    #[arg(long, env = "TESSERA_TP", default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages per replica.
    #[arg(long, env = "TESSERA_PP", default_value_t = 1)]
    pub pp: usize,
    /// CPU threads per worker (default: cores / workers).
    #[arg(long, env = "TESSERA_THREADS")]
    pub threads: Option<usize>,
    /// Where the workers run: `cpu`, or `cuda` / `cuda:N` (worker i on GPU N + i; the KV
    /// cache then takes most of each GPU's free memory and the batch limits grow to GPU
    /// sizes unless --coordinator-args sets them).
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu")]
    pub device: tessera_worker::service::DeviceChoice,
    /// Extra flags passed to the coordinator (e.g. "--max-waiting 8").
    #[arg(long, env = "TESSERA_COORDINATOR_ARGS", default_value = "", allow_hyphen_values = true)]
    pub coordinator_args: String,
    /// Extra flags passed to the gateway (e.g. "--api-key k1").
    #[arg(long, env = "TESSERA_GATEWAY_ARGS", default_value = "", allow_hyphen_values = true)]
    pub gateway_args: String,
}

/// Starts a child and waits for its "listening on ADDR" line; the rest of its output is
/// passed through.
async fn start(name: &str, mut cmd: Command, wait: Duration) -> Result<(Child, String)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).stdin(Stdio::null()).kill_on_drop(true);
    let mut child = cmd.spawn().with_context(|| format!("starting the {name}"))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("{name}: no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let addr = tokio::time::timeout(wait, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(addr) = line.split("listening on ").nth(1) {
                return Ok::<_, std::io::Error>(Some(addr.trim().to_string()));
            }
            println!("{line}");
        }
        Ok(None)
    })
    .await
    .map_err(|_| anyhow!("the {name} did not start within {wait:?}"))??
    .ok_or_else(|| anyhow!("the {name} exited before it was ready"))?;
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            println!("{line}");
        }
    });
    Ok((child, addr))
}

fn split_args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.workers == 0 || args.tp == 0 || args.pp == 0 {
        bail!("--workers, --tp and --pp must be at least 1");
    }
    let processes = args.workers * args.tp * args.pp;
    let model = crate::default_model::resolve(args.model.as_deref())?;
    let exe = std::env::current_exe().context("finding the tessera executable")?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = args.threads.unwrap_or((cores / processes).max(1));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let mut children: Vec<(String, Child)> = Vec::new();
        let mut worker_addrs = Vec::new();
        for i in 0..processes {
            let mut cmd = Command::new(&exe);
            cmd.args(["worker", "--listen", "127.0.0.1:0", "--threads", &threads.to_string()]);
            if let DeviceChoice::Cuda(first) = args.device {
                cmd.args(["--device", &format!("cuda:{}", first + i)]);
            }
            let (child, addr) = start(&format!("worker {i}"), cmd, Duration::from_secs(30)).await?;
            children.push((format!("worker {i}"), child));
            worker_addrs.push(addr);
        }
        let mut cmd = Command::new(&exe);
        cmd.args(["coordinator", "--listen", "127.0.0.1:0", "--workers", &worker_addrs.join(",")])
            .arg("--model")
            .arg(&model);
        if matches!(args.device, DeviceChoice::Cuda(_)) {
            // GPU sizes first; flags given in --coordinator-args come later and win.
            cmd.args(["--kv-memory-mib", "0", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]);
        }
        cmd.args(["--tp", &args.tp.to_string(), "--pp", &args.pp.to_string()]);
        cmd.args(split_args(&args.coordinator_args));
        let (child, coord_addr) = start("coordinator", cmd, Duration::from_secs(300)).await?;
        children.push(("coordinator".into(), child));
        let mut cmd = Command::new(&exe);
        cmd.args(["gateway", "--listen", &format!("{}:{}", args.host, args.port), "--coordinator", &coord_addr])
            .arg("--model")
            .arg(&model)
            .args(split_args(&args.gateway_args));
        let (child, http) = start("gateway", cmd, Duration::from_secs(120)).await?;
        children.push(("gateway".into(), child));
        println!(
            "tessera: serving {} on http://{http} ({} replica(s) of tp {} x pp {})",
            model.display(),
            args.workers,
            args.tp,
            args.pp
        );

        // Supervise: stop everything on a signal or when any child exits.
        let exited = async {
            let waits = children.iter_mut().map(|(name, c)| {
                let name = name.clone();
                Box::pin(async move { (name, c.wait().await) })
            });
            futures::future::select_all(waits).await.0
        };
        let result = tokio::select! {
            _ = tessera_gateway::serve::shutdown_signal() => Ok(()),
            (name, status) = exited => Err(anyhow!("the {name} exited ({status:?}); stopping the cluster")),
        };
        stop_all(&mut children).await;
        result
    })
}

/// SIGTERM to every child (so each drains), then SIGKILL after a grace period.
async fn stop_all(children: &mut [(String, Child)]) {
    for (_, c) in children.iter_mut().rev() {
        if let Some(pid) = c.id() {
            // SAFETY: plain libc call on a pid we spawned and still own.
            unsafe {
                libc::kill(pid as i32, libc::SIGTERM);
            }
        }
    }
    for (_, c) in children.iter_mut() {
        if tokio::time::timeout(Duration::from_secs(10), c.wait()).await.is_err() {
            let _ = c.kill().await;
        }
    }
}
