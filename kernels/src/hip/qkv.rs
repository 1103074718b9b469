//! The fused Q/K/V preparation on an AMD GPU: qkv.cu's general kernel (a warp per head, any
//! even head_dim; its vec8 variant packs heads into a 32-lane warp and stays CUDA's), after
//! the q|k|v GEMM: bias (Qwen2), per-head q/k RMSNorm (Qwen3), RoPE from a (cos, sin) table
//! (Llama-3 scaling and GGUF frequency factors are in the table), q out and k/v into the
//! paged caches. Argument rules are CUDA's (crate::launch_checks::qkv_shape).

use half::bf16;

use super::device::{DevBuf, Device};
use super::launch;
use super::ops::arg;
use super::Elem;
use crate::cpu::attention::PagedKv;
use crate::cpu::rope::{RopeParams, RopeStyle};
use crate::cuda::qkv_args::qkv_lens;
use crate::cuda::QkvPrep;
use crate::error::check;
use crate::launch_checks::{qkv_shape, rope_table, to_u32, Extent, QkvDims, RopeDim};
use crate::KernelError;

/// A model's RoPE (cos, sin) pairs on the device, `[max_positions, rope_dim / 2]`.
pub struct RopeTable {
    table: DevBuf<f32>,
    rope_dim: usize,
    max_positions: usize,
}

impl RopeTable {
    /// The table of `params` for positions `0..max_positions`, computed on the host as the
    /// CPU reference does and uploaded.
    pub fn new(dev: &Device, params: &RopeParams, max_positions: usize) -> Result<Self, KernelError> {
        const OP: &str = "hip_rope_table";
        check(max_positions > 0, OP, || "max_positions must be > 0".to_string())?;
        to_u32(OP, "max_positions", max_positions)?;
        let table = dev.upload(&rope_table(params, max_positions))?;
        Ok(RopeTable { table, rope_dim: params.rope_dim(), max_positions })
    }

    pub fn rope_dim(&self) -> usize {
        self.rope_dim
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }
}

/// One layer's Q/K/V preparation over HIP buffers: CUDA's [`crate::cuda::QkvPrep`] (the GEMM
/// output, bias, q/k norm weights, positions, cache slots, the RoPE table and style).
pub type QkvInputs<'a> = QkvPrep<'a, DevBuf<bf16>, DevBuf<u32>, RopeTable>;

impl<T: Elem> Extent for DevBuf<T> {
    fn extent(&self) -> usize {
        self.len()
    }
}

impl RopeDim for RopeTable {
    fn rotated(&self) -> usize {
        self.rope_dim
    }
}

/// Writes `q_out` `[n_tokens, n_heads * head_dim]` and the tokens' K/V into the caches
/// (`cache`'s geometry). A position `>= rope.max_positions()` makes that
/// token's rotated dims NaN.
pub fn qkv_rope_write(
    dev: &Device,
    q_out: &mut DevBuf<bf16>,
    k_cache: &mut DevBuf<bf16>,
    v_cache: &mut DevBuf<bf16>,
    cache: &PagedKv,
    p: &QkvInputs,
) -> Result<(), KernelError> {
    const OP: &str = "hip_qkv_rope_write";
    let (n, nh, nkv, hd) = (p.n_tokens, p.n_heads, p.n_kv_heads, p.head_dim);
    let lens = qkv_lens(p, q_out.len(), k_cache.len(), v_cache.len());
    let QkvDims { heads, n_slots } = qkv_shape(OP, &lens, cache)?;
    if n == 0 {
        return Ok(());
    }
    let shape = launch::qkv_rope(n, heads, hd, dev.wavefront_size())?;
    let kernel = dev.function("qkv", "qkv_rope_write")?;
    let (nt, nh32, nkv32, hd32) =
        (to_u32(OP, "n_tokens", n)?, to_u32(OP, "n_heads", nh)?, to_u32(OP, "n_kv", nkv)?, to_u32(OP, "head_dim", hd)?);
    let (half_rot, max_pos) =
        (to_u32(OP, "rope_dim/2", p.rope.rope_dim / 2)?, to_u32(OP, "max_positions", p.rope.max_positions)?);
    let n_slots = n_slots as u64;
    let neox: i32 = matches!(p.style, RopeStyle::Neox).into();
    let null = std::ptr::null_mut::<std::ffi::c_void>();
    let ptrs = [
        q_out.device_ptr(),
        k_cache.device_ptr(),
        v_cache.device_ptr(),
        p.qkv.device_ptr(),
        p.bias.map_or(null, DevBuf::device_ptr),
        p.qk_norm.map_or(null, |(q, _)| q.device_ptr()),
        p.qk_norm.map_or(null, |(_, k)| k.device_ptr()),
        p.positions.device_ptr(),
        p.slots.device_ptr(),
        p.rope.table.device_ptr(),
    ];
    let mut args: Vec<_> = ptrs.iter().map(arg).collect();
    args.extend([
        arg(&nt),
        arg(&nh32),
        arg(&nkv32),
        arg(&hd32),
        arg(&half_rot),
        arg(&max_pos),
        arg(&n_slots),
        arg(&p.eps),
        arg(&neox),
    ]);
    // SAFETY: the arguments follow qkv_rope_write's parameter list in qkv.cu (ten pointers,
    // six u32, u64, float, int); every length was checked by qkv_shape; cache writes happen
    // only for slots below n_slots, table reads only for positions below max_pos; shared
    // memory is head_dim f32 per warp of the block (launch::qkv_rope); heads start 4-byte
    // aligned (head_dim even).
    unsafe { dev.launch(kernel, shape, &mut args) }
}
