//! The worker service's stuck-step watch on real GPU collectives (worker/src/step_watch.rs):
//! two GPU worker services (in this process, each behind its own gRPC server on loopback)
//! load a model split over tp=2 as a coordinator would (Info for the NCCL ids, then both
//! Loads at once); a step sent to rank 0 alone blocks in its first all-reduce, waiting for
//! rank 1. When the step stream to rank 0 is dropped (the coordinator failing the replica),
//! the service must call its unrecoverable-worker hook after the grace period; a step that
//! ends in time must not. Rank 1 then runs the same step, which releases rank 0, and both
//! finish. Last, rank 0 alone again with its stream kept open: the one-shot all-reduce gives
//! up after its timeout (`TESSERA_ONESHOT_TIMEOUT_S`, 4 s here) by trapping, the step fails,
//! and the hook is called because the GPU context is lost. The process then exits: a lost
//! context cannot be torn down cleanly (this file holds this one test).
//!
//! Needs `TESSERA_GPU_TESTS=1`, two GPUs and `TESSERA_TORCH_REF=<dir>` (the random Qwen3 of
//! bench/gpu/torch_qwen3_ref.py, 16 heads / 8 KV heads: splits over 2 ranks). Skips
//! otherwise (fails under `TESSERA_NEED_TWO_GPUS=1` with fewer than two GPUs).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_kernels::cuda::Device;
use tessera_proto::worker as pb;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_worker::service::{DeviceChoice, WorkerService};
use tessera_worker::step_watch::StuckHook;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

const GRACE: Duration = Duration::from_millis(1500);

fn model_dir() -> Option<PathBuf> {
    if std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1") {
        eprintln!("skipped cuda_service_stuck: set TESSERA_GPU_TESTS=1 on a machine with two CUDA GPUs");
        return None;
    }
    let n = Device::count().unwrap_or(0);
    if n < 2 {
        assert!(std::env::var("TESSERA_NEED_TWO_GPUS").as_deref() != Ok("1"), "two GPUs needed, {n} found");
        eprintln!("skipped cuda_service_stuck: {n} GPU(s), 2 needed");
        return None;
    }
    let Some(dir) = std::env::var_os("TESSERA_TORCH_REF").map(PathBuf::from) else {
        eprintln!("skipped cuda_service_stuck: set TESSERA_TORCH_REF (bench/gpu/torch_qwen3_ref.py's output)");
        return None;
    };
    Some(dir.join("model"))
}

/// A worker service on GPU `ordinal` behind a gRPC server on a free loopback port, with a
/// hook that records what it is called with.
async fn start(ordinal: usize, calls: Arc<Mutex<Vec<String>>>) -> WorkerClient<Channel> {
    let hook: StuckHook = Arc::new(move |m: &str| calls.lock().unwrap().push(m.to_string()));
    let service = WorkerService::on(DeviceChoice::Cuda(ordinal)).with_unrecoverable_hook(GRACE, hook);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tonic::transport::Server::builder()
        .add_service(WorkerServer::new(service))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    WorkerClient::connect(format!("http://{addr}")).await.expect("connect")
}

fn step(step_id: u64) -> pb::StepRequest {
    let seq_id = step_id;
    pb::StepRequest {
        step_id,
        new_sequences: vec![pb::NewSequence { seq_id, block_table: vec![0, 1], ..Default::default() }],
        runs: vec![pb::SeqRun { seq_id, tokens: (1..=20).collect(), first_pos: 0, sample: true, from_previous: false }],
        finished: vec![seq_id],
        ..Default::default()
    }
}

/// Opens a step stream: the sender of its requests and the stream of its replies.
async fn open(c: &mut WorkerClient<Channel>) -> (mpsc::Sender<pb::StepRequest>, tonic::Streaming<pb::StepReply>) {
    let (tx, rx) = mpsc::channel(4);
    let replies = c.step(ReceiverStream::new(rx)).await.expect("step stream").into_inner();
    (tx, replies)
}

