//! The NCCL unique id that names one communicator: rank 0 makes it
//! ([`Device::nccl_unique_id`](super::Device::nccl_unique_id)), the coordinator relays it to
//! the other ranks as text (256 lowercase hex digits), and every rank joins with it. Plain
//! bytes, built without the `cuda` feature, so the coordinator and the wire code can carry
//! ids without linking CUDA.

use crate::KernelError;

/// Bytes in an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_ID_BYTES: usize = 128;

/// An NCCL unique id (128 bytes): rank 0 makes it, the coordinator relays it to the other
/// ranks.
#[derive(Clone, PartialEq, Eq)]
pub struct NcclId(pub [u8; NCCL_ID_BYTES]);

impl NcclId {
    /// 256 lowercase hex digits, two per byte in order.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(2 * NCCL_ID_BYTES);
        for &b in &self.0 {
            s.push(char::from(DIGITS[usize::from(b >> 4)]));
            s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
        }
        s
    }

    /// Parses [`NcclId::to_hex`]'s form (either case); anything else is an error naming
    /// what is wrong.
    pub fn from_hex(s: &str) -> Result<Self, KernelError> {
        const OP: &str = "nccl_id_from_hex";
        let bytes = s.as_bytes();
        if bytes.len() != 2 * NCCL_ID_BYTES {
            return Err(KernelError::Shape {
                op: OP,
                detail: format!("an NCCL id is {} hex digits, got {} characters", 2 * NCCL_ID_BYTES, s.chars().count()),
            });
        }
        let mut id = [0u8; NCCL_ID_BYTES];
        for (i, (out, pair)) in id.iter_mut().zip(bytes.chunks_exact(2)).enumerate() {
            let digit = |k: usize| -> Result<u8, KernelError> {
                let c = pair[k];
                char::from(c).to_digit(16).map(|d| d as u8).ok_or_else(|| KernelError::Shape {
                    op: OP,
                    detail: format!("character {} of the NCCL id is not a hex digit", 2 * i + k),
                })
            };
            *out = (digit(0)? << 4) | digit(1)?;
        }
        Ok(NcclId(id))
    }
}

/// Prints the first bytes only: enough to tell ids apart in logs.
impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex = self.to_hex();
        write!(f, "NcclId({}..)", &hex[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bytes that are not all equal (an xorshift stream).
    fn sample(seed: u64) -> NcclId {
        let mut x = seed | 1;
        let mut id = [0u8; NCCL_ID_BYTES];
        for b in id.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = (x >> 24) as u8;
        }
        NcclId(id)
    }

    #[test]
    fn nccl_id_hex_round_trip() {
        for seed in [1u64, 7, 0x9e37_79b9_7f4a_7c15] {
            let id = sample(seed);
            let hex = id.to_hex();
            assert_eq!(hex.len(), 256);
            assert!(hex.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)), "{hex}");
            assert_eq!(NcclId::from_hex(&hex).unwrap(), id);
            assert_eq!(NcclId::from_hex(&hex.to_uppercase()).unwrap(), id);
        }
        // Every byte value survives, in order.
        let mut all = [0u8; NCCL_ID_BYTES];
        for (i, b) in all.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(2).wrapping_add(1);
        }
        all[0] = 0x00;
        all[1] = 0xff;
        let hex = NcclId(all).to_hex();
        assert_eq!(&hex[..4], "00ff");
        assert_eq!(&hex[4..6], "05");
        assert_eq!(NcclId::from_hex(&hex).unwrap().0, all);
    }

    #[test]
    fn nccl_id_bad_hex_is_an_error() {
        let good = sample(3).to_hex();
        let cases = [
            String::new(),
            good[..254].to_string(),
            format!("{good}00"),
            format!("{}g{}", &good[..100], &good[101..]),
            format!("{} {}", &good[..10], &good[11..]),
            format!("{}é", &good[..254]),
            format!("+{}", &good[1..]),
        ];
        for bad in cases {
            match NcclId::from_hex(&bad) {
                Err(KernelError::Shape { op, detail }) => {
                    assert_eq!(op, "nccl_id_from_hex");
                    assert!(detail.contains("NCCL id"), "{detail}");
                }
                other => panic!("{bad:?} parsed as {other:?}"),
            }
        }
    }

    #[test]
    fn nccl_id_debug_is_short() {
        let id = sample(5);
        let s = format!("{id:?}");
        assert!(s.starts_with("NcclId(") && s.len() < 40, "{s}");
        assert!(s.contains(&id.to_hex()[..16]));
    }
}
