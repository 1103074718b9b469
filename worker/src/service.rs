//! The worker's gRPC service (`tessera.worker.v1.Worker`): Info, Load and the long-lived
//! Step stream. Conversion between wire messages and the executor's types lives here;
//! the executor runs each step on a blocking thread, in stream order. On a GPU a step is
//! queued and its reply waits for its rows: if the next message (a lookahead step, which
//! the coordinator sends before this reply) arrives first, it is queued behind it before
//! those rows are read (`Executor::start`), so the GPU is not idle while the host replies
//! and takes the next step; otherwise the rows are read as soon as the GPU has them.
//! `TESSERA_WORKER_OVERLAP=0` turns the queueing behind off.
//!
//! Sharded replicas: a CPU worker's collectives are TCP (it reports listener addresses); a
//! GPU worker's are NCCL: it reports `nccl:<hex id>` of a communicator id it made, and a
//! tensor-parallel Load joins the id of rank 0 (the coordinator relays every rank's report
//! as `tp_peers`, so `tp_peers[0]` is rank 0's).

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;

use tessera_kernels::cuda::{Completion, Device, NcclId};
use tessera_model::weights::ModelFiles;
use tessera_proto::worker as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use crate::backend::Backend;
use crate::collective::{Collective, TcpCollective};
use crate::constrained::Grammars;
use crate::cuda::{kv_bytes_per_block, CudaModel, CudaOptions, GroupIds, TpPart};
use crate::error::WorkerError;
use crate::executor::{Executor, NewSequence, Run, StepInput, StepOutput};
use crate::llama::LlamaModel;
use crate::metrics::{StepClock, WorkerMetrics};
use crate::parallel::{Comms, Shard};
use crate::sampling::SamplingParams;
use crate::step_trace::{StepTracer, TracedStep};
use crate::step_watch::{watch_step, StuckHook};

/// KV memory a CPU worker allocates when the load request leaves it to the worker.
const DEFAULT_KV_BYTES: u64 = 1 << 30;

/// Where a worker runs its model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    /// GPU ordinal.
    Cuda(usize),
    /// AMD GPU ordinal (the HIP backend; see crate::hip for what runs there).
    Hip(usize),
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0), `cuda:N`, `hip` (AMD GPU 0), `hip:N`, or `auto`
    /// ([`DeviceChoice::detect`]).
    fn from_str(s: &str) -> Result<Self, String> {
        let ordinal = |prefix: &str| s.strip_prefix(prefix).and_then(|n| n.parse().ok());
        match s {
            "auto" => Ok(DeviceChoice::detect()),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            "hip" => Ok(DeviceChoice::Hip(0)),
            _ => ordinal("cuda:")
                .map(DeviceChoice::Cuda)
                .or_else(|| ordinal("hip:").map(DeviceChoice::Hip))
                .ok_or_else(|| format!("unknown device {s:?}: expected auto, cpu, cuda, cuda:N, hip or hip:N")),
        }
    }
}

impl DeviceChoice {
    /// What `--device auto` picks: GPU 0 of the first GPU backend compiled in whose runtime
    /// sees a GPU (NVIDIA through CUDA, then AMD through HIP), else the CPU. A backend not
    /// compiled in sees none.
    pub fn detect() -> Self {
        Self::pick(tessera_kernels::cuda::Device::count().unwrap_or(0), crate::hip::gpu_count())
    }

    /// `detect`'s rule for the given GPU counts.
    fn pick(cuda_gpus: usize, amd_gpus: usize) -> Self {
        match (cuda_gpus, amd_gpus) {
            (n, _) if n > 0 => DeviceChoice::Cuda(0),
            (_, n) if n > 0 => DeviceChoice::Hip(0),
            _ => DeviceChoice::Cpu,
        }
    }
}

/// The service state: at most one loaded model.
#[derive(Clone, Default)]
pub struct WorkerService {
    state: Arc<Mutex<Option<Loaded>>>,
    device: DeviceChoice,
    collective: Arc<Mutex<Listeners>>,
    /// GPU workers: the NCCL ids this worker offers as a tensor-parallel rank 0 and as a
    /// pipeline's stage 0, made when first reported (Info) and replaced once a Load has
    /// used them.
    nccl_ids: Arc<NcclIds>,
    /// Step and collective timings (`GET /metrics` of the worker's admin endpoint).
    metrics: Arc<WorkerMetrics>,
    /// What Info reports of the loaded model, kept apart from `state` (which a running
    /// step holds, for good when it is stuck): Info must answer without waiting for it.
    summary: Arc<Mutex<Option<Summary>>>,
    /// What to do when this worker cannot go on (such a step, or a GPU context lost to a
    /// fault): the binary ends the process; none: nothing.
    stuck: Option<(Duration, StuckHook)>,
}

/// Prefix of a GPU worker's `tp_collective_addr` and `pp_collective_addr`: `nccl:` and the
/// id's 256 hex digits.
const NCCL_PREFIX: &str = "nccl:";

