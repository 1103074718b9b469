//! The coordinator's gRPC service (`tessera.coordinator.v1.Coordinator`): admits each
//! Generate call to a healthy replica (prefix-cache affinity, else least loaded; see
//! `routing`) and streams its events back. Dropping the response stream closes the event
//! channel, which the engine notices at its next step and aborts the sequence.
//! While draining, new calls are refused with UNAVAILABLE and `retry-after`.

use std::sync::Arc;

use tessera_proto::coordinator as cpb;
use tessera_proto::worker as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::drain::{Drain, Tracked};
use crate::engine::{EngineHandle, Submission};
use crate::error::AdmissionError;
use crate::replica_set::ReplicaSet;
use crate::routing::{prompt_block_hashes, RoutingConfig};
use crate::seq_trace::SeqTrace;

/// Seconds a client is told to wait before retrying an overloaded server.
const RETRY_AFTER_S: &str = "1";

/// The service over a set of replicas of one model.
#[derive(Clone)]
pub struct CoordinatorService {
    replicas: Arc<ReplicaSet>,
    model: String,
    max_model_len: usize,
    vocab_size: usize,
    drain: Drain,
}

impl CoordinatorService {
    /// A service over replicas that hand nothing off to each other (see `with_set`).
    pub fn new(replicas: Vec<EngineHandle>, model: String, max_model_len: usize, vocab_size: usize) -> Self {
        let set = ReplicaSet::new(RoutingConfig::default());
        set.install(replicas);
        Self::with_set(Arc::new(set), model, max_model_len, vocab_size)
    }

    /// A service over a replica set whose engines were built `in_set` it.
    pub fn with_set(replicas: Arc<ReplicaSet>, model: String, max_model_len: usize, vocab_size: usize) -> Self {
        CoordinatorService { replicas, model, max_model_len, vocab_size, drain: Drain::new() }
    }

    /// Shares `drain`: once it starts, new calls are refused and Status says not ready.
    pub fn with_drain(mut self, drain: Drain) -> Self {
        self.drain = drain;
        self
    }
}

fn with_retry_after(mut s: Status) -> Status {
    if let Ok(v) = RETRY_AFTER_S.parse() {
        s.metadata_mut().insert("retry-after", v);
    }
    s
}

fn admission_status(e: AdmissionError) -> Status {
    with_retry_after(match &e {
        AdmissionError::QueueFull { max_waiting: 0 } => Status::unavailable("no replica can serve the request"),
        AdmissionError::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
        _ => Status::invalid_argument(e.to_string()),
    })
}

/// The sampling parameters the workers get: the request's, with `min_tokens_stop_ids` set
/// from the request's stop ids (the complete set, EOS included unless ignored) when
/// `min_tokens` asks for a ban, so the sampling worker bans exactly what would end the
/// sequence; whatever a client put there itself is replaced.
fn worker_sampling(sampling: Option<pb::SamplingParams>, stop_ids: &[u32]) -> pb::SamplingParams {
    let mut s = sampling.unwrap_or_default();
    s.min_tokens_stop_ids = if s.min_tokens > 0 { stop_ids.to_vec() } else { Vec::new() };
    s
}

#[tonic::async_trait]
impl cpb::coordinator_server::Coordinator for CoordinatorService {
    type GenerateStream = Tracked<UnboundedReceiverStream<Result<cpb::GenerateEvent, Status>>>;

    async fn generate(&self, req: Request<cpb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        if self.drain.is_draining() {
            return Err(with_retry_after(Status::unavailable("the coordinator is shutting down")));
        }
        let guard = self.drain.track();
        let trace = SeqTrace::start(req.metadata(), &self.model, &req.get_ref().request_id, req.get_ref().max_tokens);
        let req = req.into_inner();
        crate::validate::validate(&req, self.vocab_size).map_err(|e| Status::invalid_argument(e.0))?;
        let hashes = prompt_block_hashes(&req.prompt_ids, self.replicas.block_size());
        let (index, replica) = self
            .replicas
            .pick(&hashes)
            .ok_or_else(|| admission_status(AdmissionError::QueueFull { max_waiting: 0 }))?;
        let (tx, rx) = mpsc::unbounded_channel();
        // Each output token is looked up in this list: deduplicated, it is no longer than
        // the vocabulary however many ids a client repeats.
        let mut stop_ids = req.stop_token_ids;
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let sub = Submission {
            prompt: req.prompt_ids,
            sampling: worker_sampling(req.sampling, &stop_ids),
            max_tokens: req.max_tokens as usize,
            stop_ids,
            events: tx,
            trace,
        };
        replica.submit(sub).await.map_err(admission_status)?;
        self.replicas.record(&hashes, index);
        Ok(Response::new(Tracked::new(UnboundedReceiverStream::new(rx), guard)))
    }

    async fn status(&self, _req: Request<cpb::StatusRequest>) -> Result<Response<cpb::CoordinatorStatus>, Status> {
        let mut st = cpb::CoordinatorStatus {
            model: self.model.clone(),
            max_model_len: self.max_model_len as u32,
            ..Default::default()
        };
        for r in self.replicas.handles() {
            let l = r.load();
            st.ready |= r.healthy();
            st.running += l.running as u32;
            st.waiting += l.waiting as u32;
            st.kv_blocks_used += l.used_blocks as u32;
            st.kv_blocks_total += l.total_blocks as u32;
        }
        st.ready &= !self.drain.is_draining();
        Ok(Response::new(st))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `min_tokens` takes the request's whole stop set to the workers; without it they get
    /// no ids, whatever the client sent.
    #[test]
    fn workers_get_the_stop_ids_to_ban_only_with_min_tokens() {
        let stops = [2u32, 7, 9];
        let asked = pb::SamplingParams { min_tokens: 4, min_tokens_stop_ids: vec![1], ..Default::default() };
        let s = worker_sampling(Some(asked), &stops);
        assert_eq!((s.min_tokens, s.min_tokens_stop_ids), (4, vec![2, 7, 9]));
        let off = pb::SamplingParams { min_tokens_stop_ids: vec![1], ..Default::default() };
        assert!(worker_sampling(Some(off), &stops).min_tokens_stop_ids.is_empty());
        assert_eq!(worker_sampling(None, &stops), pb::SamplingParams::default());
    }
}
