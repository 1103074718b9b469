//! The async engine loop of one model replica: it owns the replica's `Scheduler` and its
//! worker link, and turns client submissions into steps and sampled tokens into events.
//!
//! Loop: take new submissions (blocking only when idle), drop sequences whose client went
//! away, `schedule`, send the step deltas to the worker, wait for its reply,
//! `postprocess`, fan the tokens out to each request's event channel.
//!
//! Failure: a failed step (broken stream, worker error, step deadline, a bad reply) detaches the
//! workers at once. Each unfinished sequence is handed to another healthy replica of the
//! set (`migration`: re-prefilled with its tokens so far, its client's stream goes on) or,
//! when there is none, ends with an error event; nothing waits forever. The engine task
//! lives on, refusing new work, until the replica supervisor attaches re-formed workers
//! (`EngineHandle::attach`, with a fresh scheduler: the old prefix cache described KV
//! that is gone).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message as _;
use tessera_proto::coordinator as cpb;
use tessera_proto::worker as pb;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::Status;

use crate::error::AdmissionError;
use crate::metrics::ReplicaMetrics;
use crate::migration::{ClientState, Migrant};
use crate::replica_link::ReplicaLink;
use crate::replica_set::ReplicaSet;
use crate::scheduler::{Scheduler, SeqUpdate, StepOutput};
use crate::seq_trace::{self, SeqTrace};
use crate::sequence::{FinishReason, Sequence, StopCriteria};
use crate::worker_link::LinkError;
use crate::ScheduledBatch;

/// Events a request's stream receives.
pub type EventTx = mpsc::UnboundedSender<Result<cpb::GenerateEvent, Status>>;

/// One request as the engine takes it.
pub struct Submission {
    pub prompt: Vec<u32>,
    pub sampling: pb::SamplingParams,
    pub max_tokens: usize,
    /// The complete set of ids that end the sequence (the gateway has added EOS and
    /// end-of-turn ids unless the request ignores EOS).
    pub stop_ids: Vec<u32>,
    pub events: EventTx,
    /// The request's coordinator spans (`SeqTrace::default()` when untraced).
    pub trace: SeqTrace,
}

enum Command {
    Submit(Submission, oneshot::Sender<Result<u64, AdmissionError>>),
    /// A sequence of a failed replica, to continue here.
    Adopt(Migrant),
    /// Re-formed workers and a fresh scheduler for them.
    Attach(ReplicaLink, Scheduler),
}

/// Load figures of a replica, for routing and the Status RPC.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplicaLoad {
    pub running: usize,
    pub waiting: usize,
    pub used_blocks: usize,
    pub total_blocks: usize,
    pub steps: u64,
    /// Coordinator CPU time of the last step (schedule + build + postprocess), µs.
    pub last_cpu_us: u64,
}

/// The handle the gRPC service holds.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    load: Arc<Mutex<ReplicaLoad>>,
    /// Sequences sent to the engine and not yet taken in (routing counts them as load
    /// before the engine publishes its next figures).
    pending: Arc<AtomicUsize>,
    healthy: watch::Receiver<bool>,
    block_size: usize,
    evict: mpsc::UnboundedSender<String>,
}

impl EngineHandle {
    /// Queues a request; `Err` when admission refuses it.
    pub async fn submit(&self, s: Submission) -> Result<u64, AdmissionError> {
        let (tx, rx) = oneshot::channel();
        self.pending.fetch_add(1, Ordering::Relaxed);
        if self.tx.send(Command::Submit(s, tx)).is_err() {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            return Err(AdmissionError::QueueFull { max_waiting: 0 });
        }
        rx.await.unwrap_or(Err(AdmissionError::QueueFull { max_waiting: 0 }))
    }

    /// Hands this replica a sequence of a failed one; gives it back if the engine is gone.
    pub fn adopt(&self, m: Migrant) -> Result<(), Box<Migrant>> {
        self.pending.fetch_add(1, Ordering::Relaxed);
        self.tx.send(Command::Adopt(m)).map_err(|e| {
            self.pending.fetch_sub(1, Ordering::Relaxed);
            match e.0 {
                Command::Adopt(m) => Box::new(m),
                _ => unreachable!("sent an Adopt"),
            }
        })
    }

