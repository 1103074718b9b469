//! `tessera serve`: a whole local cluster in one command. Starts N worker processes, a
//! coordinator and a gateway on loopback (separate processes, joined by gRPC, exactly as
//! a deployment runs them), waits for each to report its address, and supervises them: a
//! worker that exits is started again on the same address (the coordinator re-forms its
//! replica); when another child exits or on SIGTERM, the cluster stops front to back
//! (gateway, which drains its streams, then coordinator, then workers), leaving no
//! process behind. With `--tls-dir` (the files `tessera certs` writes) every gRPC link
//! between them is mutual TLS.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

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
    /// Where the workers run: `cpu`, `cuda` / `cuda:N` or `hip` / `hip:N` (worker i on GPU
    /// N + i; the KV cache then takes most of each GPU's free memory and the batch limits grow
    /// to GPU sizes unless --coordinator-args sets them; HIP: one model per AMD GPU, no --tp /
    /// --pp), or `auto` (a CUDA GPU, else an AMD GPU, else the CPU; see the README's platform
    /// table).
    #[arg(long, env = "TESSERA_DEVICE", default_value = "cpu")]
    pub device: tessera_worker::service::DeviceChoice,
    /// Extra flags passed to the coordinator (e.g. "--max-waiting 8").
    #[arg(long, env = "TESSERA_COORDINATOR_ARGS", default_value = "", allow_hyphen_values = true)]
    pub coordinator_args: String,
    /// On SIGTERM: seconds the gateway, then the coordinator, may take to finish the
    /// requests in flight (new ones get 503) before they are stopped anyway.
    #[arg(long, env = "TESSERA_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Extra flags passed to the gateway (e.g. "--api-key k1").
    #[arg(long, env = "TESSERA_GATEWAY_ARGS", default_value = "", allow_hyphen_values = true)]
    pub gateway_args: String,
    /// Traces and logs of every process (passed on through the environment).
    #[command(flatten)]
    pub trace_log: crate::trace_logs::TraceLogFlags,
    /// mTLS between the processes: a directory as `tessera certs` writes it (ca.pem;
    /// server.pem/.key for the coordinator and workers, naming 127.0.0.1; client.pem/.key
    /// for the gateway).
    #[arg(long, env = "TESSERA_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
}

/// Starts a child and waits for its "listening on ADDR" line; the rest of its output is
/// passed through.
async fn start(name: &str, mut cmd: Command, wait: Duration) -> Result<(Child, String)> {
    cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).stdin(Stdio::null()).kill_on_drop(true);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl is async-signal-safe; it only asks the kernel to send the child SIGTERM
    // when this process dies (so even a SIGKILL-ed `serve` leaves no orphans).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
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

/// The mTLS flags of the servers (coordinator, workers) and of the gateway, from a
/// directory `tessera certs` wrote; checked here so a bad directory fails before any child
/// starts.
fn tls_args(dir: &std::path::Path) -> Result<(Vec<std::ffi::OsString>, Vec<std::ffi::OsString>)> {
    let f = crate::certs_cmd::CertFiles::in_dir(dir);
    let check = |cert: &std::path::Path, key: &std::path::Path| {
        crate::tls::TlsFlags {
            tls_cert: Some(cert.to_path_buf()),
            tls_key: Some(key.to_path_buf()),
            tls_ca: Some(f.ca_cert.clone()),
            tls_server_name: None,
        }
        .load()
        .with_context(|| format!("--tls-dir {}", dir.display()))
    };
    check(&f.server_cert, &f.server_key)?;
    check(&f.client_cert, &f.client_key)?;
    Ok((
        crate::tls::child_args(&f.server_cert, &f.server_key, &f.ca_cert),
        crate::tls::child_args(&f.client_cert, &f.client_key, &f.ca_cert),
    ))
}

