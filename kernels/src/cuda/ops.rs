//! Host launchers of the CUDA C kernels: shape checks (the same rules as the CPU ops, an
//! error naming the op rather than an out-of-bounds access on the device), launch geometry,
//! and the launch on the device's stream. All tensors are bf16 `[rows, cols]` row-major.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::device::{dev_err, Buf, Device, RopeCache};
use crate::cpu::rope::{RopeParams, RopeStyle};
use crate::error::check;
use crate::launch_checks::{embedding_shape, norm_args, rope_table, silu_packed_shape, to_i32, to_u32};
use crate::KernelError;
use half::bf16;

/// Threads per block of the row and gather kernels.
const BLOCK: u32 = 256;
/// Rows at most this long get a warp each instead of a block.
const WARP_ROW_MAX: usize = 1024;
/// Grid cap of the grid-stride elementwise kernels (enough to fill 132 SMs many times).
const MAX_GRID: usize = 1 << 16;

fn grid(n: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

impl Device {
    /// A norm kernel's launch for `n_rows` rows of `dim`: a warp per row (`warp`, 8 rows per
    /// block) for rows of at most [`WARP_ROW_MAX`], else a block per row (`block`).
    fn norm_launch<'a>(
        &self,
        op: &'static str,
        n_rows: usize,
        dim: usize,
        warp: &'a CudaFunction,
        block: &'a CudaFunction,
    ) -> Result<(&'a CudaFunction, LaunchConfig), KernelError> {
        Ok(if dim <= WARP_ROW_MAX {
            (warp, grid(to_u32(op, "blocks", n_rows.div_ceil(8))?, BLOCK))
        } else {
            (block, grid(to_u32(op, "n_rows", n_rows)?, BLOCK))
        })
    }

    /// `out[r] = rms_norm(x[r]) * w` for each of `n_rows` rows; `x`, `out`: `[n_rows, dim]`,
    /// `w`: `[dim]`.
    pub fn rms_norm(
        &self,
        out: &mut Buf<bf16>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_rms_norm";
        let Some((rows, dim_i)) = norm_args(OP, (out.len(), None, x.len(), w.len()), n_rows, eps)? else {
            return Ok(());
        };
        let k = &self.kernels;
        let (func, cfg) = self.norm_launch(OP, n_rows, w.len(), &k.rms_norm_warp, &k.rms_norm_block)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut out.inner).arg(&x.inner).arg(&w.inner).arg(&rows).arg(&dim_i).arg(&eps);
        // SAFETY: argument types and order match the kernel; lengths were checked above.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// The pre-norm residual add of a llama block, fused: `residual = bf16(residual + x)`,
    /// then `out = rms_norm(residual) * w` on the rounded sum (so it equals
    /// add-then-[`Device::rms_norm`] bit for bit). All `[n_rows, dim]` but `w`: `[dim]`.
    pub fn add_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
        x: &Buf<bf16>,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_add_rms_norm";
        let lens = (out.len(), Some(residual.len()), x.len(), w.len());
        let Some((rows, dim_i)) = norm_args(OP, lens, n_rows, eps)? else {
            return Ok(());
        };
        let k = &self.kernels;
        let (func, cfg) = self.norm_launch(OP, n_rows, w.len(), &k.add_rms_norm_warp, &k.add_rms_norm_block)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut out.inner).arg(&mut residual.inner).arg(&x.inner).arg(&w.inner).arg(&rows).arg(&dim_i).arg(&eps);
        // SAFETY: as in rms_norm.
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// [`Device::add_rms_norm`] with the added value as the f32 partial sums of a split GEMM
    /// ([`Device::matmul_parts`], `parts` `[splits, n_rows, dim]`, its first values):
    /// `residual = bf16(residual + bf16(sum of the parts))` (summed in split order), then the
    /// norm, as `add_rms_norm`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_parts_rms_norm(
        &self,
        out: &mut Buf<bf16>,
        residual: &mut Buf<bf16>,
        parts: &Buf<f32>,
        splits: usize,
        w: &Buf<bf16>,
        n_rows: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_add_parts_rms_norm";
        super::gemm::check_splits(OP, splits)?;
        check(out.len().checked_mul(splits).is_some_and(|n| n <= parts.len()), OP, || {
            format!("parts has {} values, fewer than {splits} x {}", parts.len(), out.len())
        })?;
        let lens = (out.len(), Some(residual.len()), out.len(), w.len());
        let Some((rows, dim_i)) = norm_args(OP, lens, n_rows, eps)? else {
            return Ok(());
        };
        let k = &self.kernels;
        let (func, cfg) =
            self.norm_launch(OP, n_rows, w.len(), &k.add_parts_rms_norm_warp, &k.add_parts_rms_norm_block)?;
        let splits_i = to_i32(OP, "splits", splits)?;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut out.inner).arg(&mut residual.inner).arg(&parts.inner).arg(&splits_i);
        b.arg(&w.inner).arg(&rows).arg(&dim_i).arg(&eps);
        // SAFETY: argument types and order match the kernel; lengths were checked above
        // (parts holds at least splits x n_rows x dim values).
        unsafe { b.launch(cfg) }.map(drop).map_err(dev_err(OP))
    }

    /// The residual add alone: `residual = bf16(residual + x)`, both the same length (the
    /// add that `add_rms_norm` fuses with a norm, for where no norm follows).
    pub fn add_residual(&self, residual: &mut Buf<bf16>, x: &Buf<bf16>) -> Result<(), KernelError> {
        const OP: &str = "cuda_add_residual";
        check(residual.len() == x.len(), OP, || format!("residual has {} values, x {}", residual.len(), x.len()))?;
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let vec = n.is_multiple_of(8);
        let units = if vec { n / 8 } else { n };
        let blocks = to_u32(OP, "blocks", units.div_ceil(BLOCK as usize).min(MAX_GRID))?;
        let func = if vec { &self.kernels.add_residual_vec8 } else { &self.kernels.add_residual };
        let units = units as u64;
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut residual.inner).arg(&x.inner).arg(&units);
        // SAFETY: argument types and order match the kernel; both buffers hold n values.
        unsafe { b.launch(grid(blocks, BLOCK)) }.map(drop).map_err(dev_err(OP))
    }

    /// SwiGLU on separate buffers: `out[i] = silu(gate[i]) * up[i]`, all the same length.
    pub fn silu_mul(&self, out: &mut Buf<bf16>, gate: &Buf<bf16>, up: &Buf<bf16>) -> Result<(), KernelError> {
        const OP: &str = "cuda_silu_mul";
        check(gate.len() == up.len() && out.len() == gate.len(), OP, || {
            format!("lengths differ: out {}, gate {}, up {}", out.len(), gate.len(), up.len())
        })?;
        // One row as long as the buffer (the kernel's columns are u32: at most 4G values).
        let n = out.len();
        to_u32(OP, "length", n)?;
        let (gv, uv) = (gate.inner.slice(..), up.inner.slice(..));
        self.launch_silu_mul(OP, out, &gv, &uv, 1, n, n)
    }

    /// SwiGLU on a packed gate|up GEMM output: `gate_up` `[n_rows, 2 * ffn]` (gate in the
    /// first half of each row), `out` `[n_rows, ffn]`.
    pub fn silu_mul_packed(&self, out: &mut Buf<bf16>, gate_up: &Buf<bf16>, n_rows: usize) -> Result<(), KernelError> {
        const OP: &str = "cuda_silu_mul_packed";
        let ffn = silu_packed_shape(OP, out.len(), gate_up.len(), n_rows)?;
        let (gv, uv) = (gate_up.inner.slice(..), gate_up.inner.slice(ffn..));
        self.launch_silu_mul(OP, out, &gv, &uv, n_rows, ffn, 2 * ffn)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_silu_mul(
        &self,
        op: &'static str,
        out: &mut Buf<bf16>,
        gate: &cudarc::driver::CudaView<'_, bf16>,
        up: &cudarc::driver::CudaView<'_, bf16>,
        n_rows: usize,
        cols: usize,
        in_stride: usize,
    ) -> Result<(), KernelError> {
        if out.is_empty() {
            return Ok(());
        }
        let vec = cols.is_multiple_of(8) && in_stride.is_multiple_of(8);
        let units = if vec { out.len() / 8 } else { out.len() };
        let blocks = to_u32(op, "blocks", units.div_ceil(BLOCK as usize).min(MAX_GRID))?;
        let func = if vec { &self.kernels.silu_mul_vec8 } else { &self.kernels.silu_mul };
        let (rows, cols, stride) = (n_rows as u64, to_u32(op, "cols", cols)?, in_stride as u64);
        let mut b = self.stream.launch_builder(func);
        b.arg(&mut out.inner).arg(gate).arg(up).arg(&rows).arg(&cols).arg(&stride);
        // SAFETY: gate/up views cover n_rows rows of in_stride (checked by the callers).
        unsafe { b.launch(grid(blocks, BLOCK)) }.map(drop).map_err(dev_err(op))
    }

    /// Embedding gather: `out[t] = table[ids[t]]`; `table` `[vocab, dim]`, `out`
    /// `[ids.len(), dim]`. An id `>= vocab` yields a NaN row (ids are on the device, so
    /// they cannot be checked here; the caller validates them where they enter).
    pub fn embedding(
        &self,
        out: &mut Buf<bf16>,
        table: &Buf<bf16>,
        ids: &Buf<u32>,
        dim: usize,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_embedding";
        let vocab = embedding_shape(OP, out.len(), table.len(), ids.len(), dim)?;
        if ids.is_empty() {
            return Ok(());
        }
        let (n, vocab, d) = (to_u32(OP, "n_tokens", ids.len())?, to_u32(OP, "vocab", vocab)?, to_u32(OP, "dim", dim)?);
        let mut b = self.stream.launch_builder(&self.kernels.embedding);
        b.arg(&mut out.inner).arg(&table.inner).arg(&ids.inner).arg(&n).arg(&vocab).arg(&d);
        // SAFETY: the kernel bounds every read by vocab and every write by n x dim.
        unsafe { b.launch(grid(n, BLOCK)) }.map(drop).map_err(dev_err(OP))
    }

    /// The (cos, sin) table of `params` for positions `0..max_positions`, computed on the
    /// host from the f64 angle exactly as the CPU reference does, then uploaded.
    pub fn rope_cache(&self, params: &RopeParams, max_positions: usize) -> Result<RopeCache, KernelError> {
        const OP: &str = "cuda_rope_cache";
        check(max_positions > 0, OP, || "max_positions must be > 0".to_string())?;
        to_u32(OP, "max_positions", max_positions)?;
        let host = rope_table(params, max_positions);
        Ok(RopeCache { table: self.upload(&host)?, rope_dim: params.rope_dim(), max_positions })
    }

    /// Rotates `x` (`[n_tokens, n_heads * head_dim]`) in place; token `t` is at position
    /// `positions[t]`. The first `cache.rope_dim()` dims of each head rotate; a position
    /// `>= cache.max_positions()` turns that token's rotated dims into NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut Buf<bf16>,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &Buf<u32>,
        cache: &RopeCache,
        style: RopeStyle,
    ) -> Result<(), KernelError> {
        const OP: &str = "cuda_rope";
        check(n_heads > 0 && head_dim > 0, OP, || format!("n_heads {n_heads} and head_dim {head_dim} must be > 0"))?;
        check(cache.rope_dim <= head_dim, OP, || format!("rope dim {} exceeds head_dim {head_dim}", cache.rope_dim))?;
        let row = n_heads * head_dim;
        check(n_tokens.checked_mul(row) == Some(x.len()), OP, || {
            format!("x has {} values, expected {n_tokens} tokens x {n_heads} heads x {head_dim}", x.len())
        })?;
        check(positions.len() == n_tokens, OP, || format!("{} positions for {n_tokens} tokens", positions.len()))?;
        if n_tokens == 0 {
            return Ok(());
        }
        let half = cache.rope_dim / 2;
        let pairs = n_heads * half;
        let block = to_u32(OP, "threads", pairs.div_ceil(32).clamp(1, 8) * 32)?;
        let (nt, nh, hd, hr) = (
            to_u32(OP, "n_tokens", n_tokens)?,
            to_u32(OP, "n_heads", n_heads)?,
            to_u32(OP, "head_dim", head_dim)?,
            to_u32(OP, "rope_dim/2", half)?,
        );
        let (stride, max_pos) = (row as u64, to_u32(OP, "max_positions", cache.max_positions)?);
        let neox: i32 = matches!(style, RopeStyle::Neox).into();
        let mut b = self.stream.launch_builder(&self.kernels.rope);
        b.arg(&mut x.inner)
            .arg(&positions.inner)
            .arg(&cache.table.inner)
            .arg(&nt)
            .arg(&nh)
            .arg(&hd)
            .arg(&hr)
            .arg(&stride)
            .arg(&max_pos)
            .arg(&neox);
        // SAFETY: table reads are bounded by max_pos; x accesses by the checked shape.
        unsafe { b.launch(grid(nt, block)) }.map(drop).map_err(dev_err(OP))
    }
}
