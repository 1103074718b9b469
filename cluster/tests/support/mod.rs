//! A real etcd server for the tests: `etcd` (Debian's `etcd-server`, or `TESSERA_ETCD_BIN`)
//! on random loopback ports with a temporary data directory, killed and cleaned up when the
//! [`EtcdServer`] is dropped. When the binary is missing the tests are skipped with a message,
//! unless `TESSERA_REQUIRE_ETCD` is set (CI sets it), in which case they fail.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    /// `http://127.0.0.1:PORT`
    pub endpoint: String,
}

fn etcd_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TESSERA_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain([PathBuf::from("/usr/bin")]).map(|d| d.join("etcd")).find(|p| p.is_file())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free loopback port")
}

impl EtcdServer {
    /// Starts a fresh single-member etcd, or returns `None` (after saying why) when there is
    /// no etcd binary and `TESSERA_REQUIRE_ETCD` is unset.
    pub fn start() -> Option<Self> {
        let Some(bin) = etcd_binary() else {
            if std::env::var_os("TESSERA_REQUIRE_ETCD").is_some_and(|v| !v.is_empty() && v != "0") {
                panic!("TESSERA_REQUIRE_ETCD is set but no etcd binary was found (apt-get install etcd-server)");
            }
            eprintln!("SKIPPED: no etcd binary (apt-get install etcd-server, or set TESSERA_ETCD_BIN)");
            return None;
        };
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tessera-etcd-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("etcd data dir");
        // Ports are picked then released; a clash with another process is retried.
        for _ in 0..5 {
            let (client, peer) = (free_port(), free_port());
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let log = std::fs::File::create(dir.join("etcd.log")).expect("etcd log");
            let child = Command::new(&bin)
                .args(["--name", "t", "--data-dir"])
                .arg(dir.join("data"))
                .args(["--listen-client-urls", &endpoint, "--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("t={peer_url}"), "--log-level", "warn", "--logger", "zap"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let mut server = EtcdServer { child, dir: dir.clone(), endpoint };
            if server.wait_ready(client, Duration::from_secs(20)) {
                return Some(server);
            }
            let _ = server.child.kill();
            let _ = server.child.wait();
            std::mem::forget(server); // keep the dir for the next try
        }
        panic!("etcd did not start; see {}", dir.join("etcd.log").display());
    }

    fn wait_ready(&mut self, port: u16, limit: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if TcpStream::connect(("127.0.0.1", port)).is_ok() && self.healthy() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }

    /// etcd answers `/health` once it has a leader (its single member).
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let addr = self.endpoint.trim_start_matches("http://");
        let Ok(mut s) = TcpStream::connect(addr) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).is_err() {
            return false;
        }
        let mut body = String::new();
        let _ = s.read_to_string(&mut body);
        body.contains("\"health\":\"true\"")
    }

    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }

    pub fn data_dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `check` every 50 ms until it is true or `limit` passes; returns the time it took.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while start.elapsed() < limit {
        if check().await {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
