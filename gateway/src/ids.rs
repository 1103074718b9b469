//! Response ids (`chatcmpl-<32 hex>`) and timestamps. The randomness comes from std's
//! randomly keyed SipHash (`RandomState`), mixed with a process-wide counter so two ids never
//! repeat within a process; ids only need to be unique, not secret.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// `prefix-` followed by 32 hex digits.
pub fn new_id(prefix: &str) -> String {
    static KEYS: OnceLock<(RandomState, RandomState)> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let (a, b) = KEYS.get_or_init(|| (RandomState::new(), RandomState::new()));
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let hash = |s: &RandomState| {
        let mut h = s.build_hasher();
        h.write_u64(n);
        h.finish()
    };
    format!("{prefix}-{:016x}{:016x}", hash(a), hash(b))
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_hex_and_distinct() {
        let ids: std::collections::HashSet<String> = (0..2000).map(|_| new_id("chatcmpl")).collect();
        assert_eq!(ids.len(), 2000);
        for id in ids.iter().take(20) {
            let hex = id.strip_prefix("chatcmpl-").unwrap_or_else(|| panic!("{id}"));
            assert_eq!(hex.len(), 32);
            assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
    }
}