    /// Fails the replica now, as if its workers had broken (`reason` says why): even a
    /// step waiting on a hung worker is given up. Ignored while the replica is failed.
    pub fn evict(&self, reason: String) {
        let _ = self.evict.send(reason);
    }

    /// Gives a failed replica its re-formed workers and a fresh scheduler; it serves again.
    pub fn attach(&self, link: ReplicaLink, sched: Scheduler) -> bool {
        self.tx.send(Command::Attach(link, sched)).is_ok()
    }

    pub fn load(&self) -> ReplicaLoad {
        *self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sequences the replica holds or is about to take in: running + waiting + pending.
    pub fn sequences(&self) -> usize {
        let l = self.load();
        l.running + l.waiting + self.pending.load(Ordering::Relaxed)
    }

    /// False from the moment the replica's workers fail until they are re-attached.
    pub fn healthy(&self) -> bool {
        *self.healthy.borrow()
    }

    /// A receiver that sees every change of `healthy()`.
    pub fn health(&self) -> watch::Receiver<bool> {
        self.healthy.clone()
    }

    /// Positions per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
}

/// The engine task's state.
pub struct Engine {
    sched: Scheduler,
    /// `None` while the replica's workers are failed and not yet re-formed.
    link: Option<ReplicaLink>,
    rx: mpsc::UnboundedReceiver<Command>,
    /// Evictions from the supervisor (`EngineHandle::evict`).
    evict: mpsc::UnboundedReceiver<String>,
    clients: HashMap<u64, ClientState>,
    next_id: u64,
    load: Arc<Mutex<ReplicaLoad>>,
    pending: Arc<AtomicUsize>,
    healthy: watch::Sender<bool>,
    /// Step ids sent and not yet answered, oldest first.
    in_flight: VecDeque<u64>,
    /// The set this replica belongs to and its index there (for hand-offs).
    set: Option<(Arc<ReplicaSet>, usize)>,
    /// Queue time, step sizes and timings, scheduler gauges (`metrics.rs`).
    metrics: ReplicaMetrics,
}

impl Engine {
    /// Builds the engine and its handle; run the engine with `tokio::spawn(engine.run())`.
    pub fn new(sched: Scheduler, link: ReplicaLink) -> (Engine, EngineHandle) {
        let (tx, rx) = mpsc::unbounded_channel();
        let load = Arc::new(Mutex::new(ReplicaLoad::default()));
        let (healthy, health_rx) = watch::channel(true);
        let block_size = sched.config().block_size;
        let pending = Arc::new(AtomicUsize::new(0));
        let (evict_tx, evict) = mpsc::unbounded_channel();
        let handle = EngineHandle {
            tx,
            load: load.clone(),
            pending: pending.clone(),
            healthy: health_rx,
            block_size,
            evict: evict_tx,
        };
        (
            Engine {
                sched,
                link: Some(link),
                rx,
                evict,
                clients: HashMap::new(),
                next_id: 1,
                load,
                pending,
                healthy,
                in_flight: VecDeque::new(),
                set: None,
                metrics: ReplicaMetrics::detached(),
            },
            handle,
        )
    }

    /// Makes this engine replica `index` of `set`: when it fails, its sequences move to
    /// the set's other replicas.
    pub fn in_set(mut self, set: Arc<ReplicaSet>, index: usize) -> Self {
        self.set = Some((set, index));
        self
    }

