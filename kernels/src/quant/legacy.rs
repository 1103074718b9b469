//! The 32-value block formats Q4_0, Q4_1 and Q8_0 (ggml's "legacy" quants).
//!
//! Block layouts (bytes):
//! - Q4_0, 18: f16 `d`, 16 bytes of nibbles; value = d * (q - 8).
//! - Q4_1, 20: f16 `d`, f16 `m`, 16 bytes of nibbles; value = d * q + m.
//! - Q8_0, 34: f16 `d`, 32 i8; value = d * q.
//!
//! In the 4-bit formats byte `j` holds value `j` in its low nibble and value `j + 16` in its
//! high nibble. The float operations are done in the same order as gguf-py's dequantizer
//! (and ggml's), so results match bit for bit.

use super::float::{f16_to_f32, le_u16};

pub(crate) const Q4_0_BYTES: usize = 18;
pub(crate) const Q4_1_BYTES: usize = 20;
pub(crate) const Q8_0_BYTES: usize = 34;

/// `src`: `out.len() / 32` Q4_0 blocks.
pub(crate) fn dequant_q4_0(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(Q4_0_BYTES)) {
        let d = f16_to_f32(le_u16(b, 0));
        let (lo, hi) = o.split_at_mut(16);
        for j in 0..16 {
            let q = b[2 + j];
            lo[j] = d * ((q & 0x0F) as i32 - 8) as f32;
            hi[j] = d * ((q >> 4) as i32 - 8) as f32;
        }
    }
}

/// `src`: `out.len() / 32` Q4_1 blocks.
pub(crate) fn dequant_q4_1(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(Q4_1_BYTES)) {
        let d = f16_to_f32(le_u16(b, 0));
        let m = f16_to_f32(le_u16(b, 2));
        let (lo, hi) = o.split_at_mut(16);
        for j in 0..16 {
            let q = b[4 + j];
            lo[j] = d * (q & 0x0F) as f32 + m;
            hi[j] = d * (q >> 4) as f32 + m;
        }
    }
}

/// `src`: `out.len() / 32` Q8_0 blocks.
pub(crate) fn dequant_q8_0(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(Q8_0_BYTES)) {
        let d = f16_to_f32(le_u16(b, 0));
        for (v, &q) in o.iter_mut().zip(&b[2..]) {
            *v = (q as i8) as f32 * d;
        }
    }
}