fn split_args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.workers == 0 || args.tp == 0 || args.pp == 0 {
        bail!("--workers, --tp and --pp must be at least 1");
    }
    if let DeviceChoice::Hip(first) = args.device {
        if args.tp > 1 || args.pp > 1 {
            bail!("--device hip: one model per AMD GPU (no --tp / --pp on HIP yet)");
        }
        // Fails once, here, with the reason (not compiled in, no GPU, no toolchain) instead
        // of in every worker; compiles the kernel modules into the cache the workers read.
        let found = tessera_worker::hip::probe(first).map_err(|e| anyhow::anyhow!("--device hip:{first}: {e}"))?;
        eprintln!("tessera serve: {found}");
    }
    let processes = args.workers * args.tp * args.pp;
    // Before any thread starts: the children (restarted workers too) inherit it.
    args.trace_log.export_to_children();
    let model = crate::default_model::resolve(args.model.as_deref())?;
    let exe = std::env::current_exe().context("finding the tessera executable")?;
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let threads = args.threads.unwrap_or((cores / processes).max(1));
    let drain = args.drain_timeout_s.to_string();
    let (server_tls, gateway_tls) = match &args.tls_dir {
        Some(dir) => tls_args(dir)?,
        None => (Vec::new(), Vec::new()),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        // Registered first, so a SIGTERM during start-up is not lost.
        let mut signal = std::pin::pin!(tessera_gateway::serve::shutdown_signal());
        let mut children: Vec<Proc> = Vec::new();
        let mut worker_addrs = Vec::new();
        for i in 0..processes {
            let spec = WorkerSpec {
                exe: exe.clone(),
                threads,
                device: args.device,
                index: i,
                drain: drain.clone(),
                tls: server_tls.clone(),
            };
            let (child, addr) =
                start(&format!("worker {i}"), spec.command("127.0.0.1:0"), Duration::from_secs(30)).await?;
            children.push(Proc::new(format!("worker {i}"), child, Some((spec, addr.clone()))));
            worker_addrs.push(addr);
        }
        let mut cmd = Command::new(&exe);
        cmd.args(["coordinator", "--listen", "127.0.0.1:0", "--workers", &worker_addrs.join(",")])
            // Admin endpoints (/metrics) on free ports; each prints `tessera <role> admin on ADDR`.
            .args(["--admin-listen", "127.0.0.1:0"])
            .arg("--model")
            .arg(&model)
            .args(["--drain-timeout-s", &drain]);
        if matches!(args.device, DeviceChoice::Cuda(_) | DeviceChoice::Hip(_)) {
            // GPU sizes first; flags given in --coordinator-args come later and win.
            cmd.args(["--kv-memory-mib", "0", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]);
        }
        cmd.args(["--tp", &args.tp.to_string(), "--pp", &args.pp.to_string()]);
        cmd.args(&server_tls);
        cmd.args(split_args(&args.coordinator_args));
        let (child, coord_addr) = start("coordinator", cmd, Duration::from_secs(300)).await?;
        children.push(Proc::new("coordinator".into(), child, None));
        let mut cmd = Command::new(&exe);
        cmd.args(["gateway", "--listen", &format!("{}:{}", args.host, args.port), "--coordinator", &coord_addr])
            .arg("--model")
            .arg(&model)
            .args(["--drain-timeout-s", &drain])
            .args(&gateway_tls)
            .args(split_args(&args.gateway_args));
        let (child, http) = start("gateway", cmd, Duration::from_secs(120)).await?;
        children.push(Proc::new("gateway".into(), child, None));
        println!("tessera: gRPC: coordinator {coord_addr}, workers {}", worker_addrs.join(","));
        println!(
            "tessera: serving {} on http://{http} ({} replica(s) of tp {} x pp {}{})",
            model.display(),
            args.workers,
            args.tp,
            args.pp,
            if args.tls_dir.is_some() { ", mTLS inside" } else { "" }
        );

        let result = supervise(&mut children, signal.as_mut()).await;
        stop_all(&mut children, Duration::from_secs(args.drain_timeout_s)).await;
        result
    })
}

/// A child process of the cluster; workers carry what restarting them needs.
struct Proc {
    name: String,
    child: Child,
    /// For a worker: how to start it again and the address it serves on.
    worker: Option<(WorkerSpec, String)>,
    /// When it was (re)started, and how many times in a row it died soon after.
    started: Instant,
    quick_exits: u32,
}

impl Proc {
    fn new(name: String, child: Child, worker: Option<(WorkerSpec, String)>) -> Self {
        Proc { name, child, worker, started: Instant::now(), quick_exits: 0 }
    }
}

