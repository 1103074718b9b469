//! Host launchers of the paged-attention kernels (`kernels/cuda/attention.cu`): the K/V
//! cache write, decode attention (split-KV when the grid would otherwise leave SMs idle,
//! the splits merged inside the same launch) and causal prefill attention over a batch of
//! sequences.
//!
//! Layout and semantics are those of [`crate::cpu::attention`], with bf16 storage: one
//! layer's K and V caches are `[num_blocks, block_size, n_kv_heads, head_dim]`, a sequence's
//! block table maps position `p` to block `table[p / block_size]`, slot `p % block_size`,
//! and query head `h` reads kv head `h / (n_heads / n_kv_heads)`. Shapes are checked here;
//! device-side indices (slots, block ids, lengths) cannot be, so the kernels never read
//! outside the cache for bad ones: they produce NaN rows instead (see the .cu file).

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::device::{dev_err, Buf, Device};
use super::launch_ex::launch_ex;
use super::paged::{
    decode_lean_smem_bytes, decode_smem_bytes, plan_splits, prefill_smem_bytes, DecodePlan, PagedBatch, HEAD_DIMS,
    MIN_SPLIT_TOKENS, PF_ROWS,
};
use crate::cpu::attention::PagedKv;
use crate::error::check;
use crate::KernelError;
use half::bf16;

/// Query heads one decode CTA serves at most (the rows 0..8 of its MMA tiles; rows 8..16
/// carry the low halves of the softmax weights); larger GQA groups are split into chunks of
/// at most this many heads.
const DECODE_MAX_GROUP: usize = 8;
/// Threads of a decode CTA (must match DEC_THREADS in the .cu).
const DECODE_THREADS: u32 = 128;
/// Threads of a prefill CTA, four warps of 16 rows (must match PF_THREADS in the .cu).
const PF_THREADS: u32 = 128;
/// Threads of a write_kv block.
const WRITE_THREADS: u32 = 128;

/// Largest decode batch that takes the lean kernels by default (the fused-GEMV steps'
/// batches, where each warp has a tile or two per split).
const DECODE_LEAN_MAX_SEQS: usize = 4;

/// `log2(e)`: scores are exponentiated with `exp2`, so the scale folds this in.
const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// The attention kernels, resolved at device start.
pub(crate) struct AttentionKernels {
    write_kv: CudaFunction,
    /// `paged_decode_hd{64,128}`.
    decode: [CudaFunction; 2],
    /// Decode CTAs resident per SM, per head dim (the driver's occupancy at the kernel's
    /// registers and shared memory): the split plan aims at one wave of them.
    decode_ctas_per_sm: [usize; 2],
    /// `paged_decode_lean_hd{64,128}`: the same plan and bits with a shallower ring, so the
    /// next (programmatically launched) GEMV's CTAs fit beside them; they trigger their
    /// dependents at once. Taken for batches of at most `lean_max_seqs` sequences.
    decode_lean: [CudaFunction; 2],
    lean_max_seqs: AtomicUsize,
    /// Whether decode attention launches programmatically (see
    /// [`Device::set_decode_early_start`]).
    early_start: AtomicBool,
    /// `paged_prefill_hd{64,128}`.
    prefill: [CudaFunction; 2],
}

impl AttentionKernels {
    /// Resolves the kernels of module `attention` through `f(module, function)`, raises
    /// the decode and prefill kernels' dynamic shared-memory limits and reads the decode
    /// kernels' occupancy.
    pub(crate) fn load(f: &dyn Fn(&str, &str) -> Result<CudaFunction, KernelError>) -> Result<Self, KernelError> {
        let m = "attention";
        let smem_limit = |func: &CudaFunction, bytes: usize| {
            let bytes = i32::try_from(bytes).unwrap_or(i32::MAX);
            func.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
                .map_err(dev_err("cuda_attention_smem_limit"))
        };
        let prefill = [f(m, "paged_prefill_hd64")?, f(m, "paged_prefill_hd128")?];
        for (func, hd) in prefill.iter().zip(HEAD_DIMS) {
            smem_limit(func, prefill_smem_bytes(hd))?;
        }
        let decode = [f(m, "paged_decode_hd64")?, f(m, "paged_decode_hd128")?];
        let mut decode_ctas_per_sm = [1usize; 2];
        for ((func, hd), per_sm) in decode.iter().zip(HEAD_DIMS).zip(&mut decode_ctas_per_sm) {
            smem_limit(func, decode_smem_bytes(hd))?;
            let n = func
                .occupancy_max_active_blocks_per_multiprocessor(DECODE_THREADS, decode_smem_bytes(hd), None)
                .map_err(dev_err("cuda_attention_occupancy"))?;
            *per_sm = (n as usize).max(1);
        }
        let decode_lean = [f(m, "paged_decode_lean_hd64")?, f(m, "paged_decode_lean_hd128")?];
        for (func, hd) in decode_lean.iter().zip(HEAD_DIMS) {
            smem_limit(func, decode_lean_smem_bytes(hd))?;
        }
        Ok(AttentionKernels {
            write_kv: f(m, "write_kv")?,
            decode,
            decode_ctas_per_sm,
            decode_lean,
            lean_max_seqs: AtomicUsize::new(DECODE_LEAN_MAX_SEQS),
            early_start: AtomicBool::new(false),
            prefill,
        })
    }
}

