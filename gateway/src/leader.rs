//! An `Engine` that follows the coordinator leader: [`LeaderEngine`] forwards to a
//! [`GrpcEngine`] for whichever address the leader channel holds now (fed from etcd by the
//! binary, see `tessera-cluster`'s `follow_leader`). When the address changes, the next
//! request or readiness check builds a client of the new leader and drops the old one. With
//! no leader published, requests get 503 (`Unavailable`) and `/ready` is false. When the
//! leader cannot be reached, it asks the watcher (through `refresh`) to read etcd again.
//! With a client TLS config (`with_tls`), every leader is dialed over mutual TLS.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use tokio::sync::{watch, Notify};

use crate::engine::{Engine, EngineError, EngineStats, EventStream, GenerateRequest};
use crate::grpc_engine::GrpcEngine;

/// A client of the current coordinator leader.
pub struct LeaderEngine {
    leader: watch::Receiver<Option<String>>,
    refresh: Arc<Notify>,
    /// The client of the address it was built for.
    current: Mutex<Option<(String, Arc<GrpcEngine>)>>,
    /// Mutual TLS towards the leader; plain gRPC when `None`.
    tls: Option<tonic::transport::ClientTlsConfig>,
}

impl LeaderEngine {
    /// Follows `leader` (the leader's `host:port`, `None` while there is none); `refresh`
    /// is notified when the leader could not be reached.
    pub fn new(leader: watch::Receiver<Option<String>>, refresh: Arc<Notify>) -> Self {
        LeaderEngine { leader, refresh, current: Mutex::new(None), tls: None }
    }

    /// Dials every leader over mutual TLS with `tls` (plain gRPC when `None`).
    pub fn with_tls(mut self, tls: Option<tonic::transport::ClientTlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    /// The client for the leader now. Must run inside a tokio runtime (a new client spawns
    /// its status poller).
    fn engine(&self) -> Result<Arc<GrpcEngine>, EngineError> {
        let addr = self.leader.borrow().clone();
        let mut cur = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let Some(addr) = addr else {
            *cur = None;
            return Err(EngineError::Unavailable { retry_after_s: 1 });
        };
        if let Some((a, e)) = cur.as_ref() {
            if *a == addr {
                return Ok(e.clone());
            }
        }
        let engine = Arc::new(GrpcEngine::with_tls(&addr, self.tls.clone())?);
        *cur = Some((addr, engine.clone()));
        Ok(engine)
    }
}

impl Engine for LeaderEngine {
    fn generate(&self, req: GenerateRequest) -> BoxFuture<'_, Result<EventStream, EngineError>> {
        Box::pin(async move {
            let r = self.engine()?.generate(req).await;
            if matches!(r, Err(EngineError::Unavailable { .. })) {
                // The leader may have changed without the watch telling us yet.
                self.refresh.notify_one();
            }
            r
        })
    }

    fn ready(&self) -> bool {
        self.engine().is_ok_and(|e| e.ready())
    }

    fn stats(&self) -> Option<EngineStats> {
        self.engine().ok()?.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn follows_the_channel_and_refuses_without_a_leader() {
        let (tx, rx) = watch::channel(None);
        let refresh = Arc::new(Notify::new());
        let engine = LeaderEngine::new(rx, refresh.clone());
        assert!(!engine.ready());
        assert!(matches!(engine.engine(), Err(EngineError::Unavailable { .. })));
        tx.send(Some("127.0.0.1:1".into())).unwrap();
        let first = engine.engine().unwrap();
        assert!(Arc::ptr_eq(&first, &engine.engine().unwrap()), "a client was rebuilt for the same leader");
        tx.send(Some("127.0.0.1:2".into())).unwrap();
        assert!(!Arc::ptr_eq(&first, &engine.engine().unwrap()), "the client did not follow the new leader");
        // Nothing listens there: the call fails as unavailable and asks for a fresh lookup.
        let req = GenerateRequest {
            request_id: "r".into(),
            prompt_ids: vec![1],
            params: crate::engine::SamplingSpec {
                temperature: 0.0,
                top_p: 1.0,
                top_k: None,
                min_p: 0.0,
                repetition_penalty: 1.0,
                frequency_penalty: 0.0,
                presence_penalty: 0.0,
                logit_bias: vec![],
                seed: None,
                max_tokens: 4,
                min_tokens: 0,
                stop_token_ids: vec![],
                ignore_eos: false,
                logprobs: None,
                constraint: None,
            },
        };
        let r = engine.generate(req).await;
        assert!(matches!(r, Err(EngineError::Unavailable { .. })), "{:?}", r.err());
        tokio::time::timeout(std::time::Duration::from_secs(1), refresh.notified()).await.expect("no refresh asked");
        tx.send(None).unwrap();
        assert!(!engine.ready());
    }
}
