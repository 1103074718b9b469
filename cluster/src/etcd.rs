//! Connecting to etcd. One place sets the client options every role uses: a short connect
//! timeout and HTTP/2 keep-alives, so a dead etcd member is noticed within ~10 s. No request
//! timeout is set on the client: election campaigns and watches block by design; unary
//! calls that must not hang are wrapped in [`with_timeout`] by their callers.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::error::ClusterError;

/// How long one unary request (get, put, txn, grant, revoke) may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Splits a comma-separated endpoint list (`--etcd-endpoints`), dropping empty entries.
pub fn parse_endpoints(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::to_string).collect()
}

/// A client of the etcd cluster at `endpoints` (`host:port` or `http://host:port`).
pub async fn connect(endpoints: &[String]) -> Result<Client, ClusterError> {
    if endpoints.is_empty() {
        return Err(ClusterError::Invalid("no etcd endpoints given".into()));
    }
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(3))
        // etcd refuses pings more often than every 5 s (its keepalive enforcement policy)
        // with GOAWAY, which would break every stream: ping every 6 s.
        .with_keep_alive(Duration::from_secs(6), Duration::from_secs(3))
        .with_keep_alive_while_idle(true);
    with_timeout("connecting", Client::connect(endpoints, Some(options))).await
}

/// Runs one etcd request with [`REQUEST_TIMEOUT`].
pub async fn with_timeout<T>(
    what: &str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, ClusterError> {
    match tokio::time::timeout(REQUEST_TIMEOUT, fut).await {
        Ok(r) => r.map_err(|e| ClusterError::Etcd(format!("{what}: {e}"))),
        Err(_) => Err(ClusterError::Etcd(format!("{what}: no answer in {REQUEST_TIMEOUT:?}"))),
    }
}

/// Checks a lease TTL flag: etcd rounds anything shorter than ~2 s up, and a TTL
/// over a few minutes makes failures slow to notice.
pub fn check_ttl(ttl_s: u64) -> Result<i64, ClusterError> {
    if (2..=600).contains(&ttl_s) {
        Ok(ttl_s as i64)
    } else {
        Err(ClusterError::Invalid(format!("lease TTL {ttl_s} s: use 2..=600")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_split_on_commas() {
        assert_eq!(parse_endpoints(" a:1, ,http://b:2,"), ["a:1", "http://b:2"]);
        assert!(parse_endpoints("").is_empty());
        assert!(check_ttl(1).is_err() && check_ttl(5).is_ok());
    }
}
