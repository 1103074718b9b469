//! The coordinator while draining: new Generate calls are refused with UNAVAILABLE and a
//! `retry-after`, and Status reports not ready.

use std::sync::Arc;

use tessera_coordinator::drain::Drain;
use tessera_coordinator::replica_set::ReplicaSet;
use tessera_coordinator::routing::RoutingConfig;
use tessera_coordinator::service::CoordinatorService;
use tessera_proto::coordinator as cpb;
use tessera_proto::coordinator::coordinator_server::Coordinator;
use tonic::{Code, Request};

fn request() -> Request<cpb::GenerateRequest> {
    Request::new(cpb::GenerateRequest { prompt_ids: vec![1, 2, 3], max_tokens: 4, ..Default::default() })
}

#[tokio::test]
async fn draining_refuses_generate_with_retry_after_and_is_not_ready() {
    let set = Arc::new(ReplicaSet::new(RoutingConfig::default()));
    set.install(Vec::new());
    let drain = Drain::new();
    let service = CoordinatorService::with_set(set, "m".into(), 128, 64).with_drain(drain.clone());
    // No replica at all: refused as unavailable too, but for that reason.
    let e = service.generate(request()).await.err().expect("no replica");
    assert_eq!(e.code(), Code::Unavailable);
    assert!(!e.message().contains("shutting down"), "{}", e.message());
    drain.start();
    let e = service.generate(request()).await.err().expect("draining");
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("shutting down"), "{}", e.message());
    assert_eq!(e.metadata().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    assert_eq!(drain.in_flight(), 0, "a refused call is not in flight");
    let st = service.status(Request::new(cpb::StatusRequest {})).await.unwrap().into_inner();
    assert!(!st.ready);
}
