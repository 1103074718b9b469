//! The inputs of the fused Q/K/V preparation (`Device::qkv_rope_write`, `kernels/cuda/qkv.cu`),
//! defined whether or not the `cuda` feature is compiled in, so callers build the same struct
//! either way.

use super::{Buf, RopeCache};
use crate::cpu::rope::RopeStyle;
use half::bf16;

/// Everything `Device::qkv_rope_write` reads besides the buffers it writes.
#[derive(Clone, Copy)]
pub struct QkvPrep<'a> {
    /// `[n_tokens, (n_heads + 2 * n_kv_heads) * head_dim]` bf16: q | k | v of each token (the
    /// fused GEMM output).
    pub qkv: &'a Buf<bf16>,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Qwen2: `[(n_heads + 2 * n_kv_heads) * head_dim]` bias added to q, k, v first.
    pub bias: Option<&'a Buf<bf16>>,
    /// Qwen3: per-head RMSNorm weights of q and of k, `[head_dim]` each, applied after the
    /// bias, before RoPE.
    pub qk_norm: Option<(&'a Buf<bf16>, &'a Buf<bf16>)>,
    /// The norm's epsilon (checked even without `qk_norm`: finite and >= 0).
    pub eps: f32,
    /// `[n_tokens]` positions.
    pub positions: &'a Buf<u32>,
    pub rope: &'a RopeCache,
    pub style: RopeStyle,
    /// `[n_tokens]` cache slot of each token (`block * block_size + offset`); a slot
    /// `>= num_blocks * block_size` (`u32::MAX` = padding) skips that token's K/V write.
    pub slots: &'a Buf<u32>,
}
