//! The coordinator's gRPC service (`tessera.coordinator.v1.Coordinator`): admits each
//! Generate call to the least-loaded healthy replica and streams its events back.
//! Dropping the response stream closes the event channel, which the engine notices at
//! its next step and aborts the sequence.

use std::sync::Arc;

use tessera_proto::coordinator as cpb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status};

use crate::engine::{EngineHandle, Submission};
use crate::error::AdmissionError;

/// Seconds a client is told to wait before retrying an overloaded server.
const RETRY_AFTER_S: &str = "1";

/// The service over a set of replicas of one model.
#[derive(Clone)]
pub struct CoordinatorService {
    replicas: Arc<Vec<EngineHandle>>,
    model: String,
    max_model_len: usize,
    vocab_size: usize,
}

impl CoordinatorService {
    pub fn new(replicas: Vec<EngineHandle>, model: String, max_model_len: usize, vocab_size: usize) -> Self {
        CoordinatorService { replicas: Arc::new(replicas), model, max_model_len, vocab_size }
    }

    /// The healthy replica with the fewest running + waiting sequences.
    fn pick(&self) -> Option<&EngineHandle> {
        self.replicas.iter().filter(|r| r.healthy()).min_by_key(|r| {
            let l = r.load();
            l.running + l.waiting
        })
    }
}

fn admission_status(e: AdmissionError) -> Status {
    let mut s = match &e {
        AdmissionError::QueueFull { max_waiting: 0 } => Status::unavailable("no replica can serve the request"),
        AdmissionError::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
        _ => Status::invalid_argument(e.to_string()),
    };
    if let Ok(v) = RETRY_AFTER_S.parse() {
        s.metadata_mut().insert("retry-after", v);
    }
    s
}

#[tonic::async_trait]
impl cpb::coordinator_server::Coordinator for CoordinatorService {
    type GenerateStream = UnboundedReceiverStream<Result<cpb::GenerateEvent, Status>>;

    async fn generate(&self, req: Request<cpb::GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let req = req.into_inner();
        crate::validate::validate(&req, self.vocab_size).map_err(|e| Status::invalid_argument(e.0))?;
        let replica = self.pick().ok_or_else(|| admission_status(AdmissionError::QueueFull { max_waiting: 0 }))?;
        let (tx, rx) = mpsc::unbounded_channel();
        let sub = Submission {
            prompt: req.prompt_ids,
            sampling: req.sampling.unwrap_or_default(),
            max_tokens: req.max_tokens as usize,
            stop_ids: req.stop_token_ids,
            events: tx,
        };
        replica.submit(sub).await.map_err(admission_status)?;
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }

    async fn status(&self, _req: Request<cpb::StatusRequest>) -> Result<Response<cpb::CoordinatorStatus>, Status> {
        let mut st = cpb::CoordinatorStatus {
            model: self.model.clone(),
            max_model_len: self.max_model_len as u32,
            ..Default::default()
        };
        for r in self.replicas.iter() {
            let l = r.load();
            st.ready |= r.healthy();
            st.running += l.running as u32;
            st.waiting += l.waiting as u32;
            st.kv_blocks_used += l.used_blocks as u32;
            st.kv_blocks_total += l.total_blocks as u32;
        }
        Ok(Response::new(st))
    }
}
