//! Worker registration and discovery against a real etcd: records appear with the right
//! fields, disappear within TTL + 1 s once their keep-alive stops (waking `wait_change`),
//! vanish at once on deregistration, come back after their lease is revoked behind the
//! worker's back, and malformed records are skipped.

mod support;

use std::time::{Duration, Instant};

use etcd_client::PutOptions;
use support::{eventually, EtcdServer};
use tessera_cluster::{register_worker, ClusterKeys, Discovery, EtcdDiscovery, WorkerRecord};

fn record(id: &str, port: u16) -> WorkerRecord {
    WorkerRecord { id: id.into(), addr: format!("127.0.0.1:{port}"), device: "cpu".into(), free_memory_bytes: 1 << 30 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_workers_are_listed_with_their_fields() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let disc = EtcdDiscovery::connect(&eps, "reg").await.unwrap();
    assert!(disc.workers().await.unwrap().is_empty());
    let b = register_worker(&eps, "reg", record("w-b", 5002), 5).await.unwrap();
    let _a =
        register_worker(&eps, "reg", WorkerRecord { device: "cuda:1".into(), ..record("w-a", 5001) }, 5).await.unwrap();
    let ws = disc.workers().await.unwrap();
    assert_eq!(ws, vec![WorkerRecord { device: "cuda:1".into(), ..record("w-a", 5001) }, record("w-b", 5002)]);
    // Another cluster's discovery sees none of them.
    let other = EtcdDiscovery::connect(&eps, "other").await.unwrap();
    assert!(other.workers().await.unwrap().is_empty());
    // Deregistering revokes the lease: gone at once, and the watcher wakes.
    let t = Instant::now();
    b.deregister().await.unwrap();
    disc.wait_change(Duration::from_secs(5)).await;
    assert!(t.elapsed() < Duration::from_secs(4), "wait_change slept through a deregistration");
    let ids: Vec<_> = disc.workers().await.unwrap().into_iter().map(|w| w.id).collect();
    assert_eq!(ids, ["w-a"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_keep_alive_stops_expires_within_ttl() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let ttl = 2;
    let disc = EtcdDiscovery::connect(&eps, "exp").await.unwrap();
    let reg = register_worker(&eps, "exp", record("w0", 6000), ttl).await.unwrap();
    // It stays while kept alive, well past the TTL.
    tokio::time::sleep(Duration::from_secs(ttl + 2)).await;
    assert_eq!(disc.workers().await.unwrap().len(), 1, "a kept-alive registration expired");
    // Dropping stops the keep-alive without revoking: like a worker that died.
    drop(reg);
    let t = Instant::now();
    disc.wait_change(Duration::from_secs(ttl + 5)).await;
    let woke = t.elapsed();
    assert!(disc.workers().await.unwrap().is_empty(), "woke after {woke:?} with the record still there");
    assert!(woke <= Duration::from_secs(ttl + 1), "the record lasted {woke:?} after its keep-alive stopped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_replaced_and_the_record_written_again() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let disc = EtcdDiscovery::connect(&eps, "re").await.unwrap();
    let reg = register_worker(&eps, "re", record("w0", 6001), 2).await.unwrap();
    let first = reg.lease_id();
    // Someone revokes the worker's lease (an operator, or etcd after a long partition).
    let client = etcd_client::Client::connect(&eps, None).await.unwrap();
    client.lease_client().revoke(first).await.unwrap();
    let back = eventually(Duration::from_secs(5), || async {
        reg.lease_id() != first && disc.workers().await.map(|w| w.len() == 1).unwrap_or(false)
    })
    .await;
    assert!(back.is_some(), "the worker did not register again after losing its lease");
    assert_eq!(disc.workers().await.unwrap(), vec![record("w0", 6001)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_records_are_skipped() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let keys = ClusterKeys::new("bad").unwrap();
    let _good = register_worker(&eps, "bad", record("ok", 7000), 5).await.unwrap();
    let client = etcd_client::Client::connect(&eps, None).await.unwrap();
    let mut kv = client.kv_client();
    for (id, value) in [
        ("junk", "not json".to_string()),
        ("missing", r#"{"id":"missing","addr":"h:1"}"#.to_string()),
        ("wrongid", r#"{"id":"other","addr":"h:1","device":"cpu","free_memory_bytes":0}"#.to_string()),
        ("noport", r#"{"id":"noport","addr":"h","device":"cpu","free_memory_bytes":0}"#.to_string()),
    ] {
        kv.put(keys.worker(id), value, None::<PutOptions>).await.unwrap();
    }
    kv.put(keys.worker("bin"), vec![0xff, 0xfe], None).await.unwrap();
    let disc = EtcdDiscovery::connect(&eps, "bad").await.unwrap();
    let ws = disc.workers().await.unwrap();
    assert_eq!(ws, vec![record("ok", 7000)]);
    // A bad record cannot be registered in the first place.
    assert!(register_worker(&eps, "bad", record("a/b", 7001), 5).await.is_err());
    assert!(register_worker(&eps, "bad", WorkerRecord { addr: "nohost".into(), ..record("x", 1) }, 5).await.is_err());
}