/// Scratch of split-KV decode: per (sequence, head, split) the normalised partial output
/// (`head_dim` f32) and its log2 softmax mass, and per (sequence, kv head chunk) a count of
/// the splits done (the last one merges; it leaves the count at 0). Made once
/// ([`Device::decode_workspace`]) and reused every step, so a decode step allocates nothing.
pub struct DecodeWorkspace {
    part_o: Buf<f32>,
    part_lse: Buf<f32>,
    /// Zero between launches. Splitting needs room for two splits per head, so a call that
    /// splits has at most `rows / 2` (sequence, head) pairs, and at most that many chunks.
    counters: Buf<u32>,
    head_dim: usize,
}

impl DecodeWorkspace {
    /// (sequence, head, split) rows it holds.
    pub fn rows(&self) -> usize {
        self.part_lse.len()
    }
}

/// Validated geometry shared by the decode and prefill launchers.
struct Geometry {
    num_seqs: usize,
    num_blocks: usize,
    hd_index: usize,
    group: usize,
    /// Query heads per CTA and the number of such chunks per kv head.
    gt: usize,
    hchunks: usize,
}

fn to_u32(op: &'static str, what: &str, v: usize) -> Result<u32, KernelError> {
    u32::try_from(v).map_err(|_| KernelError::Shape { op, detail: format!("{what} {v} exceeds u32") })
}

fn check_batch(
    op: &'static str,
    b: &PagedBatch,
    n_heads: usize,
    scale: f32,
    max_gt: usize,
) -> Result<Geometry, KernelError> {
    let c = &b.cache;
    check(c.block_size > 0 && c.n_kv_heads > 0, op, || format!("block_size and n_kv_heads must be > 0, got {c:?}"))?;
    let hd_index = HEAD_DIMS.iter().position(|&d| d == c.head_dim).ok_or_else(|| KernelError::Unsupported {
        op,
        ty: format!("head_dim {} (compiled: {HEAD_DIMS:?})", c.head_dim),
    })?;
    let block = c.n_kv_heads.checked_mul(c.head_dim).and_then(|r| r.checked_mul(c.block_size));
    let num_blocks = match block {
        Some(bl) if b.k_cache.len() == b.v_cache.len() && b.k_cache.len().is_multiple_of(bl) => b.k_cache.len() / bl,
        _ => {
            return Err(KernelError::Shape {
                op,
                detail: format!(
                    "k cache {} / v cache {} values: not equal whole numbers of blocks of {c:?}",
                    b.k_cache.len(),
                    b.v_cache.len()
                ),
            })
        }
    };
    // Slots (block * block_size + offset) are u32 on the device, the top two values markers.
    check(num_blocks.checked_mul(c.block_size).is_some_and(|n| n <= 0xffff_fffd), op, || {
        format!("{num_blocks} blocks x block_size {}: more slots than u32 ids allow", c.block_size)
    })?;
    let num_seqs = b.context_lens.len();
    check(b.max_blocks.checked_mul(num_seqs) == Some(b.block_tables.len()), op, || {
        format!(
            "block tables have {} ids, expected {num_seqs} sequences x {} max_blocks",
            b.block_tables.len(),
            b.max_blocks
        )
    })?;
    to_u32(op, "max_blocks", b.max_blocks)?;
    check(n_heads > 0 && n_heads.is_multiple_of(c.n_kv_heads), op, || {
        format!("n_heads {n_heads} is not a positive multiple of n_kv_heads {}", c.n_kv_heads)
    })?;
    check(scale.is_finite(), op, || format!("scale {scale} is not finite"))?;
    let group = n_heads / c.n_kv_heads;
    let hchunks = group.div_ceil(max_gt);
    let gt = group.div_ceil(hchunks);
    check(c.n_kv_heads * hchunks <= 65535, op, || {
        format!("{} kv heads x {hchunks} chunks exceed the grid", c.n_kv_heads)
    })?;
    Ok(Geometry { num_seqs, num_blocks, hd_index, group, gt, hchunks })
}

