//! The 256-value "K" super-block formats Q4_K, Q5_K and Q6_K.
//!
//! Block layouts (bytes):
//! - Q4_K, 144: f16 `d`, f16 `dmin`, 12 bytes of packed 6-bit (scale, min) pairs for the
//!   eight 32-value sub-blocks, 128 bytes of nibbles. Value = d*sc*q - dmin*m.
//! - Q5_K, 176: as Q4_K plus 32 bytes `qh` before the nibbles: bit `i` of `qh[l]` is the
//!   fifth bit of value `l` of sub-block `i`.
//! - Q6_K, 210: 128 bytes `ql` (low nibbles), 64 bytes `qh` (2 high bits each), 16 i8
//!   scales (one per 16 values), f16 `d`. Value = d*sc*(q - 32).
//!
//! In Q4_K/Q5_K, nibble byte `32*p + l` holds value `l` of sub-block `2p` (low nibble) and
//! of sub-block `2p + 1` (high nibble). In Q6_K each 128-value half `h` uses
//! `ql[64h..64h+64]` and `qh[32h..32h+32]`; value `32*g + l` of the half takes its low
//! nibble from `ql[l + 32*(g&1)]` (low nibble for g < 2, high for g >= 2) and its high bits
//! from bits `2g..2g+2` of `qh[l]`. The float operations follow gguf-py's order.

use super::float::{f16_to_f32, le_u16};

pub(crate) const Q4_K_BYTES: usize = 144;
pub(crate) const Q5_K_BYTES: usize = 176;
pub(crate) const Q6_K_BYTES: usize = 210;

/// Unpacks the 12 bytes of 6-bit (scale, min) pairs of a Q4_K/Q5_K block:
/// bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7
/// the same for mins, bytes 8-11 the low 4 bits of scale (low nibble) and min (high
/// nibble) 4-7.
#[inline]
pub(crate) fn k4_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 0x3F;
        mn[j] = s[j + 4] & 0x3F;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// `src`: `out.len() / 256` Q4_K blocks.
pub(crate) fn dequant_q4_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(Q4_K_BYTES)) {
        let d = f16_to_f32(le_u16(b, 0));
        let dmin = f16_to_f32(le_u16(b, 2));
        let (sc, mn) = k4_scales_mins(&b[4..16]);
        let qs = &b[16..144];
        for (i, sub) in o.chunks_exact_mut(32).enumerate() {
            let (ds, dm) = (d * sc[i] as f32, dmin * mn[i] as f32);
            let bytes = &qs[32 * (i / 2)..32 * (i / 2) + 32];
            let shift = 4 * (i % 2);
            for (v, &q) in sub.iter_mut().zip(bytes) {
                *v = ds * ((q >> shift) & 0x0F) as f32 - dm;
            }
        }
    }
}

/// `src`: `out.len() / 256` Q5_K blocks.
pub(crate) fn dequant_q5_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(Q5_K_BYTES)) {
        let d = f16_to_f32(le_u16(b, 0));
        let dmin = f16_to_f32(le_u16(b, 2));
        let (sc, mn) = k4_scales_mins(&b[4..16]);
        let qh = &b[16..48];
        let qs = &b[48..176];
        for (i, sub) in o.chunks_exact_mut(32).enumerate() {
            let (ds, dm) = (d * sc[i] as f32, dmin * mn[i] as f32);
            let bytes = &qs[32 * (i / 2)..32 * (i / 2) + 32];
            let shift = 4 * (i % 2);
            for l in 0..32 {
                let q = ((bytes[l] >> shift) & 0x0F) | (((qh[l] >> i) & 1) << 4);
                sub[l] = ds * q as f32 - dm;
            }
        }
    }
}

/// `src`: `out.len() / 256` Q6_K blocks.
pub(crate) fn dequant_q6_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(256).zip(src.chunks_exact(Q6_K_BYTES)) {
        let d = f16_to_f32(le_u16(b, 208));
        for (h, half) in o.chunks_exact_mut(128).enumerate() {
            let ql = &b[64 * h..64 * h + 64];
            let qh = &b[128 + 32 * h..128 + 32 * h + 32];
            let scales = &b[192 + 8 * h..192 + 8 * h + 8];
            for (g, group) in half.chunks_exact_mut(32).enumerate() {
                let lo = &ql[32 * (g & 1)..32 * (g & 1) + 32];
                let nib_shift = 4 * (g >> 1);
                for l in 0..32 {
                    let q = ((lo[l] >> nib_shift) & 0x0F) | (((qh[l] >> (2 * g)) & 3) << 4);
                    let sc = scales[2 * g + l / 16] as i8;
                    group[l] = (d * sc as f32) * (q as i32 - 32) as f32;
                }
            }
        }
    }
}
