//! mTLS on a real worker gRPC server (the builder `tessera worker` uses): a client with a
//! certificate from the cluster CA is served; one without a certificate, one with a
//! certificate from another CA, and a plain-text client are refused.

use std::path::Path;
use std::time::Duration;

use tessera_coordinator::worker_link::WorkerLink;
use tessera_proto::worker as pb;
use tessera_proto::worker::worker_client::WorkerClient;
use tessera_proto::worker::worker_server::WorkerServer;
use tessera_worker::service::{DeviceChoice, WorkerService};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::certs_cmd::{make, test_dir, CertFiles};
use crate::tls::{server_builder, Tls, TlsFlags};

fn load(cert: &Path, key: &Path, ca: &Path, server_name: Option<&str>) -> Tls {
    TlsFlags {
        tls_cert: Some(cert.into()),
        tls_key: Some(key.into()),
        tls_ca: Some(ca.into()),
        tls_server_name: server_name.map(Into::into),
    }
    .load()
    .expect("loading test certificates")
    .expect("TLS configured")
}

/// Starts a worker server with mTLS from `files` on a free loopback port; returns its address.
async fn start_worker(files: &CertFiles) -> String {
    let tls = load(&files.server_cert, &files.server_key, &files.ca_cert, None);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = server_builder(Some(&tls))
        .unwrap()
        .add_service(WorkerServer::new(WorkerService::on(DeviceChoice::Cpu)))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
    tokio::spawn(server);
    addr
}

/// Calls Info over `endpoint`; `Err` with the reason when the connection or call fails.
async fn info(endpoint: Endpoint) -> Result<pb::WorkerInfo, String> {
    let call = async {
        let channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
        let mut client = WorkerClient::new(channel);
        client.info(pb::InfoRequest {}).await.map(|r| r.into_inner()).map_err(|s| format!("info: {s}"))
    };
    tokio::time::timeout(Duration::from_secs(10), call).await.unwrap_or_else(|_| Err("timed out".into()))
}

fn https(addr: &str, tls: ClientTlsConfig) -> Endpoint {
    Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap()
}

#[tokio::test]
async fn worker_serves_only_clients_with_a_certificate_from_the_ca() {
    let dir = test_dir("mtls-link");
    let files = make(&dir.join("cluster"), &["localhost".into(), "127.0.0.1".into()]).unwrap();
    let other = make(&dir.join("other"), &["localhost".into(), "127.0.0.1".into()]).unwrap();
    let addr = start_worker(&files).await;
    let ca = || Certificate::from_pem(std::fs::read(&files.ca_cert).unwrap());
    let identity =
        |cert: &Path, key: &Path| Identity::from_pem(std::fs::read(cert).unwrap(), std::fs::read(key).unwrap());

    // The gateway's certificate, and the coordinator's dial path with the server one: served.
    let gateway = load(&files.client_cert, &files.client_key, &files.ca_cert, None);
    let served = info(https(&addr, gateway.client())).await;
    assert!(served.is_ok(), "a client with a CA-signed certificate was refused: {served:?}");
    let coordinator = load(&files.server_cert, &files.server_key, &files.ca_cert, None);
    let mut client = WorkerLink::dial(&addr, Duration::from_secs(5), Some(&coordinator.client())).await.unwrap();
    WorkerLink::info_of(&mut client, &addr).await.expect("the coordinator's mTLS dial was refused");

    // No client certificate (the server is trusted): refused.
    let anonymous = info(https(&addr, ClientTlsConfig::new().ca_certificate(ca()))).await;
    assert!(anonymous.is_err(), "a client without a certificate was served");
    // A certificate from another CA: refused.
    let stranger =
        ClientTlsConfig::new().ca_certificate(ca()).identity(identity(&other.client_cert, &other.client_key));
    assert!(info(https(&addr, stranger)).await.is_err(), "a client with another CA's certificate was served");
    // Plain-text gRPC: refused.
    let plain = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_timeout(Duration::from_secs(2));
    assert!(info(plain).await.is_err(), "a plain-text client was served");
    // The client checks the server too: a worker whose certificate another CA signed is not trusted.
    let impostor = start_worker(&other).await;
    assert!(info(https(&impostor, gateway.client())).await.is_err(), "a server from another CA was trusted");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_server_name_is_checked_and_can_be_set() {
    let dir = test_dir("mtls-name");
    // The worker's certificate names only `worker.internal`, not the address it is dialed by.
    let files = make(&dir, &["worker.internal".into()]).unwrap();
    let addr = start_worker(&files).await;
    let by_address = load(&files.client_cert, &files.client_key, &files.ca_cert, None);
    assert!(info(https(&addr, by_address.client())).await.is_err(), "a certificate not naming 127.0.0.1 was accepted");
    let by_name = load(&files.client_cert, &files.client_key, &files.ca_cert, Some("worker.internal"));
    let r = info(https(&addr, by_name.client())).await;
    assert!(r.is_ok(), "--tls-server-name was not used: {r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
