//! Rows of plain floating-point types (F32, F16, BF16) as f32.
//!
//! F16 goes through the `half` crate (exact; uses F16C when the CPU has it). BF16 is the
//! top half of an f32, so widening is a shift and exact too.

/// f16 bits -> f32 (exact).
#[inline]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// bf16 bits -> f32 (exact).
#[inline]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Little-endian u16 at `b[i..i + 2]`; callers pass fixed-size blocks, so `i` is in range.
#[inline]
pub(crate) fn le_u16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// `src`: `out.len()` little-endian f32 values.
pub(crate) fn dequant_f32(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// `src`: `out.len()` little-endian f16 values.
pub(crate) fn dequant_f16(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}

/// `src`: `out.len()` little-endian bf16 values.
pub(crate) fn dequant_bf16(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
}