async fn wait_for(calls: &Mutex<Vec<String>>, n: usize, within: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if calls.lock().unwrap().len() >= n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gpu_shard_blocked_on_a_missing_peer_after_the_hang_up_calls_the_hook() {
    let Some(model) = model_dir() else { return };
    // Read when the one-shot group is set up (at Load); nothing else runs yet.
    std::env::set_var("TESSERA_ONESHOT_TIMEOUT_S", "4");
    let calls: Vec<Arc<Mutex<Vec<String>>>> = (0..2).map(|_| Arc::default()).collect();
    let mut clients = vec![start(0, calls[0].clone()).await, start(1, calls[1].clone()).await];
    let mut addrs = Vec::new();
    for c in &mut clients {
        addrs.push(c.info(pb::InfoRequest {}).await.expect("info").into_inner().tp_collective_addr);
    }
    assert!(addrs.iter().all(|a| a.starts_with("nccl:")), "{addrs:?}");
    let layers = {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).expect("config.json")).unwrap();
        cfg["num_hidden_layers"].as_u64().expect("layers") as u32
    };
    let load = |rank: u32| pb::LoadRequest {
        model_path: model.to_string_lossy().into_owned(),
        block_size: 16,
        num_blocks: 64,
        shard: Some(pb::Shard {
            tp_rank: rank,
            tp_size: 2,
            pp_rank: 0,
            pp_size: 1,
            layer_begin: 0,
            layer_end: layers,
            tp_peers: addrs.clone(),
            pp_peers: vec![],
            group: 7,
        }),
        ..Default::default()
    };
    let (mut c0, mut c1) = (clients[0].clone(), clients[1].clone());
    let (r0, r1) = tokio::join!(c0.load(load(0)), c1.load(load(1)));
    r0.expect("rank 0 load");
    r1.expect("rank 1 load");

    // 1. Both ranks run a step: it ends in time, the hook stays quiet even though rank 0's
    //    stream is dropped right after.
    let ((tx0, mut rx0), (tx1, mut rx1)) = (open(&mut c0).await, open(&mut c1).await);
    tx0.send(step(1)).await.unwrap();
    tx1.send(step(1)).await.unwrap();
    for rx in [&mut rx0, &mut rx1] {
        let reply = rx.next().await.expect("a reply").expect("reply ok");
        assert!(reply.error.is_empty() && reply.sampled.len() == 1, "{reply:?}");
    }
    drop((tx0, rx0));
    tokio::time::sleep(GRACE * 2).await;
    assert!(calls.iter().all(|c| c.lock().unwrap().is_empty()), "a step that ended was reported stuck");

    // 2. Rank 0 alone: its step waits in the all-reduce for rank 1. Hang up on it.
    let (tx0, rx0) = open(&mut c0).await;
    tx0.send(step(2)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hung_up = Instant::now();
    drop((tx0, rx0));
    // The coordinator's readiness check: Info answers although the step holds the model.
    let info = tokio::time::timeout(Duration::from_secs(2), c0.info(pb::InfoRequest {}))
        .await
        .expect("Info hung while a step was stuck")
        .expect("info");
    assert_eq!(info.into_inner().num_blocks, 64);
    assert!(wait_for(&calls[0], 1, GRACE + Duration::from_secs(10)).await, "the hook was not called");
    let waited = hung_up.elapsed();
    assert!(waited >= GRACE, "called {waited:?} after the hang-up, before the grace period");
    let msg = calls[0].lock().unwrap()[0].clone();
    assert!(msg.contains("step 2") && msg.contains("after the coordinator closed the step stream"), "{msg}");
    eprintln!("RESULT unrecoverable-worker hook called {waited:?} after the hang-up (grace {GRACE:?}): {msg}");

    // 3. Rank 1 runs the step too, which releases rank 0's; rank 1's reply is fine, and no
    //    hook fired on rank 1.
    tx1.send(step(2)).await.unwrap();
    let reply = rx1.next().await.expect("a reply").expect("reply ok");
    assert!(reply.error.is_empty(), "{reply:?}");
    assert!(calls[1].lock().unwrap().is_empty());
    assert_eq!(calls[0].lock().unwrap().len(), 1, "called once");

    // 4. Rank 0 alone, stream open: the all-reduce traps after 4 s; the step's error reply
    //    comes back and the hook says the context is lost.
    let (tx0, mut rx0) = open(&mut c0).await;
    let t0 = Instant::now();
    tx0.send(step(3)).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(30), rx0.next())
        .await
        .expect("no reply within 30 s")
        .expect("a reply")
        .expect("reply ok");
    assert!(!reply.error.is_empty() && reply.sampled.is_empty(), "{reply:?}");
    assert!(wait_for(&calls[0], 2, Duration::from_secs(5)).await, "the hook was not called for the lost context");
    let msg = calls[0].lock().unwrap()[1].clone();
    assert!(msg.contains("step 3") && msg.contains("left the GPU context unusable"), "{msg}");
    eprintln!("RESULT lost GPU context reported {:?} after the lone step was sent: {msg}", t0.elapsed());
    assert!(calls[1].lock().unwrap().is_empty());
    eprintln!("test a_gpu_shard_blocked_on_a_missing_peer_after_the_hang_up_calls_the_hook ... ok (exiting: GPU 0's context is lost)");
    std::process::exit(0);
}
