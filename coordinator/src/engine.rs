//! The async engine loop of one model replica: it owns the replica's `Scheduler` and its
//! worker link, and turns client submissions into steps and sampled tokens into events.
//!
//! Loop: take new submissions (blocking only when idle), drop sequences whose client went
//! away, `schedule`, send the step deltas to the worker, wait for its reply,
//! `postprocess`, fan the tokens out to each request's event channel. A failed step
//! ends every sequence of the replica with an error event; nothing waits forever.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tessera_proto::coordinator as cpb;
use tessera_proto::worker as pb;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::error::AdmissionError;
use crate::replica_link::ReplicaLink;
use crate::scheduler::{Scheduler, SeqUpdate, StepOutput};
use crate::sequence::{FinishReason, Sequence, StopCriteria};
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
}

enum Command {
    Submit(Submission, oneshot::Sender<Result<u64, AdmissionError>>),
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
    healthy: Arc<AtomicBool>,
}

impl EngineHandle {
    /// Queues a request; `Err` when admission refuses it.
    pub async fn submit(&self, s: Submission) -> Result<u64, AdmissionError> {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Submit(s, tx)).is_err() {
            return Err(AdmissionError::QueueFull { max_waiting: 0 });
        }
        rx.await.unwrap_or(Err(AdmissionError::QueueFull { max_waiting: 0 }))
    }

    pub fn load(&self) -> ReplicaLoad {
        *self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// False once the replica's worker has failed.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

struct Client {
    events: EventTx,
    sampling: pb::SamplingParams,
    prompt_tokens: usize,
    completion_tokens: usize,
    announced: bool,
}

/// The engine task's state.
pub struct Engine {
    sched: Scheduler,
    link: ReplicaLink,
    rx: mpsc::UnboundedReceiver<Command>,
    clients: HashMap<u64, Client>,
    next_id: u64,
    load: Arc<Mutex<ReplicaLoad>>,
    healthy: Arc<AtomicBool>,
    /// Step ids sent and not yet answered, oldest first.
    in_flight: std::collections::VecDeque<u64>,
}

impl Engine {
    /// Builds the engine and its handle; run the engine with `tokio::spawn(engine.run())`.
    pub fn new(sched: Scheduler, link: ReplicaLink) -> (Engine, EngineHandle) {
        let (tx, rx) = mpsc::unbounded_channel();
        let load = Arc::new(Mutex::new(ReplicaLoad::default()));
        let healthy = Arc::new(AtomicBool::new(true));
        let handle = EngineHandle { tx, load: load.clone(), healthy: healthy.clone() };
        (
            Engine {
                sched,
                link,
                rx,
                clients: HashMap::new(),
                next_id: 1,
                load,
                healthy,
                in_flight: std::collections::VecDeque::new(),
            },
            handle,
        )
    }

    pub async fn run(mut self) {
        self.publish(0);
        loop {
            if !self.sched.has_work() {
                match self.rx.recv().await {
                    Some(cmd) => self.command(cmd),
                    None => return, // every handle dropped: shut down
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.command(cmd);
            }
            self.drop_departed();
            let t0 = Instant::now();
            // Keep the pipeline full: up to one step per stage in flight (1 otherwise);
            // the scheduler never puts a sequence in two of them.
            let mut send_failed = None;
            while self.in_flight.len() < self.link.depth() {
                let Some(batch) = self.sched.schedule() else { break };
                let req = self.step_request(&batch);
                let id = req.step_id;
                if let Err(e) = self.link.send(req).await {
                    send_failed = Some(e);
                    break;
                }
                self.in_flight.push_back(id);
            }
            let mut cpu = t0.elapsed();
            let Some(&want) = self.in_flight.front() else {
                if let Some(e) = send_failed {
                    self.fail_replica(e);
                    continue;
                }
                self.publish(0);
                // Work exists but nothing fits this step (cannot happen with one batch in
                // flight at a time unless everything was just aborted); wait for input.
                if self.sched.has_work() {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
                continue;
            };
            let result = match send_failed {
                Some(e) => Err(e),
                None => self.link.recv(want).await,
            };
            match result {
                Ok(reply) => {
                    self.in_flight.pop_front();
                    let t1 = Instant::now();
                    let outs: Vec<StepOutput> =
                        reply.sampled.iter().map(|s| StepOutput { seq_id: s.seq_id, token: s.token }).collect();
                    let updates = self.sched.postprocess(&outs);
                    let by_id: HashMap<u64, &pb::Sampled> = reply.sampled.iter().map(|s| (s.seq_id, s)).collect();
                    for u in updates {
                        self.emit(u, by_id.get(&u.seq_id).copied());
                    }
                    cpu += t1.elapsed();
                }
                Err(e) => self.fail_replica(e),
            }
            self.publish(cpu.as_micros() as u64);
        }
    }

    /// The workers are gone or broken: every sequence of the replica ends with an error
    /// event now rather than waiting on them, and new work is refused.
    fn fail_replica(&mut self, e: crate::worker_link::LinkError) {
        self.healthy.store(false, Ordering::Relaxed);
        self.in_flight.clear();
        let msg = e.to_string();
        let mut ended = Vec::new();
        while self.sched.has_in_flight() {
            ended.extend(self.sched.postprocess(&[]));
        }
        ended.extend(self.sched.fail_all());
        let ids: Vec<u64> = ended.iter().map(|u| u.seq_id).chain(self.clients.keys().copied()).collect();
        for id in ids {
            self.finish_with_error(id, &msg);
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(s, reply) => {
                if !self.healthy.load(Ordering::Relaxed) {
                    let _ = reply.send(Err(AdmissionError::QueueFull { max_waiting: 0 }));
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let stop = StopCriteria::new(s.max_tokens, s.stop_ids);
                let prompt_tokens = s.prompt.len();
                let seq = Sequence::new(id, s.prompt, stop, id);
                match self.sched.add(seq) {
                    Ok(()) => {
                        self.clients.insert(
                            id,
                            Client {
                                events: s.events,
                                sampling: s.sampling,
                                prompt_tokens,
                                completion_tokens: 0,
                                announced: false,
                            },
                        );
                        let _ = reply.send(Ok(id));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                }
            }
        }
    }

    /// Clients that closed their stream are aborted; their blocks free at once or, if
    /// they are in the step running now, at its postprocess.
    fn drop_departed(&mut self) {
        let gone: Vec<u64> = self.clients.iter().filter(|(_, c)| c.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.sched.abort(id);
            self.clients.remove(&id);
        }
    }

    fn step_request(&self, batch: &ScheduledBatch) -> pb::StepRequest {
        pb::StepRequest {
            step_id: batch.step_id,
            finished: batch.finished.clone(),
            new_sequences: batch
                .new_seqs
                .iter()
                .map(|n| {
                    // Positions before the sequence's first run are prefix-cache hits.
                    let first = batch.runs.iter().find(|r| r.seq_id == n.seq_id).map_or(0, |r| r.first_pos);
                    let cached = self.sched.get(n.seq_id).map(|s| &s.tokens()[..first.min(s.len())]).unwrap_or(&[]);
                    pb::NewSequence {
                        seq_id: n.seq_id,
                        sampling: self.clients.get(&n.seq_id).map(|c| c.sampling.clone()),
                        block_table: n.block_table.clone(),
                        cached_tokens: cached.to_vec(),
                        num_generated: n.prior_output.len() as u32,
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
                })
                .collect(),
        }
    }

    fn emit(&mut self, u: SeqUpdate, sampled: Option<&pb::Sampled>) {
        let Some(c) = self.clients.get_mut(&u.seq_id) else { return };
        let send = |c: &Client, e: cpb::generate_event::Event| c.events.send(Ok(cpb::GenerateEvent { event: Some(e) }));
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
                    message: String::new(),
                }),
            );
            self.clients.remove(&u.seq_id);
        }
    }

    fn finish_with_error(&mut self, id: u64, msg: &str) {
        if let Some(c) = self.clients.remove(&id) {
            let _ = c.events.send(Ok(cpb::GenerateEvent {
                event: Some(cpb::generate_event::Event::Finished(cpb::Finished {
                    reason: cpb::FinishReason::Error as i32,
                    prompt_tokens: c.prompt_tokens as u32,
                    completion_tokens: c.completion_tokens as u32,
                    message: msg.to_string(),
                })),
            }));
        }
    }

    fn publish(&self, cpu_us: u64) {
        let s = self.sched.stats();
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