impl Device {
    /// Stores new tokens' keys and values: `k`, `v` `[n_tokens, n_kv_heads * head_dim]`,
    /// token `t` into slot `slots[t]` (`block * block_size + offset`) of `k_cache` /
    /// `v_cache`. A slot `>= num_blocks * block_size` (`u32::MAX` for padding tokens) is
    /// skipped. `head_dim` must be a multiple of 8 (16-byte copies).
    pub fn write_kv(
        &self,
        cache: &PagedKv,
        k_cache: &mut Buf<bf16>,
        v_cache: &mut Buf<bf16>,
        k: &Buf<bf16>,
        v: &Buf<bf16>,
        slots: &Buf<u32>,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_write_kv";
        check(
            cache.block_size > 0 && cache.n_kv_heads > 0 && cache.head_dim > 0 && cache.head_dim.is_multiple_of(8),
            OP,
            || format!("block_size, n_kv_heads must be > 0 and head_dim a positive multiple of 8, got {cache:?}"),
        )?;
        let (row, block) = match cache.n_kv_heads.checked_mul(cache.head_dim) {
            Some(r) => (r, r.checked_mul(cache.block_size).unwrap_or(0)),
            None => (0, 0),
        };
        check(block > 0 && k_cache.len() == v_cache.len() && k_cache.len().is_multiple_of(block), OP, || {
            format!(
                "k cache {} / v cache {} values: not equal whole numbers of {block}-value blocks",
                k_cache.len(),
                v_cache.len()
            )
        })?;
        let n = slots.len();
        check(k.len() == v.len() && n.checked_mul(row) == Some(k.len()), OP, || {
            format!("k {} / v {} values, expected {n} tokens (slots) x {row}", k.len(), v.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let n_slots = (k_cache.len() / row) as u64;
        let (nt, vecs) = (to_u32(OP, "n_tokens", n)?, to_u32(OP, "row vectors", row / 8)?);
        let cfg = LaunchConfig { grid_dim: (nt, 1, 1), block_dim: (WRITE_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&self.kernels.attention.write_kv);
        b.arg(&mut k_cache.inner)
            .arg(&mut v_cache.inner)
            .arg(&k.inner)
            .arg(&v.inner)
            .arg(&slots.inner)
            .arg(&nt)
            .arg(&vecs)
            .arg(&n_slots);
        // SAFETY: argument order matches the kernel; sources cover n x row values; a slot is
        // used only when below n_slots, so writes stay inside the caches.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// Scratch for split-KV decode of up to `max_seqs` sequences x `n_heads` heads x
    /// `max_splits` splits. Calls with more sequences use fewer splits.
    pub fn decode_workspace(
        &self,
        max_seqs: usize,
        n_heads: usize,
        head_dim: usize,
        max_splits: usize,
    ) -> Result<DecodeWorkspace, KernelError> {
        const OP: &str = "cuda_decode_workspace";
        let rows = max_seqs.checked_mul(n_heads).and_then(|r| r.checked_mul(max_splits));
        let rows = rows.filter(|&r| r > 0).ok_or_else(|| KernelError::Shape {
            op: OP,
            detail: format!("{max_seqs} sequences x {n_heads} heads x {max_splits} splits: empty or overflowing"),
        })?;
        let o_len = rows.checked_mul(head_dim).filter(|_| head_dim > 0).ok_or_else(|| KernelError::Shape {
            op: OP,
            detail: format!("{rows} rows x head_dim {head_dim}: empty or overflowing"),
        })?;
        Ok(DecodeWorkspace {
            part_o: self.alloc(o_len)?,
            part_lse: self.alloc(rows)?,
            counters: self.alloc((rows / 2).max(1))?,
            head_dim,
        })
    }

    /// Decode batches of at most `n` sequences take the lean kernels (default
    /// [`DECODE_LEAN_MAX_SEQS`]; 0: never), for A/B runs. Results are the same bits.
    pub fn set_decode_lean_max_seqs(&self, n: usize) {
        self.kernels.attention.lean_max_seqs.store(n, Ordering::Relaxed);
    }

    /// Decode attention launches programmatically (`early`; default off), so its CTAs start
    /// while the kernel ahead of them runs: each reads the context lengths and block tables
    /// and copies the K/V of positions below `context_lens[s] - 1` before it waits for that
    /// kernel, then q and the newest position after. Only for callers where all of that was
    /// written before the kernel ahead started, which is then usually the one writing q and
    /// the newest K/V (the qkv GEMV with RoPE, or `qkv_rope_write`): the decode step of a
    /// model, whose tables and lengths are the step's inputs and whose older K/V came from
    /// earlier steps. Results are the same bits either way.
    pub fn set_decode_early_start(&self, early: bool) {
        self.kernels.attention.early_start.store(early, Ordering::Relaxed);
    }

    /// Decode attention: one query per sequence, `q`, `out` `[num_seqs, n_heads, head_dim]`,
    /// the query at position `context_lens[s] - 1` attending to positions
    /// `0..context_lens[s]`; scores `scale * q.k`, softmax and sums in f32.
    ///
    /// `max_context` (the longest context in the batch) sizes the split-KV grid: with
    /// `split_len` `None` the number of splits is chosen to fill the GPU and each sequence
    /// divides its own context into that many splits (at least 64 positions each), so a
    /// `max_context` far above the real contexts (a captured graph's) costs only the CTAs of
    /// splits that have nothing to do, which exit at once; a longer context is still handled
    /// correctly. `split_len` `Some(n)` forces `n` positions per split, the last split of a
    /// sequence running to its end. Without a `workspace`, or with one too small for two
    /// splits, each CTA covers a whole context. The splits of a sequence are merged by the
    /// last of its CTAs to finish: one kernel launch either way. Returns the plan used.
    ///
    /// Runs on tensor cores: `q.k` is the exact bf16 products summed in f32; each softmax
    /// weight multiplies V as two bf16 terms (about 16 significant bits), so the output is
    /// that of f32 weights up to its own bf16 rounding. Batches of at most
    /// [`Device::set_decode_lean_max_seqs`] sequences run the lean kernel (the same bits),
    /// which lets the next kernel launch programmatically beside it.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode_attention(
        &self,
        out: &mut Buf<bf16>,
        q: &Buf<bf16>,
        batch: &PagedBatch,
        n_heads: usize,
        scale: f32,
        max_context: usize,
        split_len: Option<usize>,
        workspace: Option<&mut DecodeWorkspace>,
    ) -> Result<DecodePlan, KernelError> {
        const OP: &str = "cuda_paged_decode_attention";
        let g = check_batch(OP, batch, n_heads, scale, DECODE_MAX_GROUP)?;
        let hd = batch.cache.head_dim;
        check(g.num_seqs.checked_mul(n_heads * hd) == Some(q.len()) && out.len() == q.len(), OP, || {
            format!(
                "q {} / out {} values, expected {} sequences x {n_heads} heads x {hd}",
                q.len(),
                out.len(),
                g.num_seqs
            )
        })?;
        check(split_len != Some(0), OP, || "split_len must be > 0".to_string())?;
        if g.num_seqs == 0 {
            return Ok(DecodePlan { n_splits: 1, split_len: max_context.max(1) });
        }
        let capacity = match &workspace {
            Some(ws) => {
                check(ws.head_dim == hd, OP, || format!("workspace head_dim {} != {hd}", ws.head_dim))?;
                ws.rows() / (g.num_seqs * n_heads)
            }
            None => 1,
        };
        let ctas = g.num_seqs * batch.cache.n_kv_heads * g.hchunks;
        let slots = self.sm_count * self.kernels.attention.decode_ctas_per_sm[g.hd_index];
        let plan = plan_splits(ctas, max_context, split_len, capacity, slots);

        let att = &self.kernels.attention;
        let lean = g.num_seqs <= att.lean_max_seqs.load(Ordering::Relaxed);
        let func = if lean { &att.decode_lean[g.hd_index] } else { &att.decode[g.hd_index] };
        let u = |what: &str, v: usize| to_u32(OP, what, v);
        let (seqs, ykv) = (u("num_seqs", g.num_seqs)?, u("kv chunks", batch.cache.n_kv_heads * g.hchunks)?);
        // 0: every sequence derives its split length from its own context (the kernel's rule
        // is paged::auto_split_len).
        let dev_split = if split_len.is_some() { u("split_len", plan.split_len)? } else { 0 };
        let n_splits = u("n_splits", plan.n_splits)?;
        let (max_blocks, num_blocks, block_size) = (
            u("max_blocks", batch.max_blocks)?,
            u("num_blocks", g.num_blocks)?,
            u("block_size", batch.cache.block_size)?,
        );
        let (nh, nkv, group, gt) =
            (u("n_heads", n_heads)?, u("n_kv_heads", batch.cache.n_kv_heads)?, u("group", g.group)?, u("gt", g.gt)?);
        let min_split = u("min_split", MIN_SPLIT_TOKENS)?;
        let scale_log2 = scale * LOG2_E;
        let smem = u("shared memory", if lean { decode_lean_smem_bytes(hd) } else { decode_smem_bytes(hd) })?;
        let cfg =
            LaunchConfig { grid_dim: (seqs, ykv, n_splits), block_dim: (DECODE_THREADS, 1, 1), shared_mem_bytes: smem };
        let null: sys::CUdeviceptr = 0;
        let ws = workspace.filter(|_| plan.n_splits > 1);
        if let Some(w) = &ws {
            // Guaranteed by the capacity rule (see DecodeWorkspace::counters); checked so a
            // change there cannot turn into writes past the buffer.
            check(g.num_seqs * batch.cache.n_kv_heads * g.hchunks <= w.counters.len(), OP, || {
                format!("workspace holds {} split counters, {ctas} needed", w.counters.len())
            })?;
        }
        let s = &self.stream;
        let (mut out_p, _g0) = out.inner.device_ptr_mut(s);
        let (mut part_o, mut part_lse, mut counters) = (null, null, null);
        let mut _ws_guards = None;
        if let Some(w) = ws {
            let (o, go) = w.part_o.inner.device_ptr_mut(s);
            let (l, gl) = w.part_lse.inner.device_ptr_mut(s);
            let (c, gc) = w.counters.inner.device_ptr_mut(s);
            (part_o, part_lse, counters) = (o, l, c);
            _ws_guards = Some((go, gl, gc));
        }
        let (mut q_p, _g1) = q.inner.device_ptr(s);
        let (mut k_p, _g2) = batch.k_cache.inner.device_ptr(s);
        let (mut v_p, _g3) = batch.v_cache.inner.device_ptr(s);
        let (mut table_p, _g4) = batch.block_tables.inner.device_ptr(s);
        let (mut ctx_p, _g5) = batch.context_lens.inner.device_ptr(s);
        let (mut max_blocks, mut num_blocks, mut block_size) = (max_blocks, num_blocks, block_size);
        let (mut nh, mut nkv, mut group, mut gt) = (nh, nkv, group, gt);
        let (mut dev_split, mut n_splits, mut min_split, mut scale_log2) = (dev_split, n_splits, min_split, scale_log2);
        let ptr = |p: &mut sys::CUdeviceptr| -> *mut c_void { (p as *mut sys::CUdeviceptr).cast() };
        let int = |v: &mut u32| -> *mut c_void { (v as *mut u32).cast() };
        let mut params: [*mut c_void; 20] = [
            ptr(&mut out_p),
            ptr(&mut part_o),
            ptr(&mut part_lse),
            ptr(&mut counters),
            ptr(&mut q_p),
            ptr(&mut k_p),
            ptr(&mut v_p),
            ptr(&mut table_p),
            int(&mut max_blocks),
            ptr(&mut ctx_p),
            int(&mut num_blocks),
            int(&mut block_size),
            int(&mut nh),
            int(&mut nkv),
            int(&mut group),
            int(&mut gt),
            int(&mut dev_split),
            int(&mut n_splits),
            int(&mut min_split),
            (&mut scale_log2 as *mut f32).cast(),
        ];
        let early = att.early_start.load(Ordering::Relaxed);
        // SAFETY: `params` points at live locals in the kernel's parameter order and types
        // (eight pointers, u32 max_blocks, the context-length pointer, nine u32, f32); q/out/
        // table/cache lengths were checked; partials and counters are touched only with
        // n_splits > 1, where the workspace holds num_seqs x n_heads x n_splits rows
        // (plan_splits capped n_splits by it; the kernel never lets more than n_splits splits
        // of a sequence start before its context) and a counter per (sequence, kv head
        // chunk); otherwise they are null and unused. With `early` (programmatic launch) the
        // caller vouched, through set_decode_early_start, that what the kernel reads before
        // its griddepcontrol.wait was complete before the kernel ahead of it started.
        unsafe { launch_ex(OP, s, func, cfg, early, &mut params) }?;
        Ok(plan)
    }

    /// Causal prefill attention over a batch: sequence `s` has query tokens
    /// `cu_q[s]..cu_q[s + 1]` of `q` / `out` (`[total_tokens, n_heads, head_dim]`), at
    /// positions `context_lens[s] - n_q ..` (a chunk may start mid-context; its own K/V are
    /// already in the cache); query `i` attends to positions `0..=first_pos + i`.
    /// `max_q_len` (the longest chunk) sizes the grid; longer chunks are still covered.
    /// A sequence whose chunk is longer than its context gets NaN rows; one whose `cu_q`
    /// range leaves `q` is skipped (its rows are not written).
    ///
    /// Runs on tensor cores (flash-attention 2 with bf16 `mma.sync`): scores, softmax and
    /// the output accumulate in f32, but the softmax weights are rounded to bf16 before
    /// they multiply V, so each output element may differ from an f32 computation by up to
    /// `2^-8 * sum_p w_p |v_p|` (relative rounding of each weight) besides its own bf16
    /// rounding.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill_attention(
        &self,
        out: &mut Buf<bf16>,
        q: &Buf<bf16>,
        batch: &PagedBatch,
        cu_q: &Buf<u32>,
        max_q_len: usize,
        n_heads: usize,
        scale: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_paged_prefill_attention";
        let g = check_batch(OP, batch, n_heads, scale, PF_ROWS)?;
        let hd = batch.cache.head_dim;
        let row = n_heads * hd;
        check(q.len().is_multiple_of(row) && out.len() == q.len(), OP, || {
            format!("q {} / out {} values: not equal whole numbers of {n_heads} heads x {hd}", q.len(), out.len())
        })?;
        check(cu_q.len() == g.num_seqs + 1, OP, || {
            format!("cu_q has {} offsets for {} sequences", cu_q.len(), g.num_seqs)
        })?;
        if g.num_seqs == 0 || q.is_empty() {
            return Ok(());
        }
        let u = |what: &str, v: usize| to_u32(OP, what, v);
        let total = u("total tokens", q.len() / row)?;
        let bq = PF_ROWS / g.gt;
        let tiles = u("q tiles", max_q_len.max(1).div_ceil(bq).min(65535 * 32))?;
        let (seqs, ykv) = (u("num_seqs", g.num_seqs)?, u("kv chunks", batch.cache.n_kv_heads * g.hchunks)?);
        check(seqs <= 65535, OP, || format!("{seqs} sequences exceed the grid's z (65535)"))?;
        let (max_blocks, num_blocks, block_size) = (
            u("max_blocks", batch.max_blocks)?,
            u("num_blocks", g.num_blocks)?,
            u("block_size", batch.cache.block_size)?,
        );
        let (nh, nkv, group, gt) =
            (u("n_heads", n_heads)?, u("n_kv_heads", batch.cache.n_kv_heads)?, u("group", g.group)?, u("gt", g.gt)?);
        let scale_log2 = scale * LOG2_E;
        let smem = u("shared memory", prefill_smem_bytes(hd))?;
        let cfg = LaunchConfig { grid_dim: (tiles, ykv, seqs), block_dim: (PF_THREADS, 1, 1), shared_mem_bytes: smem };
        let mut b = self.stream.launch_builder(&self.kernels.attention.prefill[g.hd_index]);
        b.arg(&mut out.inner)
            .arg(&q.inner)
            .arg(&batch.k_cache.inner)
            .arg(&batch.v_cache.inner)
            .arg(&batch.block_tables.inner)
            .arg(&max_blocks)
            .arg(&batch.context_lens.inner)
            .arg(&cu_q.inner)
            .arg(&total)
            .arg(&num_blocks)
            .arg(&block_size)
            .arg(&nh)
            .arg(&nkv)
            .arg(&group)
            .arg(&gt)
            .arg(&scale_log2);
        // SAFETY: argument order matches the kernel; q/out rows are bounded on the device by
        // `total`, cache reads by num_blocks and max_blocks.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }
}