/// How to start worker `index`.
struct WorkerSpec {
    exe: PathBuf,
    threads: usize,
    device: DeviceChoice,
    index: usize,
    drain: String,
    /// The mTLS flags (empty without TLS).
    tls: Vec<std::ffi::OsString>,
}

impl WorkerSpec {
    fn command(&self, listen: &str) -> Command {
        let mut cmd = Command::new(&self.exe);
        cmd.args(["worker", "--listen", listen, "--threads", &self.threads.to_string()]);
        cmd.args(["--drain-timeout-s", &self.drain]);
        cmd.args(["--admin-listen", "127.0.0.1:0"]);
        cmd.args(&self.tls);
        // Always named: the workers must not detect a device of their own (`auto`).
        let device = match self.device {
            DeviceChoice::Cuda(first) => format!("cuda:{}", first + self.index),
            DeviceChoice::Hip(first) => format!("hip:{}", first + self.index),
            DeviceChoice::Cpu => "cpu".to_string(),
        };
        cmd.args(["--device", &device]);
        cmd
    }
}

/// Until a signal: a worker that exits is started again on its address (the coordinator
/// re-forms its replica once it answers); any other child exiting stops the cluster.
async fn supervise(
    children: &mut [Proc],
    mut signal: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<()> {
    loop {
        let exited = {
            let waits =
                children.iter_mut().enumerate().map(|(i, p)| Box::pin(async move { (i, p.child.wait().await) }));
            // A signal wins over a child's exit (the workers may be stopping because of it).
            tokio::select! {
                biased;
                _ = signal.as_mut() => None,
                ((i, status), _, _) = futures::future::select_all(waits) => Some((i, status)),
            }
        };
        let Some((i, status)) = exited else { return Ok(()) };
        let p = &mut children[i];
        let Some((spec, addr)) = &p.worker else {
            return Err(anyhow!("the {} exited ({status:?}); stopping the cluster", p.name));
        };
        eprintln!("tessera: {} exited ({status:?}); starting it again on {addr}", p.name);
        // A worker that keeps dying soon after its start is restarted ever more slowly.
        p.quick_exits = if p.started.elapsed() < Duration::from_secs(10) { p.quick_exits + 1 } else { 0 };
        let mut backoff = Duration::from_millis(200);
        if p.quick_exits > 1 {
            let delay = (backoff * 2u32.saturating_pow(p.quick_exits.min(6))).min(Duration::from_secs(10));
            tokio::select! {
                _ = signal.as_mut() => return Ok(()),
                _ = tokio::time::sleep(delay) => {}
            }
        }
        let child = loop {
            let attempt = start(&p.name, spec.command(addr), Duration::from_secs(30));
            tokio::select! {
                biased;
                _ = signal.as_mut() => return Ok(()),
                r = attempt => match r {
                    Ok((child, _)) => break child,
                    Err(e) => eprintln!("tessera: restarting the {}: {e:#}; retrying in {backoff:?}", p.name),
                },
            }
            tokio::select! {
                _ = signal.as_mut() => return Ok(()),
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        };
        p.child = child;
        p.started = Instant::now();
    }
}

/// Stops the cluster front to back, so each role drains before what it depends on goes:
/// the gateway (its streams finish, up to `drain`), then the coordinator, then the
/// workers. Each gets SIGTERM, then SIGKILL if it outlives its grace period.
async fn stop_all(children: &mut [Proc], drain: Duration) {
    let grace = drain + Duration::from_secs(5);
    for stage in ["gateway", "coordinator", "worker"] {
        let members = children.iter_mut().filter(|p| p.name.starts_with(stage));
        let members: Vec<&mut Proc> = members.collect();
        for p in &members {
            if let Some(pid) = p.child.id() {
                // SAFETY: plain libc call on a pid we spawned and still own (not yet reaped).
                unsafe {
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
        }
        for p in members {
            if tokio::time::timeout(grace, p.child.wait()).await.is_err() {
                eprintln!("tessera: the {} did not stop within {grace:?}; killing it", p.name);
                let _ = p.child.kill().await;
            }
        }
    }
}
