//! What the ranks of a one-shot all-reduce group tell each other at setup, and the layout of
//! the peer-memory region each rank shares (kernels/cuda/allreduce_oneshot.cu reads the same
//! offsets). Pure Rust, built without the `cuda` feature, so the encoding is tested in CI.
//!
//! Each rank describes itself in a 128-byte [`PeerRecord`]: its process (a per-process
//! random nonce: ranks in one process use each other's pointers directly, other processes
//! open the CUDA IPC handle), its GPU's UUID, its region's address, IPC handle and capacity.
//! The records travel through one NCCL f32 all-reduce: rank `r` writes its bytes, as small
//! integers (exact in f32), into its own 128 slots of a zeroed `[128 * world]` buffer, so
//! the sum holds every rank's bytes untouched.

use std::hash::{BuildHasher, Hasher};
use std::sync::OnceLock;

use crate::KernelError;

/// Largest tensor-parallel group the one-shot kernel serves.
pub const ONESHOT_MAX_WORLD: usize = 8;
/// Largest grid (blocks) of the kernel: the flag array has a row per block.
pub const ONESHOT_MAX_BLOCKS: usize = 64;
/// Byte offset of the kernel's per-block epoch counters in a region.
pub const EPOCHS_OFFSET: usize = 2048;
/// Byte offset of the error word a timed-out wait writes before it traps.
pub const ERROR_OFFSET: usize = 2304;
/// Byte offset of the data slots: for odd and even calls, one slot of `cap` bytes per
/// source rank (up to [`ONESHOT_MAX_WORLD`]), which that rank pushes its input into.
pub const DATA_OFFSET: usize = 4096;
/// Bytes of an IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_BYTES: usize = 64;
/// Bytes of one rank's record.
pub const RECORD_BYTES: usize = 128;

const MAGIC: u32 = 0x5241_4f54; // "TOAR" little-endian
const VERSION: u8 = 1;

// The flag rows must end before the epochs, the epochs before the error word, all before data.
const _: () = assert!(ONESHOT_MAX_BLOCKS * ONESHOT_MAX_WORLD * 4 <= EPOCHS_OFFSET);
const _: () = assert!(EPOCHS_OFFSET + ONESHOT_MAX_BLOCKS * 4 <= ERROR_OFFSET);
const _: () = assert!(ERROR_OFFSET + 8 <= DATA_OFFSET);

/// Each data buffer's size for messages of up to `max_bytes`: a multiple of 256 bytes, so
/// both buffers start 16-byte aligned (the kernel's vector width).
pub fn data_capacity(max_bytes: usize) -> usize {
    max_bytes.div_ceil(256).max(1) * 256
}

/// Bytes of a region with data slots of `cap` bytes.
pub fn region_bytes(cap: usize) -> usize {
    DATA_OFFSET + 2 * ONESHOT_MAX_WORLD * cap
}

/// One rank's self-description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerRecord {
    /// The rank set its region up (allocation, handle); `false` makes every rank fall back.
    pub ok: bool,
    /// `handle` is valid (export can fail where same-process peers still work).
    pub ipc_ok: bool,
    /// Random per process: equal nonces mean one process (one address space).
    pub nonce: u64,
    /// The GPU's UUID (`cuDeviceGetUuid`): ordinals differ between processes, UUIDs do not.
    pub uuid: [u8; 16],
    /// The region's address in its own process.
    pub ptr: u64,
    /// Each data buffer's bytes (must agree across ranks).
    pub cap: u64,
    /// Kernel grid (must agree across ranks).
    pub blocks: u32,
    /// `cuIpcGetMemHandle` of the region.
    pub handle: [u8; IPC_HANDLE_BYTES],
}

impl PeerRecord {
    /// A record that says "this rank failed": everything else is zero.
    pub fn failed(nonce: u64) -> Self {
        PeerRecord {
            ok: false,
            ipc_ok: false,
            nonce,
            uuid: [0; 16],
            ptr: 0,
            cap: 0,
            blocks: 0,
            handle: [0; IPC_HANDLE_BYTES],
        }
    }

    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = u8::from(self.ok);
        b[6] = u8::from(self.ipc_ok);
        b[8..16].copy_from_slice(&self.nonce.to_le_bytes());
        b[16..32].copy_from_slice(&self.uuid);
        b[32..40].copy_from_slice(&self.ptr.to_le_bytes());
        b[40..48].copy_from_slice(&self.cap.to_le_bytes());
        b[48..52].copy_from_slice(&self.blocks.to_le_bytes());
        b[64..128].copy_from_slice(&self.handle);
        b
    }

    /// Parses [`PeerRecord::to_bytes`]; another build's record (magic, version) is an error.
    pub fn from_bytes(b: &[u8]) -> Result<Self, KernelError> {
        const OP: &str = "oneshot_peer_record";
        let bad = |detail: String| KernelError::Device { op: OP, detail };
        if b.len() != RECORD_BYTES {
            return Err(bad(format!("a record is {RECORD_BYTES} bytes, got {}", b.len())));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if u32_at(0) != MAGIC || b[4] != VERSION {
            return Err(bad(format!(
                "a peer sent magic {:#x} version {} (expected {MAGIC:#x} version {VERSION}): mixed builds?",
                u32_at(0),
                b[4]
            )));
        }
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&b[16..32]);
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        handle.copy_from_slice(&b[64..128]);
        Ok(PeerRecord {
            ok: b[5] == 1,
            ipc_ok: b[6] == 1,
            nonce: u64_at(8),
            uuid,
            ptr: u64_at(32),
            cap: u64_at(40),
            blocks: u32_at(48),
            handle,
        })
    }
}

