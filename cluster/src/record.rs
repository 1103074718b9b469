//! The JSON form of a [`WorkerRecord`] stored at `workers/<id>`:
//! `{"id": "...", "addr": "host:port", "device": "cpu", "free_memory_bytes": 123}`.
//! Parsing is strict: every field is required with its type, the id must equal the key's
//! last segment, and the address must be `host:port`. Unknown fields are ignored, so a newer
//! worker can add some without breaking an older coordinator.

use serde::{Deserialize, Serialize};

use crate::discovery::WorkerRecord;
use crate::error::ClusterError;

#[derive(Serialize, Deserialize)]
struct Wire {
    id: String,
    addr: String,
    device: String,
    free_memory_bytes: u64,
}

/// Checks the parts of a record that keys and dialing depend on.
pub fn validate(r: &WorkerRecord) -> Result<(), String> {
    if r.id.is_empty() || r.id.len() > 256 || r.id.contains('/') || r.id.chars().any(char::is_control) {
        return Err(format!("worker id {:?}: 1-256 characters, no '/' or control characters", r.id));
    }
    let (host, port) = r.addr.rsplit_once(':').ok_or_else(|| format!("address {:?} is not host:port", r.addr))?;
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c == '/') {
        return Err(format!("address {:?} has no usable host", r.addr));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("address {:?} has no valid port", r.addr)),
    }
}

/// The stored form of `r`.
pub fn encode(r: &WorkerRecord) -> Result<String, ClusterError> {
    validate(r).map_err(ClusterError::Invalid)?;
    let wire = Wire {
        id: r.id.clone(),
        addr: r.addr.clone(),
        device: r.device.clone(),
        free_memory_bytes: r.free_memory_bytes,
    };
    serde_json::to_string(&wire).map_err(|e| ClusterError::Invalid(e.to_string()))
}

/// Parses the value stored at `key`.
pub fn decode(key: &str, value: &[u8]) -> Result<WorkerRecord, ClusterError> {
    let bad = |reason: String| ClusterError::Malformed { key: key.to_string(), reason };
    let wire: Wire = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
    let r =
        WorkerRecord { id: wire.id, addr: wire.addr, device: wire.device, free_memory_bytes: wire.free_memory_bytes };
    validate(&r).map_err(bad)?;
    let key_id = key.rsplit('/').next().unwrap_or_default();
    if key_id != r.id {
        return Err(bad(format!("id {:?} differs from the key's {key_id:?}", r.id)));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> WorkerRecord {
        WorkerRecord { id: "w1".into(), addr: "10.0.0.2:50061".into(), device: "cuda:0".into(), free_memory_bytes: 7 }
    }

    #[test]
    fn round_trips() {
        let s = encode(&rec()).unwrap();
        assert_eq!(decode("/tessera/c/workers/w1", s.as_bytes()).unwrap(), rec());
    }

    #[test]
    fn rejects_what_cannot_be_used() {
        let k = "/tessera/c/workers/w1";
        for bad in [
            &b"not json"[..],
            br#"{"id":"w1","addr":"h:1","device":"cpu"}"#,
            br#"{"id":"w1","addr":"h:1","device":"cpu","free_memory_bytes":-1}"#,
            br#"{"id":"w1","addr":"nohost","device":"cpu","free_memory_bytes":0}"#,
            br#"{"id":"w1","addr":"h:99999","device":"cpu","free_memory_bytes":0}"#,
            br#"{"id":"w2","addr":"h:1","device":"cpu","free_memory_bytes":0}"#,
        ] {
            assert!(matches!(decode(k, bad), Err(ClusterError::Malformed { .. })), "{}", String::from_utf8_lossy(bad));
        }
        let extra = br#"{"id":"w1","addr":"h:1","device":"cpu","free_memory_bytes":0,"zone":"a"}"#;
        assert!(decode(k, extra).is_ok());
    }
}
