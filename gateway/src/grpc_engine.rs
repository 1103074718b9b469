//! The production `Engine`: a gRPC client of the coordinator (`tessera.coordinator.v1`).
//! Each sequence is one server-streaming Generate call; dropping the gateway's receiver
//! drops the call, which closes the coordinator's event channel and aborts the sequence.
//! Readiness comes from polling the coordinator's Status in the background. With a client
//! TLS config the channel is mutual TLS (the gateway presents its certificate and checks the
//! coordinator's against the cluster CA).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tessera_proto::coordinator as cpb;
use tessera_proto::coordinator::coordinator_client::CoordinatorClient;
use tessera_proto::worker as wpb;
use tessera_telemetry::trace as otel;
use tokio::sync::mpsc;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Code;

use std::sync::Mutex;

use crate::engine::{
    Constraint, Engine, EngineError, EngineEvent, EngineStats, EventStream, FinishReason, GenerateRequest,
};

/// How often readiness is refreshed.
const STATUS_PERIOD: Duration = Duration::from_millis(500);

/// Client of one coordinator.
pub struct GrpcEngine {
    client: CoordinatorClient<Channel>,
    ready: Arc<AtomicBool>,
    stats: Arc<Mutex<Option<EngineStats>>>,
}

impl GrpcEngine {
    /// A client of the coordinator at `addr` (`host:port` or a URI). Connects lazily, so
    /// the gateway can start before the coordinator; `/ready` says when it can serve.
    pub fn new(addr: &str) -> Result<Self, EngineError> {
        Self::with_tls(addr, None)
    }

    /// Like [`GrpcEngine::new`], over mutual TLS when `tls` is set (a bare `host:port` is
    /// dialed as `https://`).
    pub fn with_tls(addr: &str, tls: Option<ClientTlsConfig>) -> Result<Self, EngineError> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let uri = if addr.contains("://") { addr.to_string() } else { format!("{scheme}://{addr}") };
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|e| EngineError::Internal(format!("bad coordinator address {addr}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(2));
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| EngineError::Internal(format!("TLS settings for the coordinator {addr}: {e}")))?;
        }
        let channel = endpoint.connect_lazy();
        let client = CoordinatorClient::new(channel);
        let ready = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(None));
        let (poll_client, poll_ready, poll_stats) = (client.clone(), ready.clone(), Arc::downgrade(&stats));
        tokio::spawn(async move { poll_status(poll_client, poll_ready, poll_stats).await });
        Ok(GrpcEngine { client, ready, stats })
    }
}

async fn poll_status(
    mut client: CoordinatorClient<Channel>,
    ready: Arc<AtomicBool>,
    stats: std::sync::Weak<Mutex<Option<EngineStats>>>,
) {
    let weak = Arc::downgrade(&ready);
    drop(ready);
    loop {
        let status = client.status(cpb::StatusRequest {}).await.ok().map(|r| r.into_inner());
        let (Some(flag), Some(cell)) = (weak.upgrade(), stats.upgrade()) else {
            return; // the engine was dropped
        };
        flag.store(status.as_ref().is_some_and(|s| s.ready), Ordering::Relaxed);
        *cell.lock().unwrap_or_else(|e| e.into_inner()) = status.map(|s| EngineStats {
            running: s.running,
            waiting: s.waiting,
            kv_blocks_used: s.kv_blocks_used,
            kv_blocks_total: s.kv_blocks_total,
        });
        tokio::time::sleep(STATUS_PERIOD).await;
    }
}

fn to_proto(req: &GenerateRequest) -> cpb::GenerateRequest {
    let p = &req.params;
    cpb::GenerateRequest {
        request_id: req.request_id.clone(),
        prompt_ids: req.prompt_ids.clone(),
        sampling: Some(wpb::SamplingParams {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k.unwrap_or(0),
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty,
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            logit_bias: p.logit_bias.iter().copied().collect(),
            seed: p.seed,
            top_logprobs: p.logprobs.unwrap_or(0),
            logprobs: p.logprobs.is_some(),
            constraint: p.constraint.as_ref().map(constraint_to_proto),
            min_tokens: p.min_tokens,
            // The coordinator fills these from `stop_token_ids` below.
            min_tokens_stop_ids: Vec::new(),
        }),
        max_tokens: p.max_tokens,
        stop_token_ids: p.stop_token_ids.clone(),
        ignore_eos: p.ignore_eos,
    }
}

