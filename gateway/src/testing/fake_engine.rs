//! `FakeEngine`: an `Engine` whose sequences follow a script chosen per request, and which
//! records what it was asked and which sequences were aborted (receiver dropped before the
//! script finished), so tests can assert that a client disconnect or a matched stop string
//! freed the sequence.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{mpsc, Notify};

use crate::engine::{Engine, EngineError, EngineEvent, EventStream, FinishReason, GenerateRequest};

/// One step of a scripted sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum FakeStep {
    Send(EngineEvent),
    Sleep(Duration),
    /// Wait until the receiver is dropped (a sequence that never ends by itself).
    Hold,
}

/// What the engine saw.
#[derive(Debug, Clone, Default)]
pub struct FakeLog {
    pub requests: Vec<GenerateRequest>,
    /// Request ids whose receiver was dropped before their script ended.
    pub aborted: Vec<String>,
    /// Request ids that ran their script to the end.
    pub completed: Vec<String>,
}

type Script = dyn Fn(&GenerateRequest) -> Result<Vec<FakeStep>, EngineError> + Send + Sync;

pub struct FakeEngine {
    script: Box<Script>,
    ready: AtomicBool,
    log: Arc<Mutex<FakeLog>>,
    changed: Arc<Notify>,
}

impl FakeEngine {
    /// `script` picks each sequence's steps, or refuses it.
    pub fn new(
        script: impl Fn(&GenerateRequest) -> Result<Vec<FakeStep>, EngineError> + Send + Sync + 'static,
    ) -> Self {
        FakeEngine {
            script: Box::new(script),
            ready: AtomicBool::new(true),
            log: Arc::new(Mutex::new(FakeLog::default())),
            changed: Arc::new(Notify::new()),
        }
    }

    /// Every sequence answers with `reply` (see `reply_steps`).
    pub fn replying(reply: Vec<u32>) -> Self {
        FakeEngine::new(move |req| Ok(reply_steps(req, &reply, 0)))
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub fn log(&self) -> FakeLog {
        lock(&self.log).clone()
    }

    /// Waits (at most `timeout`) until `request_id` is recorded as aborted.
    pub async fn wait_for_abort(&self, request_id: &str, timeout: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if lock(&self.log).aborted.iter().any(|id| id == request_id) {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

fn lock(log: &Mutex<FakeLog>) -> MutexGuard<'_, FakeLog> {
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The usual engine behaviour over a fixed reply: `PromptInfo`, then the reply's tokens
/// (logprob of the `k`-th token = -(k+1)/8; alternatives `(id+1+j) % 256` with logprob
/// -(k+2+j)/8 when asked), stopping after a token in `stop_token_ids` (`Stop`), after
/// `max_tokens` tokens (`Length`), or at the end of the reply (`Stop`).
pub fn reply_steps(req: &GenerateRequest, reply: &[u32], cached_tokens: u32) -> Vec<FakeStep> {
    let p = &req.params;
    let mut steps = vec![FakeStep::Send(EngineEvent::PromptInfo { cached_tokens })];
    let mut reason = FinishReason::Stop;
    let mut count = 0u32;
    for (k, &id) in reply.iter().enumerate() {
        let (logprob, top) = match p.logprobs {
            Some(n) => {
                let top = (0..n).map(|j| ((id + 1 + j) % 256, -((k as u32 + 2 + j) as f32) / 8.0)).collect();
                (Some(-((k + 1) as f32) / 8.0), top)
            }
            None => (None, Vec::new()),
        };
        steps.push(FakeStep::Send(EngineEvent::Token { id, logprob, top }));
        count += 1;
        if p.stop_token_ids.binary_search(&id).is_ok() {
            break;
        }
        if count == p.max_tokens {
            reason = FinishReason::Length;
            break;
        }
    }
    let prompt_tokens = req.prompt_ids.len() as u32;
    steps.push(FakeStep::Send(EngineEvent::Finished { reason, prompt_tokens, completion_tokens: count }));
    steps
}

impl Engine for FakeEngine {
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, EngineError>> {
        Box::pin(async move {
            let steps = (self.script)(&req);
            let id = req.request_id.clone();
            lock(&self.log).requests.push(req);
            let steps = steps?;
            let (tx, rx) = mpsc::channel(4);
            let log = self.log.clone();
            let changed = self.changed.clone();
            tokio::spawn(async move {
                let finished = run(&tx, steps).await;
                let mut log = lock(&log);
                if finished {
                    log.completed.push(id)
                } else {
                    log.aborted.push(id)
                }
                drop(log);
                changed.notify_waiters();
            });
            Ok(rx)
        })
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
}

/// Plays the steps; false as soon as the receiver is found dropped.
async fn run(tx: &mpsc::Sender<EngineEvent>, steps: Vec<FakeStep>) -> bool {
    for step in steps {
        match step {
            FakeStep::Send(event) => {
                if tx.send(event).await.is_err() {
                    return false;
                }
            }
            FakeStep::Sleep(d) => {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = tx.closed() => return false,
                }
            }
            FakeStep::Hold => {
                tx.closed().await;
                return false;
            }
        }
    }
    true
}
