//! The worker's Load call on outside input: sizes a message may ask for that this host
//! cannot hold, or that make no sense, are refused with a status (the process lives on and
//! a sane Load afterwards succeeds).

mod common;

use tessera_proto::worker as pb;
use tessera_proto::worker::worker_server::Worker;
use tessera_worker::service::{DeviceChoice, WorkerService};
use tonic::{Code, Request};

fn request(model: &str, block_size: u32, num_blocks: u32) -> Request<pb::LoadRequest> {
    Request::new(pb::LoadRequest { model_path: model.into(), block_size, num_blocks, ..Default::default() })
}

#[tokio::test]
async fn load_refuses_kv_sizes_the_host_cannot_hold() {
    let Some(path) = common::model_path::default_model() else { return };
    let model = path.to_string_lossy().into_owned();
    let w = WorkerService::on(DeviceChoice::Cpu);

    // u32::MAX blocks of 16 positions: petabytes of KV for SmolLM2.
    let err = w.load(request(&model, 16, u32::MAX)).await.expect_err("petabytes of KV");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("GiB available"), "{err}");

    let err = w.load(request(&model, 1 << 20, 4)).await.expect_err("a million-position block");
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    assert!(err.message().contains("block_size"), "{err}");

    // The same service still loads a sane request.
    let reply = w.load(request(&model, 16, 64)).await.expect("a sane load").into_inner();
    assert!(reply.info.is_some());
}
