//! The coordinator's connection to one worker: connect, load the model, then the
//! long-lived Step stream, one request in, one reply out, in order. With a client TLS
//! config the link is mutual TLS (`https://`): the coordinator presents its certificate and
//! checks the worker's against the cluster CA.

use std::time::Duration;

use tessera_proto::worker as pb;
use tessera_proto::worker::worker_client::WorkerClient;
use tokio::sync::mpsc;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Streaming;

/// Why talking to a worker failed.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("worker {addr}: cannot connect: {source}")]
    Connect { addr: String, source: tonic::transport::Error },
    #[error("worker {addr}: {what}: {status}")]
    Rpc { addr: String, what: &'static str, status: Box<tonic::Status> },
    #[error("worker {addr}: the step stream closed")]
    StreamClosed { addr: String },
    #[error("worker {addr}: step {step} failed: {message}")]
    StepFailed { addr: String, step: u64, message: String },
    #[error("replica of {addr}: step {step} got no reply within {after:?}")]
    StepTimeout { addr: String, step: u64, after: std::time::Duration },
    #[error("worker {addr}: reply for step {got}, expected {want}")]
    OutOfOrder { addr: String, got: u64, want: u64 },
    /// Two tensor ranks of the last stage sampled different tokens (their next lookahead
    /// decodes would compute different sequences).
    #[error("replica of {addr}: step {step}: tensor ranks sampled different tokens ({detail})")]
    RanksDisagree { addr: String, step: u64, detail: String },
    /// A reply that no healthy worker sends (a sampled token outside the vocabulary).
    #[error("worker {addr}: step {step}: bad reply: {detail}")]
    BadReply { addr: String, step: u64, detail: String },
    /// The supervisor took the replica's workers away (e.g. a worker's registration
    /// lease expired: it is hung or cut off even if its stream is still open).
    #[error("replica of {addr}: {reason}")]
    Evicted { addr: String, reason: String },
}

/// A worker with an open Step stream.
pub struct WorkerLink {
    addr: String,
    client: WorkerClient<Channel>,
    tx: mpsc::Sender<pb::StepRequest>,
    replies: Streaming<pb::StepReply>,
}

impl WorkerLink {
    /// Connects (retrying for up to `wait` while the worker starts; over TLS when `tls` is
    /// set), loads the model and opens the step stream. Returns the worker's state after
    /// loading.
    pub async fn connect(
        addr: &str,
        load: pb::LoadRequest,
        wait: Duration,
        tls: Option<&ClientTlsConfig>,
    ) -> Result<(Self, pb::WorkerInfo), LinkError> {
        let mut client = Self::dial(addr, wait, tls).await?;
        let info = Self::load(&mut client, addr, load).await?;
        Ok((Self::open(client, addr).await?, info))
    }

    /// A client of the worker at `addr`, retrying for up to `wait` while it starts. With
    /// `tls`, the connection is mutual TLS (a bare `host:port` is dialed as `https://`).
    pub async fn dial(
        addr: &str,
        wait: Duration,
        tls: Option<&ClientTlsConfig>,
    ) -> Result<WorkerClient<Channel>, LinkError> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let uri = if addr.contains("://") { addr.to_string() } else { format!("{scheme}://{addr}") };
        let mut endpoint = Endpoint::from_shared(uri)
            .map_err(|e| LinkError::Connect { addr: addr.into(), source: e })?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(2));
        if let Some(tls) = tls {
            endpoint =
                endpoint.tls_config(tls.clone()).map_err(|e| LinkError::Connect { addr: addr.into(), source: e })?;
        }
        let deadline = tokio::time::Instant::now() + wait;
        let channel = loop {
            match endpoint.connect().await {
                Ok(c) => break c,
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(LinkError::Connect { addr: addr.into(), source: e })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        };
        Ok(WorkerClient::new(channel).max_decoding_message_size(tessera_proto::MAX_MESSAGE_BYTES))
    }

    /// Asks the worker what it is (before loading: its collective addresses).
    pub async fn info_of(client: &mut WorkerClient<Channel>, addr: &str) -> Result<pb::WorkerInfo, LinkError> {
        client.info(pb::InfoRequest {}).await.map(|r| r.into_inner()).map_err(|s| LinkError::Rpc {
            addr: addr.into(),
            what: "info",
            status: Box::new(s),
        })
    }

    /// Loads a model (shard); returns the worker's state after loading.
    pub async fn load(
        client: &mut WorkerClient<Channel>,
        addr: &str,
        load: pb::LoadRequest,
    ) -> Result<pb::WorkerInfo, LinkError> {
        let reply = client.load(load).await.map_err(|s| LinkError::Rpc {
            addr: addr.into(),
            what: "load",
            status: Box::new(s),
        })?;
        Ok(reply.into_inner().info.unwrap_or_default())
    }

    /// Opens the step stream of a loaded worker.
    pub async fn open(mut client: WorkerClient<Channel>, addr: &str) -> Result<Self, LinkError> {
        let (tx, rx) = mpsc::channel(4);
        let replies = client
            .step(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(|s| LinkError::Rpc { addr: addr.into(), what: "open step stream", status: Box::new(s) })?
            .into_inner();
        Ok(WorkerLink { addr: addr.into(), client, tx, replies })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sends one step and waits for its reply.
    pub async fn step(&mut self, req: pb::StepRequest) -> Result<pb::StepReply, LinkError> {
        let want = req.step_id;
        self.send(req).await?;
        self.recv(want).await
    }

    /// Queues one step on the stream (replies come back in the order steps were sent).
    pub async fn send(&mut self, req: pb::StepRequest) -> Result<(), LinkError> {
        self.tx.send(req).await.map_err(|_| LinkError::StreamClosed { addr: self.addr.clone() })
    }

    /// The next reply, which must be step `want`'s.
    pub async fn recv(&mut self, want: u64) -> Result<pb::StepReply, LinkError> {
        let reply = match self.replies.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return Err(LinkError::StreamClosed { addr: self.addr.clone() }),
            Err(s) => return Err(LinkError::Rpc { addr: self.addr.clone(), what: "step", status: Box::new(s) }),
        };
        if reply.step_id != want {
            return Err(LinkError::OutOfOrder { addr: self.addr.clone(), got: reply.step_id, want });
        }
        if !reply.error.is_empty() {
            return Err(LinkError::StepFailed { addr: self.addr.clone(), step: want, message: reply.error });
        }
        Ok(reply)
    }

    /// The worker's current state.
    pub async fn info(&mut self) -> Result<pb::WorkerInfo, LinkError> {
        let addr = self.addr.clone();
        self.client.info(pb::InfoRequest {}).await.map(|r| r.into_inner()).map_err(|s| LinkError::Rpc {
            addr,
            what: "info",
            status: Box::new(s),
        })
    }
}
