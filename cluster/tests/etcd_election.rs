//! Coordinator leader election against a real etcd: one leader at a time; when the leader
//! dies (its keep-alive stops) the standby leads and makes a fenced write within TTL + 3 s
//! while the old leader's fenced writes are refused; gateways following the leader see the
//! new address; cluster settings are read from `config`.

mod support;

use std::time::{Duration, Instant};

use support::{eventually, EtcdServer};
use tessera_cluster::{campaign, follow_leader, load_settings, ClusterError, ClusterKeys, LeaderInfo};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_within_ttl_and_the_old_leaders_writes_are_refused() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let keys = ClusterKeys::new("el").unwrap();
    let ttl = 2;
    let a = campaign(&eps, "el", "127.0.0.1:1001", ttl).await.unwrap();
    a.publish_address("127.0.0.1:1001").await.unwrap();
    a.fence().put(&keys.plan(), "plan by a", false).await.unwrap();
    let gateway = follow_leader(&eps, "el").await.unwrap();
    assert_eq!(gateway.current().as_deref(), Some("127.0.0.1:1001"));

    // The standby waits while `a` leads.
    let eps_b = eps.clone();
    let standby = tokio::spawn(async move { campaign(&eps_b, "el", "127.0.0.1:1002", ttl).await });
    tokio::time::sleep(Duration::from_secs(ttl + 1)).await;
    assert!(!standby.is_finished(), "a second leader was elected while the first was alive");
    assert!(!a.is_lost());

    // Kill the leader: its keep-alive stops, nothing is revoked.
    let old_fence = a.fence();
    let killed = Instant::now();
    drop(a);
    let b = tokio::time::timeout(Duration::from_secs(ttl + 3), standby)
        .await
        .expect("no new leader within TTL + 3 s")
        .unwrap()
        .unwrap();
    b.fence().put(&keys.plan(), "plan by b", false).await.unwrap();
    b.publish_address("127.0.0.1:1002").await.unwrap();
    let acted = killed.elapsed();
    assert!(acted <= Duration::from_secs(ttl + 3), "the new leader acted {acted:?} after the kill");
    assert!(b.token() > old_fence.token());

    // The deposed leader's writes are refused and change nothing.
    let refused = old_fence.put(&keys.plan(), "late plan by a", false).await;
    assert!(matches!(refused, Err(ClusterError::Fenced { .. })), "{refused:?}");
    assert!(matches!(old_fence.delete(&keys.leader()).await, Err(ClusterError::Fenced { .. })));
    let client = etcd_client::Client::connect(&eps, None).await.unwrap();
    let plan = client.kv_client().get(keys.plan(), None).await.unwrap();
    assert_eq!(plan.kvs()[0].value(), b"plan by b");
    let leader = client.kv_client().get(keys.leader(), None).await.unwrap();
    let info: LeaderInfo = serde_json::from_slice(leader.kvs()[0].value()).unwrap();
    assert_eq!(info, LeaderInfo { addr: "127.0.0.1:1002".into(), token: b.token() });

    // The gateway follows.
    let followed =
        eventually(Duration::from_secs(3), || async { gateway.current().as_deref() == Some("127.0.0.1:1002") }).await;
    assert!(followed.is_some(), "the gateway still resolves {:?}", gateway.current());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resigning_hands_over_at_once_and_the_leader_notices_a_lost_key() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    let ttl = 10;
    let a = campaign(&eps, "rs", "a:1", ttl).await.unwrap();
    a.publish_address("a:1").await.unwrap();
    let gateway = follow_leader(&eps, "rs").await.unwrap();
    let mut seen = gateway.subscribe();
    let eps_b = eps.clone();
    let standby = tokio::spawn(async move { campaign(&eps_b, "rs", "b:1", ttl).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    a.resign().await.unwrap();
    // Well under the 10 s TTL: resigning revokes the lease.
    let b = tokio::time::timeout(Duration::from_secs(3), standby).await.expect("no handover").unwrap().unwrap();
    assert!(t.elapsed() < Duration::from_secs(3));
    // The published address went with the old lease.
    tokio::time::timeout(Duration::from_secs(3), seen.wait_for(|a| a.is_none())).await.unwrap().unwrap();
    b.publish_address("b:1").await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), seen.wait_for(|a| a.as_deref() == Some("b:1")))
        .await
        .unwrap()
        .unwrap();

    // Deleting the leader's election key behind its back (an operator's mistake) deposes it:
    // `lost` fires and its writes are refused.
    let client = etcd_client::Client::connect(&eps, None).await.unwrap();
    let keys = ClusterKeys::new("rs").unwrap();
    let opts = etcd_client::DeleteOptions::new().with_prefix();
    client.kv_client().delete(format!("{}/", keys.election()), Some(opts)).await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), b.lost()).await.expect("the leader did not notice");
    assert!(b.is_lost());
    assert!(matches!(b.fence().put(&keys.plan(), "x", false).await, Err(ClusterError::Fenced { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_come_from_the_config_key() {
    let Some(etcd) = EtcdServer::start() else { return };
    let eps = etcd.endpoints();
    assert_eq!(load_settings(&eps, "cfg").await.unwrap(), Default::default());
    let client = etcd_client::Client::connect(&eps, None).await.unwrap();
    let key = ClusterKeys::new("cfg").unwrap().config();
    client.kv_client().put(key.as_str(), r#"{"max_num_seqs": 3, "model": "/m.gguf"}"#, None).await.unwrap();
    let s = load_settings(&eps, "cfg").await.unwrap();
    assert_eq!((s.max_num_seqs, s.model.as_deref(), s.max_waiting), (Some(3), Some("/m.gguf"), None));
    client.kv_client().put(key.as_str(), r#"{"max_num_seqs": "many"}"#, None).await.unwrap();
    assert!(matches!(load_settings(&eps, "cfg").await, Err(ClusterError::Malformed { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_an_error_not_a_hang() {
    // Nothing listens on this port (bound and released).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let eps = vec![format!("127.0.0.1:{port}")];
    let t = Instant::now();
    assert!(campaign(&eps, "x", "a:1", 5).await.is_err());
    assert!(follow_leader(&eps, "x").await.is_err());
    assert!(t.elapsed() < Duration::from_secs(25));
}
