//! GGML tensor types: their ids in GGUF files, block geometry, and row dequantisation.
//!
//! A row of a quantised matrix is a sequence of fixed-size blocks; `block_elems` values
//! are stored in `block_bytes` bytes. Layouts follow ggml's `ggml-common.h` (the file
//! format is the contract; the code here is our own). Submodules: `float` (F32/F16/BF16),
//! `legacy` (Q4_0/Q4_1/Q8_0), `kquant` (Q4_K/Q5_K/Q6_K), `q8` (activation quantisation
//! for the CPU matmul), `weight` (the borrowed matrix view).

mod float;
mod kquant;
mod legacy;
pub mod q8;
mod weight;

pub(crate) use float::{bf16_to_f32, f16_to_f32};
pub(crate) use kquant::k4_scales_mins;
pub use weight::Weight;

use crate::KernelError;

/// Tensor element types Tessera reads. Discriminants are GGUF's `ggml_type` ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q8_0 = 8,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    BF16 = 30,
}

impl GgmlType {
    /// Maps a GGUF type id; `None` for types Tessera does not read.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// Values per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18, // f16 d + 16 bytes of nibbles
            Self::Q4_1 => 20, // f16 d, f16 m + 16 bytes of nibbles
            Self::Q8_0 => 34, // f16 d + 32 i8
            Self::Q4K => 144, // f16 d, f16 dmin, 12 bytes scales, 128 bytes nibbles
            Self::Q5K => 176, // f16 d, f16 dmin, 12 scales, 32 high bits, 128 nibbles
            Self::Q6K => 210, // 128 low nibbles, 64 high bits, 16 i8 scales, f16 d
        }
    }

    /// Bytes taken by `n` values, or `None` when `n` is not a whole number of blocks
    /// (or the product overflows).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }

    /// The name llama.cpp and the `gguf` Python package use.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Dequantises one row (`out.len()` values, a whole number of blocks) from `src`.
pub fn dequantize_row(ty: GgmlType, src: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let need = ty.bytes_for(out.len()).ok_or_else(|| KernelError::Shape {
        op: "dequantize_row",
        detail: format!("{} values is not a whole number of {ty} blocks", out.len()),
    })?;
    crate::error::check(src.len() == need, "dequantize_row", || {
        format!("{} bytes given, {need} needed for {} {ty} values", src.len(), out.len())
    })?;
    dequantize_unchecked(ty, src, out);
    Ok(())
}

/// [`dequantize_row`] without the length checks: `src` must hold exactly the blocks of
/// `out` (extra values on either side are left alone / ignored, never read out of bounds).
pub(crate) fn dequantize_unchecked(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => float::dequant_f32(src, out),
        GgmlType::F16 => float::dequant_f16(src, out),
        GgmlType::BF16 => float::dequant_bf16(src, out),
        GgmlType::Q4_0 => legacy::dequant_q4_0(src, out),
        GgmlType::Q4_1 => legacy::dequant_q4_1(src, out),
        GgmlType::Q8_0 => legacy::dequant_q8_0(src, out),
        GgmlType::Q4K => kquant::dequant_q4_k(src, out),
        GgmlType::Q5K => kquant::dequant_q5_k(src, out),
        GgmlType::Q6K => kquant::dequant_q6_k(src, out),
    }
}