/// A GPU worker's offered NCCL ids, one per kind of group it may found.
#[derive(Default)]
struct NcclIds {
    tp: Mutex<Option<NcclId>>,
    pp: Mutex<Option<NcclId>>,
}

/// Where a CPU worker accepts its tensor-parallel group's and its pipeline neighbours'
/// collective connections: bound when first reported (Info), consumed by a sharded Load,
/// bound anew after that (on fresh ports, which the next Info reports).
#[derive(Default)]
struct Listeners {
    host: Option<IpAddr>,
    tp: Option<TcpListener>,
    pp: Option<TcpListener>,
}

impl Listeners {
    fn ensure(&mut self) -> (String, String) {
        let host = self.host.unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let addr = |slot: &mut Option<TcpListener>| {
            if slot.is_none() {
                *slot = TcpListener::bind((host, 0)).ok();
            }
            slot.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default()
        };
        (addr(&mut self.tp), addr(&mut self.pp))
    }
}

/// Connection and per-operation timeouts of the CPU collectives: a peer that stops
/// responding fails the step within `OP_TIMEOUT` instead of hanging the replica.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);
const OP_TIMEOUT: Duration = Duration::from_secs(30);

/// The loaded model as Info reports it.
#[derive(Clone)]
struct Summary {
    device: &'static str,
    device_name: String,
    model: String,
    num_blocks: u32,
    block_size: u32,
    vocab_size: u32,
    max_model_len: u32,
}

struct Loaded {
    name: String,
    exec: Executor,
}

impl Loaded {
    fn summary(&self) -> Summary {
        let backend = self.exec.backend();
        let (device, device_name) = backend.device();
        let c = backend.config();
        Summary {
            device,
            device_name,
            model: self.name.clone(),
            num_blocks: self.exec.num_blocks() as u32,
            block_size: self.exec.block_size() as u32,
            vocab_size: c.vocab_size as u32,
            max_model_len: c.max_position as u32,
        }
    }
}

impl WorkerService {
    pub fn new() -> Self {
        Self::default()
    }

    /// A service that loads models onto `device`.
    pub fn on(device: DeviceChoice) -> Self {
        WorkerService {
            state: Arc::default(),
            device,
            collective: Arc::default(),
            nccl_ids: Arc::default(),
            metrics: Arc::default(),
            summary: Arc::default(),
            stuck: None,
        }
    }

    /// Calls `hook` when this worker cannot go on: a GPU step still running `grace` after
    /// the coordinator closed its stream (blocked in a collective on a peer that is gone,
    /// or a hung kernel, see crate::step_watch), or a step that failed with an error that left
    /// the GPU context unusable (a kernel fault or trap: every later step would fail).
    pub fn with_unrecoverable_hook(mut self, grace: Duration, hook: StuckHook) -> Self {
        self.stuck = Some((grace, hook));
        self
    }

    /// This worker's metrics.
    pub fn metrics(&self) -> Arc<WorkerMetrics> {
        self.metrics.clone()
    }

    /// Binds the collective listeners on `host` (the worker's own address) instead of
    /// loopback, for replicas spread over machines.
    pub fn with_collective_host(self, host: IpAddr) -> Self {
        self.collective.lock().unwrap_or_else(|e| e.into_inner()).host = Some(host);
        self
    }

    fn info(&self) -> pb::WorkerInfo {
        let mut info = pb::WorkerInfo {
            device: match self.device {
                DeviceChoice::Cpu => "cpu".into(),
                DeviceChoice::Cuda(_) => "cuda".into(),
                DeviceChoice::Hip(_) => "hip".into(),
            },
            device_name: format!("cpu ({} threads)", rayon::current_num_threads()),
            // Every sampling rank keeps grammar matchers (see `load_model`).
            ranks_sample_alike: true,
            ..Default::default()
        };
        match self.device {
            DeviceChoice::Cpu => {
                let (tp, pp) = self.collective.lock().unwrap_or_else(|e| e.into_inner()).ensure();
                (info.tp_collective_addr, info.pp_collective_addr) = (tp, pp);
            }
            DeviceChoice::Cuda(_) => {
                (info.tp_collective_addr, info.pp_collective_addr) =
                    (nccl_addr(&self.nccl_ids.tp), nccl_addr(&self.nccl_ids.pp));
            }
            // One model per AMD GPU (crate::hip): no group to offer.
            DeviceChoice::Hip(_) => {}
        }
        if let Some(m) = self.summary.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            (info.device, info.device_name) = (m.device.into(), m.device_name);
            info.model = m.model;
            (info.num_blocks, info.block_size) = (m.num_blocks, m.block_size);
            (info.vocab_size, info.max_model_len) = (m.vocab_size, m.max_model_len);
        }
        info
    }
}

