//! The inputs of the fused Q/K/V preparation (`Device::qkv_rope_write`, `kernels/cuda/qkv.cu`),
//! defined whether or not the `cuda` feature is compiled in, so callers build the same struct
//! either way. The HIP launcher of the same kernel takes it too, over its own buffers
//! (`hip::QkvInputs`); the type parameters default to CUDA's.

use super::{Buf, RopeCache};
use crate::cpu::rope::RopeStyle;
use crate::launch_checks::{Extent, QkvLens, RopeDim};
use half::bf16;

/// Everything `Device::qkv_rope_write` reads besides the buffers it writes (`B`: a bf16
/// device buffer, `U`: a u32 one, `R`: the RoPE table).
pub struct QkvPrep<'a, B = Buf<bf16>, U = Buf<u32>, R = RopeCache> {
    /// `[n_tokens, (n_heads + 2 * n_kv_heads) * head_dim]` bf16: q | k | v of each token (the
    /// fused GEMM output).
    pub qkv: &'a B,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Qwen2: `[(n_heads + 2 * n_kv_heads) * head_dim]` bias added to q, k, v first.
    pub bias: Option<&'a B>,
    /// Qwen3: per-head RMSNorm weights of q and of k, `[head_dim]` each, applied after the
    /// bias, before RoPE.
    pub qk_norm: Option<(&'a B, &'a B)>,
    /// The norm's epsilon (checked even without `qk_norm`: finite and >= 0).
    pub eps: f32,
    /// `[n_tokens]` positions.
    pub positions: &'a U,
    pub rope: &'a R,
    pub style: RopeStyle,
    /// `[n_tokens]` cache slot of each token (`block * block_size + offset`); a slot
    /// `>= num_blocks * block_size` (`u32::MAX` = padding) skips that token's K/V write.
    pub slots: &'a U,
}

// By hand: a derive would ask B, U and R to be Copy; only the references are copied.
impl<B, U, R> Clone for QkvPrep<'_, B, U, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B, U, R> Copy for QkvPrep<'_, B, U, R> {}

/// The lengths of `p` the launchers check (crate::launch_checks::qkv_shape), with those of
/// the buffers the kernel writes.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
pub(crate) fn qkv_lens<B: Extent, U: Extent, R: RopeDim>(
    p: &QkvPrep<'_, B, U, R>,
    q_out: usize,
    k_cache: usize,
    v_cache: usize,
) -> QkvLens {
    QkvLens {
        n_tokens: p.n_tokens,
        n_heads: p.n_heads,
        n_kv: p.n_kv_heads,
        head_dim: p.head_dim,
        qkv: p.qkv.extent(),
        q_out,
        positions: p.positions.extent(),
        slots: p.slots.extent(),
        bias: p.bias.map(Extent::extent),
        qk_norm: p.qk_norm.map(|(q, k)| (q.extent(), k.extent())),
        k_cache,
        v_cache,
        rope_dim: p.rope.rotated(),
        eps: p.eps,
    }
}
