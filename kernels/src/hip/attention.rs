//! Paged attention on AMD GPUs: the launcher of attention.cu's portable kernel (the HIP build's
//! replacement for CUDA's tensor-core prefill and decode), one block per (query token, head).
//! The cache layout and batch description are CUDA's ([`crate::cuda::PagedBatch`]'s fields, as
//! plain device buffers here): k/v caches `[num_blocks, block_size, n_kv, head_dim]` bf16, one
//! block table row of `max_blocks` ids per sequence, context lengths, and `cu_q` (sequence s
//! owns query tokens `cu_q[s]..cu_q[s + 1]`).

use half::bf16;

use super::device::{DevBuf, Device};
use super::launch::{self, LaunchShape};
use super::ops::arg;
use crate::error::check;
use crate::KernelError;

/// One layer's paged attention inputs on the device.
pub struct PagedInputs<'a> {
    pub k_cache: &'a DevBuf<bf16>,
    pub v_cache: &'a DevBuf<bf16>,
    /// `[num_seqs, max_blocks]` block ids.
    pub block_tables: &'a DevBuf<u32>,
    /// `[num_seqs]` positions cached per sequence, the queries' own included.
    pub context_lens: &'a DevBuf<u32>,
    /// `[num_seqs + 1]`, non-decreasing, `cu_q[0] = 0`.
    pub cu_q: &'a DevBuf<u32>,
    pub block_size: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

/// `out[t, h] = softmax(scale q[t, h] · K) V` over each query's causal range (`q`, `out`:
/// `[total_q, n_heads, head_dim]` bf16).
pub fn paged_attention(
    dev: &Device,
    out: &mut DevBuf<bf16>,
    q: &DevBuf<bf16>,
    kv: &PagedInputs,
    n_heads: usize,
    scale: f32,
) -> Result<(), KernelError> {
    const OP: &str = "hip_paged_attention";
    let hd = kv.head_dim;
    check(hd == 64 || hd == 128, OP, || format!("head_dim {hd}: the portable kernel has 64 and 128"))?;
    check(kv.n_kv > 0 && n_heads > 0 && n_heads.is_multiple_of(kv.n_kv) && n_heads <= 65535, OP, || {
        format!("{n_heads} heads over {} kv heads", kv.n_kv)
    })?;
    let slot = kv.n_kv * hd;
    check(
        kv.block_size > 0
            && kv.k_cache.len() == kv.v_cache.len()
            && kv.k_cache.len().is_multiple_of(kv.block_size * slot),
        OP,
        || {
            format!(
                "caches of {} / {} values for blocks of {} x {slot}",
                kv.k_cache.len(),
                kv.v_cache.len(),
                kv.block_size
            )
        },
    )?;
    let num_blocks = kv.k_cache.len() / (kv.block_size * slot);
    let num_seqs = kv.context_lens.len();
    check(num_seqs > 0 && kv.cu_q.len() == num_seqs + 1 && kv.block_tables.len().is_multiple_of(num_seqs), OP, || {
        format!("{num_seqs} sequences, cu_q {}, block tables {}", kv.cu_q.len(), kv.block_tables.len())
    })?;
    let max_blocks = kv.block_tables.len() / num_seqs;
    let row = n_heads * hd;
    check(q.len().is_multiple_of(row) && out.len() == q.len(), OP, || {
        format!("q {} / out {} for rows of {row}", q.len(), out.len())
    })?;
    let total_q = q.len() / row;
    let fits = |v: usize| u32::try_from(v).is_ok();
    check(fits(num_blocks) && fits(max_blocks) && fits(kv.block_size) && total_q > 0, OP, || {
        format!("{total_q} queries, {num_blocks} blocks, {max_blocks} per table")
    })?;
    let shape = attention_shape(total_q, n_heads)?;
    let kernel = dev.function(
        "attention",
        if hd == 64 { "paged_attention_portable_hd64" } else { "paged_attention_portable_hd128" },
    )?;
    let ptrs = [
        out.device_ptr(),
        q.device_ptr(),
        kv.k_cache.device_ptr(),
        kv.v_cache.device_ptr(),
        kv.block_tables.device_ptr(),
    ];
    let (ctx, cu) = (kv.context_lens.device_ptr(), kv.cu_q.device_ptr());
    let (mb, ns, nb, bs, nh, nkv) =
        (max_blocks as u32, num_seqs as u32, num_blocks as u32, kv.block_size as u32, n_heads as u32, kv.n_kv as u32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let mut args = [
        arg(&ptrs[0]),
        arg(&ptrs[1]),
        arg(&ptrs[2]),
        arg(&ptrs[3]),
        arg(&ptrs[4]),
        arg(&mb),
        arg(&ctx),
        arg(&cu),
        arg(&ns),
        arg(&nb),
        arg(&bs),
        arg(&nh),
        arg(&nkv),
        arg(&scale_log2),
    ];
    // SAFETY: the arguments follow paged_attention_portable_hd*'s parameter list in
    // attention.cu; the buffer sizes were checked above. Device-side indices (block ids,
    // context lengths, cu_q) are checked by the kernel, which writes NaN rows for bad ones.
    unsafe { dev.launch(kernel, shape, &mut args) }
}

/// Grid (queries, heads) of ATT_PORT_THREADS (a multiple of 32 and 64).
pub fn attention_shape(total_q: usize, n_heads: usize) -> Result<LaunchShape, KernelError> {
    let q = u32::try_from(total_q).ok().filter(|&g| g > 0 && g <= i32::MAX as u32);
    let h = u32::try_from(n_heads).ok().filter(|&g| g > 0 && g <= 65535);
    match (q, h) {
        (Some(q), Some(h)) => Ok(LaunchShape { grid: [q, h, 1], block: launch::ATT_PORT_THREADS, shared_bytes: 0 }),
        _ => Err(KernelError::Shape { op: "hip_paged_attention", detail: format!("grid of {total_q} x {n_heads}") }),
    }
}