    /// Records this replica's metrics into `metrics` (a coordinator-wide registry).
    pub fn with_metrics(mut self, metrics: ReplicaMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    pub async fn run(mut self) {
        self.publish(0);
        loop {
            if self.link.is_none() || !self.sched.has_work() {
                tokio::select! {
                    cmd = self.rx.recv() => match cmd {
                        Some(cmd) => self.command(cmd),
                        None => return, // every handle dropped: shut down
                    },
                    Some(reason) = self.evict.recv() => self.evicted(reason),
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            if self.link.is_none() {
                continue;
            }
            self.drop_departed();
            self.step().await;
        }
    }

    /// Sends what fits in flight, waits for the oldest step's reply and streams its tokens.
    async fn step(&mut self) {
        let Some(link) = self.link.as_mut() else { return };
        let t0 = Instant::now();
        // Keep the pipeline full: up to one step per stage in flight (1 otherwise);
        // the scheduler never puts a sequence in two of them.
        let mut send_failed = None;
        // One step per pipeline stage; a replica without stages keeps a second step queued
        // when the scheduler can fill it with lookahead decodes.
        let depth = link.depth().max(self.sched.config().max_in_flight);
        while self.in_flight.len() < depth {
            let Some(batch) = self.sched.schedule() else { break };
            self.metrics.scheduled(&batch);
            seq_trace::on_scheduled(&mut self.clients, &batch);
            let req = step_request(&self.sched, &self.clients, &batch);
            let id = req.step_id;
            if let Err(e) = link.send(req).await {
                send_failed = Some(e);
                break;
            }
            self.in_flight.push_back(id);
        }
        let mut cpu = t0.elapsed();
        let Some(&want) = self.in_flight.front() else {
            if let Some(e) = send_failed {
                return self.fail_replica(e);
            }
            self.publish(0);
            // Work exists but nothing fits this step (cannot happen with one batch in
            // flight at a time unless everything was just aborted); wait for input.
            if self.sched.has_work() {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            return;
        };
        let result = match send_failed {
            Some(e) => Err(e),
            None => tokio::select! {
                r = link.recv(want) => r,
                Some(reason) = self.evict.recv() => Err(LinkError::Evicted { addr: link.addr().to_string(), reason }),
            },
        };
        match result {
            Ok(reply) => {
                self.in_flight.pop_front();
                seq_trace::on_step_done(&mut self.clients, want);
                let t1 = Instant::now();
                let outs: Vec<StepOutput> =
                    reply.sampled.iter().map(|s| StepOutput { seq_id: s.seq_id, token: s.token }).collect();
                let updates = self.sched.postprocess(&outs);
                let by_id: HashMap<u64, &pb::Sampled> = reply.sampled.iter().map(|s| (s.seq_id, s)).collect();
                // A sequence that failed on its own (its constraint) has no sampled token, so
                // postprocess ends it with an error; this is the message the client gets.
                let errors: HashMap<u64, &str> =
                    reply.seq_errors.iter().map(|e| (e.seq_id, e.message.as_str())).collect();
                for u in updates {
                    self.emit(u, by_id.get(&u.seq_id).copied(), errors.get(&u.seq_id).copied());
                }
                cpu += t1.elapsed();
                let worker = Duration::from_micros(u64::from(reply.forward_us) + u64::from(reply.sample_us));
                self.metrics.step_done(t0.elapsed(), cpu, worker);
            }
            Err(e) => self.fail_replica(e),
        }
        self.publish(cpu.as_micros() as u64);
    }

    /// The workers are gone or broken: they are detached at once, new work is refused, and
    /// every unfinished sequence moves to another healthy replica or ends with an error
    /// event now rather than waiting on them.
    fn fail_replica(&mut self, e: LinkError) {
        let msg = e.to_string();
        self.link = None;
        self.healthy.send_replace(false);
        self.in_flight.clear();
        self.metrics.forget_all();
        // The tokens of the step that failed never came back: each sequence's output is
        // exactly what its client has been sent.
        let clients: Vec<(u64, ClientState)> = self.clients.drain().collect();
        let mut migrants = Vec::new();
        for (id, client) in clients {
            match self.sched.get(id).filter(|s| !s.is_finished()) {
                Some(seq) => migrants.push(Migrant::new(seq, client, &msg)),
                None => client.fail(&msg),
            }
        }
        self.sched.fail_all();
        self.publish(0);
        let index = self.set.as_ref().map_or(0, |(_, i)| *i);
        tracing::warn!("tessera coordinator: replica {index} failed ({} sequence(s) to move): {msg}", migrants.len());
        match &self.set {
            Some((set, index)) => {
                set.replica_failed(*index);
                for m in migrants {
                    set.hand_off(*index, m);
                }
            }
            None => migrants.into_iter().for_each(Migrant::fail),
        }
    }

    /// An eviction: fails the replica if it is serving (a stale one, sent before a failure
    /// the engine found on its own, is dropped).
    fn evicted(&mut self, reason: String) {
        if let Some(link) = &self.link {
            let addr = link.addr().to_string();
            self.fail_replica(LinkError::Evicted { addr, reason });
        }
    }

    fn command(&mut self, cmd: Command) {
        if matches!(cmd, Command::Submit(..) | Command::Adopt(_)) {
            self.pending.fetch_sub(1, Ordering::Relaxed);
        }
        match cmd {
            Command::Submit(s, reply) => {
                if self.link.is_none() {
                    // It raced with this replica's failure: another healthy replica takes
                    // it over, else it is refused (UNAVAILABLE).
                    match &self.set {
                        Some((set, index)) if set.can_hand_off(*index) => {
                            let index = *index;
                            let stop = StopCriteria::new(s.max_tokens, s.stop_ids);
                            let mut client = ClientState::new(s.events, s.sampling, s.prompt.len());
                            client.trace = s.trace;
                            let seq = Sequence::new(0, s.prompt, stop, 0);
                            let m = Migrant::new(&seq, client, "its replica failed before admitting it");
                            set.hand_off(index, m);
                            let _ = reply.send(Ok(0));
                        }
                        _ => {
                            let _ = reply.send(Err(AdmissionError::QueueFull { max_waiting: 0 }));
                        }
                    }
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let stop = StopCriteria::new(s.max_tokens, s.stop_ids);
                let prompt_tokens = s.prompt.len();
                let seq = Sequence::new(id, s.prompt, stop, id).with_wire_bytes(s.sampling.encoded_len());
                match self.sched.add(seq) {
                    Ok(()) => {
                        self.clients.insert(id, ClientState::new(s.events, s.sampling, prompt_tokens));
                        self.clients.entry(id).and_modify(|c| c.trace = s.trace);
                        self.metrics.queued(id);
                        let _ = reply.send(Ok(id));
                    }
                    Err(e) => {
                        s.trace.refused(&e.to_string());
                        let _ = reply.send(Err(e));
                    }
                }
            }
            Command::Adopt(m) => self.adopt(m),
            Command::Attach(link, sched) => {
                // Evictions sent before this formation were about the old workers.
                while self.evict.try_recv().is_ok() {}
                self.sched = sched;
                self.link = Some(link);
                self.in_flight.clear();
                self.publish(0);
                self.healthy.send_replace(true);
            }
        }
    }

    /// Continues a sequence of a failed replica here (or passes it on if this replica has
    /// failed meanwhile).
    fn adopt(&mut self, m: Migrant) {
        if self.link.is_none() {
            match &self.set {
                Some((set, index)) => set.hand_off(*index, m),
                None => m.fail(),
            }
            return;
        }
        if m.client.events.is_closed() {
            return; // its client went away meanwhile
        }
        let id = self.next_id;
        self.next_id += 1;
        match self.sched.add(m.sequence(id)) {
            Ok(()) => {
                self.clients.insert(id, m.client);
                self.clients.entry(id).and_modify(|c| c.trace.requeued(Some(&m.reason)));
            }
            Err(e) => m.client.fail(&format!("{}; moving the request to another replica failed: {e}", m.reason)),
        }
    }

    /// Clients that closed their stream are aborted; their blocks free at once or, if
    /// they are in the step running now, at its postprocess.
    fn drop_departed(&mut self) {
        let gone: Vec<u64> = self.clients.iter().filter(|(_, c)| c.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.sched.abort(id);
            self.clients.remove(&id);
            self.metrics.forget(id);
        }
    }

    fn emit(&mut self, u: SeqUpdate, sampled: Option<&pb::Sampled>, error: Option<&str>) {
        let Some(c) = self.clients.get_mut(&u.seq_id) else { return };
        let send =
            |c: &ClientState, e: cpb::generate_event::Event| c.events.send(Ok(cpb::GenerateEvent { event: Some(e) }));
        if !c.announced {
            c.announced = true;
            let _ = send(
                c,
                cpb::generate_event::Event::Prompt(cpb::PromptInfo {
                    prompt_tokens: c.prompt_tokens as u32,
                    cached_tokens: u.num_cached_prompt as u32,
                }),
            );
        }
        if let Some(t) = u.token {
            c.completion_tokens += 1;
            let (logprob, top_ids, top_logprobs) = match sampled {
                Some(s) => (s.logprob, s.top_ids.clone(), s.top_logprobs.clone()),
                None => (0.0, Vec::new(), Vec::new()),
            };
            let _ =
                send(c, cpb::generate_event::Event::Token(cpb::TokenEvent { id: t, logprob, top_ids, top_logprobs }));
        }
        if let Some(reason) = u.finished {
            let reason = match reason {
                FinishReason::Stop => cpb::FinishReason::Stop,
                FinishReason::Length => cpb::FinishReason::Length,
                FinishReason::Aborted => cpb::FinishReason::Abort,
                FinishReason::Error => cpb::FinishReason::Error,
            };
            let _ = send(
                c,
                cpb::generate_event::Event::Finished(cpb::Finished {
                    reason: reason as i32,
                    prompt_tokens: c.prompt_tokens as u32,
                    completion_tokens: c.completion_tokens as u32,
                    message: error.unwrap_or_default().to_string(),
                }),
            );
            c.trace.finish(seq_trace::reason_name(reason), c.prompt_tokens, c.completion_tokens, u.num_cached_prompt);
            self.clients.remove(&u.seq_id);
        }
    }

    fn publish(&mut self, cpu_us: u64) {
        let s = self.sched.stats();
        self.metrics.publish(&s, self.sched.config().num_blocks);
        let mut l = self.load.lock().unwrap_or_else(|e| e.into_inner());
        *l = ReplicaLoad {
            running: s.running,
            waiting: s.waiting,
            used_blocks: s.used_blocks,
            total_blocks: self.sched.config().num_blocks,
            steps: s.steps,
            last_cpu_us: if cpu_us > 0 { cpu_us } else { l.last_cpu_us },
        };
    }
}

/// The wire form of a scheduled batch.
fn step_request(sched: &Scheduler, clients: &HashMap<u64, ClientState>, batch: &ScheduledBatch) -> pb::StepRequest {
    pb::StepRequest {
        step_id: batch.step_id,
        finished: batch.finished.clone(),
        new_sequences: batch
            .new_seqs
            .iter()
            .map(|n| {
                // Positions before the sequence's first run are prefix-cache hits.
                let first = batch.runs.iter().find(|r| r.seq_id == n.seq_id).map_or(0, |r| r.first_pos);
                let cached = sched.get(n.seq_id).map(|s| &s.tokens()[..first.min(s.len())]).unwrap_or(&[]);
                pb::NewSequence {
                    seq_id: n.seq_id,
                    sampling: clients.get(&n.seq_id).map(|c| c.sampling.clone()),
                    block_table: n.block_table.clone(),
                    cached_tokens: cached.to_vec(),
                    num_generated: n.prior_output.len() as u32,
                    traceparent: clients.get(&n.seq_id).map(|c| c.trace.traceparent()).unwrap_or_default(),
                }
            })
            .collect(),
        appends: batch
            .appends
            .iter()
            .map(|a| pb::BlockAppend { seq_id: a.seq_id, block_ids: a.block_ids.clone() })
            .collect(),
        runs: batch
            .runs
            .iter()
            .map(|r| pb::SeqRun {
                seq_id: r.seq_id,
                tokens: r.tokens.clone(),
                first_pos: r.first_pos as u32,
                sample: r.sample,
                from_previous: r.from_previous,
            })
            .collect(),
    }
}
