//! Host launcher of the fused Q/K/V preparation (`kernels/cuda/qkv.cu`). After the fused QKV
//! GEMM one kernel adds the bias (Qwen2), applies the per-head q/k RMSNorm (Qwen3) and RoPE,
//! writes q and stores k and v into the paged caches: the work of the separate bias, norm,
//! rope and `write_kv` launches, with one read of the GEMM output and one bf16 rounding.
//! Semantics are those of the CPU path of a llama block (`cpu::activation::add_row_bias`,
//! `cpu::norm::rms_norm`, `cpu::rope::rope`, `cpu::attention::write_kv`), in f32.
//!
//! Head dims 64 and 128 (any `8 * 2^k` up to 256) take the 16-byte-per-lane kernel; other
//! even head dims the general one (a warp per head, 4-byte accesses).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::device::{dev_err, Buf, Device};
use super::qkv_args::{qkv_lens, QkvPrep};
use crate::cpu::attention::PagedKv;
use crate::cpu::rope::RopeStyle;
use crate::error::check;
use crate::launch_checks::{qkv_shape, to_u32, QkvDims};
use crate::KernelError;
use half::bf16;

/// Warps (one head each) per block of the general kernel; must match QKV_WARPS in the .cu.
const WARPS: usize = 4;
/// Threads per block of the vec8 kernel (`THREADS / (head_dim / 8)` heads each).
const VEC8_THREADS: usize = 128;

/// The launch shape for a head dim: `Some(log2 of the lanes per head)` when the vec8 kernel
/// serves it (`head_dim / 8` lanes, a power of two up to a warp), `None` for the general one.
fn vec8_lanes_log2(head_dim: usize) -> Option<u32> {
    let lanes = head_dim / 8;
    (head_dim.is_multiple_of(8) && lanes.is_power_of_two() && lanes <= 32).then(|| lanes.trailing_zeros())
}

impl Device {
    /// Writes `q_out` `[n_tokens, n_heads * head_dim]` = rope(norm(q + bq)), and stores
    /// rope(norm(k + bk)) and (v + bv) into the paged caches `[num_blocks, block_size,
    /// n_kv_heads, head_dim]` at `p.slots` (a slot past the cache skips that token's K/V).
    /// Bias and norm are applied only when given; dims past the rope cache's `rope_dim` are
    /// not rotated, and a position `>= p.rope.max_positions()` makes the rotated dims of that
    /// token's q and k NaN.
    pub fn qkv_rope_write(
        &self,
        q_out: &mut Buf<bf16>,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        cache: &PagedKv,
        p: &QkvPrep,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_qkv_rope_write";
        let (n, nh, nkv, hd) = (p.n_tokens, p.n_heads, p.n_kv_heads, p.head_dim);
        let lens = qkv_lens(p, q_out.len(), k_cache.len(), v_cache.len());
        let QkvDims { heads, n_slots } = qkv_shape(OP, &lens, cache)?;
        if n == 0 {
            return Ok(());
        }

        let n_slots = n_slots as u64;
        let (nt, nh32, nkv32, hd32) = (
            to_u32(OP, "n_tokens", n)?,
            to_u32(OP, "n_heads", nh)?,
            to_u32(OP, "n_kv_heads", nkv)?,
            to_u32(OP, "head_dim", hd)?,
        );
        let (half_rot, max_pos) =
            (to_u32(OP, "rope_dim/2", p.rope.rope_dim / 2)?, to_u32(OP, "max_positions", p.rope.max_positions)?);
        // (kernel, heads per block, threads per block); shared memory is head_dim f32 per head.
        let lanes_log2 = vec8_lanes_log2(hd);
        let (func, per_block, threads) = match lanes_log2 {
            Some(l) => (&self.kernels.qkv_rope_write_vec8, VEC8_THREADS >> l, VEC8_THREADS),
            None => (&self.kernels.qkv_rope_write, WARPS, 32 * WARPS),
        };
        let head_blocks = heads.div_ceil(per_block);
        check(head_blocks <= 65535, OP, || format!("{heads} heads exceed the grid"))?;
        let cfg = LaunchConfig {
            grid_dim: (nt, head_blocks as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: to_u32(OP, "shared memory", per_block * hd * 4)?,
        };
        let neox: i32 = matches!(p.style, RopeStyle::Neox).into();
        let null = 0u64;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut q_out.inner).arg(&mut k_cache.inner).arg(&mut v_cache.inner).arg(&p.qkv.inner);
        match p.bias {
            Some(bias) => b.arg(&bias.inner),
            None => b.arg(&null),
        };
        match p.qk_norm {
            Some((qn, kn)) => b.arg(&qn.inner).arg(&kn.inner),
            None => b.arg(&null).arg(&null),
        };
        b.arg(&p.positions.inner)
            .arg(&p.slots.inner)
            .arg(&p.rope.table.inner)
            .arg(&nt)
            .arg(&nh32)
            .arg(&nkv32)
            .arg(&hd32)
            .arg(&half_rot)
            .arg(&max_pos)
            .arg(&n_slots)
            .arg(&p.eps)
            .arg(&neox);
        if let Some(l) = &lanes_log2 {
            b.arg(l);
        }
        // SAFETY: argument types and order match the kernel (the vec8 one takes lanes_log2
        // last); qkv, q_out, bias, norm weights, positions and slots lengths were checked
        // against the shape; cache writes happen only for slots below n_slots (the caches'
        // slot count); table reads only for positions below max_pos; shared memory is
        // head_dim f32 per head of the block, as both kernels index it. Head offsets are
        // multiples of head_dim elements, so 16-byte aligned on the vec8 path (head_dim % 8
        // == 0) and 4-byte aligned on the other (head_dim even).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }
}