/// The gateway's grammar as the worker's `Constraint` message (one to one).
fn constraint_to_proto(c: &Constraint) -> wpb::Constraint {
    use wpb::constraint::Kind;
    let kind = match c {
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::Lark(s) => Kind::Lark(s.clone()),
        Constraint::Regex(s) => Kind::Regex(s.clone()),
    };
    wpb::Constraint { kind: Some(kind) }
}

/// The coordinator's refusal as the engine's error. `ResourceExhausted` is the coordinator's
/// full queue (429); `OutOfRange` is gRPC's answer to a message over the receiver's size
/// limit, a request too large (400) rather than a fault of the service (500).
fn map_status(s: tonic::Status) -> EngineError {
    let retry = s.metadata().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(1);
    match s.code() {
        Code::ResourceExhausted => EngineError::Overloaded { retry_after_s: retry },
        Code::Unavailable => EngineError::Unavailable { retry_after_s: retry },
        Code::InvalidArgument => EngineError::InvalidRequest(s.message().to_string()),
        Code::OutOfRange => EngineError::InvalidRequest(format!("the request is too large: {}", s.message())),
        _ => EngineError::Internal(format!("{:?}: {}", s.code(), s.message())),
    }
}

fn to_event(e: cpb::generate_event::Event, logprobs: bool) -> EngineEvent {
    use cpb::generate_event::Event;
    match e {
        Event::Prompt(p) => EngineEvent::PromptInfo { cached_tokens: p.cached_tokens },
        Event::Token(t) => EngineEvent::Token {
            id: t.id,
            logprob: logprobs.then_some(t.logprob),
            top: t.top_ids.into_iter().zip(t.top_logprobs).collect(),
        },
        Event::Finished(f) => {
            let reason = match cpb::FinishReason::try_from(f.reason) {
                Ok(cpb::FinishReason::Stop) => FinishReason::Stop,
                Ok(cpb::FinishReason::Length) => FinishReason::Length,
                Ok(cpb::FinishReason::Abort) => FinishReason::Abort,
                _ => return EngineEvent::Error(EngineError::Internal(f.message)),
            };
            EngineEvent::Finished { reason, prompt_tokens: f.prompt_tokens, completion_tokens: f.completion_tokens }
        }
    }
}

impl Engine for GrpcEngine {
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, EngineError>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            let logprobs = req.params.logprobs.is_some();
            let mut call = tonic::Request::new(to_proto(&req));
            // The W3C trace context of the caller's span (the request's `stream` phase), when
            // it is traced: the coordinator's spans become its children.
            otel::inject(&otel::Context::current(), call.metadata_mut());
            let mut stream = client.generate(call).await.map_err(map_status)?.into_inner();
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        // The gateway dropped the receiver: returning drops the call,
                        // which the coordinator sees as a cancelled stream.
                        _ = tx.closed() => return,
                        msg = stream.message() => {
                            let ev = match msg {
                                Ok(Some(m)) => match m.event {
                                    Some(e) => to_event(e, logprobs),
                                    None => continue,
                                },
                                Ok(None) => EngineEvent::Error(EngineError::Internal(
                                    "the coordinator ended the stream without finishing".into(),
                                )),
                                Err(s) => EngineEvent::Error(map_status(s)),
                            };
                            let last = matches!(ev, EngineEvent::Finished { .. } | EngineEvent::Error(_));
                            if tx.send(ev).await.is_err() || last {
                                return;
                            }
                        }
                    }
                }
            });
            Ok(rx)
        })
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    fn stats(&self) -> Option<EngineStats> {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_the_engine_errors_of_their_http_codes() {
        // What tonic answers for a message over the coordinator's decoding limit.
        let big = tonic::Status::out_of_range("Error, decoded message length too large: found 70000000 bytes");
        match map_status(big) {
            EngineError::InvalidRequest(m) => assert!(m.contains("too large") && m.contains("70000000"), "{m}"),
            other => panic!("a message over the size limit must be a 400, got {other:?}"),
        }
        let mut full = tonic::Status::resource_exhausted("queue full");
        full.metadata_mut().insert("retry-after", tonic::metadata::MetadataValue::from_static("7"));
        assert!(matches!(map_status(full), EngineError::Overloaded { retry_after_s: 7 }));
        assert!(matches!(map_status(tonic::Status::unavailable("x")), EngineError::Unavailable { retry_after_s: 1 }));
        let bad = map_status(tonic::Status::invalid_argument("sampling.top_p = 2 is out of range"));
        assert!(matches!(bad, EngineError::InvalidRequest(m) if m == "sampling.top_p = 2 is out of range"));
        assert!(matches!(map_status(tonic::Status::internal("boom")), EngineError::Internal(_)));
    }
}