/// Rank `rank`'s slots of the all-gather buffer (`[RECORD_BYTES * world]` f32, zero but
/// for its own bytes).
pub fn encode_slots(bytes: &[u8], rank: usize, world: usize) -> Vec<f32> {
    let mut slots = vec![0.0f32; bytes.len() * world];
    for (i, &b) in bytes.iter().enumerate() {
        slots[rank * bytes.len() + i] = f32::from(b);
    }
    slots
}

/// Every rank's bytes (`per_rank` each) from the summed slots; a value that is not a byte
/// (two ranks wrote one slot, or the sum was corrupted) is an error.
pub fn decode_slots(summed: &[f32], per_rank: usize, world: usize) -> Result<Vec<Vec<u8>>, KernelError> {
    const OP: &str = "oneshot_gather";
    if per_rank == 0 || summed.len() != per_rank * world {
        return Err(KernelError::Device {
            op: OP,
            detail: format!("gathered {} values for {world} ranks of {per_rank}", summed.len()),
        });
    }
    summed
        .chunks_exact(per_rank)
        .map(|chunk| {
            chunk
                .iter()
                .map(|&f| {
                    if (0.0..=255.0).contains(&f) && f.fract() == 0.0 {
                        Ok(f as u8)
                    } else {
                        Err(KernelError::Device { op: OP, detail: format!("gathered byte {f} is not one of 0..=255") })
                    }
                })
                .collect()
        })
        .collect()
}

/// This process's nonce: random (std's per-process hash keys, mixed with the pid), fixed
/// for the life of the process.
pub fn process_nonce() -> u64 {
    static NONCE: OnceLock<u64> = OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish() | 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(seed: u8) -> PeerRecord {
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(seed);
        }
        let mut uuid = [0u8; 16];
        for (i, b) in uuid.iter_mut().enumerate() {
            *b = 255 - (i as u8) * 3 - seed;
        }
        PeerRecord {
            ok: seed.is_multiple_of(2),
            ipc_ok: !seed.is_multiple_of(3),
            nonce: 0x0123_4567_89ab_cdef ^ u64::from(seed),
            uuid,
            ptr: 0x7f00_dead_0000 + u64::from(seed) * 4096,
            cap: 1 << 20,
            blocks: 16 + u32::from(seed),
            handle,
        }
    }

    #[test]
    fn records_survive_the_f32_all_gather() {
        let world = 5;
        let records: Vec<PeerRecord> = (0..world).map(|r| sample(r as u8 * 11 + 1)).collect();
        // What NCCL's sum would hold: every rank's slots added, in any order.
        let mut sum = vec![0.0f32; RECORD_BYTES * world];
        for (r, rec) in records.iter().enumerate().rev() {
            for (s, v) in sum.iter_mut().zip(encode_slots(&rec.to_bytes(), r, world)) {
                *s += v;
            }
        }
        let got = decode_slots(&sum, RECORD_BYTES, world).unwrap();
        for (r, bytes) in got.iter().enumerate() {
            assert_eq!(PeerRecord::from_bytes(bytes).unwrap(), records[r], "rank {r}");
        }
        // Two ranks in one slot, or a fraction, is caught.
        let mut bad = sum.clone();
        bad[3] += 200.0;
        assert!(decode_slots(&bad, RECORD_BYTES, world).is_err());
        bad[3] = 0.5;
        assert!(decode_slots(&bad, RECORD_BYTES, world).is_err());
        assert!(decode_slots(&sum[1..], RECORD_BYTES, world).is_err());
    }

    #[test]
    fn foreign_or_short_records_are_errors() {
        let mut b = sample(4).to_bytes();
        assert!(PeerRecord::from_bytes(&b[..100]).is_err());
        b[4] = VERSION + 1;
        let msg = PeerRecord::from_bytes(&b).unwrap_err().to_string();
        assert!(msg.contains("mixed builds"), "{msg}");
        let failed = PeerRecord::failed(9);
        let back = PeerRecord::from_bytes(&failed.to_bytes()).unwrap();
        assert!(!back.ok && back.nonce == 9);
    }

    #[test]
    fn layout_keeps_buffers_aligned() {
        for max in [1usize, 2, 255, 256, 257, 65_536, 1 << 20, (3 << 20) + 6] {
            let cap = data_capacity(max);
            assert!(cap >= max && cap.is_multiple_of(256) && cap - max < 256, "{max} -> {cap}");
            assert_eq!(region_bytes(cap), DATA_OFFSET + 2 * ONESHOT_MAX_WORLD * cap);
            assert_eq!((DATA_OFFSET + cap) % 16, 0);
        }
        assert_eq!(process_nonce(), process_nonce());
        assert_ne!(process_nonce(), 0);
    }
}