/// `nccl:<hex>` of the NCCL id in `slot`, made now if there is none; empty when NCCL is
/// unavailable (a parallel Load naming this worker as its group's rank 0 then fails with a
/// message saying so).
fn nccl_addr(slot: &Mutex<Option<NcclId>>) -> String {
    let mut id = slot.lock().unwrap_or_else(|e| e.into_inner());
    if id.is_none() {
        *id = Device::nccl_unique_id().ok();
    }
    id.as_ref().map(|id| format!("{NCCL_PREFIX}{}", id.to_hex())).unwrap_or_default()
}

fn load(
    req: &pb::LoadRequest,
    device: DeviceChoice,
    listeners: &Mutex<Listeners>,
    nccl_ids: &NcclIds,
    metrics: &WorkerMetrics,
) -> Result<Loaded, Status> {
    let path = PathBuf::from(&req.model_path);
    let files =
        ModelFiles::open(&path).map_err(|e| Status::invalid_argument(format!("loading {}: {e}", path.display())))?;
    let sharded = req.shard.as_ref().filter(|s| s.tp_size > 1 || s.pp_size > 1);
    let block_size = if req.block_size == 0 { 16 } else { req.block_size as usize };
    if block_size > MAX_BLOCK_SIZE {
        return Err(Status::invalid_argument(format!("block_size {block_size} is over {MAX_BLOCK_SIZE}")));
    }
    let max_step_tokens = match req.max_step_tokens {
        0 => DEFAULT_MAX_STEP_TOKENS,
        n => n as usize,
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let backend = match device {
        DeviceChoice::Cpu => {
            let shard = sharded.map(shard_of).transpose()?;
            let model =
                LlamaModel::load_shard(Arc::new(files), shard).map_err(|e| Status::invalid_argument(e.to_string()))?;
            let per = model.kv_bytes_per_block(block_size) as u64;
            let num_blocks = blocks_for(req, per, DEFAULT_KV_BYTES)?.unwrap_or(0);
            check_host_memory(num_blocks, per)?;
            let comms = match sharded {
                Some(s) => connect_comms(s, listeners, metrics)?,
                None => Comms::default(),
            };
            Backend::cpu_sharded(model, num_blocks, block_size, comms)
        }
        DeviceChoice::Cuda(ordinal) => {
            let config = files.config().map_err(|e| Status::invalid_argument(e.to_string()))?;
            let shard = sharded.map(shard_of).transpose()?;
            let part = match &shard {
                Some(s) => TpPart::of_shard(&config, s).map_err(|e| Status::invalid_argument(e.to_string()))?,
                None => TpPart::whole(&config),
            };
            let per = kv_bytes_per_block(&part.local_config(&config), block_size) as u64;
            // No budget given: the GPU backend sizes the cache from its free memory.
            let num_blocks = blocks_for(req, per, 0)?;
            let opts =
                CudaOptions { device: ordinal, block_size, num_blocks, max_step_tokens, ..CudaOptions::default() };
            let model = match (&shard, sharded) {
                (Some(shard), Some(s)) => {
                    let ids = GroupIds {
                        tp: (s.tp_size > 1)
                            .then(|| group_id(&s.tp_peers, "tensor-parallel rank 0", &nccl_ids.tp))
                            .transpose()?,
                        pp: (s.pp_size > 1)
                            .then(|| group_id(&s.pp_peers, "pipeline stage 0", &nccl_ids.pp))
                            .transpose()?,
                    };
                    CudaModel::load_shard(&files, &opts, shard, &ids)
                }
                _ => CudaModel::load(&files, &opts),
            };
            Backend::cuda(model.map_err(|e| Status::failed_precondition(e.to_string()))?)
        }
        DeviceChoice::Hip(ordinal) => {
            if sharded.is_some() {
                return Err(Status::unimplemented(
                    "tensor and pipeline parallel shards do not run on HIP yet: one model per AMD GPU",
                ));
            }
            let config = files.config().map_err(|e| Status::invalid_argument(e.to_string()))?;
            let per = kv_bytes_per_block(&config, block_size) as u64;
            let num_blocks = blocks_for(req, per, 0)?;
            let opts =
                CudaOptions { device: ordinal, block_size, num_blocks, max_step_tokens, ..CudaOptions::default() };
            let model = crate::hip::HipModel::load(&files, &opts);
            Backend::Hip(Box::new(model.map_err(|e| Status::failed_precondition(e.to_string()))?))
        }
    };
    if backend.num_blocks() == 0 {
        return Err(Status::invalid_argument("the KV memory budget holds no block"));
    }
    // Every tensor rank of the last stage samples (the leader's tokens are the replica's),
    // and all of them keep grammar matchers for constrained sequences, so they all sample
    // the same token: a lookahead decode runs each rank's own last sampled token.
    let samples = sharded.is_none_or(|s| s.pp_rank + 1 >= s.pp_size.max(1));
    let mut exec = Executor::new(backend).with_max_step_tokens(max_step_tokens);
    // TESSERA_WORKER_OVERLAP=0: a GPU step is never queued behind the pending one (A/B runs).
    if std::env::var("TESSERA_WORKER_OVERLAP").as_deref() == Ok("0") {
        exec = exec.with_queueing_behind(false);
    }
    if samples {
        let grammars = Arc::new(Grammars::for_model(path));
        // Built in the background now rather than on the first constrained step's mask
        // thread (a few hundred milliseconds that step would otherwise wait).
        let warm = grammars.clone();
        let _ = std::thread::Builder::new().name("grammar-compiler".into()).spawn(move || warm.compiler().map(drop));
        exec = exec.with_grammars(grammars);
    }
    Ok(Loaded { name, exec })
}

/// The worker's part of the model as the coordinator placed it.
fn shard_of(s: &pb::Shard) -> Result<Shard, Status> {
    let (tp, stages) = (s.tp_size.max(1) as usize, s.pp_size.max(1) as usize);
    if s.tp_peers.len() != tp || (stages > 1 && s.pp_peers.len() != stages) {
        return Err(Status::invalid_argument(format!(
            "shard lists {} tensor peers for tp {tp} and {} pipeline peers for pp {stages}",
            s.tp_peers.len(),
            s.pp_peers.len()
        )));
    }
    Ok(Shard {
        tp_rank: s.tp_rank as usize,
        tp,
        stage: s.pp_rank as usize,
        stages,
        layers: s.layer_begin as usize..s.layer_end as usize,
    })
}

/// The NCCL id of a GPU shard's group (its tensor-parallel group or its pipeline): what
/// the group's rank 0 (`who`) reported, `peers[0]`. When that is this worker's own id, it
/// is used up: the next Info offers a fresh one.
fn group_id(peers: &[String], who: &str, own: &Mutex<Option<NcclId>>) -> Result<NcclId, Status> {
    let peer = peers.first().map(String::as_str).unwrap_or_default();
    let hex = peer.strip_prefix(NCCL_PREFIX).ok_or_else(|| {
        Status::invalid_argument(format!(
            "{who} reported {peer:?}, not an NCCL id (`{NCCL_PREFIX}<hex>`): \
             is it a GPU worker with NCCL installed?"
        ))
    })?;
    let id = NcclId::from_hex(hex).map_err(|e| Status::invalid_argument(format!("{who}'s NCCL id: {e}")))?;
    let mut own = own.lock().unwrap_or_else(|e| e.into_inner());
    if own.as_ref() == Some(&id) {
        *own = None;
    }
    Ok(id)
}

/// Joins this shard's tensor-parallel group and pipeline (blocking until every peer has
/// connected, at most CONNECT_TIMEOUT).
fn connect_comms(s: &pb::Shard, listeners: &Mutex<Listeners>, metrics: &WorkerMetrics) -> Result<Comms, Status> {
    let parse = |peers: &[String]| -> Result<Vec<SocketAddr>, Status> {
        peers
            .iter()
            .map(|p| p.parse().map_err(|_| Status::invalid_argument(format!("bad collective peer address {p:?}"))))
            .collect()
    };
    let (tp_l, pp_l) = {
        let mut l = listeners.lock().unwrap_or_else(|e| e.into_inner());
        (l.tp.take(), l.pp.take())
    };
    let join = |listener: Option<TcpListener>,
                rank: u32,
                peers: &[String],
                group: u64|
     -> Result<Box<dyn Collective>, Status> {
        let listener =
            listener.ok_or_else(|| Status::failed_precondition("no collective listener: call Info first"))?;
        let c = TcpCollective::connect(rank as usize, listener, &parse(peers)?, group, CONNECT_TIMEOUT, OP_TIMEOUT)
            .map_err(|e| Status::unavailable(format!("joining the replica's collective: {e}")))?;
        Ok(Box::new(c))
    };
    let base = s.group.wrapping_mul(1 << 16);
    let mut comms = Comms::default();
    if s.tp_size > 1 {
        let tp = join(tp_l, s.tp_rank, &s.tp_peers, base.wrapping_add(u64::from(s.pp_rank)))?;
        comms.tp = Some(metrics.timed_tp(tp));
    }
    if s.pp_size > 1 {
        let pp = join(pp_l, s.pp_rank, &s.pp_peers, base.wrapping_add(0x8000 + u64::from(s.tp_rank)))?;
        comms.pp = Some(metrics.timed_pp(pp));
    }
    Ok(comms)
}

/// KV blocks the request asks for: its count, or its budget (else `default_budget`; 0
/// means "let the backend decide") over `per_block` bytes.
fn blocks_for(req: &pb::LoadRequest, per_block: u64, default_budget: u64) -> Result<Option<usize>, Status> {
    if req.num_blocks > 0 {
        return Ok(Some(req.num_blocks as usize));
    }
    let budget = if req.kv_memory_bytes > 0 { req.kv_memory_bytes } else { default_budget };
    if budget == 0 {
        return Ok(None);
    }
    match (budget / per_block.max(1)) as usize {
        0 => Err(Status::invalid_argument("the KV memory budget holds no block")),
        n => Ok(Some(n)),
    }
}

/// Largest KV block (positions) a Load may ask for; engines use 16 to 256.
const MAX_BLOCK_SIZE: usize = 4096;

/// Most tokens per Step when the Load leaves it to the worker (`max_step_tokens` 0): the
/// budget `tessera serve` gives a GPU replica (the coordinator's own default is 512).
const DEFAULT_MAX_STEP_TOKENS: usize = 8192;

/// Refuses a CPU KV cache of `num_blocks` blocks of `per_block` bytes that this host's
/// available memory (`MemAvailable`) cannot hold: allocated anyway, it would be zero pages
/// until written and then get the process killed mid-serving instead of failing the Load.
fn check_host_memory(num_blocks: usize, per_block: u64) -> Result<(), Status> {
    let want = (num_blocks as u64).saturating_mul(per_block);
    match host_memory_available() {
        Some(have) if want > have => Err(Status::resource_exhausted(format!(
            "a KV cache of {num_blocks} blocks needs {:.1} GiB; this host has {:.1} GiB available",
            want as f64 / GIB,
            have as f64 / GIB
        ))),
        _ => Ok(()),
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// `MemAvailable` from /proc/meminfo in bytes (`None` where there is no such file).
fn host_memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn params_from(p: Option<pb::SamplingParams>) -> SamplingParams {
    let Some(p) = p else { return SamplingParams::greedy() };
    let top = p.top_logprobs as usize;
    SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        min_p: p.min_p,
        repetition_penalty: if p.repetition_penalty == 0.0 { 1.0 } else { p.repetition_penalty },
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        logit_bias: p.logit_bias.into_iter().collect(),
        seed: p.seed,
        logprobs: (p.logprobs || top > 0).then_some(top),
        constraint: p.constraint.and_then(|c| c.kind).map(constraint_from),
        min_tokens: p.min_tokens,
        min_tokens_stop_ids: p.min_tokens_stop_ids,
    }
}

/// The wire constraint as the executor's (`json_object: false` still means a JSON object:
/// the field's presence selects the kind).
fn constraint_from(k: pb::constraint::Kind) -> tessera_constrain::Constraint {
    use pb::constraint::Kind;
    use tessera_constrain::Constraint;
    match k {
        Kind::JsonSchema(s) => Constraint::JsonSchema(s),
        Kind::JsonObject(_) => Constraint::JsonObject,
        Kind::Lark(s) => Constraint::Lark(s),
        Kind::Regex(s) => Constraint::Regex(s),
    }
}

fn step_input(req: pb::StepRequest) -> StepInput {
    StepInput {
        finished: req.finished,
        new_sequences: req
            .new_sequences
            .into_iter()
            .map(|s| NewSequence {
                seq_id: s.seq_id,
                params: params_from(s.sampling),
                block_table: s.block_table,
                cached_tokens: s.cached_tokens,
                num_generated: u64::from(s.num_generated),
            })
            .collect(),
        appends: req.appends.into_iter().map(|a| (a.seq_id, a.block_ids)).collect(),
        runs: req
            .runs
            .into_iter()
            .map(|r| Run {
                seq_id: r.seq_id,
                tokens: r.tokens,
                first_pos: r.first_pos as usize,
                sample: r.sample,
                from_previous: r.from_previous,
            })
            .collect(),
    }
}

fn step_reply(step_id: u64, out: StepOutput) -> pb::StepReply {
    pb::StepReply {
        step_id,
        sampled: out
            .sampled
            .into_iter()
            .map(|(seq_id, s)| pb::Sampled {
                seq_id,
                token: s.token,
                logprob: s.logprob,
                top_ids: s.top.iter().map(|t| t.0).collect(),
                top_logprobs: s.top.iter().map(|t| t.1).collect(),
            })
            .collect(),
        forward_us: out.forward_us.min(u32::MAX as u64) as u32,
        sample_us: out.sample_us.min(u32::MAX as u64) as u32,
        error: String::new(),
        seq_errors: out.errors.into_iter().map(|(seq_id, message)| pb::SequenceError { seq_id, message }).collect(),
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn info(&self, _req: Request<pb::InfoRequest>) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(WorkerService::info(self)))
    }

    async fn load(&self, req: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReply>, Status> {
        let req = req.into_inner();
        let t0 = Instant::now();
        let (device, listeners, nccl_ids) = (self.device, self.collective.clone(), self.nccl_ids.clone());
        let metrics = self.metrics.clone();
        let (state, summary) = (self.state.clone(), self.summary.clone());
        // On the blocking pool, the swap too: a step still holding the old model (stuck on
        // a peer) must not block a runtime thread. What Info reports changes with the
        // model, under its lock, so a Load whose caller went away (the task runs on) still
        // leaves the two consistent.
        tokio::task::spawn_blocking(move || {
            let loaded = load(&req, device, &listeners, &nccl_ids, &metrics)?;
            let mut model = state.lock().unwrap_or_else(|e| e.into_inner());
            *summary.lock().unwrap_or_else(|e| e.into_inner()) = Some(loaded.summary());
            *model = Some(loaded);
            Ok::<_, Status>(())
        })
        .await
        .map_err(|e| Status::internal(format!("load task failed: {e}")))??;
        Ok(Response::new(pb::LoadReply {
            info: Some(WorkerService::info(self)),
            load_ms: t0.elapsed().as_millis().min(u32::MAX as u128) as u32,
        }))
    }

    type StepStream = ReceiverStream<Result<pb::StepReply, Status>>;

    async fn step(&self, req: Request<Streaming<pb::StepRequest>>) -> Result<Response<Self::StepStream>, Status> {
        let mut incoming = req.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let state = self.state.clone();
        let metrics = self.metrics.clone();
        // GPU steps have no timeout of their own (a collective on a peer that is gone, a
        // hung kernel): they are watched. CPU collectives time out (OP_TIMEOUT).
        let gpu = matches!(self.device, DeviceChoice::Cuda(_) | DeviceChoice::Hip(_));
        let stuck = self.stuck.clone();
        tokio::spawn(async move {
            let mut tracer = StepTracer::default();
            // The step queued on the GPU whose reply waits for its rows.
            let mut pending: Option<Awaiting> = None;
            // A GPU step's watch: its stuck timeout and hook.
            let watch = || stuck.as_ref().filter(|_| gpu).map(|(g, h)| (*g, h));
            loop {
                let next = match pending.as_mut() {
                    None => incoming.next().await,
                    Some(p) => {
                        // The next message or the pending step's rows, whichever comes
                        // first: a message first is queued behind the pending step.
                        let done = p.done.clone();
                        let rows = async move {
                            if let Some(c) = done {
                                // An error here is the step's own, which reading its rows reports.
                                let _ = tokio::task::spawn_blocking(move || c.wait()).await;
                            }
                        };
                        tokio::select! {
                            biased;
                            m = incoming.next() => m,
                            () = rows => {
                                let Some(p) = pending.take() else { continue };
                                if !complete_and_reply(p, &state, &metrics, &tx, watch(), &stuck).await {
                                    break;
                                }
                                continue;
                            }
                        }
                    }
                };
                let msg = match next {
                    Some(Ok(m)) => m,
                    None => break,
                    // The coordinator went away (nobody to tell), or its message did not
                    // decode: say which before the stream ends.
                    Some(Err(e)) => {
                        let _ = tx.send(Err(Status::invalid_argument(format!("step stream: {e}")))).await;
                        break;
                    }
                };
                let step_id = msg.step_id;
                let traced = tracer.begin(&msg);
                let mut earlier = pending.take();
                // The pending step has finished on the GPU already: its reply goes first, so
                // the coordinator can schedule on its tokens while this step runs.
                if let Some(p) = earlier.take_if(|p| p.done.as_ref().is_none_or(Completion::is_done)) {
                    if !complete_and_reply(p, &state, &metrics, &tx, watch(), &stuck).await {
                        break;
                    }
                }
                let (state2, metrics2) = (state.clone(), metrics.clone());
                let earlier_clock = earlier.as_ref().map(|p| p.clock);
                let job = tokio::task::spawn_blocking(move || start_step(&state2, &metrics2, msg, earlier_clock));
                let started = watch_step(job, tx.closed(), watch(), || format!("step {step_id}")).await;
                let started = started.unwrap_or_else(|e| StartedStep {
                    previous: None,
                    this: StepState::Done(Err((format!("step task failed: {e}"), false))),
                });
                // The earlier step's reply first: the coordinator reads replies in order.
                if let Some(p) = earlier {
                    let out = started.previous.unwrap_or_else(|| Err(("the pending step was lost".into(), false)));
                    if !reply(&tx, p.step_id, out, p.traced, &metrics, &stuck).await {
                        break;
                    }
                }
                match started.this {
                    StepState::Done(out) => {
                        if !reply(&tx, step_id, out, traced, &metrics, &stuck).await {
                            break;
                        }
                    }
                    StepState::Queued { clock, done } => pending = Some(Awaiting { step_id, traced, clock, done }),
                }
            }
            // The stream ended with a step queued: read its rows so the executor is ready
            // for the next stream (nobody is left to reply to), watched like any step after
            // the coordinator has gone.
            if let Some(p) = pending {
                let (state, metrics) = (state.clone(), metrics.clone());
                let job = tokio::task::spawn_blocking(move || complete_pending(&state, &metrics, p.clock));
                let _ = watch_step(job, std::future::ready(()), watch(), || format!("step {}", p.step_id)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// A step queued on the GPU whose reply waits for its rows: its id, trace, metrics clock
/// and a handle that waits for its rows (`None`: it has finished, or sampled nothing).
struct Awaiting {
    step_id: u64,
    traced: Option<TracedStep>,
    clock: StepClock,
    done: Option<Completion>,
}

/// A step's result for its reply: the output, or the error and whether it left the GPU
/// context unusable.
type StepResult = Result<StepOutput, (String, bool)>;

/// What a step's start did (see `Executor::start`).
struct StartedStep {
    /// The pending step's result, when there was one.
    previous: Option<StepResult>,
    this: StepState,
}

enum StepState {
    Done(StepResult),
    /// Queued: the metrics clock and a handle that waits for its rows (`None`: it has
    /// finished, or sampled nothing).
    Queued {
        clock: StepClock,
        done: Option<Completion>,
    },
}

/// On a blocking thread: starts `msg`'s step on the loaded model, after or behind the
/// pending one (whose metrics clock is `earlier`).
fn start_step(
    state: &Mutex<Option<Loaded>>,
    metrics: &WorkerMetrics,
    msg: pb::StepRequest,
    earlier: Option<StepClock>,
) -> StartedStep {
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    let Some(l) = guard.as_mut() else {
        let error = || Err(("no model is loaded".to_string(), false));
        return StartedStep { previous: earlier.map(|_| error()), this: StepState::Done(error()) };
    };
    let input = step_input(msg);
    let clock = metrics.step_clock(&input);
    let started = l.exec.start(input);
    let lost = |e: WorkerError, exec: &Executor| (e.to_string(), exec.backend().context_lost_by(&e));
    let previous = started.previous.map(|r| {
        if let Some(c) = earlier {
            metrics.record_step(c);
        }
        r.map_err(|e| lost(e, &l.exec))
    });
    let this = match started.this {
        Ok(Some(out)) => {
            metrics.record_step(clock);
            StepState::Done(Ok(out))
        }
        Ok(None) => StepState::Queued { clock, done: l.exec.pending_completion() },
        Err(e) => {
            metrics.record_step(clock);
            StepState::Done(Err(lost(e, &l.exec)))
        }
    };
    StartedStep { previous, this }
}

/// On a blocking thread: reads the pending step's rows and finishes it.
fn complete_pending(state: &Mutex<Option<Loaded>>, metrics: &WorkerMetrics, clock: StepClock) -> StepResult {
    let mut guard = state.lock().unwrap_or_else(|e| e.into_inner());
    let Some(l) = guard.as_mut() else { return Err(("no model is loaded".to_string(), false)) };
    let out = l.exec.complete().unwrap_or_else(|| Err(WorkerError::InvalidBatch("no step is pending".into())));
    metrics.record_step(clock);
    out.map_err(|e| (e.to_string(), l.exec.backend().context_lost_by(&e)))
}

/// Reads the pending step `p`'s rows on a blocking thread (watched as a step) and sends its
/// reply. False once the coordinator is gone.
async fn complete_and_reply(
    p: Awaiting,
    state: &Arc<Mutex<Option<Loaded>>>,
    metrics: &Arc<WorkerMetrics>,
    tx: &mpsc::Sender<Result<pb::StepReply, Status>>,
    watch: Option<(Duration, &StuckHook)>,
    stuck: &Option<(Duration, StuckHook)>,
) -> bool {
    let (state2, metrics2, clock) = (state.clone(), metrics.clone(), p.clock);
    let job = tokio::task::spawn_blocking(move || complete_pending(&state2, &metrics2, clock));
    let out = watch_step(job, tx.closed(), watch, || format!("step {}", p.step_id)).await;
    let out = out.unwrap_or_else(|e| Err((format!("step task failed: {e}"), false)));
    reply(tx, p.step_id, out, p.traced, metrics, stuck).await
}

/// Sends step `step_id`'s reply (ending its trace); a step whose error left the GPU context
/// unusable then calls the stuck hook. False once the coordinator is gone.
async fn reply(
    tx: &mpsc::Sender<Result<pb::StepReply, Status>>,
    step_id: u64,
    result: StepResult,
    traced: Option<TracedStep>,
    metrics: &WorkerMetrics,
    stuck: &Option<(Duration, StuckHook)>,
) -> bool {
    let (reply, lost) = match result {
        Ok(out) => (step_reply(step_id, out), false),
        Err((error, lost)) => (pb::StepReply { step_id, error, ..Default::default() }, lost),
    };
    if let Some(t) = traced {
        t.end(&reply, Some(metrics.last_collective()));
    }
    // The coordinator gets the step's own error before the worker gives up.
    let what = lost.then(|| format!("step {step_id} failed and left the GPU context unusable: {}", reply.error));
    let sent = tx.send(Ok(reply)).await;
    if let (Some(what), Some((_, hook))) = (what, stuck) {
        hook(&what);
    }
    sent.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Info answers while a step holds the model (for good, when it is stuck on a peer):
    /// the coordinator's readiness checks must not hang, nor tie up a runtime thread.
    #[tokio::test]
    // The guard held across the await is the point: it stands for a step stuck on a peer.
    #[allow(clippy::await_holding_lock)]
    async fn info_answers_while_a_step_holds_the_model() {
        use pb::worker_server::Worker;
        let Some(path) = crate::test_model_path::default_model() else { return };
        let svc = WorkerService::on(DeviceChoice::Cpu);
        let req =
            pb::LoadRequest { model_path: path.to_string_lossy().into_owned(), num_blocks: 32, ..Default::default() };
        Worker::load(&svc, Request::new(req)).await.expect("load");
        let held = svc.state.clone();
        let guard = held.lock().unwrap();
        let info = {
            let svc = svc.clone();
            tokio::time::timeout(Duration::from_secs(5), tokio::task::spawn_blocking(move || svc.info()))
                .await
                .expect("Info blocked on the model a step holds")
                .expect("info task")
        };
        drop(guard);
        assert_eq!((info.num_blocks, info.block_size), (32, 16));
        assert!(info.model.ends_with(".gguf") && info.vocab_size > 0, "{info:?}");
    }

    /// A Load's `max_step_tokens` reaches the executor: a larger step is refused (the GPU
    /// backends kept activation memory for that many tokens only); 0 takes the default.
    #[test]
    fn load_sets_the_step_token_cap() {
        let Some(path) = crate::test_model_path::default_model() else { return };
        let load_with = |max_step_tokens| {
            let req = pb::LoadRequest {
                model_path: path.to_string_lossy().into_owned(),
                num_blocks: 64,
                max_step_tokens,
                ..Default::default()
            };
            load(&req, DeviceChoice::Cpu, &Mutex::default(), &NcclIds::default(), &WorkerMetrics::default())
                .map_err(|e| e.to_string())
                .expect("load")
        };
        let step = |exec: &mut Executor, n: usize| {
            exec.step(crate::executor::StepInput {
                new_sequences: vec![crate::executor::NewSequence {
                    seq_id: 1,
                    params: SamplingParams::greedy(),
                    block_table: (0..8).collect(),
                    cached_tokens: vec![],
                    num_generated: 0,
                }],
                runs: vec![crate::executor::Run {
                    seq_id: 1,
                    tokens: vec![1; n],
                    first_pos: 0,
                    sample: true,
                    from_previous: false,
                }],
                finished: vec![1],
                ..Default::default()
            })
        };
        let mut small = load_with(8).exec;
        let err = step(&mut small, 9).expect_err("9 tokens over a cap of 8");
        assert!(err.to_string().contains("max_step_tokens"), "{err}");
        step(&mut small, 8).expect("8 tokens");
        let mut default = load_with(0).exec;
        step(&mut default, 9).expect("the default cap is far above 9");
    }

    #[test]
    fn device_choice_parses_cpu_and_cuda_ordinals() {
        assert_eq!("cpu".parse::<DeviceChoice>(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse::<DeviceChoice>(), Ok(DeviceChoice::Cuda(3)));
        assert_eq!("hip".parse::<DeviceChoice>(), Ok(DeviceChoice::Hip(0)));
        assert_eq!("hip:2".parse::<DeviceChoice>(), Ok(DeviceChoice::Hip(2)));
        // No GPU runtime in the test build sees a GPU here unless one is present.
        assert_eq!("auto".parse::<DeviceChoice>(), Ok(DeviceChoice::detect()));
        assert_eq!(DeviceChoice::pick(0, 0), DeviceChoice::Cpu);
        assert_eq!(DeviceChoice::pick(0, 2), DeviceChoice::Hip(0));
        assert_eq!(DeviceChoice::pick(1, 2), DeviceChoice::Cuda(0));
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "", "hip:", "hip:x", "rocm", "auto:0"] {
            assert!(bad.parse::<DeviceChoice>().is_err(), "{bad:?} accepted");
        }
    }

    fn shard_with_peer0(peer: &str) -> pb::Shard {
        pb::Shard {
            tp_size: 2,
            tp_rank: 1,
            pp_size: 1,
            tp_peers: vec![peer.into(), "nccl:00".into()],
            ..Default::default()
        }
    }

    /// A GPU shard joins rank 0's id; this worker's own id is used up only when it is
    /// rank 0's; anything but `nccl:<256 hex digits>` is a clear error.
    #[test]
    fn gpu_shards_take_rank_0s_nccl_id() {
        let id = |seed: u8| NcclId(std::array::from_fn(|i| (i as u8).wrapping_mul(37).wrapping_add(seed)));
        let own = Mutex::new(Some(id(1)));
        let peer = format!("nccl:{}", id(2).to_hex());
        let group = |s: pb::Shard| group_id(&s.tp_peers, "tensor-parallel rank 0", &own);
        assert_eq!(group(shard_with_peer0(&peer)).unwrap(), id(2));
        assert_eq!(*own.lock().unwrap(), Some(id(1)), "another worker's id leaves ours alone");
        let peer = format!("nccl:{}", id(1).to_hex());
        assert_eq!(group(shard_with_peer0(&peer)).unwrap(), id(1));
        assert_eq!(*own.lock().unwrap(), None, "our id, once used, is replaced at the next Info");
        for bad in ["127.0.0.1:4000", "", "nccl:abc"] {
            let e = group(shard_with_peer0(bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
            assert!(e.message().contains("NCCL id"), "{bad:?}: {}", e.message());
        }
    }
}
